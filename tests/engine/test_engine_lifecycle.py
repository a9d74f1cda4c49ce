"""Destructive tests on their own engine: a stopped vLLM, hung readiness, and the SIGTERM drain."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from tests.engine.conftest import LaunchedEngine, engine_config, http, launched, metric

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("engine_packages")]


@pytest.fixture(scope="module")
def engine(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LaunchedEngine]:
    """Prewarm runs at start here (the default); the last test ends this engine with SIGTERM."""
    config = engine_config(tiny_model, health={"readinessDeadlineSeconds": 2, "readinessCacheSeconds": 0.5,
                                               "startupTimeoutSeconds": 400})
    with launched(tmp_path_factory.mktemp("lifecycle"), config) as e:
        yield e


def children(pid: int) -> dict[int, str]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            comm, rest = stat.split("(", 1)[1].rsplit(")", 1)
            if int(rest.split()[1]) == pid:
                out[int(d.name)] = comm
    return out


def wait_status(engine: LaunchedEngine, path: str, status: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if engine.get(path, timeout=10).status == status:
            return True
        time.sleep(0.25)
    return False


def test_prewarm_on_start_makes_the_pod_ready(engine: LaunchedEngine) -> None:
    assert wait_status(engine, "/readyz", 200, 60), engine.tail()
    result = engine.get("/prewarm").json()
    assert result["ok"] is True and result["requests"] == 5
    text = engine.metrics()
    assert metric(text, "flashmodel_startup_seconds", 'phase="prewarm"') == pytest.approx(
        result["durationSeconds"], rel=1e-2)
    assert metric(text, "flashmodel_startup_seconds", 'phase="launcher"') > 0
    # The launcher met a supported vLLM and said which, before it started it.
    log = engine.log_path.read_text(errors="replace")
    version_line = next(line for line in log.splitlines() if "event=vllm-version " in line)
    assert "ok=true" in version_line
    assert log.index("event=vllm-version ") < log.index("event=engine-spawned")


def test_readyz_fails_while_the_engine_core_is_stopped_though_health_answers(engine: LaunchedEngine) -> None:
    vllm = engine.vllm_pid()
    core = next(pid for pid, comm in children(vllm).items() if "EngineCor" in comm)
    os.kill(core, signal.SIGSTOP)
    try:
        # vLLM's own /health still says 200: the process exists and nothing has "failed".
        assert http("GET", engine.engine + "/health", timeout=5).status == 200
        assert wait_status(engine, "/readyz", 503, 10)
        reason = engine.get("/readyz").json()["reason"]
        assert "did not finish within readinessDeadlineSeconds=2" in reason
        assert engine.get("/livez").status == 200  # liveness must not restart a pod that may recover
        # Failing readiness while alive for hungReadinessSeconds (3) recommends remediation.
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            engine.get("/readyz")
            if metric(engine.metrics(), "flashmodel_remediation_recommended", 'reason="hung_readiness"') == 1:
                break
            time.sleep(0.5)
        assert metric(engine.metrics(), "flashmodel_remediation_recommended", 'reason="hung_readiness"') == 1
    finally:
        os.kill(core, signal.SIGCONT)
    assert wait_status(engine, "/readyz", 200, 30), engine.tail()
    assert metric(engine.metrics(), "flashmodel_remediation_recommended", 'reason="hung_readiness"') == 0


def test_a_held_health_poll_answers_when_a_generation_fails_not_at_the_end_of_its_wait(engine: LaunchedEngine) -> None:
    # The operator's steady-pod poll: `?wait=&unless=<state>` is held while the answer's state stays.
    assert wait_status(engine, "/readyz", 200, 60), engine.tail()
    state = engine.get("/health/poll").json()["state"]
    start = time.monotonic()
    held = engine.get(f"/health/poll?wait=2&unless={state}", timeout=20)
    assert 2.0 <= time.monotonic() - start < 6.0 and held.json()["state"] == state and held.json()["ready"]
    start = time.monotonic()
    assert engine.get("/health/poll?wait=30&unless=r0g1p0d0", timeout=40).json()["ready"]  # not the state: at once
    assert time.monotonic() - start < 5.0
    for query, says in [("wait=abc&unless=x", "not a number"), ("wait=301&unless=x", "outside 0-300"),
                        ("wait=5", "needs unless=")]:
        bad = engine.get(f"/health/poll?{query}")
        assert bad.status == 400 and says in bad.json()["reason"], (query, bad.text)

    # The port is also the Service's: past HEALTH_POLL_MAX_HELD held at once, a poll is answered at once.
    from flashmodel_engine.shim import HEALTH_POLL_MAX_HELD

    async def many(count: int) -> list[float]:
        async with aiohttp.ClientSession() as session:
            async def one() -> float:
                start = time.monotonic()
                async with session.get(f"{engine.shim}/health/poll?wait=4&unless={state}") as r:
                    assert r.status == 200 and (await r.json())["state"] == state
                return time.monotonic() - start
            return list(await asyncio.gather(*(one() for _ in range(count))))

    times = sorted(asyncio.run(many(HEALTH_POLL_MAX_HELD + 2)))
    assert times[1] < 2.0 and times[2] >= 3.5, times  # two answered at once, the rest held

    core = next(pid for pid, comm in children(engine.vllm_pid()).items() if "EngineCor" in comm)
    os.kill(core, signal.SIGSTOP)
    try:
        start = time.monotonic()
        held = engine.get(f"/health/poll?wait=60&unless={state}", timeout=90)
        answered = time.monotonic() - start
    finally:
        os.kill(core, signal.SIGCONT)
    # A generation at most every 5 s while held, its deadline 2 s, a look every second.
    assert answered < 12.0, answered
    assert held.status == 200 and held.json()["ready"] is False and held.json()["state"] != state, held.text
    assert "readinessDeadlineSeconds=2" in held.json()["reason"]
    assert wait_status(engine, "/readyz", 200, 30), engine.tail()


def test_readyz_and_livez_fail_while_the_api_server_is_stopped(engine: LaunchedEngine) -> None:
    vllm = engine.vllm_pid()
    os.kill(vllm, signal.SIGSTOP)
    try:
        assert wait_status(engine, "/readyz", 503, 10)
        assert engine.get("/livez", timeout=10).status == 503
        assert engine.get("/startupz").status == 200  # it did start; startup is not re-judged
        deadline = time.monotonic() + 10  # the sampler's scrape of vLLM times out after 2 s
        while time.monotonic() < deadline and metric(engine.metrics(), "flashmodel_engine_up") != 0:
            time.sleep(0.5)
        assert metric(engine.metrics(), "flashmodel_engine_up") == 0
    finally:
        os.kill(vllm, signal.SIGCONT)
    assert wait_status(engine, "/readyz", 200, 30), engine.tail()


def test_sigterm_drains_in_flight_requests_then_exits_with_vllms_code(engine: LaunchedEngine) -> None:
    tokens = 400

    async def run() -> tuple[list[tuple[int, int]], int, float]:
        async with aiohttp.ClientSession() as s:
            started = asyncio.Event()
            begun = 0

            async def one() -> tuple[int, int]:
                nonlocal begun
                body = {"model": "tiny", "prompt": "inspection ticket", "max_tokens": tokens, "temperature": 0,
                        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                got = 0
                streaming = False
                async with s.post(engine.engine + "/v1/completions", json=body) as r:
                    async for raw in r.content:
                        line = raw.decode().strip()
                        if line.startswith("data: {"):
                            chunk = json.loads(line[6:])
                            # Counted once per request: SIGTERM goes only when all 8 are generating.
                            if chunk.get("choices") and not streaming:
                                streaming = True
                                begun += 1
                                if begun == 8:
                                    started.set()
                            if chunk.get("usage"):
                                got = chunk["usage"]["completion_tokens"]
                    return r.status, got

            tasks = [asyncio.create_task(one()) for _ in range(8)]
            await asyncio.wait_for(started.wait(), 60)
            engine.proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            # While draining the pod reports not-ready at once, so the Service stops sending.
            async with s.get(engine.shim + "/readyz") as r:
                ready = (r.status, (await r.json())["reason"])
            assert ready[0] == 503 and "draining" in ready[1], ready
            results = await asyncio.gather(*tasks)
            return results, await asyncio.to_thread(engine.proc.wait, 90), time.monotonic() - t0

    results, code, took = asyncio.run(run())
    assert results == [(200, tokens)] * 8  # every in-flight request completed in full
    assert code == 0, engine.tail()
    assert took < 60
    assert "event=drain-done rc=0" in engine.tail(400)
