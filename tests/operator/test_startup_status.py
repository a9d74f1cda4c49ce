"""A pod's start-up by phase: read from the engine's health poll, written to status.pods and status.startup."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from flashmodel_engine.config import RemediationSettings
from flashmodel_engine.contract import HEALTH_POLL_PATH, STARTUP_PHASES
from flashmodel_engine.metrics import ENGINE_INIT_OTHER, EngineMetrics
from flashmodel_engine.shim import health_poll_answer
from flashmodel_engine.startup_phases import PHASES, StartupPhases
from flashmodel_operator.apply import Cluster
from flashmodel_operator.gating import PodWatch
from flashmodel_operator.model_status import note_startup, startup_summary
from flashmodel_operator.pod_state import STARTUP_PHASES as STATUS_PHASES
from flashmodel_operator.pod_state import ModelState, PodRecord, startup_times
from flashmodel_operator.render import PREWARM_GATE
from flashmodel_operator.settings import OperatorSettings, use
from flashmodel_operator.shim_client import parse_health_poll
from flashmodel_operator.status_model import FlashModelStatus
from flashmodel_operator.status_model import StartupPhases as StatusPhases
from prometheus_client import REGISTRY

# A GPU start as vLLM 0.26 logs it (tests/engine/test_startup_phases.py has the lines), with the shim's
# own phases around it.
GPU_ENGINE = {
    "launcher": 4.6,
    "engine_load": 81.0,
    "weights": 2.41,
    "model_load": 3.12,
    "compile": 14.52,
    "graph_capture": 23.0,
    "engine_init": 42.8,
    "engine_init_other": 42.8 - 14.52 - 23.0,
    "prewarm": 1.9,
}


def test_a_gpu_start_becomes_phases_that_add_up_to_process_start_to_prewarmed() -> None:
    times = startup_times(GPU_ENGINE)
    assert times is not None
    phases = dict(times.phases)
    assert list(phases) == ["launcher", "engineOther", "weights", "compile", "graphCapture", "kvInit", "prewarm"]
    # The model load (weights and the model's construction), not the weights' read alone.
    assert phases["weights"] == 3.1
    assert phases["kvInit"] == 5.3
    # engine_load less vLLM's timed phases: its imports, tokenizer and API server.
    assert phases["engineOther"] == round(81.0 - 3.12 - 42.8, 1)
    assert times.seconds == pytest.approx(4.6 + 81.0 + 1.9, abs=0.2)
    assert times.seconds == round(sum(phases.values()), 1)
    assert times.slowest == ("engineOther", phases["engineOther"])


def test_an_eager_start_has_no_compile_or_capture_and_an_unfinished_one_no_times() -> None:
    cpu = {"launcher": 3.0, "engine_load": 28.0, "weights": 0.0, "engine_init": 6.0, "engine_init_other": 6.0}
    times = startup_times(cpu)
    assert times is not None
    assert dict(times.phases) == {"launcher": 3.0, "engineOther": 22.0, "weights": 0.0, "kvInit": 6.0}
    assert times.seconds == 31.0
    # vLLM has not answered /health yet: the start is not over, so nothing for the status.
    assert startup_times({"launcher": 3.0, "weights": 1.0}) is None


def test_the_status_phases_are_the_schemas_and_the_engine_phases_the_contracts() -> None:
    assert set(STATUS_PHASES) == {field.alias for field in StatusPhases.model_fields.values()}
    assert {*PHASES, ENGINE_INIT_OTHER, "launcher", "engine_load", "prewarm"} == set(STARTUP_PHASES)


def _engine_answer() -> dict[str, Any]:
    """The health poll answer the engine's own code builds after vLLM logged an eager start."""
    metrics = EngineMetrics(RemediationSettings())
    phases = StartupPhases()
    for line in (
        "Loading weights took 0.40 seconds",
        "init engine (profile, create kv cache, warmup model) took 5.50 s",
    ):
        phases.observe(line)
    metrics.record_startup_phases(phases)
    for phase, seconds in (("launcher", 2.0), ("engine_load", 20.0), ("prewarm", 0.7)):
        metrics.startup_seconds.labels(phase=phase).set(seconds)
    return health_poll_answer(True, "ok", 1, True, metrics, None, metrics.startup_by_phase())


def test_the_operator_reads_the_phases_the_engine_answers() -> None:
    reading, ready = parse_health_poll(json.dumps(_engine_answer()).encode())
    assert ready
    assert dict(reading.startup) == {
        "launcher": 2.0, "engine_load": 20.0, "weights": 0.4, "engine_init": 5.5, "engine_init_other": 5.5,
        "prewarm": 0.7,
    }


@pytest.mark.parametrize(
    "value",
    [None, "12", [1, 2], {"launcher": "3"}, {"launcher": True}, {"launcher": -1}, {"launcher": float("nan")}],
    ids=["absent", "string", "list", "string-seconds", "bool-seconds", "negative", "nan"],
)
def test_unreadable_phases_are_left_out_and_never_fail_the_poll(value: object) -> None:
    # A poll refused over the phases would count a healthy pod as failing its health checks.
    answer = dict(_engine_answer(), startupSeconds=value)
    reading, ready = parse_health_poll(json.dumps(answer).encode())
    assert ready and reading.generation == 1.0
    assert reading.startup == ()


def test_a_pod_entry_shows_its_start_and_validates_against_the_crd_schema() -> None:
    state = ModelState()
    record = PodRecord(prewarmed=True, cold_ttft_ms=900.0, warm_ttft_ms=40.0)
    assert note_startup(state, {}, "qwen-a", record, GPU_ENGINE, "2026-12-07T10:00:00Z")
    entry = record.to_status("qwen-a")
    assert record.startup is not None
    assert entry["startupSeconds"] == record.startup.seconds
    assert entry["startupPhases"]["graphCapture"] == 23.0
    status = FlashModelStatus.model_validate({"pods": [entry], "startup": startup_summary(state)})
    assert status.startup is not None and status.startup.slowest_phase == "engineOther"
    # Before the engine reported its start-up, the entry says nothing of it.
    assert "startupSeconds" not in PodRecord(prewarmed=True).to_status("qwen-b")


def _observed(phase: str) -> float:
    value = REGISTRY.get_sample_value("flashmodel_operator_pod_startup_seconds_count", {"phase": phase})
    return value or 0.0


CPU_ENGINE = {"launcher": 3.0, "engine_load": 28.0, "engine_init": 6.0, "engine_init_other": 6.0}


def test_a_start_is_noted_and_counted_once_and_the_newest_pods_is_the_models() -> None:
    state = ModelState()
    older, newer = PodRecord(prewarmed=True), PodRecord(prewarmed=True)
    assert startup_summary(state) is None
    before = _observed("total"), _observed("graphCapture")
    assert note_startup(state, {}, "qwen-a", older, GPU_ENGINE, "2026-12-07T10:00:00Z")
    assert (_observed("total"), _observed("graphCapture")) == (before[0] + 1, before[1] + 1)
    # The same phases on every later poll: nothing to write, nothing to count.
    assert not note_startup(state, {}, "qwen-a", older, GPU_ENGINE, "2026-12-07T10:00:00Z")
    assert _observed("total") == before[0] + 1
    newest = {"lastPod": "qwen-b", "lastPodSeconds": 31.0, "slowestPhase": "engineOther", "slowestPhaseSeconds": 22.0}
    assert note_startup(state, {}, "qwen-b", newer, CPU_ENGINE, "2026-12-07T10:05:00Z")
    assert startup_summary(state) == newest
    # An older pod read later (an operator restarted reads its pods in any order) is not the newest.
    assert note_startup(state, {}, "qwen-c", PodRecord(), GPU_ENGINE, "2026-12-07T09:00:00Z")
    assert startup_summary(state) == newest
    # An operator restarted reads its pods' phases again: a start the status already shows is written
    # (its memory is empty) but not counted a second time.
    shown = {"status": {"pods": [newer.to_status("qwen-b")]}}
    total = _observed("total")
    assert note_startup(ModelState(), shown, "qwen-b", PodRecord(), CPU_ENGINE, "2026-12-07T10:05:00Z")
    assert _observed("total") == total


class StatusCluster(Cluster):
    """The real Cluster class with its transport replaced: keeps the status patches, reads nothing."""

    def __init__(self) -> None:
        self.status_patches: list[dict[str, Any]] = []

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        raise AssertionError("a warm pod's poll reads nothing from the API")

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any] | None:
        self.status_patches.append(status)
        return None


async def test_a_warm_pods_polls_write_its_start_up_once() -> None:
    answer = _engine_answer()

    async def poll(request: web.Request) -> web.Response:
        return web.json_response(answer)

    app = web.Application()
    app.router.add_get(HEALTH_POLL_PATH, poll)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    pod = {
        "metadata": {"name": "qwen-abc", "namespace": "ns-startup", "creationTimestamp": "2026-12-07T10:00:00Z"},
        "status": {
            "phase": "Running",
            "podIP": "127.0.0.1",
            "conditions": [
                {"type": PREWARM_GATE, "status": "True", "reason": "PrewarmSucceeded"},
                {"type": "Ready", "status": "True"},
            ],
        },
    }
    fm = {
        "metadata": {"name": "qwen", "namespace": "ns-startup", "uid": "u1", "generation": 1},
        "spec": {"model": {"hub": {"id": "m"}}},
        "status": {},
    }
    cluster = StatusCluster()
    use(OperatorSettings(monitor_seconds=5.0, health_poll_wait_seconds=0.0))
    try:
        async with aiohttp.ClientSession() as session:
            watch = PodWatch(cluster, session, "ns-startup", "qwen-abc", "qwen", live_body=pod,
                             flashmodels=lambda ns, n: fm)
            watch.context.state.control_token = "token"
            watch.shim_port = port
            for _ in range(3):
                assert await watch.step() is not None
    finally:
        use(OperatorSettings())
        await runner.cleanup()
    # Three polls, one write: the phases change once per engine start.
    assert len(cluster.status_patches) == 1
    [patch] = cluster.status_patches
    [entry] = patch["pods"]
    assert entry["name"] == "qwen-abc"
    assert entry["startupPhases"] == {"launcher": 2.0, "engineOther": 14.1, "weights": 0.4, "kvInit": 5.5,
                                      "prewarm": 0.7}
    assert entry["startupSeconds"] == 22.7
    assert patch["startup"] == {
        "lastPod": "qwen-abc", "lastPodSeconds": 22.7, "slowestPhase": "engineOther", "slowestPhaseSeconds": 14.1,
    }
