"""PURE: whether to drain and evict one pod of a model now, from what the operator observed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flashmodel_operator.model import RemediationSpec

MEMORY_DIVERGENCE = "MemoryDivergence"
GENERATION_HUNG = "GenerationHung"
PREWARM_FAILED = "PrewarmFailed"

# The engine already requires divergence to be sustained over its window; the operator adds
# its own short confirmation so one stale or flapping scrape never evicts a pod.
CONFIRM_SECONDS = 15.0


@dataclass(frozen=True)
class PodHealth:
    """One engine pod as the operator last saw it through the health shim."""

    name: str
    prewarmed: bool
    """The readiness gate is True: the pod serves traffic."""
    livez_ok: bool
    divergence_recommended: bool
    """The shim's flashmodel_remediation_recommended{reason="memory_divergence"} is 1."""
    divergence_ratio: float
    divergent_since: float | None
    """Monotonic time since which every scrape said divergent; None when the last one did not."""
    readyz_failing_since: float | None
    """Monotonic time since which /readyz failed on every poll (after prewarm); None when it passed."""
    deleting: bool = False
    prewarm_failure: str | None = None
    """Why its prewarm failed every attempt (the pod never served); None when it did not."""
    endpoint_ready: bool = False
    """The pod's own Ready condition is True: the kubelet's probes pass too, so the Service sends it traffic.

    The gate alone is not enough: a replacement's gate opens before its container's first passing
    readiness probe, and draining another pod in that window leaves the model with no endpoint.
    """
    standby: bool = False
    """Prewarmed and held out of the Service (spec.standbyReplicas): replacing it takes no traffic away."""


@dataclass(frozen=True)
class ModelBudget:
    """What limits remediation across all pods of one model."""

    restarts_last_hour: int
    in_flight: str | None
    """A pod of this model being drained or evicted now."""
    seconds_since_last: float | None
    ready_pods: int
    """Pods the operator itself saw prewarm that pass readiness now."""
    desired_pods: int
    backoff_seconds: float = 60.0
    """After one remediation the next waits at least this long (and for the replacement's readiness)."""


@dataclass(frozen=True)
class Decision:
    action: Literal["evict", "hold"]
    reason: str
    """MemoryDivergence / GenerationHung for evict; why not for hold."""
    pod: str
    message: str
    divergence_ratio: float = 0.0


def serving_pods(pods: list[PodHealth]) -> int:
    """Pods that carry traffic now: prewarmed by this operator, generating, and endpoints of the Service."""
    return sum(
        1 for p in pods if p.prewarmed and p.endpoint_ready and p.readyz_failing_since is None and not p.deleting
    )


def _candidate(pod: PodHealth, spec: RemediationSpec, now: float) -> tuple[str, str, float] | None:
    if pod.deleting:
        return None
    if pod.prewarm_failure is not None:
        return PREWARM_FAILED, pod.prewarm_failure, pod.divergence_ratio
    if pod.divergence_recommended and pod.divergent_since is not None and now - pod.divergent_since >= CONFIRM_SECONDS:
        return (
            MEMORY_DIVERGENCE,
            f"memory {pod.divergence_ratio:.1%} of the card above the post-prewarm baseline while KV-cache "
            f"use is low, for {now - pod.divergent_since:.0f}s after the engine's {spec.divergence_window_seconds}s "
            f"window (threshold {spec.divergence_ratio:.0%})",
            pod.divergence_ratio,
        )
    if (
        pod.livez_ok
        and pod.readyz_failing_since is not None
        and now - pod.readyz_failing_since >= spec.hung_readiness_seconds
    ):
        return (
            GENERATION_HUNG,
            f"one-token generation failing for {now - pod.readyz_failing_since:.0f}s while the process is alive "
            f"(threshold {spec.hung_readiness_seconds}s)",
            pod.divergence_ratio,
        )
    return None


def decide(pods: list[PodHealth], budget: ModelBudget, spec: RemediationSpec, now: float) -> Decision | None:
    """The one remediation to start now, a hold that says why not, or None when nothing is wrong."""
    if not spec.enabled:
        return None
    # The pod being drained now is already handled: a hold naming it would say nothing new.
    candidates = [
        (pod, c) for pod in pods if pod.name != budget.in_flight and (c := _candidate(pod, spec, now)) is not None
    ]
    if not candidates:
        return None
    # The longest-hung or most-diverged pod first: it is the one hurting users most.
    pod, (reason, message, ratio) = max(candidates, key=lambda pc: (pc[1][0] == GENERATION_HUNG, pc[1][2]))
    if budget.in_flight is not None:
        return Decision("hold", "RemediationInProgress", pod.name, f"pod {budget.in_flight} is being replaced first")
    if budget.restarts_last_hour >= spec.max_restarts_per_hour:
        return Decision(
            "hold",
            "RestartBudgetExhausted",
            pod.name,
            f"{budget.restarts_last_hour} remediations in the last hour reach "
            f"spec.remediation.maxRestartsPerHour={spec.max_restarts_per_hour}; {reason}: {message}",
        )
    if budget.seconds_since_last is not None and budget.seconds_since_last < budget.backoff_seconds:
        return Decision("hold", "BackingOff", pod.name, f"last remediation {budget.seconds_since_last:.0f}s ago")
    # A serving pod is taken out only when the others carry the model: a hung one serves nobody anyway.
    if (
        reason == MEMORY_DIVERGENCE
        and pod.prewarmed
        and not pod.standby
        and budget.desired_pods > 1
        and budget.ready_pods < budget.desired_pods
    ):
        return Decision(
            "hold", "WaitingForReadyPods", pod.name, f"{budget.ready_pods}/{budget.desired_pods} pods ready"
        )
    return Decision("evict", reason, pod.name, message, ratio)
