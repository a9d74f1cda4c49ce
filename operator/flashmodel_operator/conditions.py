"""Status conditions (Ready, Available, Progressing, Degraded, Autoscaling, Routing, AdaptersReady), from what was seen.

Ready: every desired pod serves (ready and prewarmed as the operator saw it), no roll-out under way.
Available: at least one pod serves, the way a Deployment reports it: a scale-up or a roll-out turns
Ready False while the model keeps answering, and Available stays True through it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

READY = "Ready"
AVAILABLE = "Available"
PROGRESSING = "Progressing"
DEGRADED = "Degraded"
AUTOSCALING = "Autoscaling"
ROUTING = "Routing"
ADAPTERS_READY = "AdaptersReady"
SCALED_TO_ZERO = "ScaledToZero"
WAKING = "Waking"
IDLE_AT_ZERO = (
    "no pod runs while the model is idle (autoscaling.minReplicas 0); the gateway holds the next request "
    "and the autoscaler wakes a pod for it"
)


@dataclass(frozen=True)
class Problem:
    """Why a FlashModel cannot reach its desired state; becomes the Degraded condition."""

    reason: str
    """CamelCase reason, e.g. PreflightFailed."""
    message: str
    """What was wrong, the value seen, and what to change."""


@dataclass(frozen=True)
class Observation:
    """What the operator saw of one FlashModel's children in one pass."""

    generation: int
    desired_replicas: int
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    prewarmed_replicas: int = 0
    deployment_generation_observed: bool = False
    """The Deployment controller has seen the latest pod template."""
    problem: Problem | None = None
    unschedulable: str | None = None
    """The scheduler's reason a pod of the model is Pending (no node with a free T4, say), with the pod's name."""
    autoscaling: tuple[bool, str, str] | None = None
    """(active, reason, message) of the model's autoscaler; None without spec.autoscaling."""
    routing: tuple[bool, str, str] | None = None
    """(active, reason, message) of the model's InferencePool and endpoint picker; None without spec.routing."""
    adapters: tuple[bool, str, str] | None = None
    """(loaded everywhere, reason, message) of the model's LoRA adapters; None with LoRA off."""
    scales_to_zero: bool = False
    """autoscaling.minReplicas is 0: zero pods is the model idle, not stopped, and the first pod after it is
    waking a model the gateway holds requests for."""
    remediation_held: Problem | None = None
    """A pod needs replacing and the operator will not act (its restart budget is spent): Degraded says so,
    while Ready and Available still count the pods that serve."""


def _condition(
    kind: str, status: bool, reason: str, message: str, generation: int, previous: dict[str, dict[str, Any]], now: str
) -> dict[str, Any]:
    text = "True" if status else "False"
    before = previous.get(kind)
    # lastTransitionTime moves only when the status flips, as the API conventions ask.
    since = (
        before["lastTransitionTime"]
        if before and before.get("status") == text and "lastTransitionTime" in before
        else now
    )
    return {
        "type": kind,
        "status": text,
        "reason": reason,
        "message": message,
        "observedGeneration": generation,
        "lastTransitionTime": since,
    }


def build_conditions(obs: Observation, previous: list[dict[str, Any]], now: str) -> list[dict[str, Any]]:
    """The conditions for this pass; `previous` keeps transition times stable."""
    before = {c.get("type", ""): c for c in previous}
    gen = obs.generation
    want = obs.desired_replicas

    if obs.problem is not None:
        degraded = _condition(DEGRADED, True, obs.problem.reason, obs.problem.message, gen, before, now)
    elif obs.remediation_held is not None:
        held = obs.remediation_held
        degraded = _condition(DEGRADED, True, held.reason, held.message, gen, before, now)
    else:
        degraded = _condition(DEGRADED, False, "AsExpected", "no problem seen", gen, before, now)

    rolling = not obs.deployment_generation_observed or obs.updated_replicas < want or obs.replicas > want
    if obs.problem is not None:
        progressing = _condition(PROGRESSING, False, "Blocked", obs.problem.message, gen, before, now)
    elif rolling:
        msg = f"{obs.updated_replicas}/{want} pods run the current spec"
        progressing = _condition(PROGRESSING, True, "RollingOut", msg, gen, before, now)
    elif obs.ready_replicas < want:
        msg = f"{obs.ready_replicas}/{want} pods ready, {obs.prewarmed_replicas} prewarmed"
        progressing = _condition(PROGRESSING, True, "WaitingForReadyPods", msg, gen, before, now)
    else:
        progressing = _condition(
            PROGRESSING, False, "RolloutComplete", f"{want} pods run the current spec", gen, before, now
        )

    if obs.problem is not None:
        ready = _condition(READY, False, obs.problem.reason, obs.problem.message, gen, before, now)
    elif want == 0 and obs.scales_to_zero:
        ready = _condition(READY, True, SCALED_TO_ZERO, IDLE_AT_ZERO, gen, before, now)
    elif want == 0:
        ready = _condition(READY, False, SCALED_TO_ZERO, "spec.replicas is 0", gen, before, now)
    elif obs.scales_to_zero and min(obs.ready_replicas, obs.prewarmed_replicas) == 0 and obs.problem is None:
        msg = f"waking from zero: {obs.ready_replicas}/{want} pods ready; the gateway holds requests meanwhile"
        if obs.unschedulable is not None:
            msg += f"; {obs.unschedulable}"
        ready = _condition(READY, False, WAKING, msg, gen, before, now)
    elif min(obs.ready_replicas, obs.prewarmed_replicas) >= want and not rolling:
        ready = _condition(
            READY, True, "AllReplicasReady", f"{obs.ready_replicas}/{want} pods ready and prewarmed", gen, before, now
        )
    elif obs.ready_replicas >= want and not rolling:
        # Ready by the kubelet, but the operator did not see every pod prewarm (its gate was set by another).
        msg = f"{obs.ready_replicas}/{want} pods ready, {obs.prewarmed_replicas} prewarmed by the operator"
        ready = _condition(READY, False, "NotPrewarmed", msg, gen, before, now)
    elif obs.unschedulable is not None:
        msg = f"{obs.ready_replicas}/{want} pods ready; {obs.unschedulable}"
        ready = _condition(READY, False, "Unschedulable", msg, gen, before, now)
    else:
        msg = f"{obs.ready_replicas}/{want} pods ready"
        ready = _condition(READY, False, "ReplicasNotReady", msg, gen, before, now)
    conditions = [ready, _available(obs, before, now), progressing, degraded]
    if obs.autoscaling is not None:
        active, reason, message = obs.autoscaling
        conditions.append(_condition(AUTOSCALING, active, reason, message, gen, before, now))
    if obs.routing is not None:
        active, reason, message = obs.routing
        conditions.append(_condition(ROUTING, active, reason, message, gen, before, now))
    if obs.adapters is not None:
        # Not part of Ready: a failed adapter leaves the base model (and the other adapters) serving.
        loaded, reason, message = obs.adapters
        conditions.append(_condition(ADAPTERS_READY, loaded, reason, message, gen, before, now))
    return conditions


def _available(obs: Observation, before: dict[str, dict[str, Any]], now: str) -> dict[str, Any]:
    serving = min(obs.ready_replicas, obs.prewarmed_replicas)
    gen = obs.generation
    if serving >= 1:
        return _condition(AVAILABLE, True, "MinimumReplicasAvailable", f"{serving} pods serving", gen, before, now)
    if obs.desired_replicas == 0:
        message = IDLE_AT_ZERO if obs.scales_to_zero else "spec.replicas is 0"
        return _condition(AVAILABLE, False, SCALED_TO_ZERO, message, gen, before, now)
    if obs.problem is not None:
        return _condition(AVAILABLE, False, obs.problem.reason, obs.problem.message, gen, before, now)
    if obs.scales_to_zero:
        msg = f"waking from zero: {obs.ready_replicas} ready, {obs.prewarmed_replicas} prewarmed"
        return _condition(AVAILABLE, False, WAKING, msg, gen, before, now)
    msg = f"no pod serves yet: {obs.ready_replicas} ready, {obs.prewarmed_replicas} prewarmed"
    if obs.unschedulable is not None:
        msg += f"; {obs.unschedulable}"
    return _condition(AVAILABLE, False, "NoServingPod", msg, gen, before, now)


def same_conditions(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Equal for status purposes: transition times aside, nothing a reader would see changed."""

    def key(conds: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
        return sorted(
            (c.get("type"), c.get("status"), c.get("reason"), c.get("message"), c.get("observedGeneration"))
            for c in conds
        )

    return key(a) == key(b)
