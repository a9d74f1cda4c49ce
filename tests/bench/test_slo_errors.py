"""Error paths of the load generator against a small fake SSE server (the real-server proof is
test_slo_vllm.py): failures must be counted as errors with a reason, never as fast successes."""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from bench.slo import loadgen
from bench.slo.loadgen import Prompt, RunLimits, Target, Workload


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _sse(
    request: web.Request, chunks: list[dict[str, Any]], first_delay: float = 0.0, done: bool = True
) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    await asyncio.sleep(first_delay)
    for c in chunks:
        await resp.write(b"data: " + json.dumps(c).encode() + b"\n\n")
    if done:
        await resp.write(b"data: [DONE]\n\n")
    return resp


def _tok(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "text": text}]}


async def handler(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    mode = body["prompt"]
    seen.append(body)
    if mode == "ok-slow-first":
        return await _sse(
            request,
            [_tok(" a"), _tok(" b"), _tok(" c"), {"choices": [], "usage": {"completion_tokens": 3}}],
            first_delay=0.2,
        )
    if mode == "stall":
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i, pause in enumerate((0.0, 0.05, 0.3, 0.05)):
            await asyncio.sleep(pause)
            await resp.write(b"data: " + json.dumps(_tok(f" w{i}")).encode() + b"\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp
    if mode == "http-500":
        return web.json_response({"error": {"message": "boom"}}, status=500)
    if mode == "no-tokens":
        return await _sse(request, [{"choices": [{"index": 0, "text": ""}]}])
    if mode == "stream-error":
        return await _sse(request, [_tok(" a"), {"error": {"message": "engine died", "code": 500}}])
    if mode == "hang":
        await asyncio.sleep(1.5)
        return await _sse(request, [_tok(" a")])
    if mode == "bad-json":
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: {not json\n\n")
        return resp
    if mode == "json-invalid":
        return await _sse(request, [_tok('{"ticket": "x"'), _tok(", oops")])
    raise AssertionError(mode)


seen: list[dict[str, Any]] = []


@pytest.fixture
async def fake_server() -> AsyncIterator[str]:
    app = web.Application()
    app.router.add_post("/v1/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = _free_port()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    seen.clear()
    yield f"http://127.0.0.1:{port}"
    await runner.cleanup()


async def _one(url: str, mode: str, variant: loadgen.Variant = "plain", timeout: float = 2.0) -> loadgen.RequestResult:
    wl = Workload([Prompt(mode, None, 1)], variant=variant)
    async with loadgen.new_session(8) as session:
        return await loadgen.send_one(session, Target(url, "m", "secret"), wl, 0, 0.0, 0.0, timeout, None)


async def test_a_good_stream_is_timed_from_the_first_token(fake_server: str) -> None:
    r = await _one(fake_server, "ok-slow-first")
    assert r.ok and r.error is None
    assert r.ttft_s is not None and r.ttft_s >= 0.19
    assert r.output_tokens == 3  # from usage, not guessed
    assert r.e2e_s is not None and r.e2e_s >= r.ttft_s
    assert r.max_gap_s is not None and r.max_gap_s < 0.1  # the three chunks came together
    assert seen[0]["stream"] is True


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("http-500", "http_500"),
        ("no-tokens", "no_tokens"),
        ("stream-error", "stream_error"),
        ("bad-json", "bad_stream"),
    ],
)
async def test_failures_are_errors_with_a_reason(fake_server: str, mode: str, kind: str) -> None:
    r = await _one(fake_server, mode)
    assert not r.ok
    assert r.error is not None and r.error.startswith(kind), r.error


async def test_a_stall_mid_stream_is_measured(fake_server: str) -> None:
    r = await _one(fake_server, "stall")
    assert r.ok and r.output_tokens == 4
    # The fake server stalls 0.3 s; the bound above only says the whole request was not counted.
    assert r.max_gap_s is not None and 0.28 <= r.max_gap_s < 1.5
    s = loadgen.summarize([r], 1.0)
    assert s["max_gap_p99_ms"] is not None and s["max_gap_p99_ms"] >= 280


async def test_a_hung_request_times_out(fake_server: str) -> None:
    r = await _one(fake_server, "hang", timeout=0.5)
    assert not r.ok and r.error is not None and r.error.startswith("timeout")


async def test_connection_refused_is_an_error() -> None:
    r = await _one(f"http://127.0.0.1:{_free_port()}", "ok-slow-first")
    assert not r.ok and r.error is not None and r.error.startswith("client_error")


async def test_invalid_guided_json_is_flagged(fake_server: str) -> None:
    r = await _one(fake_server, "json-invalid", variant="json")
    assert r.ok and r.json_valid is False
    s = loadgen.summarize([r], 1.0)
    assert s["json_valid"] == 0


async def test_a_run_with_errors_fails_the_slo(fake_server: str) -> None:
    wl = Workload([Prompt("ok-slow-first", None, 1), Prompt("http-500", None, 1)])
    async with loadgen.new_session(8) as session:
        res, wall = await loadgen.run_open_loop(
            session, Target(fake_server, "m"), wl, 50.0, RunLimits(num_requests=6, request_timeout_s=2.0)
        )
    s = loadgen.summarize(res, wall)
    assert s["requests"] == 6 and s["ok"] == 3 and s["errors"] == 3
    assert not loadgen.meets_slo(s, 10_000)
    assert s["ttft_p50_ms"] is not None and s["ttft_p50_ms"] >= 190


def test_cli_refuses_a_remote_target(capsys: pytest.CaptureFixture[str]) -> None:
    rc = loadgen.main(["run", "--url", "http://192.0.2.10:8000", "--rate", "1"])
    assert rc == 2
    assert "not a loopback address" in capsys.readouterr().err
