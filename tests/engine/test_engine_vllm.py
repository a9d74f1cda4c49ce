"""The engine pod against a real vLLM (cpu profile, tiny model): probes, prewarm, metrics, health poll, divergence."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from flashmodel_engine.modelinfos import BAKED_BY
from flashmodel_engine.modelinfos import SEED_ENV as FLASHMODEL_SEED_ENV
from flashmodel_engine.prewarm import MAX_BATCH_REQUESTS

from tests.engine.conftest import LaunchedEngine, engine_config, http, launched, metric

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("engine_packages")]
API_KEY = "test-key-7f3a"
CONTROL_TOKEN = "operator-token-51c2"


@pytest.fixture(scope="module")
def engine(tiny_model: Path, baked_modelinfos: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LaunchedEngine]:
    """One engine for this module, prewarm left to POST /prewarm so 'before prewarm' is observable.

    Its vLLM cache starts empty, with the image's baked model facts to seed it (as in a new pod)."""
    workdir = tmp_path_factory.mktemp("engine")
    (workdir / "api-key").write_text(API_KEY + "\n")
    (workdir / "control-token").write_text(CONTROL_TOKEN + "\n")
    config = engine_config(tiny_model, auth={"apiKeyFile": str(workdir / "api-key")})
    config["server"]["controlTokenFile"] = str(workdir / "control-token")
    seeded = {"VLLM_CACHE_ROOT": str(workdir / "vllm-cache"), FLASHMODEL_SEED_ENV: str(baked_modelinfos)}
    with launched(workdir, config, ["--no-prewarm-on-start"], seeded) as e:
        yield e


def auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}


def completion(engine: LaunchedEngine, prompt: str, max_tokens: int = 8) -> dict[str, Any]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    r = http("POST", engine.engine + "/v1/completions", body.encode(), auth())
    assert r.status == 200, r.text
    result: dict[str, Any] = r.json()
    return result


def wait_for(predicate: Any, timeout: float, interval: float = 0.25) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def ensure_prewarmed(engine: LaunchedEngine) -> None:
    """The memory baseline is taken after prewarm; run it here when this test runs on its own."""
    if engine.get("/prewarm").status == 404:
        r = engine.post("/prewarm")
        assert r.status == 200 and r.json()["ok"], r.text


def test_launcher_started_vllm_with_the_profile_command_line(engine: LaunchedEngine) -> None:
    cmdline = Path(f"/proc/{engine.vllm_pid()}/cmdline").read_bytes().split(b"\0")
    args = [a.decode() for a in cmdline if a]
    assert args[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert args[args.index("--block-size") + 1] == "32"
    assert args[args.index("--host") + 1] == "127.0.0.1"
    assert API_KEY not in " ".join(args)  # the key travels in the environment, not in ps
    # The API key configured is enforced by vLLM itself.
    body = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 1}).encode()
    assert http("POST", engine.engine + "/v1/completions", body, {"Content-Type": "application/json"}).status == 401


def test_vllm_started_from_the_baked_model_facts(engine: LaunchedEngine, baked_modelinfos: Path) -> None:
    assert "event=modelinfos-seeded" in engine.log_path.read_text(errors="replace")
    [baked] = baked_modelinfos.glob("*.json")
    cached = engine.workdir / "vllm-cache" / "modelinfos" / baked.name
    # vLLM rewrites a file it finds stale (its own JSON, without our key); this one it took as is.
    assert json.loads(cached.read_text()) == json.loads(baked.read_text())
    assert json.loads(cached.read_text())["bakedBy"] == BAKED_BY


def test_probes_before_and_after_prewarm(engine: LaunchedEngine) -> None:
    assert engine.get("/startupz").status == 200
    assert engine.get("/livez").status == 200
    before = engine.get("/readyz")
    assert before.status == 503
    assert "prewarm has not succeeded" in before.json()["reason"]
    poll = engine.get("/health/poll")
    assert poll.status == 200, poll.text  # the poll answered; readiness is in its body
    assert poll.json()["ready"] is False and "prewarm has not succeeded" in poll.json()["reason"]
    assert poll.json()["prewarmSucceeded"] is False
    assert engine.get("/prewarm").status == 404
    assert metric(engine.metrics(), "flashmodel_prewarm_succeeded") == 0

    r = engine.post("/prewarm")
    assert r.status == 200, r.text
    result = r.json()
    assert set(result) == {"ok", "requests", "batchedRequests", "coldTTFTMs", "warmTTFTMs", "durationSeconds", "error"}
    assert result["ok"] is True and result["error"] is None
    assert result["requests"] == 5
    # A batch of many sequences ran too (its first run compiles kernels on a GPU): as many as the
    # engine runs at once (this engine's maxNumSeqs), up to the prewarm's own cap.
    assert result["batchedRequests"] == min(MAX_BATCH_REQUESTS, 64)
    assert result["coldTTFTMs"] > 0 and result["warmTTFTMs"] > 0
    assert result["durationSeconds"] > 0
    assert engine.get("/prewarm").json() == result

    after = engine.get("/readyz")
    assert after.status == 200, after.text
    assert "one-token generation answered" in after.json()["reason"]
    poll = engine.get("/health/poll").json()
    assert poll["ready"] is True and poll["prewarmSucceeded"] is True, poll
    text = engine.metrics()
    assert metric(text, "flashmodel_prewarm_succeeded") == 1
    assert metric(text, "flashmodel_prewarm_ttft_seconds", 'phase="cold"') == pytest.approx(
        result["coldTTFTMs"] / 1000, rel=1e-3)


def test_prewarm_covers_the_context_budget_and_the_chat_template(engine: LaunchedEngine) -> None:
    before = metric(engine.metrics(), "vllm:prompt_tokens_total") or 0.0
    r = engine.post("/prewarm", json.dumps({"requests": 4}).encode())
    assert r.status == 200 and r.json()["requests"] == 4
    prompt_tokens = (metric(engine.metrics(), "vllm:prompt_tokens_total") or 0.0) - before
    # One request is near maxModelLen - template - maxTokens (4096 - ~10 - 8): vLLM counted it.
    assert prompt_tokens > 3500
    custom = engine.post("/prewarm", json.dumps({"requests": 2, "prompts": ["valve report"]}).encode())
    assert custom.status == 200 and custom.json()["ok"] is True


@pytest.mark.parametrize(("body", "reason"), [
    (b"{not json", "body is not JSON"),
    (b"[1, 2]", "body must be a JSON object"),
    (b'{"request": 3}', "unknown keys ['request']"),
    (b'{"requests": 0}', "requests must be an integer 1..100, got 0"),
    (b'{"requests": "5"}', "requests must be an integer 1..100"),
    (b'{"prompts": [""]}', "prompts must be a list of non-empty strings"),
])
def test_bad_prewarm_requests_get_400_with_a_reason(engine: LaunchedEngine, body: bytes, reason: str) -> None:
    r = engine.post("/prewarm", body)
    assert r.status == 400
    assert reason in r.json()["reason"]


@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Bearer {API_KEY}", CONTROL_TOKEN],
                         ids=["none", "wrong", "api-key", "no-bearer"])
def test_prewarm_answers_only_the_operators_token(engine: LaunchedEngine, authorization: str | None) -> None:
    # The health port is on the Service: anyone in the cluster reaches it, and a prewarm runs
    # generations and decides readiness.
    headers = {"Content-Type": "application/json"}
    if authorization is not None:
        headers["Authorization"] = authorization
    r = http("POST", engine.shim + "/prewarm", b"", headers)
    assert r.status == 401, r.text
    assert "answers only the operator" in r.json()["reason"]
    # The probes stay open to the kubelet.
    for path in ("/livez", "/startupz", "/metrics"):
        assert engine.get(path).status == 200


def test_a_failed_ad_hoc_prewarm_keeps_a_prewarmed_pod_ready(engine: LaunchedEngine) -> None:
    ensure_prewarmed(engine)
    assert engine.get("/readyz").status == 200
    too_long = json.dumps({"requests": 1, "prompts": ["valve " * 20000]}).encode()
    r = engine.post("/prewarm", too_long)
    assert r.status == 502 and r.json()["ok"] is False, r.text
    # Seen before: one such request (anonymous, through the Service) took a serving pod out of it.
    time.sleep(1.5)  # past readinessCacheSeconds
    ready = engine.get("/readyz")
    assert ready.status == 200, ready.text
    assert metric(engine.metrics(), "flashmodel_prewarm_succeeded") == 1


def operator_poll(engine: LaunchedEngine) -> tuple[Any, bool]:
    """One health poll as the operator makes it: its client, over its kept-alive connection."""
    from flashmodel_operator.shim_client import ShimClient, ShimConnection

    host, port = engine.config["server"]["host"], engine.config["server"]["shimPort"]

    async def poll() -> tuple[Any, bool]:
        connection = ShimConnection(host, port)
        async with aiohttp.ClientSession() as session:
            try:
                return await ShimClient(session, host, port=port, connection=connection).poll(30)
            finally:
                connection.close()

    return asyncio.run(poll())


def test_the_health_poll_says_what_readyz_and_metrics_say_in_one_request(engine: LaunchedEngine) -> None:
    from flashmodel_operator.shim_client import parse_metrics

    ensure_prewarmed(engine)
    raw = engine.get("/health/poll")
    assert raw.status == 200, raw.text
    assert set(raw.json()) == {"ready", "reason", "generation", "prewarmSucceeded", "divergenceRatio",
                               "divergenceRecommended", "requestsRunning", "requestsWaiting", "state",
                               "startupSeconds"}
    # The start-up phases for the pod's status: the shim's and vLLM's, as /metrics has them.
    assert {"launcher", "engine_load", "weights", "engine_init"} <= set(raw.json()["startupSeconds"])
    assert raw.json()["startupSeconds"]["engine_load"] == metric(
        engine.metrics(), "flashmodel_startup_seconds", 'phase="engine_load"')
    reading, ready = operator_poll(engine)
    assert reading is not None and reading.state == raw.json()["state"]
    scraped = parse_metrics(engine.metrics())
    assert ready and engine.get("/readyz").status == 200
    assert reading is not None
    assert (reading.generation, reading.prewarm_succeeded, reading.divergence_recommended) == (
        scraped.generation, scraped.prewarm_succeeded, scraped.divergence_recommended) == (1.0, True, False)
    assert reading.divergence_ratio == pytest.approx(scraped.divergence_ratio, abs=0.01)

    # vLLM's running and waiting requests, from the shim's sample (every 0.5 s in these tests).
    body = json.dumps({"model": "tiny", "prompt": "the valve on line two", "max_tokens": 400,
                       "temperature": 0, "ignore_eos": True}).encode()
    seen: list[float] = []

    async def load() -> None:
        async with aiohttp.ClientSession(headers=auth()) as s:
            async def one() -> None:
                async with s.post(engine.engine + "/v1/completions", data=body) as r:
                    assert r.status == 200, await r.text()
                    await r.read()

            async def poll() -> float:
                async with s.get(engine.shim + "/health/poll") as r:
                    answer = await r.json()
                return float(answer["requestsRunning"] + answer["requestsWaiting"])

            # Batches until a poll lands inside one: on a loaded machine a whole batch can finish
            # within one poll. Each batch starts right after a poll, so the polls during it answer
            # from the cached readiness instead of waiting for a probe generation behind the batch.
            deadline = time.monotonic() + 60
            while max(seen, default=0.0) < 1 and time.monotonic() < deadline:
                await poll()
                batch = asyncio.gather(*(one() for _ in range(8)))
                while not batch.done():
                    seen.append(await poll())
                    await asyncio.sleep(0.1)
                await batch

    asyncio.run(load())
    assert max(seen) >= 1, f"the poll never saw the 8 requests running: {seen}"
    idle = wait_for(lambda: (a := engine.get("/health/poll").json())["requestsRunning"] + a["requestsWaiting"] == 0,
                    timeout=5)
    assert idle, "the poll still counts requests after they finished"


def test_unknown_path_and_method_are_4xx(engine: LaunchedEngine) -> None:
    assert engine.get("/nope").status == 404
    assert http("DELETE", engine.shim + "/prewarm").status == 405


def test_metrics_pass_vllm_through_with_real_values(engine: LaunchedEngine) -> None:
    finished_before = metric(engine.metrics(), "flashmodel_requests_finished_total") or 0
    for _ in range(3):
        completion(engine, "the pump on line three", 4)
    text = wait_for(lambda: (t := engine.metrics()) and (metric(t, "flashmodel_requests_per_second") or 0) > 0
                    and t, timeout=10)
    assert text, "requests_per_second stayed 0 after client requests"
    # The counter the autoscaler's rate() reads: exactly the client's requests, the readiness
    # probes running meanwhile excluded.
    def finished() -> float:
        return metric(engine.metrics(), "flashmodel_requests_finished_total") - finished_before

    wait_for(lambda: finished() >= 3, timeout=10)
    time.sleep(2.5)  # one more sample, with probes in between
    assert finished() == 3, f"{finished()} client requests counted, 3 sent"
    assert metric(text, "flashmodel_requests_waiting") == 0
    assert metric(text, "vllm:request_success_total") >= 3  # vLLM's own metrics are passed through
    assert "vllm:kv_cache_usage_perc" in text or "vllm:gpu_cache_usage_perc" in text
    kv = metric(text, "flashmodel_kv_cache_usage_ratio")
    assert 0 <= kv <= 1
    used = metric(text, "flashmodel_memory_used_bytes", 'source="host_rss"')
    total = metric(text, "flashmodel_memory_total_bytes", 'source="host_rss"')
    assert 500 * 2**20 < used < total  # a loaded vLLM holds hundreds of MB at least
    assert metric(text, "flashmodel_memory_baseline_bytes") > 0
    assert metric(text, "flashmodel_engine_generation") == 1
    assert metric(text, "flashmodel_engine_up") == 1
    assert metric(text, "flashmodel_probe_generation_latency_seconds_count") >= 1
    assert metric(text, "flashmodel_remediation_recommended", 'reason="memory_divergence"') == 0
    assert metric(text, "flashmodel_startup_seconds", 'phase="engine_load"') > 1
    # vLLM's own phases, read from its log lines: on the CPU it loads weights and inits its engine
    # core (eager: no compile, no graph capture, no graph pool).
    engine_init = metric(text, "flashmodel_startup_seconds", 'phase="engine_init"')
    assert 0 < engine_init < metric(text, "flashmodel_startup_seconds", 'phase="engine_load"')
    # The tiny model's weights load in under the 0.01 s vLLM rounds to: present, not necessarily > 0.
    assert 'flashmodel_startup_seconds{phase="weights"}' in text
    assert metric(text, "flashmodel_startup_seconds", 'phase="weights"') >= 0
    assert metric(text, "flashmodel_startup_seconds", 'phase="engine_init_other"') == engine_init
    assert 'phase="graph_capture"' not in text
    assert metric(text, "flashmodel_startup_graph_memory_bytes") == 0


def test_readiness_is_cached_and_single_flight(engine: LaunchedEngine) -> None:
    time.sleep(1.2)  # let the cache expire
    before = metric(engine.metrics(), "flashmodel_probe_generation_latency_seconds_count") or 0

    async def burst() -> list[int]:
        async with aiohttp.ClientSession() as s:
            async def one() -> int:
                async with s.get(engine.shim + "/readyz") as r:
                    return r.status
            return await asyncio.gather(*(one() for _ in range(20)))

    assert asyncio.run(burst()) == [200] * 20
    after = metric(engine.metrics(), "flashmodel_probe_generation_latency_seconds_count") or 0
    assert after - before <= 1  # twenty probes, at most one generation


async def _load(engine: LaunchedEngine, concurrency: int, requests: int) -> list[int]:
    async with aiohttp.ClientSession(headers=auth()) as s:
        sem = asyncio.Semaphore(concurrency)

        async def one(i: int) -> int:
            body = {"model": "tiny", "prompt": "inspection ticket " * (50 + i * 10), "max_tokens": 64,
                    "temperature": 0, "ignore_eos": True}
            async with sem, s.post(engine.engine + "/v1/completions", json=body) as r:
                await r.read()
                return r.status

        return await asyncio.gather(*(one(i) for i in range(requests)))


def test_no_divergence_under_a_burst_of_real_load(engine: LaunchedEngine) -> None:
    ensure_prewarmed(engine)
    seen: list[float] = []

    async def watch(stop: asyncio.Event) -> None:
        async with aiohttp.ClientSession() as s:
            while not stop.is_set():
                async with s.get(engine.shim + "/metrics") as r:
                    t = await r.text()
                seen.append(metric(t, "flashmodel_remediation_recommended", 'reason="memory_divergence"') or 0)
                await asyncio.sleep(0.25)

    async def run() -> list[int]:
        stop = asyncio.Event()
        watcher = asyncio.create_task(watch(stop))
        statuses = await _load(engine, 32, 96)
        await asyncio.sleep(4)  # longer than divergenceWindowSeconds after the burst
        stop.set()
        await watcher
        return statuses

    statuses = asyncio.run(run())
    assert statuses == [200] * 96
    assert len(seen) > 10 and max(seen) == 0
    text = engine.metrics()
    assert metric(text, "flashmodel_memory_divergence_ratio") < 0.01


def test_divergence_detected_when_the_engine_process_grows(engine: LaunchedEngine) -> None:
    ensure_prewarmed(engine)
    text = engine.metrics()
    total = metric(text, "flashmodel_memory_total_bytes")
    assert total
    ratio_limit = engine.config["remediation"]["divergenceRatio"]
    grow_mib = int(2.5 * ratio_limit * total / 2**20)
    last_under_start = time.monotonic()  # nothing has grown yet
    engine.hog_file.write_text(str(grow_mib))
    try:
        # The shim's window starts at its first sample over the limit, which lies after the start of
        # the last scrape that still read the ratio under it; bound the window from that scrape, not
        # from when the test happened to notice the rise (a loaded CI machine noticed it 0.75 s late).
        window = engine.config["remediation"]["divergenceWindowSeconds"]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            scrape_start = time.monotonic()
            if (metric(engine.metrics(), "flashmodel_memory_divergence_ratio") or 0) > ratio_limit:
                break
            last_under_start = scrape_start
            time.sleep(0.25)
        else:
            pytest.fail(f"ratio never passed {ratio_limit}: {engine.tail(5)}")
        # Not yet: the divergence must be sustained for divergenceWindowSeconds first.
        early = metric(engine.metrics(), "flashmodel_remediation_recommended", 'reason="memory_divergence"')
        assert early == 0 or time.monotonic() - last_under_start >= window
        flagged = wait_for(lambda: metric(engine.metrics(), "flashmodel_remediation_recommended",
                                          'reason="memory_divergence"') == 1, timeout=15)
        assert flagged
        # The operator's poll reads the same signal (it is what the operator decides on).
        reading, _ = operator_poll(engine)
        assert reading is not None and reading.divergence_recommended
        assert reading.divergence_ratio > ratio_limit
        assert time.monotonic() - last_under_start >= window
        ratio = metric(engine.metrics(), "flashmodel_memory_divergence_ratio")
        assert ratio == pytest.approx(grow_mib * 2**20 / total, rel=0.35)
    finally:
        engine.hog_file.write_text("0")
    cleared = wait_for(lambda: metric(engine.metrics(), "flashmodel_remediation_recommended",
                                      'reason="memory_divergence"') == 0, timeout=20)
    assert cleared, "memory was released but the signal stayed"
    reading, _ = operator_poll(engine)
    assert reading is not None and not reading.divergence_recommended
