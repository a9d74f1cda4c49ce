"""Prewarm before traffic: warm one pod up through its shim, then open its readiness gate."""

from __future__ import annotations

import logging
import time
from typing import Any

from prometheus_client import Counter

from flashmodel_operator import adapters
from flashmodel_operator.eviction import decide, evict_and_record
from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.model_status import now_iso
from flashmodel_operator.pod_context import PodClocks, PodContext
from flashmodel_operator.pod_state import PodRecord, container_restarts
from flashmodel_operator.remediation import PodHealth
from flashmodel_operator.settings import current
from flashmodel_operator.shim_client import ShimClient
from flashmodel_operator.standby_gate import open_or_hold

log = logging.getLogger(__name__)

PREWARM_ATTEMPTS = 3
PREWARM_BACKOFF_SECONDS = 5.0
PREWARMS = Counter("flashmodel_operator_prewarms_total", "Prewarm runs against engine pods", ["result"])
# Every label value exported from the start at 0, so rate() and increase() see the first one.
for _result in ("succeeded", "failed"):
    PREWARMS.labels(result=_result)


async def prewarm(
    ctx: PodContext,
    clocks: PodClocks,
    pod: dict[str, Any],
    fm: dict[str, Any],
    spec: FlashModelSpec,
    shim: ShimClient,
) -> float | None:
    """One prewarm attempt on a pod whose gate is closed; the seconds until the next look, or None when replaced."""
    if ctx.state.in_flight == ctx.name:
        return current().monitor_seconds  # being drained: the gate stays off
    if not await shim.started():
        return 2.0  # still loading; the startup probe owns the deadline
    # The adapters first: the prewarm covers them, and the gate must not open on a pod without the set.
    wait = await adapters.sync(ctx, pod, fm, spec, shim, before_prewarm=True)
    if wait is not None:
        return wait
    record = ctx.state.pods.setdefault(ctx.name, PodRecord())
    record.template = ctx.template
    if not spec.prewarm.enabled:
        record.prewarmed, record.reason = True, "PrewarmDisabled"
        await ctx.write_pods_status()
        await open_or_hold(ctx, fm, spec, record, "PrewarmDisabled", "spec.prewarm.enabled is false")
        await ctx.write_pods_status()
        return current().monitor_seconds
    if clocks.prewarm_failure is not None:
        return await replace_unprewarmed(ctx, clocks.prewarm_failure, fm, spec)
    started = time.monotonic()
    result = await shim.prewarm(spec.prewarm.requests, spec.prewarm.prompts, spec.prewarm.timeout_seconds)
    if result.get("ok"):
        PREWARMS.labels(result="succeeded").inc()
        cold, warm = float(result.get("coldTTFTMs", 0.0)), float(result.get("warmTTFTMs", 0.0))
        metrics = await shim.metrics()
        clocks.prewarmed(metrics.generation if metrics else None, container_restarts(pod))
        msg = f"{result.get('requests')} warm-up requests, cold TTFT {cold:.0f} ms, warm TTFT {warm:.0f} ms"
        record.prewarmed, record.reason = True, None
        record.cold_ttft_ms, record.warm_ttft_ms = round(cold, 1), round(warm, 1)
        record.last_prewarm_time = now_iso()
        # status.pods says the pod is prewarmed before its gate opens: the status's prewarmedReplicas
        # counts open gates, so a reader never sees more prewarmed replicas than prewarmed entries.
        await ctx.write_pods_status()
        serves = await open_or_hold(ctx, fm, spec, record, "PrewarmSucceeded", msg)
        if not serves:
            msg += "; held out of the Service as a standby"
        await ctx.api(ctx.cluster.event, pod, "Normal", "Prewarmed", msg)
        log.info(
            "event=prewarmed model=%s/%s pod=%s cold_ms=%.1f warm_ms=%.1f seconds=%.1f standby=%s",
            ctx.namespace,
            ctx.model,
            ctx.name,
            cold,
            warm,
            time.monotonic() - started,
            not serves,
        )
        await ctx.write_pods_status()
        return current().monitor_seconds
    PREWARMS.labels(result="failed").inc()
    if result.get("status") == 401:
        # A model deleted and made again under its name has a new token: read it again.
        ctx.state.control_token = None
    clocks.attempts += 1
    record.prewarm_failures += 1
    record.reason = "PrewarmFailed"
    error = str(result.get("error") or "no reason given")
    msg = f"prewarm attempt {clocks.attempts}/{PREWARM_ATTEMPTS} failed: {error}"
    await ctx.api(ctx.cluster.event, pod, "Warning", "PrewarmFailed", msg)
    log.warning(
        "event=prewarm-failed model=%s/%s pod=%s attempt=%d error=%r",
        ctx.namespace,
        ctx.model,
        ctx.name,
        clocks.attempts,
        error,
    )
    await ctx.write_pods_status()
    if clocks.attempts >= PREWARM_ATTEMPTS:
        clocks.prewarm_failure = f"{clocks.attempts} failed prewarms: {error}"
        return await replace_unprewarmed(ctx, clocks.prewarm_failure, fm, spec)
    return float(PREWARM_BACKOFF_SECONDS * 2 ** (clocks.attempts - 1))


async def replace_unprewarmed(ctx: PodContext, failure: str, fm: dict[str, Any], spec: FlashModelSpec) -> float | None:
    """Ask for this never-prewarmed pod's eviction on the one path with the budget, back-off and one at a time."""
    health = PodHealth(
        name=ctx.name,
        prewarmed=False,
        livez_ok=False,
        divergence_recommended=False,
        divergence_ratio=0.0,
        divergent_since=None,
        readyz_failing_since=None,
        prewarm_failure=failure,
    )
    async with ctx.state.lock:
        ctx.state.health[ctx.name] = health
        decision = await decide(ctx, fm, spec, time.monotonic())
        if decision is not None and decision.action == "evict":
            ctx.state.in_flight = decision.pod
    if decision is None or decision.action != "evict":
        return current().monitor_seconds  # held (the event says why); asked again on the next look
    replaced = f"pod {ctx.name} replaced after {decision.message}"
    await ctx.api(ctx.cluster.event, fm, "Warning", "PrewarmFailed", replaced)
    await evict_and_record(ctx, fm, decision)
    return None
