"""PodWatch: a Pending or warm pod is watched through kopf's live body, not by polling the API; its health polls."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web
from flashmodel_engine.contract import health_poll_state, parse_health_poll_wait
from flashmodel_operator.apply import Cluster
from flashmodel_operator.eviction import REMEDIATIONS, decide, evict_and_record
from flashmodel_operator.gating import PodWatch
from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.model_status import history_length, restarts_last_hour
from flashmodel_operator.prewarm_gate import PREWARM_ATTEMPTS, prewarm
from flashmodel_operator.remediation import Decision, PodHealth
from flashmodel_operator.render import PREWARM_GATE
from flashmodel_operator.settings import OperatorSettings, use
from flashmodel_operator.shim_client import ShimClient

from tests.support.local_http import serve_local


class CountingCluster(Cluster):
    """The real Cluster class with its transport replaced: counts reads, answers with a fixed pod."""

    def __init__(self, pod: dict[str, Any]) -> None:
        self.reads = 0
        self.pod = pod

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return self.pod

    def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return None  # the model is gone: the watch ends after its first real look


def _pod(phase: str, ip: str | None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": "qwen-abc", "namespace": "ns"}, "status": status}


async def test_pending_pod_costs_no_api_reads() -> None:
    pending = _pod("Pending", None)
    cluster = CountingCluster(pending)
    async with aiohttp.ClientSession() as session:
        watch = PodWatch(cluster, session, "ns", "qwen-abc", "qwen", live_body=pending)
        for _ in range(5):
            assert await watch.step() == 1.0
    assert cluster.reads == 0


async def test_running_pod_is_read_fresh_from_the_api() -> None:
    running = _pod("Running", "10.0.0.7")
    cluster = CountingCluster(running)
    async with aiohttp.ClientSession() as session:
        watch = PodWatch(cluster, session, "ns", "qwen-abc", "qwen", live_body=running)
        # Running: the pod and its model are read from the API; the model is gone, so the watch ends.
        assert await watch.step() is None
    assert cluster.reads == 2


class EvictingCluster(Cluster):
    """The real Cluster class with its transport replaced: an eviction, then the writes that record it."""

    def __init__(self) -> None:
        self.evicted = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.status_patches: list[dict[str, Any]] = []
        self.events: list[str] = []

    def evict(self, namespace: str, name: str) -> Literal["evicted", "blocked", "gone"]:
        self.loop.call_soon_threadsafe(self.evicted.set)
        time.sleep(0.2)  # the API server answers; meanwhile the pod's deletion reaches kopf
        return "evicted"

    def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any] | None:
        return {"metadata": {"name": name, "namespace": namespace}, "status": {}}

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.status_patches.append(status)

    def event(self, involved: dict[str, Any], type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(reason)


async def test_an_eviction_is_recorded_even_when_the_pods_daemon_is_cancelled() -> None:
    # kopf cancels a pod's daemon once the pod is marked for deletion, which the eviction itself
    # causes: the status entry, the event and the metric must still be written.
    cluster = EvictingCluster()
    fm = {"metadata": {"name": "qwen", "namespace": "ns-cancel"}, "status": {}}
    decision = Decision("evict", "GenerationHung", "qwen-abc", "hung for 20s")
    before = REMEDIATIONS.labels(reason="GenerationHung")._value.get()
    async with aiohttp.ClientSession() as session:
        watch = PodWatch(cluster, session, "ns-cancel", "qwen-abc", "qwen")
        daemon = asyncio.create_task(evict_and_record(watch.context, fm, decision))
        await cluster.evicted.wait()
        daemon.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await daemon
        for _ in range(100):
            if cluster.events:
                break
            await asyncio.sleep(0.05)
    assert [p["remediations"][0]["pod"] for p in cluster.status_patches] == ["qwen-abc"]
    assert cluster.events == ["Remediated"]
    assert REMEDIATIONS.labels(reason="GenerationHung")._value.get() == before + 1


def _remediations(count: int, minutes_ago: float = 5) -> list[dict[str, Any]]:
    at = (dt.datetime.now(dt.UTC) - dt.timedelta(minutes=minutes_ago)).strftime("%Y-%m-%dT%H:%M:%SZ")
    return [
        {"pod": f"p{i}", "reason": "GenerationHung", "message": "", "divergenceRatio": 0.0, "time": at}
        for i in range(count)
    ]


class BudgetCluster(Cluster):
    """The real Cluster class with its transport replaced: a model with a remediation history; counts evictions."""

    def __init__(self, budget: int, history: list[dict[str, Any]], namespace: str) -> None:
        # A namespace per test: the operator's memory of a model (its last remediation) is per process.
        self.fm: dict[str, Any] = {
            "metadata": {"name": "qwen", "namespace": namespace},
            "spec": {"model": {"hub": {"id": "m"}}, "remediation": {"maxRestartsPerHour": budget}},
            "status": {"remediations": history},
        }
        self.evictions: list[str] = []
        self.events: list[tuple[str, str]] = []

    def evict(self, namespace: str, name: str) -> Literal["evicted", "blocked", "gone"]:
        self.evictions.append(name)
        return "evicted"

    def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.fm

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.fm["status"] = {**self.fm["status"], **status}

    def event(self, involved: dict[str, Any], type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append((reason, message))

    def set_pod_condition(self, namespace: str, name: str, kind: str, value: bool, reason: str, message: str) -> None:
        pass


class FailingShim(ShimClient):
    """A shim whose every prewarm fails (fault injection: the engine answers 502)."""

    def __init__(self) -> None:
        self.pod_ip = "127.0.0.9"
        self.prewarms = 0

    async def started(self) -> bool:
        return True

    async def prewarm(self, requests: int, prompts: list[str], timeout: float) -> dict[str, Any]:
        self.prewarms += 1
        return {"ok": False, "error": "HTTP 502", "status": 502}


def test_the_budget_counts_as_many_remediations_as_it_allows() -> None:
    # The CRD allows budgets up to 60; counting only the last 10 entries made any budget above 10 unlimited.
    now = dt.datetime.now(dt.UTC)
    fm = {"spec": {"remediation": {"maxRestartsPerHour": 20}}, "status": {"remediations": _remediations(15)}}
    assert restarts_last_hour(fm, now) == 15
    assert history_length(fm) == 20
    assert history_length({"spec": {"remediation": {"maxRestartsPerHour": 1}}}) == 10


async def test_a_recorded_eviction_keeps_the_whole_hour_the_budget_counts() -> None:
    cluster = BudgetCluster(budget=20, history=_remediations(12), namespace="ns-history")
    async with aiohttp.ClientSession() as session:
        watch = PodWatch(cluster, session, "ns-history", "qwen-x", "qwen")
        await evict_and_record(watch.context, cluster.fm, Decision("evict", "GenerationHung", "qwen-x", "hung"))
    assert len(cluster.fm["status"]["remediations"]) == 13
    assert restarts_last_hour(cluster.fm, dt.datetime.now(dt.UTC)) == 13


async def test_an_evicted_pod_is_no_candidate_for_the_models_next_decision() -> None:
    # Two hung pods: once the first is evicted, the hold the second gets must name the second.
    cluster = BudgetCluster(budget=20, history=[], namespace="ns-evicted")
    spec = FlashModelSpec.model_validate(cluster.fm["spec"])
    hung_since = time.monotonic() - 3600
    async with aiohttp.ClientSession() as session:
        first = PodWatch(cluster, session, "ns-evicted", "qwen-a", "qwen")
        second = PodWatch(cluster, session, "ns-evicted", "qwen-b", "qwen")  # the model's state is shared
        for name in ("qwen-a", "qwen-b"):
            first.context.state.health[name] = PodHealth(
                name=name,
                prewarmed=True,
                livez_ok=True,
                divergence_recommended=False,
                divergence_ratio=0.0,
                divergent_since=None,
                readyz_failing_since=hung_since,
                endpoint_ready=False,
            )
        await evict_and_record(first.context, cluster.fm, Decision("evict", "GenerationHung", "qwen-a", "hung"))
        assert "qwen-a" not in first.context.state.health
        await decide(second.context, cluster.fm, spec, time.monotonic())  # within the back-off (60 s by default)
    held = [m for reason, m in cluster.events if reason == "RemediationHeld"]
    assert held and held[-1].startswith("pod qwen-b: BackingOff"), held


async def test_pods_whose_prewarm_keeps_failing_are_replaced_within_the_budget_one_at_a_time() -> None:
    cluster = BudgetCluster(budget=1, history=_remediations(1), namespace="ns-budget")
    spec = FlashModelSpec.model_validate(cluster.fm["spec"])
    pod: dict[str, Any] = {"metadata": {"name": "qwen-a", "namespace": "ns-budget"}, "status": {}}
    shim = FailingShim()
    passes: list[tuple[str, str]] = []
    async with aiohttp.ClientSession() as session:
        a = PodWatch(cluster, session, "ns-budget", "qwen-a", "qwen", request_pass=lambda *key: passes.append(key))
        b = PodWatch(cluster, session, "ns-budget", "qwen-b", "qwen", request_pass=lambda *key: passes.append(key))
        for watch in (a, b):
            for _ in range(PREWARM_ATTEMPTS + 3):
                delay = await prewarm(watch.context, watch.clocks, pod, cluster.fm, spec, shim)
                assert delay is not None, "a pod was evicted past an exhausted restart budget"
    assert cluster.evictions == []
    assert shim.prewarms == 2 * PREWARM_ATTEMPTS  # once failed for good, a pod waits instead of prewarming
    held = [m for r, m in cluster.events if r == "RemediationHeld"]
    assert held and "RestartBudgetExhausted" in held[0]
    # The hold is the model's news: one pass asked for, which puts it into Degraded (held message kept).
    assert passes == [("ns-budget", "qwen")]
    assert a.context.state.last_hold == "RestartBudgetExhausted"
    assert a.context.state.last_hold_message.startswith("pod qwen-")

    # With budget left, one pod goes, and the next waits for the back-off.
    cluster.fm["status"]["remediations"] = []
    async with aiohttp.ClientSession() as session:
        first = await prewarm(a.context, a.clocks, pod, cluster.fm, spec, shim)
        second = await prewarm(b.context, b.clocks, pod, cluster.fm, spec, shim)
    assert first is None and second is not None
    assert cluster.evictions == ["qwen-a"]


class GateOrderCluster(BudgetCluster):
    """Records, at the moment a pod's gate opens, what status.pods says of that pod."""

    def __init__(self, namespace: str) -> None:
        super().__init__(budget=3, history=[], namespace=namespace)
        self.pods_at_gate_open: list[list[dict[str, Any]]] = []

    def set_pod_condition(self, namespace: str, name: str, kind: str, value: bool, reason: str, message: str) -> None:
        if kind == PREWARM_GATE and value:
            self.pods_at_gate_open.append([dict(e) for e in self.fm["status"].get("pods") or []])


class SucceedingShim(FailingShim):
    async def prewarm(self, requests: int, prompts: list[str], timeout: float) -> dict[str, Any]:
        self.prewarms += 1
        return {"ok": True, "requests": requests, "coldTTFTMs": 900.0, "warmTTFTMs": 40.0}

    async def metrics(self) -> None:
        return None


@pytest.mark.parametrize("enabled", [True, False], ids=["prewarmed", "prewarm-disabled"])
async def test_status_pods_says_prewarmed_before_the_gate_opens(enabled: bool) -> None:
    # The status's prewarmedReplicas counts open gates: a status read between the gate opening and
    # the pod's entry must not show more prewarmed replicas than prewarmed entries.
    cluster = GateOrderCluster(namespace=f"ns-gate-order-{enabled}")
    cluster.fm["spec"]["prewarm"] = {"enabled": enabled}
    spec = FlashModelSpec.model_validate(cluster.fm["spec"])
    pod: dict[str, Any] = {"metadata": {"name": "qwen-a", "namespace": cluster.fm["metadata"]["namespace"]}}
    async with aiohttp.ClientSession() as session:
        watch = PodWatch(cluster, session, cluster.fm["metadata"]["namespace"], "qwen-a", "qwen")
        assert await prewarm(watch.context, watch.clocks, pod, cluster.fm, spec, SucceedingShim()) is not None
    assert len(cluster.pods_at_gate_open) == 1
    [entries] = cluster.pods_at_gate_open
    assert [(e["name"], e["prewarmed"]) for e in entries] == [("qwen-a", True)]
    if enabled:
        assert entries[0]["coldTTFTMs"] == 900.0 and entries[0]["warmTTFTMs"] == 40.0


class ShimServer:
    """A real HTTP server with a shim's endpoints, counting the requests each path gets."""

    def __init__(self, ready: bool = True, held_polls: bool = False, holds: bool = True) -> None:
        self.ready = ready
        self.held_polls = held_polls
        self.holds = holds
        """False: answers a state but holds nothing, as a shim at its limit of held polls."""
        """Answer with a `state` and hold a poll that asks `?wait=&unless=` until `change()` (the engine's shim)."""
        self.changed = asyncio.Event()
        self.requests: dict[str, int] = {}
        self.queries: list[dict[str, str]] = []
        self.port = 0
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> ShimServer:
        async def handle(request: web.Request) -> web.Response:
            self.requests[request.path] = self.requests.get(request.path, 0) + 1
            if request.path == "/metrics":
                return web.Response(text=METRICS_PAGE, content_type="text/plain")
            if request.path == "/health/poll":
                if not self.held_polls:
                    return web.json_response(dict(HEALTH_POLL_ANSWER, ready=self.ready))
                self.queries.append(dict(request.query))
                wait, unless = parse_health_poll_wait(request.query)
                if unless == self.state() and self.holds:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), wait)
                return web.json_response(dict(HEALTH_POLL_ANSWER, ready=self.ready, state=self.state()))
            ok = self.ready or request.path != "/readyz"
            return web.json_response({"ok": ok}, status=200 if ok else 503)

        self.runner, self.port = await serve_local(handle, "GET")
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def state(self) -> str:
        return health_poll_state(self.ready, 1, True, False)

    def change(self, ready: bool) -> None:
        self.ready = ready
        self.changed.set()
        self.changed = asyncio.Event()


METRICS_PAGE = (
    "# HELP vllm:e2e_request_latency_seconds Histogram of end to end request latency in seconds.\n"
    "# TYPE vllm:e2e_request_latency_seconds histogram\n"
    + "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{2**i}",model_name="qwen"}} {i}\n' for i in range(20))
    + 'vllm:num_requests_running{model_name="qwen"} 0.0\n'
    "flashmodel_engine_generation 1.0\n"
    "flashmodel_prewarm_succeeded 1.0\n"
    'flashmodel_remediation_recommended{reason="memory_divergence"} 0.0\n'
)


HEALTH_POLL_ANSWER = {
    "ready": True,
    "reason": "one-token generation answered in 12 ms",
    "generation": 1,
    "prewarmSucceeded": True,
    "divergenceRatio": 0.0,
    "divergenceRecommended": False,
    "requestsRunning": 0.0,
    "requestsWaiting": 0.0,
}
"""What the engine's shim answers on /health/poll for a steady pod (the same values as METRICS_PAGE)."""


def _warm_pod() -> dict[str, Any]:
    pod = _pod("Running", "127.0.0.1")
    pod["status"]["conditions"] = [
        {"type": PREWARM_GATE, "status": "True", "reason": "PrewarmSucceeded"},
        {"type": "Ready", "status": "True"},
    ]
    return pod


class NoReadsCluster(Cluster):
    """The real Cluster class with its transport replaced: any read is counted."""

    def __init__(self) -> None:
        self.reads = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return None

    def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return None


WATCHED_MODEL = {
    "metadata": {"name": "qwen", "namespace": "ns", "uid": "u1", "generation": 1},
    "spec": {"model": {"hub": {"id": "m"}}, "remediation": {"hungReadinessSeconds": 10}},
    "status": {},
}


async def test_a_warm_pod_is_polled_without_api_reads_and_one_request_a_poll() -> None:
    # A fleet of 1,000 warm pods polled every 5 s would be 400 API reads a second if each poll
    # read its pod and its model; the watch streams already carry both.
    cluster = NoReadsCluster()
    use(OperatorSettings(monitor_seconds=5.0))
    try:
        async with ShimServer() as shim, aiohttp.ClientSession() as session:
            watch = PodWatch(
                cluster,
                session,
                "ns",
                "qwen-abc",
                "qwen-warm",
                live_body=_warm_pod(),
                flashmodels=lambda ns, n: WATCHED_MODEL,
            )
            watch.context.state.control_token = "token"
            watch.shim_port = shim.port
            delays = [await watch.step() for _ in range(5)]
    finally:
        use(OperatorSettings())
    assert cluster.reads == 0
    assert shim.requests == {"/health/poll": 5}
    assert all(d is not None and 4.5 <= d <= 5.5 for d in delays), delays
    health = watch.context.state.health["qwen-abc"]
    assert health.livez_ok and health.readyz_failing_since is None and not health.divergence_recommended
    assert watch.clocks.generation_seen == 1.0


async def test_a_failing_readiness_is_looked_at_again_when_it_reaches_the_hung_threshold() -> None:
    # Polls come every 5 s; a pod whose generation fails is looked at again the moment its failure
    # reaches hungReadinessSeconds, so its eviction does not wait up to one more period.
    use(OperatorSettings(monitor_seconds=5.0))
    try:
        async with ShimServer(ready=False) as shim, aiohttp.ClientSession() as session:
            watch = PodWatch(
                NoReadsCluster(),
                session,
                "ns",
                "qwen-abc",
                "qwen-hung",
                live_body=_warm_pod(),
                flashmodels=lambda ns, n: WATCHED_MODEL,
            )
            watch.context.state.control_token = "token"
            watch.shim_port = shim.port
            first = await watch.step()
            assert first is not None and 4.5 <= first <= 5.5
            assert watch.clocks.readyz_failing_since is not None
            watch.clocks.readyz_failing_since -= 8.0  # 8 s of the 10 s threshold have passed
            second = await watch.step()
    finally:
        use(OperatorSettings())
    assert second is not None and 1.5 <= second <= 2.3, second
    assert shim.requests["/livez"] == 2  # liveness is asked only while readiness fails


def _held_watch(shim: ShimServer, session: aiohttp.ClientSession, spec: dict[str, Any] | None = None) -> PodWatch:
    model = dict(WATCHED_MODEL, spec={**WATCHED_MODEL["spec"], **(spec or {})})
    watch = PodWatch(
        NoReadsCluster(), session, "ns", "qwen-abc", "qwen-warm", live_body=_warm_pod(), flashmodels=lambda ns, n: model
    )
    watch.context.state.control_token = "token"
    watch.shim_port = shim.port
    return watch


async def test_a_steady_pods_poll_waits_in_the_shim_and_a_change_is_answered_at_once() -> None:
    # 1,000 steady pods polled every 5 s are 200 polls a second; held by the shim until their answer
    # changes, 33 (30 s each), and a fault reaches the operator as the shim sees it.
    use(OperatorSettings(monitor_seconds=5.0, health_poll_wait_seconds=2.0))
    try:
        async with ShimServer(held_polls=True) as shim, aiohttp.ClientSession() as session:
            watch = _held_watch(shim, session)
            assert await watch.step() == 0.0  # answered at once: nothing held yet
            assert watch.held_state == shim.state() and shim.queries == [{}]

            start = time.monotonic()
            assert await watch.step() == 0.0
            held = time.monotonic() - start
            assert 1.7 <= held <= 2.6, held  # 2 s jittered by 10 %, then answered unchanged
            wait = float(shim.queries[1]["wait"])
            assert shim.queries[1]["unless"] == shim.state() and 1.8 <= wait <= 2.2

            start = time.monotonic()
            step = asyncio.create_task(watch.step())
            await asyncio.sleep(0.3)
            shim.change(ready=False)
            delay = await step
            assert time.monotonic() - start < 1.0
    finally:
        use(OperatorSettings())
    # Failing readiness: polled again on its threshold (10 s) or every monitor_seconds, never held.
    assert watch.held_state is None
    # Its clock starts with the answer that showed it, not with the held poll that waited for it.
    assert watch.clocks.readyz_failing_since is not None and watch.clocks.readyz_failing_since >= start + 0.3
    assert delay is not None and 4.5 <= delay <= 5.5
    assert shim.requests["/health/poll"] == 3 and shim.requests["/livez"] == 1


@pytest.mark.parametrize(
    ("wait_seconds", "spec", "ready_condition", "held_polls"),
    [
        (0.0, {}, "True", True),
        (2.0, {"standbyReplicas": 1}, "True", True),
        (2.0, {}, "False", True),
        (2.0, {}, "True", False),
    ],
    ids=["turned-off", "model-with-standbys", "not-yet-a-ready-endpoint", "engine-before-held-polls"],
)
async def test_a_poll_is_not_held_where_a_decision_waits_on_each_poll(
    wait_seconds: float, spec: dict[str, Any], ready_condition: str, held_polls: bool
) -> None:
    use(OperatorSettings(monitor_seconds=5.0, health_poll_wait_seconds=wait_seconds))
    try:
        async with ShimServer(held_polls=held_polls) as shim, aiohttp.ClientSession() as session:
            watch = _held_watch(shim, session, spec)
            assert watch.live_body is not None
            watch.live_body["status"]["conditions"][1]["status"] = ready_condition
            delays = [await watch.step() for _ in range(2)]
    finally:
        use(OperatorSettings())
    assert all(d is not None and 4.5 <= d <= 5.5 for d in delays), delays
    assert watch.held_state is None
    assert all("wait" not in q for q in shim.queries)


async def test_a_shim_that_holds_no_poll_is_polled_every_monitor_seconds_not_in_a_loop() -> None:
    # The shim's port is also the Service's: where others hold its limit of held polls, it answers the
    # operator's at once, and asking again at once would poll it as fast as it answers.
    use(OperatorSettings(monitor_seconds=5.0, health_poll_wait_seconds=2.0))
    try:
        async with ShimServer(held_polls=True, holds=False) as shim, aiohttp.ClientSession() as session:
            watch = _held_watch(shim, session)
            delays = [await watch.step() for _ in range(3)]
    finally:
        use(OperatorSettings())
    assert delays[0] == 0.0  # not yet asked to be held
    assert all(d is not None and 4.5 <= d <= 5.5 for d in delays[1:]), delays
    assert [q.get("unless") for q in shim.queries] == [None, shim.state(), shim.state()]  # asked each time
