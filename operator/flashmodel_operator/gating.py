"""Per engine pod: prewarm before traffic (the readiness gate), then watch health; remediate one pod at a time."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aiohttp
from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter
from pydantic import ValidationError

from flashmodel_operator import GROUP
from flashmodel_operator.apply import Cluster, transient
from flashmodel_operator.conditions import READY
from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.remediation import (
    GENERATION_HUNG,
    MEMORY_DIVERGENCE,
    PREWARM_FAILED,
    Decision,
    ModelBudget,
    PodHealth,
    decide,
    serving_pods,
)
from flashmodel_operator.render import CONTROL_TOKEN_KEY, MODEL_LABEL, PREWARM_GATE, control_secret_name
from flashmodel_operator.shim_client import ShimClient

log = logging.getLogger(__name__)

POLL_SECONDS = float(os.environ.get("FLASHMODEL_MONITOR_SECONDS", "5"))
PREWARM_ATTEMPTS = 3
PREWARM_BACKOFF_SECONDS = 5.0
DRAIN_SECONDS = 30.0
"""How long a drained pod may finish its in-flight requests before it is evicted anyway (the engine drains too)."""
HISTORY = 10
ENDPOINT_PROPAGATION_SECONDS = float(os.environ.get("FLASHMODEL_ENDPOINT_PROPAGATION_SECONDS", "5"))
"""After the endpoint left the EndpointSlice, time for proxies and clients to stop using it."""

REMEDIATIONS = Counter("flashmodel_operator_remediations_total", "Pods drained and evicted", ["reason"])
PREWARMS = Counter("flashmodel_operator_prewarms_total", "Prewarm runs against engine pods", ["result"])
# Every label value exported from the start at 0, so rate() and increase() see the first one.
for _reason in (MEMORY_DIVERGENCE, GENERATION_HUNG, PREWARM_FAILED):
    REMEDIATIONS.labels(reason=_reason)
for _result in ("succeeded", "failed"):
    PREWARMS.labels(result=_result)

T = TypeVar("T")


def _now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class PodRecord:
    """status.pods[] of one pod: what its prewarm did."""

    prewarmed: bool = False
    cold_ttft_ms: float | None = None
    warm_ttft_ms: float | None = None
    last_prewarm_time: str | None = None
    prewarm_failures: int = 0
    reason: str | None = None

    def to_status(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "prewarmed": self.prewarmed, "prewarmFailures": self.prewarm_failures}
        for key, value in (
            ("coldTTFTMs", self.cold_ttft_ms),
            ("warmTTFTMs", self.warm_ttft_ms),
            ("lastPrewarmTime", self.last_prewarm_time),
            ("reason", self.reason),
        ):
            if value is not None:
                out[key] = value
        return out


@dataclass
class ModelState:
    """The operator's memory of one model's pods; the API server holds what must survive a restart."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pods: dict[str, PodRecord] = field(default_factory=dict)
    health: dict[str, PodHealth] = field(default_factory=dict)
    in_flight: str | None = None
    last_remediation: float | None = None
    last_hold: str | None = None
    written: list[dict[str, Any]] | None = None
    control_token: str | None = None
    """The model's `<name>-shim` token, which the shims require on POST /prewarm."""


MODELS: dict[tuple[str, str], ModelState] = {}


def model_state(namespace: str, model: str) -> ModelState:
    return MODELS.setdefault((namespace, model), ModelState())


PREWARMED_REASONS = frozenset({"PrewarmSucceeded", "PrewarmDisabled"})
"""The gate reasons this operator writes when it opens the gate; anything else did not see our prewarm."""


def gate_is_true(pod: dict[str, Any]) -> bool:
    """The pod's readiness gate is open, and by this operator after a prewarm it saw succeed.

    A gate set True by anyone else (kwok sets every readiness gate of the pods it runs) is no prewarm.
    """
    return any(
        c.get("type") == PREWARM_GATE and c.get("status") == "True" and c.get("reason") in PREWARMED_REASONS
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def pod_is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition: its containers' probes and all its readiness gates pass."""
    return any(
        c.get("type") == READY and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or []
    )


def container_restarts(pod: dict[str, Any]) -> int:
    return sum(int(c.get("restartCount", 0)) for c in (pod.get("status") or {}).get("containerStatuses") or [])


def history_length(fm: dict[str, Any]) -> int:
    """How many status.remediations to keep: at least HISTORY, and all an hour's budget can hold."""
    budget = ((fm.get("spec") or {}).get("remediation") or {}).get("maxRestartsPerHour", 0)
    return max(HISTORY, int(budget) if isinstance(budget, int) else 0)


def restarts_last_hour(fm: dict[str, Any], now: dt.datetime) -> int:
    count = 0
    for entry in (fm.get("status") or {}).get("remediations") or []:
        try:
            at = dt.datetime.strptime(entry["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        except (KeyError, ValueError):
            continue
        if now - at < dt.timedelta(hours=1):
            count += 1
    return count


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
    ) -> None:
        self.cluster = cluster
        self.live_body = live_body
        """kopf's live view of the pod (updated from the watch stream), so waiting costs no API reads."""
        self.session = session
        self.namespace = namespace
        self.name = name
        self.model = model
        self.state = model_state(namespace, model)
        self.generation_seen: float | None = None
        self.attempts = 0
        self.divergent_since: float | None = None
        self.readyz_failing_since: float | None = None
        self.restarts_seen: int | None = None
        self.prewarm_failure: str | None = None
        """Set once every prewarm attempt failed: the pod waits for its turn to be replaced."""

    async def _api(self, fn: Callable[..., T], *args: Any) -> T:
        # The API client is synchronous; keep the event loop free for the other pods.
        return await asyncio.to_thread(fn, *args)

    async def run(self, stopped: Any) -> None:
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
                    delay = min(POLL_SECONDS, 0.5 * 2 ** min(failures, 4))
                    log.warning("event=pod-watch-retry model=%s/%s pod=%s failures=%d error=%s", self.namespace,
                                self.model, self.name, failures, type(exc).__name__)
                else:
                    failures = 0
                if delay is None:
                    return
                await asyncio.sleep(delay)
        finally:
            async with self.state.lock:
                self.state.pods.pop(self.name, None)
                self.state.health.pop(self.name, None)
                if self.state.in_flight == self.name:
                    self.state.in_flight = None
            await self.write_pods_status()

    async def step(self) -> float | None:
        """One look at the pod; the seconds until the next, or None when the watch is over."""
        if self.live_body is not None:
            # A Pending pod (no GPU node free, image pulling) can wait for hours; reading it from
            # the API every second made 400 Pending pods cost ~150 reads/s and most of a core.
            seen = self.live_body.get("status") or {}
            if seen.get("phase") != "Running" or not seen.get("podIP"):
                return 1.0
        pod = await self._api(self.cluster.get, "v1", "Pod", self.namespace, self.name)
        if pod is None or pod["metadata"].get("deletionTimestamp"):
            return None
        status = pod.get("status") or {}
        ip = status.get("podIP")
        if not ip or status.get("phase") != "Running":
            return 1.0
        fm = await self._api(self.cluster.get_flashmodel, self.namespace, self.model)
        if fm is None:
            return None
        try:
            spec = FlashModelSpec.model_validate(fm.get("spec") or {})
        except ValidationError:
            return POLL_SECONDS  # the reconcile reports the spec problem
        if self.state.control_token is None:
            # The Secret is made before the Deployment and lives as long as the model: read it once.
            self.state.control_token = await self._api(
                self.cluster.secret_value, self.namespace, control_secret_name(self.model), CONTROL_TOKEN_KEY
            )
        shim = ShimClient(self.session, ip, token=self.state.control_token)
        if not gate_is_true(pod):
            return await self.prewarm(pod, fm, spec, shim)
        return await self.watch(pod, fm, spec, shim)

    async def prewarm(
        self, pod: dict[str, Any], fm: dict[str, Any], spec: FlashModelSpec, shim: ShimClient
    ) -> float | None:
        if self.state.in_flight == self.name:
            return POLL_SECONDS  # being drained: the gate stays off
        if not await shim.started():
            return 2.0  # still loading; the startup probe owns the deadline
        record = self.state.pods.setdefault(self.name, PodRecord())
        if not spec.prewarm.enabled:
            await self.set_gate(True, "PrewarmDisabled", "spec.prewarm.enabled is false")
            record.prewarmed, record.reason = True, "PrewarmDisabled"
            await self.write_pods_status()
            return POLL_SECONDS
        if self.prewarm_failure is not None:
            return await self.replace_unprewarmed(fm, spec)
        started = time.monotonic()
        result = await shim.prewarm(spec.prewarm.requests, spec.prewarm.prompts, spec.prewarm.timeout_seconds)
        if result.get("ok"):
            PREWARMS.labels(result="succeeded").inc()
            cold, warm = float(result.get("coldTTFTMs", 0.0)), float(result.get("warmTTFTMs", 0.0))
            metrics = await shim.metrics()
            self.generation_seen = metrics.generation if metrics else None
            self.restarts_seen = container_restarts(pod)
            self.attempts = 0
            self.divergent_since = self.readyz_failing_since = None
            msg = f"{result.get('requests')} warm-up requests, cold TTFT {cold:.0f} ms, warm TTFT {warm:.0f} ms"
            await self.set_gate(True, "PrewarmSucceeded", msg)
            record.prewarmed, record.reason = True, None
            record.cold_ttft_ms, record.warm_ttft_ms = round(cold, 1), round(warm, 1)
            record.last_prewarm_time = _now_iso()
            await self._api(self.cluster.event, pod, "Normal", "Prewarmed", msg)
            log.info(
                "event=prewarmed model=%s/%s pod=%s cold_ms=%.1f warm_ms=%.1f seconds=%.1f",
                self.namespace,
                self.model,
                self.name,
                cold,
                warm,
                time.monotonic() - started,
            )
            await self.write_pods_status()
            return POLL_SECONDS
        PREWARMS.labels(result="failed").inc()
        if result.get("status") == 401:
            # A model deleted and made again under its name has a new token: read it again.
            self.state.control_token = None
        self.attempts += 1
        record.prewarm_failures += 1
        record.reason = "PrewarmFailed"
        error = str(result.get("error") or "no reason given")
        msg = f"prewarm attempt {self.attempts}/{PREWARM_ATTEMPTS} failed: {error}"
        await self._api(self.cluster.event, pod, "Warning", "PrewarmFailed", msg)
        log.warning(
            "event=prewarm-failed model=%s/%s pod=%s attempt=%d error=%r",
            self.namespace,
            self.model,
            self.name,
            self.attempts,
            error,
        )
        await self.write_pods_status()
        if self.attempts >= PREWARM_ATTEMPTS:
            self.prewarm_failure = f"{self.attempts} failed prewarms: {error}"
            return await self.replace_unprewarmed(fm, spec)
        return float(PREWARM_BACKOFF_SECONDS * 2 ** (self.attempts - 1))

    async def replace_unprewarmed(self, fm: dict[str, Any], spec: FlashModelSpec) -> float | None:
        """Ask for this never-prewarmed pod's eviction on the one path with the budget, back-off and one at a time."""
        assert self.prewarm_failure is not None
        health = PodHealth(
            name=self.name,
            prewarmed=False,
            livez_ok=False,
            divergence_recommended=False,
            divergence_ratio=0.0,
            divergent_since=None,
            readyz_failing_since=None,
            prewarm_failure=self.prewarm_failure,
        )
        async with self.state.lock:
            self.state.health[self.name] = health
            decision = await self.decide(fm, spec, time.monotonic())
            if decision is not None and decision.action == "evict":
                self.state.in_flight = decision.pod
        if decision is None or decision.action != "evict":
            return POLL_SECONDS  # held (the event says why); asked again on the next look
        replaced = f"pod {self.name} replaced after {decision.message}"
        await self._api(self.cluster.event, fm, "Warning", "PrewarmFailed", replaced)
        await self.evict_and_record(fm, decision)
        return None

    async def watch(
        self, pod: dict[str, Any], fm: dict[str, Any], spec: FlashModelSpec, shim: ShimClient
    ) -> float | None:
        now = time.monotonic()
        self.state.pods.setdefault(self.name, PodRecord(prewarmed=True))
        restarts = container_restarts(pod)
        if self.restarts_seen is None:
            self.restarts_seen = restarts
        elif restarts > self.restarts_seen:
            # The kubelet restarted the engine container: it is cold, so off traffic until warm.
            msg = f"engine container restarted ({self.restarts_seen} -> {restarts} restarts)"
            await self.set_gate(False, "EngineRestarted", msg)
            await self._api(self.cluster.event, pod, "Warning", "EngineRestarted", msg + "; prewarming again")
            self.state.pods[self.name].prewarmed = False
            self.restarts_seen = None
            await self.write_pods_status()
            return 0.5
        metrics = await shim.metrics()
        live = await shim.live()
        ready = await shim.ready(spec.health.readiness_deadline_seconds + 2)
        if metrics is not None:
            if self.generation_seen is None:
                self.generation_seen = metrics.generation
            elif metrics.generation != self.generation_seen:
                # vLLM restarted inside the pod: cold again, so no traffic until it is warm again.
                msg = f"engine restarted in the pod (generation {self.generation_seen:g} -> {metrics.generation:g})"
                await self.set_gate(False, "EngineRestarted", msg)
                await self._api(self.cluster.event, pod, "Warning", "EngineRestarted", msg + "; prewarming again")
                self.state.pods[self.name].prewarmed = False
                self.generation_seen = None
                await self.write_pods_status()
                return 0.5
            self.divergent_since = (self.divergent_since or now) if metrics.divergence_recommended else None
        self.readyz_failing_since = None if ready else (self.readyz_failing_since or now)
        health = PodHealth(
            name=self.name,
            prewarmed=True,
            livez_ok=live,
            divergence_recommended=bool(metrics and metrics.divergence_recommended),
            divergence_ratio=metrics.divergence_ratio if metrics else 0.0,
            divergent_since=self.divergent_since,
            readyz_failing_since=self.readyz_failing_since,
            endpoint_ready=pod_is_ready(pod),
        )
        async with self.state.lock:
            self.state.health[self.name] = health
            decision = await self.decide(fm, spec, now)
            if decision is not None and decision.action == "evict":
                self.state.in_flight = decision.pod
        if decision is not None and decision.action == "evict":
            # Each pod's own watch drains and evicts it, so the work stops with the pod.
            if decision.pod == self.name:
                await self.remediate(fm, shim, decision)
                return None
            async with self.state.lock:
                if self.state.in_flight == decision.pod:
                    self.state.in_flight = None  # its own watch picks it up on its next step
        return POLL_SECONDS

    async def decide(self, fm: dict[str, Any], spec: FlashModelSpec, now: float) -> Decision | None:
        pods = list(self.state.health.values())
        budget = ModelBudget(
            restarts_last_hour=restarts_last_hour(fm, dt.datetime.now(dt.UTC)),
            in_flight=self.state.in_flight,
            seconds_since_last=None if self.state.last_remediation is None else now - self.state.last_remediation,
            # The pods this operator saw prewarm that serve now, not the Deployment's count
            # (which counts any gate set True, kwok's included).
            ready_pods=serving_pods(pods),
            desired_pods=spec.replicas,
        )
        decision = decide(pods, budget, spec.remediation, now)
        if decision is None or decision.action == "evict":
            self.state.last_hold = None
            if decision is not None and decision.pod != self.name:
                return None  # that pod's own watch acts on it
            return decision
        if decision.reason != self.state.last_hold:
            # A hold is news once, not every poll.
            self.state.last_hold = decision.reason
            await self._api(
                self.cluster.event,
                fm,
                "Normal",
                "RemediationHeld",
                f"pod {decision.pod}: {decision.reason}: {decision.message}",
            )
            log.info(
                "event=remediation-held model=%s/%s pod=%s reason=%s",
                self.namespace,
                self.model,
                decision.pod,
                decision.reason,
            )
        return None

    async def remediate(self, fm: dict[str, Any], shim: ShimClient, decision: Decision) -> None:
        """Drain (gate off: the Service stops routing here; wait for in-flight requests), then evict."""
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": self.name, "namespace": self.namespace}}
        await self.set_gate(False, decision.reason, "draining: " + decision.message)
        await self._api(
            self.cluster.event, pod, "Warning", decision.reason, "draining and evicting: " + decision.message
        )
        deadline = time.monotonic() + DRAIN_SECONDS
        # Zero requests in flight means nothing while the Service still routes here: a request
        # sent on a stale endpoint list after the eviction would meet a stopping engine (seen:
        # HTTP 500 "cannot schedule new futures after shutdown"). First the address leaves the
        # EndpointSlices, then proxies and clients get time to notice, then in-flight counts.
        while time.monotonic() < deadline:
            try:
                routed = await self._api(self.cluster.serving_addresses, self.namespace, self.model)
            except ApiException as exc:  # cannot tell: rely on the propagation wait alone
                log.warning(
                    "event=drain-endpoints-unknown model=%s/%s pod=%s error=%s",
                    self.namespace,
                    self.model,
                    self.name,
                    exc.status,
                )
                break
            if shim.pod_ip not in routed:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(max(0.0, min(ENDPOINT_PROPAGATION_SECONDS, deadline - time.monotonic())))
        while time.monotonic() < deadline:
            metrics = await shim.metrics()
            if metrics is None or metrics.requests_running + metrics.requests_waiting == 0:
                break
            await asyncio.sleep(0.5)
        await self.evict_and_record(fm, decision)

    async def evict_and_record(self, fm: dict[str, Any], decision: Decision) -> None:
        """Evict, then record it, even if this pod's daemon is cancelled meanwhile.

        The eviction marks the pod for deletion and kopf then cancels the pod's daemon, this
        task's caller: unshielded, the status entry, event and metric could die with it (seen
        in CI: the pod evicted, nothing recorded, the restart budget one short).
        """
        await asyncio.shield(self._evict_and_record(fm, decision))

    async def _evict_and_record(self, fm: dict[str, Any], decision: Decision) -> None:
        while True:
            outcome = await self._api(self.cluster.evict, self.namespace, self.name)
            if outcome != "blocked":
                break
            # The PodDisruptionBudget said no: wait for it rather than force the pod out.
            await asyncio.sleep(2.0)
        async with self.state.lock:
            self.state.last_remediation = time.monotonic()
            self.state.in_flight = None
        if outcome == "gone":
            return
        REMEDIATIONS.labels(reason=decision.reason).inc()
        entry = {
            "pod": self.name,
            "reason": decision.reason,
            "message": decision.message,
            "divergenceRatio": round(decision.divergence_ratio, 4),
            "time": _now_iso(),
        }
        latest = await self._api(self.cluster.get_flashmodel, self.namespace, self.model) or fm
        history = [*((latest.get("status") or {}).get("remediations") or []), entry][-history_length(latest):]
        await self._api(self.cluster.patch_status, self.namespace, self.model, {"remediations": history})
        await self._api(
            self.cluster.event,
            fm,
            "Warning",
            "Remediated",
            f"evicted pod {self.name}: {decision.reason}: {decision.message}",
        )
        log.warning(
            "event=remediated model=%s/%s pod=%s reason=%s", self.namespace, self.model, self.name, decision.reason
        )

    async def set_gate(self, value: bool, reason: str, message: str) -> None:
        await self._api(self.cluster.set_pod_condition, self.namespace, self.name, PREWARM_GATE, value, reason, message)

    async def write_pods_status(self) -> None:
        async with self.state.lock:
            pods = [record.to_status(name) for name, record in sorted(self.state.pods.items())]
            if pods == self.state.written:
                return
            self.state.written = pods
        try:
            await self._api(self.cluster.patch_status, self.namespace, self.model, {"pods": pods})
        except Exception as exc:  # the model may be gone; the next change writes again
            log.info("event=pods-status-skipped model=%s/%s error=%s", self.namespace, self.model, exc)


def model_of(labels: dict[str, str]) -> str | None:
    return labels.get(MODEL_LABEL)


__all__ = ["GROUP", "PodWatch", "gate_is_true", "model_of"]
