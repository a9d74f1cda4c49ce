"""Drain and evict one pod on the remediation decision, within the model's budget, and record it."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from typing import Any

from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.model_status import history_length, now_iso, restarts_last_hour
from flashmodel_operator.pod_context import PodContext
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

log = logging.getLogger(__name__)

STANDBY_ROUTED_SECONDS = 15.0
"""How long a drain waits for a promoted standby to become a ready endpoint before it goes on anyway."""
DRAIN_SECONDS = 30.0
"""How long a drained pod may finish its in-flight requests before it is evicted anyway (the engine drains too)."""

REMEDIATIONS = Counter("flashmodel_operator_remediations_total", "Pods drained and evicted", ["reason"])
# Every label value exported from the start at 0, so rate() and increase() see the first one.
for _reason in (MEMORY_DIVERGENCE, GENERATION_HUNG, PREWARM_FAILED):
    REMEDIATIONS.labels(reason=_reason)


async def decide(ctx: PodContext, fm: dict[str, Any], spec: FlashModelSpec, now: float) -> Decision | None:
    """The model's remediation decision for this watch's pod: evict it, or None (a hold is an event, once)."""
    pods = list(ctx.state.health.values())
    budget = ModelBudget(
        restarts_last_hour=restarts_last_hour(fm, dt.datetime.now(dt.UTC)),
        in_flight=ctx.state.in_flight,
        seconds_since_last=None if ctx.state.last_remediation is None else now - ctx.state.last_remediation,
        # The pods this operator saw prewarm that serve now, not the Deployment's count
        # (which counts any gate set True, kwok's included).
        ready_pods=serving_pods(pods),
        desired_pods=spec.replicas,
        backoff_seconds=current().remediation_backoff_seconds,
    )
    decision = decide_remediation(pods, budget, spec.remediation, now)
    if decision is None or decision.action == "evict":
        if ctx.state.last_hold is not None:
            ctx.state.last_hold, ctx.state.last_hold_message = None, ""
            ctx.request_pass()  # the status said it was held
        if decision is not None and decision.pod != ctx.name:
            return None  # that pod's own watch acts on it
        return decision
    if decision.reason != ctx.state.last_hold:
        # A hold is news once, not every poll; the pass puts a held-for-good one into Degraded.
        ctx.state.last_hold = decision.reason
        ctx.state.last_hold_message = f"pod {decision.pod}: {decision.message}"
        ctx.request_pass()
        await ctx.api(
            ctx.cluster.event,
            fm,
            "Normal",
            "RemediationHeld",
            f"pod {decision.pod}: {decision.reason}: {decision.message}",
        )
        log.info(
            "event=remediation-held model=%s/%s pod=%s reason=%s",
            ctx.namespace,
            ctx.model,
            decision.pod,
            decision.reason,
        )
    return None


async def remediate(
    ctx: PodContext, fm: dict[str, Any], spec: FlashModelSpec, shim: ShimClient, decision: Decision
) -> None:
    """Promote a standby in its place, drain (gate off: the Service stops routing here; wait for
    in-flight requests), then evict."""
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": ctx.name, "namespace": ctx.namespace}}
    promoted = await promote_for(ctx, fm, spec, f"{decision.reason}: {decision.message}")
    if promoted is not None:
        # The standby takes traffic before this pod stops taking it, so the model never has fewer
        # endpoints than before, even with one replica.
        await _wait_routed(ctx, promoted[1], STANDBY_ROUTED_SECONDS)
    await ctx.set_gate(False, decision.reason, "draining: " + decision.message)
    await ctx.api(ctx.cluster.event, pod, "Warning", decision.reason, "draining and evicting: " + decision.message)
    deadline = time.monotonic() + DRAIN_SECONDS
    # Zero requests in flight means nothing while the Service still routes here: a request
    # sent on a stale endpoint list after the eviction would meet a stopping engine (seen:
    # HTTP 500 "cannot schedule new futures after shutdown"). First the address leaves the
    # EndpointSlices, then proxies and clients get time to notice, then in-flight counts.
    while time.monotonic() < deadline:
        try:
            routed = await ctx.api(ctx.cluster.serving_addresses, ctx.namespace, ctx.model)
        except ApiException as exc:  # cannot tell: rely on the propagation wait alone
            log.warning(
                "event=drain-endpoints-unknown model=%s/%s pod=%s error=%s",
                ctx.namespace,
                ctx.model,
                ctx.name,
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
    await evict_and_record(ctx, fm, decision)


async def _wait_routed(ctx: PodContext, address: str, seconds: float) -> None:
    """Until the Service's ready endpoints include `address`, or `seconds` pass (then drain anyway)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            routed = await ctx.api(ctx.cluster.serving_addresses, ctx.namespace, ctx.model)
        except ApiException:
            return
        if address in routed:
            # No propagation wait here: until the drain's own wait is over, the old pod still serves
            # whoever has not heard of the new endpoint yet.
            return
        await asyncio.sleep(0.25)


async def evict_and_record(ctx: PodContext, fm: dict[str, Any], decision: Decision) -> None:
    """Evict, then record it, even if this pod's daemon is cancelled meanwhile.

    The eviction marks the pod for deletion and kopf then cancels the pod's daemon, this
    task's caller: unshielded, the status entry, event and metric could die with it, leaving
    the pod evicted, nothing recorded and the restart budget one short.
    """
    await asyncio.shield(_evict_and_record(ctx, fm, decision))


async def _evict_and_record(ctx: PodContext, fm: dict[str, Any], decision: Decision) -> None:
    while True:
        outcome = await ctx.api(ctx.cluster.evict, ctx.namespace, ctx.name)
        if outcome != "blocked":
            break
        # The PodDisruptionBudget said no: wait for it rather than force the pod out.
        await asyncio.sleep(2.0)
    async with ctx.state.lock:
        ctx.state.last_remediation = time.monotonic()
        ctx.state.in_flight = None
        # Evicted: no longer a candidate. Its health record would otherwise stay until this watch
        # ends, after the record and event below, and the model's next decision could name this
        # pod in its hold (BackingOff) instead of the pod that is waiting.
        ctx.state.health.pop(ctx.name, None)
    if outcome == "gone":
        return
    REMEDIATIONS.labels(reason=decision.reason).inc()
    entry = {
        "pod": ctx.name,
        "reason": decision.reason,
        "message": decision.message,
        "divergenceRatio": round(decision.divergence_ratio, 4),
        "time": now_iso(),
    }
    await ctx.api(record_remediation, ctx.cluster, ctx.namespace, ctx.model, fm, entry, history_length)
    await ctx.api(
        ctx.cluster.event,
        fm,
        "Warning",
        "Remediated",
        f"evicted pod {ctx.name}: {decision.reason}: {decision.message}",
    )
    log.warning(
        "event=remediated model=%s/%s pod=%s reason=%s", ctx.namespace, ctx.model, ctx.name, decision.reason
    )
