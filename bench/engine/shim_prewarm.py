"""Engine benchmark on the real vLLM (cpu profile, tiny model): shim overhead, prewarm effect, start-up split.

    ~/.cache/flashmodel/venv-engine/bin/python -m bench.engine.shim_prewarm [--out results.json]

Starts two engines one after the other (never two at once): A without prewarm, B with it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

from tests.engine.conftest import LaunchedEngine, engine_config, launched, metric
from tests.support.tiny_model import build_tiny_model

PROMPT = "Inspection ticket 4711: the pump on line 3 vibrates above its limit. Summarise the ticket."


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))] * 1000


async def ttft(session: aiohttp.ClientSession, engine: LaunchedEngine, max_tokens: int = 16) -> float:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    async with session.post(engine.engine + "/v1/completions", json=body) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            if raw.startswith(b"data: {") and b'"text"' in raw:
                first = time.perf_counter() - t0
                await r.read()
                return first
    raise AssertionError("no token streamed")


async def probe_latencies(session: aiohttp.ClientSession, url: str, n: int) -> tuple[list[float], Counter[str]]:
    out: list[float] = []
    reasons: Counter[str] = Counter()
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.get(url) as r:
            body = await r.json()
        out.append(time.perf_counter() - t0)
        reasons[f"{r.status} {body['reason'].split(' in ')[0]}"] += 1
    return out, reasons


async def under_load(
    session: aiohttp.ClientSession, engine: LaunchedEngine, path: str, n: int, concurrency: int = 32
) -> dict[str, Any]:
    stop = asyncio.Event()
    done = 0

    async def client() -> None:
        nonlocal done
        while not stop.is_set():
            body = {"model": "tiny", "prompt": PROMPT * 4, "max_tokens": 32, "temperature": 0, "ignore_eos": True}
            async with session.post(engine.engine + "/v1/completions", json=body) as r:
                assert r.status == 200
                await r.read()
                done += 1

    clients = [asyncio.create_task(client()) for _ in range(concurrency)]
    await asyncio.sleep(3)  # let the 32 requests fill the batch
    t0 = time.perf_counter()
    lat, reasons = await probe_latencies(session, engine.shim + path, n)
    elapsed = time.perf_counter() - t0
    stop.set()
    await asyncio.gather(*clients)
    return {
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "n": n,
        "answers": dict(reasons),
        "client_requests_per_second": round(done / (elapsed + 3), 1),
    }


async def run_a(engine: LaunchedEngine, n: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as s:
        res["first_ttft_ms_without_prewarm"] = await ttft(s, engine) * 1000
        res["second_ttft_ms_without_prewarm"] = await ttft(s, engine) * 1000
        async with s.post(engine.shim + "/prewarm") as r:
            res["prewarm"] = await r.json()
        for path in ("/readyz", "/livez"):
            lat, reasons = await probe_latencies(s, engine.shim + path, n)
            res[f"{path[1:]}_alone"] = {
                "p50_ms": pct(lat, 0.5),
                "p99_ms": pct(lat, 0.99),
                "n": n,
                "answers": dict(reasons),
            }
        for path in ("/readyz", "/livez"):
            res[f"{path[1:]}_under_32_concurrent"] = await under_load(s, engine, path, n)
    return res


async def run_b(engine: LaunchedEngine) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while engine.get("/readyz").status != 200 and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    res: dict[str, Any] = {}
    async with aiohttp.ClientSession() as s:
        res["first_ttft_ms_after_prewarm"] = await ttft(s, engine) * 1000
        warm = [await ttft(s, engine) for _ in range(10)]
        res["warm_ttft_ms_median"] = statistics.median(warm) * 1000
    text = engine.metrics()
    res["startup_seconds"] = {
        p: round(metric(text, "flashmodel_startup_seconds", f'phase="{p}"'), 2)
        for p in ("launcher", "engine_load", "prewarm")
    }
    res["prewarm"] = engine.get("/prewarm").json()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--probes", type=int, default=200)
    args = ap.parse_args()
    import torch
    import vllm

    model = build_tiny_model()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "cpus": len(__import__("os").sched_getaffinity(0)),
        "python": platform.python_version(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
    }
    # readinessCacheSeconds 0: every /readyz does its real check, so the numbers are the probe's cost.
    health = {"readinessDeadlineSeconds": 5, "readinessCacheSeconds": 0, "startupTimeoutSeconds": 400}
    with tempfile.TemporaryDirectory() as d:
        work_a, work_b = Path(d) / "a", Path(d) / "b"
        work_a.mkdir()
        work_b.mkdir()
        with launched(work_a, engine_config(model, health=health), ["--no-prewarm-on-start"]) as a:
            results["a"] = asyncio.run(run_a(a, args.probes))
        with launched(work_b, engine_config(model, health=health)) as b:
            results["b"] = asyncio.run(run_b(b))
    results["first_ttft_ratio_without_over_with_prewarm"] = round(
        results["a"]["first_ttft_ms_without_prewarm"] / results["b"]["first_ttft_ms_after_prewarm"], 1
    )
    emit(results, args.out)


def emit(results: dict[str, Any], out: Path | None) -> None:
    """Print the results as JSON, and keep them in `out` when given (docs/benchmarks/engine.md cites it)."""
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        out.write_text(text)


if __name__ == "__main__":
    main()
