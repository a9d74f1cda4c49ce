"""Per engine pod: the watch that prewarms it (prewarm_gate), follows its health and hands a bad one to eviction."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

import aiohttp
from flashmodel_engine.contract import SHIM_PORT
from pydantic import ValidationError

from flashmodel_operator import adapters
from flashmodel_operator.apply import Cluster, transient
from flashmodel_operator.eviction import decide, remediate
from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.model_status import note_startup
from flashmodel_operator.pod_context import PodClocks, PodContext
from flashmodel_operator.pod_state import (
    PodRecord,
    container_restarts,
    gate_is_standby,
    gate_is_true,
    model_state,
    pod_is_ready,
)
from flashmodel_operator.prewarm_gate import prewarm
from flashmodel_operator.remediation import CONFIRM_SECONDS, PodHealth
from flashmodel_operator.render import CONTROL_TOKEN_KEY, MODEL_LABEL, control_secret_name
from flashmodel_operator.settings import current
from flashmodel_operator.shim_client import ShimClient, ShimConnection, ShimReading
from flashmodel_operator.standby_gate import serve_if_needed, stand_by_if_surplus, template_of

log = logging.getLogger(__name__)

FlashModelLookup = Callable[[str, str], "dict[str, Any] | None"]
"""(namespace, name) -> the FlashModel as the operator's watch last saw it, or None when it has not."""

POLL_JITTER = 0.1
"""Each poll comes up to this fraction of monitor_seconds early or late: a fleet's pods, started
together by one burst, would otherwise be polled in lock-step bursts for as long as they live."""


def poll_delay(now: float, deadlines: list[float]) -> float:
    """The pause before the next health poll: monitor_seconds, jittered (mean unchanged), or less.

    Less when a fault seen on an earlier poll (a failing readiness, a divergence signal) reaches its
    threshold sooner: the poll then lands on the threshold, not up to a whole period after it.
    """
    delay = current().monitor_seconds * random.uniform(1 - POLL_JITTER, 1 + POLL_JITTER)
    for deadline in deadlines:
        # A little past the threshold, so the comparison `now - since >= threshold` holds on that poll.
        delay = min(delay, max(0.1, deadline - now + 0.05))
    return delay


def holds_polls(ready: bool, metrics: ShimReading | None, pod: dict[str, Any], spec: FlashModelSpec) -> bool:
    """Whether the pod's next health poll may wait in the shim for a change (health_poll_wait_seconds).

    Only a steady pod's: ready in the shim and in its Ready condition (other pods' remediation
    counts it as a serving endpoint from its last poll), no divergence, an engine that answers a
    `state`, and a model without standbys, whose promotion and step-back are decided on each
    pod's poll and must not wait half a minute for it.
    """
    return (
        current().health_poll_wait_seconds > 0
        and ready
        and metrics is not None
        and bool(metrics.state)
        and not metrics.divergence_recommended
        and spec.standby_replicas == 0
        and pod_is_ready(pod)
    )


class PodWatch:
    """The life of one engine pod as the operator sees it: prewarm, gate, watch, remediate."""

    def __init__(
        self,
        cluster: Cluster,
        session: aiohttp.ClientSession,
        namespace: str,
        name: str,
        model: str,
        live_body: Mapping[str, Any] | None = None,
        flashmodels: FlashModelLookup | None = None,
        request_pass: Callable[[str, str], None] | None = None,
    ) -> None:
        self.context = PodContext(cluster, namespace, name, model, model_state(namespace, model), request_pass)
        """What the steps (prewarm, the standby gate, eviction) get: the pod, its model's memory, the API."""
        self.clocks = PodClocks()
        self.live_body = live_body
        """kopf's live view of the pod (updated from the watch stream), so waiting costs no API reads."""
        self.flashmodels = flashmodels
        """The operator's watch of FlashModels: a warm pod's poll reads its model from memory, not the API."""
        self._spec: tuple[tuple[str, int], FlashModelSpec] | None = None
        self.shim_port = SHIM_PORT
        self.connection: ShimConnection | None = None
        """The kept-alive connection of this pod's polls (its IP is fixed for the pod's life)."""
        self.session = session
        self.held_state: str | None = None
        """The state of a steady pod's last health poll answer: its next poll waits in the shim for a change."""

    async def run(self, stopped: Any) -> None:
        ctx = self.context
        failures = 0
        try:
            while not stopped:
                try:
                    delay = await self.step()
                except Exception as exc:
                    if not transient(exc):
                        raise
                    # One failed read must not end the watch (kopf would restart it only after a back-off):
                    # look again soon, a little later each time while the API keeps failing.
                    failures += 1
                    delay = min(current().monitor_seconds, 0.5 * 2 ** min(failures, 4))
                    log.warning(
                        "event=pod-watch-retry model=%s/%s pod=%s failures=%d error=%s",
                        ctx.namespace,
                        ctx.model,
                        ctx.name,
                        failures,
                        type(exc).__name__,
                    )
                else:
                    failures = 0
                if delay is None:
                    return
                await asyncio.sleep(delay)
        finally:
            if self.connection is not None:
                self.connection.close()
            async with ctx.state.lock:
                ctx.state.pods.pop(ctx.name, None)
                ctx.state.health.pop(ctx.name, None)
                if ctx.state.in_flight == ctx.name:
                    ctx.state.in_flight = None
            await ctx.write_pods_status()

    async def step(self) -> float | None:
        """One look at the pod; the seconds until the next, or None when the watch is over."""
        ctx = self.context
        pod: dict[str, Any] | None = None
        if self.live_body is not None:
            # A Pending pod (no GPU node free, image pulling) can wait for hours; reading it from
            # the API every second made 400 Pending pods cost ~150 reads/s and most of a core.
            seen = self.live_body.get("status") or {}
            if seen.get("phase") != "Running" or not seen.get("podIP"):
                return 1.0
            steady = gate_is_true(self.live_body) and ctx.gate_written is not False
            waiting = gate_is_standby(self.live_body) and ctx.gate_written is not True
            if steady or waiting:
                # A warm pod, polled for as long as it lives: the watch stream's view is current
                # enough for its health, and a read per poll would cost 1,000 pods up to 200 pod
                # reads a second. Anything in transition (prewarm, a gate this watch just closed)
                # reads the pod fresh below.
                pod = dict(self.live_body)
        if pod is None:
            pod = await ctx.api(ctx.cluster.get, "v1", "Pod", ctx.namespace, ctx.name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return None
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if not ip or status.get("phase") != "Running":
            return 1.0
        fm = self.flashmodels(ctx.namespace, ctx.model) if self.flashmodels is not None else None
        if fm is None:
            fm = await ctx.api(ctx.cluster.get_flashmodel, ctx.namespace, ctx.model)
        if fm is None:
            return None
        spec = self.spec_of(fm)
        if spec is None:
            return current().monitor_seconds  # the reconcile reports the spec problem
        if ctx.state.control_token is None:
            # The Secret is made before the Deployment and lives as long as the model: read it once.
            ctx.state.control_token = await ctx.api(
                ctx.cluster.secret_value, ctx.namespace, control_secret_name(ctx.model), CONTROL_TOKEN_KEY
            )
        if self.connection is None or self.connection.host != ip:
            self.connection = ShimConnection(ip, self.shim_port)
        shim = ShimClient(
            self.session, ip, port=self.shim_port, token=ctx.state.control_token, connection=self.connection
        )
        ctx.template = template_of(pod)
        if gate_is_standby(pod) and ctx.state.in_flight != ctx.name:
            # Prewarmed and held out of the Service: watched like a serving pod, and promoted when needed.
            ctx.state.pods.setdefault(ctx.name, PodRecord(prewarmed=True, standby=True))
            await adapters.sync(ctx, pod, fm, spec, shim, before_prewarm=False)
            delay = await self.watch_health(pod, fm, spec, shim)
            record = ctx.state.pods.get(ctx.name)
            if delay is not None and record is not None and await serve_if_needed(ctx, fm, spec, record):
                return 0.5
            return delay
        if not gate_is_true(pod):
            return await prewarm(ctx, self.clocks, pod, fm, spec, shim)
        if ctx.state.pods.get(ctx.name) is not None:
            # A serving pod gets a changed adapter set without a restart (a pod the operator has no record of
            # yet, after its restart, gets one from watch_health first).
            await adapters.sync(ctx, pod, fm, spec, shim, before_prewarm=False)
        delay = await self.watch_health(pod, fm, spec, shim)
        record = ctx.state.pods.get(ctx.name)
        if delay is not None and record is not None and await stand_by_if_surplus(ctx, fm, spec, record):
            return 0.5
        return delay

    def spec_of(self, fm: Mapping[str, Any]) -> FlashModelSpec | None:
        """The model's spec, validated once per generation (None when invalid): a poll must not re-parse it."""
        meta = fm.get("metadata") or {}
        key = (str(meta.get("uid", "")), int(meta.get("generation", 0)))
        if self._spec is not None and self._spec[0] == key and key != ("", 0):
            return self._spec[1]
        try:
            spec = FlashModelSpec.model_validate(fm.get("spec") or {})
        except ValidationError:
            return None
        self._spec = (key, spec)
        return spec

    async def watch_health(
        self, pod: dict[str, Any], fm: dict[str, Any], spec: FlashModelSpec, shim: ShimClient
    ) -> float | None:
        ctx = self.context
        record = ctx.state.pods.setdefault(ctx.name, PodRecord(prewarmed=True))
        record.template = ctx.template
        restarts = container_restarts(pod)
        if self.clocks.restarts_seen is None:
            self.clocks.restarts_seen = restarts
        elif restarts > self.clocks.restarts_seen:
            # The kubelet restarted the engine container: it is cold, so off traffic until warm.
            await self._rearm(pod, f"engine container restarted ({self.clocks.restarts_seen} -> {restarts} restarts)")
            self.clocks.restarts_seen = None
            return 0.5
        # One request for the readiness result and the metrics values (two on an engine from before
        # the health poll). Liveness only matters once generation fails (hung = alive but not
        # generating), so a steady pod is not asked for it. A steady pod's poll is held by the shim
        # until its answer changes (or health_poll_wait_seconds, jittered, pass).
        held, self.held_state = self.held_state, None
        wait = current().health_poll_wait_seconds * random.uniform(1 - POLL_JITTER, 1 + POLL_JITTER) if held else 0.0
        asked = time.monotonic()
        poll = shim.poll(spec.health.readiness_deadline_seconds + 2, wait=wait, unless=held)
        if wait > 0:
            # A held poll may wait half a minute: a changed adapter set ends it, so the next step PUTs it now.
            answered, result = await adapters.unless_woken(ctx.state, poll)
            if result is None or not answered:
                self.held_state = held
                return 0.0
            metrics, ready = result
        else:
            metrics, ready = await poll
        live = True if ready else await shim.live()
        # After the poll, which a held one makes up to half a minute long: a fault's clock starts
        # when the answer shows it, or its threshold would be counted from before the fault.
        now = time.monotonic()
        if metrics is not None:
            if self.clocks.generation_seen is None:
                self.clocks.generation_seen = metrics.generation
            elif metrics.generation != self.clocks.generation_seen:
                # vLLM restarted inside the pod: cold again, so no traffic until it is warm again.
                seen = self.clocks.generation_seen
                await self._rearm(pod, f"engine restarted in the pod (generation {seen:g} -> {metrics.generation:g})")
                self.clocks.generation_seen = None
                return 0.5
            divergent = metrics.divergence_recommended
            self.clocks.divergent_since = (self.clocks.divergent_since or now) if divergent else None
            created = str(pod["metadata"].get("creationTimestamp") or "")
            if metrics.startup and note_startup(ctx.state, fm, ctx.name, record, dict(metrics.startup), created):
                await ctx.write_pods_status()
        self.clocks.readyz_failing_since = None if ready else (self.clocks.readyz_failing_since or now)
        health = PodHealth(
            name=ctx.name,
            prewarmed=True,
            livez_ok=live,
            divergence_recommended=bool(metrics and metrics.divergence_recommended),
            divergence_ratio=metrics.divergence_ratio if metrics else 0.0,
            divergent_since=self.clocks.divergent_since,
            readyz_failing_since=self.clocks.readyz_failing_since,
            endpoint_ready=pod_is_ready(pod),
            standby=record.standby,
        )
        async with ctx.state.lock:
            ctx.state.health[ctx.name] = health
            decision = await decide(ctx, fm, spec, now)
            if decision is not None and decision.action == "evict":
                ctx.state.in_flight = decision.pod
        if decision is not None and decision.action == "evict":
            # Each pod's own watch drains and evicts it, so the work stops with the pod.
            if decision.pod == ctx.name:
                await remediate(ctx, fm, spec, shim, decision)
                return None
            async with ctx.state.lock:
                if ctx.state.in_flight == decision.pod:
                    ctx.state.in_flight = None  # its own watch picks it up on its next step
        deadlines = []
        if self.clocks.readyz_failing_since is not None and live:
            deadlines.append(self.clocks.readyz_failing_since + spec.remediation.hung_readiness_seconds)
        if self.clocks.divergent_since is not None:
            deadlines.append(self.clocks.divergent_since + CONFIRM_SECONDS)
        if not deadlines and holds_polls(ready, metrics, pod, spec):
            assert metrics is not None
            self.held_state = metrics.state
            if held != metrics.state or now - asked >= wait / 2:
                return 0.0
            # The same answer at once: the shim held no poll (its limit of held polls was reached), so
            # this pod is polled every monitor_seconds, asking again to be held each time.
        return poll_delay(time.monotonic(), deadlines)

    async def _rearm(self, pod: dict[str, Any], msg: str) -> None:
        """The engine restarted: it is cold, so its gate closes until a prewarm opens it again."""
        ctx = self.context
        await ctx.set_gate(False, "EngineRestarted", msg)
        await ctx.api(ctx.cluster.event, pod, "Warning", "EngineRestarted", msg + "; prewarming again")
        ctx.state.pods[ctx.name].prewarmed = False
        adapters.forget_pod_set(ctx.state.pods[ctx.name])
        await ctx.write_pods_status()


def model_of(labels: dict[str, str]) -> str | None:
    return labels.get(MODEL_LABEL)


__all__ = ["PodWatch", "model_of"]
