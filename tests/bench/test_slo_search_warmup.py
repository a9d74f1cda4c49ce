"""The SLO search against a server with a one-off cold-start stall (the H200 run of 2026-12-02:
the first batch of more than one sequence stalled every stream for about a second, once).

The old search ran its first trial cold, failed it, never went back above a failing rate and
reported less than half of what the server carried warm. A stall must not cap the search; an
overload must still fail it."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import socket
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from bench.slo import loadgen
from bench.slo.loadgen import Prompt, RequestResult, RunLimits, SearchSettings, Target, Workload

STALL_S = 1.0  # how long the first concurrent batch blocks every stream, once
TOKENS = 8
TOKEN_GAP_S = 0.04  # 8 tokens take ~0.3 s, so at 8 req/s requests overlap


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ColdServer:
    """Fast and uncapped, except that the first time two requests are in flight at once every
    stream stops for STALL_S (as a JIT compile of the engine's batch>1 kernels does)."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.stall_until = 0.0
        self.stalls = 0

    async def _wait_stall(self) -> None:
        while (left := self.stall_until - time.monotonic()) > 0:
            await asyncio.sleep(left)

    async def handle(self, request: web.Request) -> web.StreamResponse:
        await request.json()
        self.in_flight += 1
        try:
            if self.in_flight >= 2 and self.stalls == 0:
                self.stalls = 1
                self.stall_until = time.monotonic() + STALL_S
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(TOKENS):
                await asyncio.sleep(0.005 if i == 0 else TOKEN_GAP_S)
                await self._wait_stall()
                chunk = {"choices": [{"index": 0, "text": f" t{i}"}]}
                await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await resp.write(b"data: [DONE]\n\n")
            return resp
        finally:
            self.in_flight -= 1


@pytest.fixture
async def cold_server() -> AsyncIterator[tuple[str, ColdServer]]:
    server = ColdServer()
    app = web.Application()
    app.router.add_post("/v1/completions", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    yield f"http://127.0.0.1:{port}", server
    await runner.cleanup()


WORKLOAD = Workload([Prompt(f"p{i}", None, 1) for i in range(8)], cache_salt=False)
LIMITS = RunLimits(request_timeout_s=10.0, max_in_flight=64)


def _settings(**kw: Any) -> SearchSettings:
    base: dict[str, Any] = {
        "slo_ttft_ms": 300.0,
        "rate_start": 8.0,
        "rate_max": 16.0,
        "bisect_steps": 1,
        "trial_seconds": 1.0,
        "trial_min_requests": 8,
        "trial_max_requests": 16,
        "max_total_s": 60.0,
    }
    return SearchSettings(**(base | kw))


async def _search(url: str, settings: SearchSettings) -> dict[str, Any]:
    async with loadgen.new_session(64) as session:
        return await loadgen.search_max_rate(session, Target(url, "m"), WORKLOAD, settings, LIMITS, seed=1)


async def test_a_one_off_cold_stall_does_not_cap_the_search(cold_server: tuple[str, ColdServer]) -> None:
    """Fails on the search before 2026-12-02: it reported 6 req/s (8 failed cold, 4 and 6 passed)."""
    url, server = cold_server
    result = await _search(url, _settings())
    assert server.stalls == 1
    assert result["max_rate_rps"] == 16.0
    assert result["first_failing_rps"] is None
    # The stall landed in the warm-up pass, which is recorded but is no trial.
    warm = result["warmup"]
    assert warm is not None and warm["rate_rps"] == 8.0 and not warm["passed"]
    assert warm["summary"]["ttft_p99_ms"] > 300
    assert [t["rate_rps"] for t in result["trials"]] == [8.0, 16.0]
    assert all(t["passed"] and t["counted"] for t in result["trials"])


async def test_without_warmup_the_retry_absorbs_the_stall(cold_server: tuple[str, ColdServer]) -> None:
    url, server = cold_server
    result = await _search(url, _settings(warmup=False))
    assert server.stalls == 1 and result["warmup"] is None
    first, second = result["trials"][:2]
    assert first["rate_rps"] == second["rate_rps"] == 8.0
    assert not first["passed"] and not first["counted"] and first["attempt"] == 0
    assert second["passed"] and second["counted"] and second["attempt"] == 1
    assert result["retried_rates"] == [8.0]
    assert result["max_rate_rps"] == 16.0


async def test_with_neither_the_cold_trial_caps_the_search_as_before(cold_server: tuple[str, ColdServer]) -> None:
    """The old behaviour, kept reachable (warmup=False, retries_on_failure=0) and shown to be wrong."""
    url, _ = cold_server
    result = await _search(url, _settings(warmup=False, retries_on_failure=0))
    assert result["first_failing_rps"] == 8.0
    assert result["max_rate_rps"] is not None and result["max_rate_rps"] < 8.0


def _fake_trial(capacity: float, calls: list[float]) -> loadgen.TrialRunner:
    """A server with a hard capacity: TTFT 50 ms up to it, 2 s above it, every time."""

    async def trial(rate: float, limits: RunLimits) -> tuple[list[RequestResult], float]:
        calls.append(rate)
        ttft = 0.05 if rate <= capacity else 2.0
        results = [
            RequestResult(
                index=i, prompt_tokens=1, scheduled_s=0.0, ok=True, ttft_s=ttft, e2e_s=ttft + 0.1, output_tokens=4
            )
            for i in range(limits.num_requests)
        ]
        return results, 1.0

    return trial


async def _search_offline(settings: SearchSettings, trial: loadgen.TrialRunner) -> dict[str, Any]:
    """The search with `trial` in place of the open-loop runs: no server is reached."""
    async with loadgen.new_session(8) as session:
        return await loadgen.search_max_rate(
            session, Target("http://127.0.0.1:9", "m"), WORKLOAD, settings, LIMITS, run_trial=trial
        )


@pytest.mark.parametrize("warmup", [True, False])
async def test_an_overload_still_fails_after_the_retry(warmup: bool) -> None:
    calls: list[float] = []
    settings = SearchSettings(rate_start=4, rate_max=256, bisect_steps=3, warmup=warmup, retries_on_failure=1)
    result = await _search_offline(settings, _fake_trial(37.0, calls))
    # The same bracket as the search without retries (test_slo_stats: 4, 8, 16, 32, 64, 48, 40, 36),
    # each failing rate run twice.
    assert result["max_rate_rps"] == 36
    assert result["first_failing_rps"] == 40
    assert calls == ([4] if warmup else []) + [4, 8, 16, 32, 64, 64, 48, 48, 40, 40, 36]
    assert result["retried_rates"] == [40, 48, 64]
    assert result["at_max"]["ttft_p99_ms"] == 50.0


def _fixed_trial(outcomes: dict[float, list[tuple[float, float]]], calls: list[float]) -> loadgen.TrialRunner:
    """Each rate's attempts in order: (TTFT in s, fraction of the rate delivered)."""

    async def trial(rate: float, limits: RunLimits) -> tuple[list[RequestResult], float]:
        calls.append(rate)
        ttft, delivered = outcomes[rate].pop(0) if rate in outcomes else (0.05, 1.0)
        n = limits.num_requests
        results = [
            RequestResult(
                index=i, prompt_tokens=1, scheduled_s=0.0, ok=True, ttft_s=ttft, e2e_s=ttft + 0.1, output_tokens=4
            )
            for i in range(n)
        ]
        return results, n / (rate * delivered)  # achieved_rps = delivered x rate

    return trial


async def test_a_plain_overload_is_not_run_again_but_a_stall_is() -> None:
    calls: list[float] = []
    settings = SearchSettings(
        rate_start=32, rate_max=256, bisect_steps=1, warmup=False, retries_on_failure=1, overload_ttft_ms=2000
    )
    outcomes = {
        # 64: a stall (1.2 s, 95 % delivered): run again, and the retry passes.
        64.0: [(1.2, 0.95), (0.05, 1.0)],
        # 128: an overload (6 s, 60 % delivered): counted at once.
        128.0: [(6.0, 0.6)],
        # 96: slow (2.5 s) but 90 % delivered: not plainly an overload, so run again; fails again.
        96.0: [(2.5, 0.9), (2.5, 0.9)],
    }
    result = await _search_offline(settings, _fixed_trial(outcomes, calls))
    assert calls == [32, 64, 64, 128, 96, 96]
    assert (result["max_rate_rps"], result["first_failing_rps"]) == (64, 96)
    assert result["retried_rates"] == [64, 96]
    assert [t.get("overload", False) for t in result["trials"]] == [False, False, False, True, False, False]
    # Off by default: the same overload is run again.
    calls.clear()
    default = dataclasses.replace(settings, overload_ttft_ms=0.0)
    outcomes = {64.0: [(0.05, 1.0)], 128.0: [(6.0, 0.6), (6.0, 0.6)], 96.0: [(0.05, 1.0)]}
    await _search_offline(default, _fixed_trial(outcomes, calls))
    assert calls == [32, 64, 128, 128, 96]


async def test_a_fixed_rate_trial_reports_the_slo_of_what_it_sent(cold_server: tuple[str, ColdServer]) -> None:
    url, server = cold_server
    async with loadgen.new_session(64) as session:
        # The first trial meets the one-off stall (TTFT p99 over 300 ms), the second runs warm.
        cold = await loadgen.rate_trial(session, Target(url, "m"), WORKLOAD, 16.0, 1.0, (300.0, 50.0))
        warm = await loadgen.rate_trial(session, Target(url, "m"), WORKLOAD, 16.0, 1.0, (300.0, 50.0))
    assert server.stalls == 1
    assert cold["summary"]["requests"] == warm["summary"]["requests"] == 64  # at least 64 requests a trial
    assert not cold["passed"] and cold["summary"]["ttft_p99_ms"] > 300
    assert warm["passed"] and warm["summary"]["tpot_p99_ms"] < 50


def test_goodput_at_fixed_rates_needs_most_rounds_there_and_at_every_lower_rate() -> None:
    assert loadgen.goodput_at_rates({8.0: [True, True, False], 16.0: [True, False, False], 32.0: [True] * 3}) == 8.0
    assert loadgen.goodput_at_rates({8.0: [True, False]}) is None  # a tie is not most rounds
    assert loadgen.goodput_at_rates({16.0: [True, True, True], 8.0: [True, True, True]}) == 16.0
