"""Drain and evict one pod on the remediation decision, within the model's budget, and record it."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import TYPE_CHECKING, Any

from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.model_status import history_length, now_iso, restarts_last_hour
from flashmodel_operator.reconcile import record_remediation
from flashmodel_operator.remediation import (
    GENERATION_HUNG,
    MEMORY_DIVERGENCE,
    PREWARM_FAILED,
    Decision,
    ModelBudget,
    serving_pods,
)
from flashmodel_operator.remediation import (
    decide as decide_remediation,
)
from flashmodel_operator.settings import current
from flashmodel_operator.shim_client import ShimClient
from flashmodel_operator.standby_gate import promote_for

if TYPE_CHECKING:
    from flashmodel_operator.gating import PodWatch

log = logging.getLogger(__name__)

STANDBY_ROUTED_SECONDS = 15.0
"""How long a drain waits for a promoted standby to become a ready endpoint before it goes on anyway."""
DRAIN_SECONDS = 30.0
"""How long a drained pod may finish its in-flight requests before it is evicted anyway (the engine drains too)."""

REMEDIATIONS = Counter("flashmodel_operator_remediations_total", "Pods drained and evicted", ["reason"])
# Every label value exported from the start at 0, so rate() and increase() see the first one.
for _reason in (MEMORY_DIVERGENCE, GENERATION_HUNG, PREWARM_FAILED):
    REMEDIATIONS.labels(reason=_reason)


async def decide(watch: PodWatch, fm: dict[str, Any], spec: FlashModelSpec, now: float) -> Decision | None:
    """The model's remediation decision for this watch's pod: evict it, or None (a hold is an event, once)."""
    pods = list(watch.state.health.values())
    budget = ModelBudget(
        restarts_last_hour=restarts_last_hour(fm, dt.datetime.now(dt.UTC)),
        in_flight=watch.state.in_flight,
        seconds_since_last=None if watch.state.last_remediation is None else now - watch.state.last_remediation,
        # The pods this operator saw prewarm that serve now, not the Deployment's count
        # (which counts any gate set True, kwok's included).
        ready_pods=serving_pods(pods),
        desired_pods=spec.replicas,
        backoff_seconds=current().remediation_backoff_seconds,
    )
    decision = decide_remediation(pods, budget, spec.remediation, now)
    if decision is None or decision.action == "evict":
        watch.state.last_hold = None
        if decision is not None and decision.pod != watch.name:
            return None  # that pod's own watch acts on it
        return decision
    if decision.reason != watch.state.last_hold:
        # A hold is news once, not every poll.
        watch.state.last_hold = decision.reason
        await watch.api(
            watch.cluster.event,
            fm,
            "Normal",
            "RemediationHeld",
            f"pod {decision.pod}: {decision.reason}: {decision.message}",
        )
        log.info(
            "event=remediation-held model=%s/%s pod=%s reason=%s",
            watch.namespace,
            watch.model,
            decision.pod,
            decision.reason,
        )
    return None


async def remediate(watch: PodWatch, fm: dict[str, Any], shim: ShimClient, decision: Decision) -> None:
    """Promote a standby in its place, drain (gate off: the Service stops routing here; wait for
    in-flight requests), then evict."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": watch.name, "namespace": watch.namespace}}
    spec = watch.spec_of(fm)
    promoted = None if spec is None else await promote_for(watch, fm, spec, f"{decision.reason}: {decision.message}")
    if promoted is not None:
        # The standby takes traffic before this pod stops taking it, so the model never has fewer
        # endpoints than before, even with one replica.
        await _wait_routed(watch, promoted[1], STANDBY_ROUTED_SECONDS)
    await watch.set_gate(False, decision.reason, "draining: " + decision.message)
    await watch.api(watch.cluster.event, pod, "Warning", decision.reason, "draining and evicting: " + decision.message)
    deadline = time.monotonic() + DRAIN_SECONDS
    # Zero requests in flight means nothing while the Service still routes here: a request
    # sent on a stale endpoint list after the eviction would meet a stopping engine (seen:
    # HTTP 500 "cannot schedule new futures after shutdown"). First the address leaves the
    # EndpointSlices, then proxies and clients get time to notice, then in-flight counts.
    while time.monotonic() < deadline:
        try:
            routed = await watch.api(watch.cluster.serving_addresses, watch.namespace, watch.model)
        except ApiException as exc:  # cannot tell: rely on the propagation wait alone
            log.warning(
                "event=drain-endpoints-unknown model=%s/%s pod=%s error=%s",
                watch.namespace,
                watch.model,
                watch.name,
                exc.status,
            )
            break
        if shim.pod_ip not in routed:
            break
        await asyncio.sleep(0.5)
    await asyncio.sleep(max(0.0, min(current().endpoint_propagation_seconds, deadline - time.monotonic())))
    while time.monotonic() < deadline:
        metrics = await shim.metrics()
        if metrics is None or metrics.requests_running + metrics.requests_waiting == 0:
            break
        await asyncio.sleep(0.5)
    await evict_and_record(watch, fm, decision)


async def _wait_routed(watch: PodWatch, address: str, seconds: float) -> None:
    """Until the Service's ready endpoints include `address`, or `seconds` pass (then drain anyway)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            routed = await watch.api(watch.cluster.serving_addresses, watch.namespace, watch.model)
        except ApiException:
            return
        if address in routed:
            # No propagation wait here: until the drain's own wait is over, the old pod still serves
            # whoever has not heard of the new endpoint yet.
            return
        await asyncio.sleep(0.25)


async def evict_and_record(watch: PodWatch, fm: dict[str, Any], decision: Decision) -> None:
    """Evict, then record it, even if this pod's daemon is cancelled meanwhile.

    The eviction marks the pod for deletion and kopf then cancels the pod's daemon, this
    task's caller: unshielded, the status entry, event and metric could die with it, leaving
    the pod evicted, nothing recorded and the restart budget one short.
    """
    await asyncio.shield(_evict_and_record(watch, fm, decision))


async def _evict_and_record(watch: PodWatch, fm: dict[str, Any], decision: Decision) -> None:
    while True:
        outcome = await watch.api(watch.cluster.evict, watch.namespace, watch.name)
        if outcome != "blocked":
            break
        # The PodDisruptionBudget said no: wait for it rather than force the pod out.
        await asyncio.sleep(2.0)
    async with watch.state.lock:
        watch.state.last_remediation = time.monotonic()
        watch.state.in_flight = None
        # Evicted: no longer a candidate. Its health record would otherwise stay until this watch
        # ends, after the record and event below, and the model's next decision could name this
        # pod in its hold (BackingOff) instead of the pod that is waiting.
        watch.state.health.pop(watch.name, None)
    if outcome == "gone":
        return
    REMEDIATIONS.labels(reason=decision.reason).inc()
    entry = {
        "pod": watch.name,
        "reason": decision.reason,
        "message": decision.message,
        "divergenceRatio": round(decision.divergence_ratio, 4),
        "time": now_iso(),
    }
    await watch.api(record_remediation, watch.cluster, watch.namespace, watch.model, fm, entry, history_length)
    await watch.api(
        watch.cluster.event,
        fm,
        "Warning",
        "Remediated",
        f"evicted pod {watch.name}: {decision.reason}: {decision.message}",
    )
    log.warning(
        "event=remediated model=%s/%s pod=%s reason=%s", watch.namespace, watch.model, watch.name, decision.reason
    )
