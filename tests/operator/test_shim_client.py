"""The operator's side of the shim: its metric text, its health poll, the kept-alive connection of the polls."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiohttp import web
from flashmodel_operator.shim_client import ShimClient, ShimConnection, ShimReading, parse_health_poll, parse_metrics

TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# TYPE flashmodel_memory_divergence_ratio gauge
flashmodel_memory_divergence_ratio 0.23
# TYPE flashmodel_remediation_recommended gauge
flashmodel_remediation_recommended{reason="memory_divergence"} 1.0
flashmodel_remediation_recommended{reason="hung_readiness"} 0.0
# TYPE flashmodel_engine_generation gauge
flashmodel_engine_generation 2.0
# TYPE flashmodel_prewarm_succeeded gauge
flashmodel_prewarm_succeeded 1.0
"""


def test_parse_metrics_reads_divergence_generation_and_load() -> None:
    m = parse_metrics(TEXT)
    assert m.divergence_recommended and m.divergence_ratio == 0.23
    assert (m.generation, m.requests_running, m.requests_waiting) == (2.0, 3.0, 1.0)
    assert m.prewarm_succeeded


def test_only_memory_divergence_counts_as_divergence() -> None:
    text = TEXT.replace('{reason="memory_divergence"} 1.0', '{reason="memory_divergence"} 0.0').replace(
        '{reason="hung_readiness"} 0.0', '{reason="hung_readiness"} 1.0'
    )
    assert not parse_metrics(text).divergence_recommended


def test_the_operator_reads_the_series_the_engine_writes() -> None:
    # Both sides name these series through flashmodel_engine.contract; a rename on one side only
    # would leave the operator reading zeros (no prewarm seen, no divergence, no restart).
    from flashmodel_engine.config import RemediationSettings
    from flashmodel_engine.metrics import EngineMetrics

    engine = EngineMetrics(RemediationSettings())
    engine.prewarm_succeeded.set(1)
    engine.generation.set(3)
    engine.divergence_ratio.set(0.4)
    engine.remediation.labels("memory_divergence").set(1)
    m = parse_metrics(engine.render(None).decode())
    assert (m.prewarm_succeeded, m.generation, m.divergence_ratio, m.divergence_recommended) == (True, 3.0, 0.4, True)


def test_the_engine_exporters_own_page_parses_with_vllms_histograms_before_it() -> None:
    # The page the shim serves: vLLM's series first, then the engine's exporter's (with a
    # timestamp on one line, which the text format allows).
    from flashmodel_engine.config import RemediationSettings
    from flashmodel_engine.metrics import EngineMetrics

    vllm = "".join(f'vllm:e2e_request_latency_seconds_bucket{{le="{2**i}",model_name="tiny"}} {i}\n' for i in range(30))
    vllm += 'vllm:num_requests_running{engine="0",model_name="tiny"} 2.0 1733400000000\n'
    exporter = EngineMetrics(RemediationSettings())
    exporter.generation.set(3)
    page = exporter.render(vllm).decode()
    m = parse_metrics(page)
    assert (m.generation, m.requests_running, m.divergence_recommended) == (3.0, 2.0, False)


POLL = {
    "ready": True,
    "reason": "one-token generation answered in 9 ms",
    "generation": 2,
    "prewarmSucceeded": True,
    "divergenceRatio": 0.23,
    "divergenceRecommended": True,
    "requestsRunning": 3,
    "requestsWaiting": 1.0,
}


def test_parse_health_poll_reads_readiness_and_the_values_metrics_gives() -> None:
    reading, ready = parse_health_poll(json.dumps(POLL).encode())
    assert ready
    # The same reading the /metrics page above gives: the operator decides alike on either path.
    assert reading == parse_metrics(TEXT)


@pytest.mark.parametrize(
    "body",
    [
        b"ready",  # not JSON: a server that is not the shim
        b"[true]",
        json.dumps({k: v for k, v in POLL.items() if k != "ready"}).encode(),
        json.dumps(dict(POLL, divergenceRecommended="false")).encode(),  # truthy, but not a flag
        json.dumps(dict(POLL, ready=1)).encode(),
        json.dumps(dict(POLL, generation=True)).encode(),
        json.dumps(dict(POLL, divergenceRatio=None)).encode(),
    ],
    ids=["not-json", "not-an-object", "no-ready", "string-flag", "number-flag", "bool-number", "null-number"],
)
def test_an_unreadable_health_poll_is_refused(body: bytes) -> None:
    with pytest.raises(ValueError):
        parse_health_poll(body)


def test_the_operator_reads_the_health_poll_the_engine_writes() -> None:
    # The engine's answer, built by the function its handler uses, read by the operator's parser.
    from flashmodel_engine.config import RemediationSettings
    from flashmodel_engine.contract import health_poll_state
    from flashmodel_engine.metrics import EngineMetrics, EngineSample
    from flashmodel_engine.shim import health_poll_answer

    engine = EngineMetrics(RemediationSettings())
    engine.divergence.ratio, engine.divergence.recommended = 0.4, True
    sample = EngineSample(
        kv_cache_usage=0.1, running=2.0, waiting=5.0, request_success_total=9.0, generation_tokens_total=90.0
    )
    answer = health_poll_answer(False, "one-token generation timed out", 3, True, engine, sample)
    reading, ready = parse_health_poll(json.dumps(answer).encode())
    assert not ready
    assert reading == ShimReading(
        generation=3.0,
        divergence_ratio=0.4,
        divergence_recommended=True,
        requests_running=2.0,
        requests_waiting=5.0,
        prewarm_succeeded=True,
        state=health_poll_state(False, 3, True, True),
    )
    # Before vLLM's first sample: no request counts, not an error.
    reading, _ = parse_health_poll(json.dumps(health_poll_answer(True, "ok", 1, False, engine, None)).encode())
    assert (reading.requests_running, reading.requests_waiting, reading.prewarm_succeeded) == (0.0, 0.0, False)


class Shim:
    """A real aiohttp server (the shim's own server stack) whose answers a test shapes per path."""

    def __init__(
        self, keepalive_timeout: float = 75.0, health_poll: str | None = None, health_poll_status: int = 200
    ) -> None:
        self.keepalive_timeout = keepalive_timeout
        self.health_poll = health_poll
        """The /health/poll answer's body; None answers 404."""
        self.health_poll_status = health_poll_status
        self.paths: list[str] = []
        self.peers: list[int] = []
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def __aenter__(self) -> Shim:
        async def handle(request: web.Request) -> web.StreamResponse:
            peer = request.transport.get_extra_info("peername") if request.transport else None
            self.peers.append(peer[1] if peer else 0)
            self.paths.append(request.path)
            if request.path == "/chunked":
                resp = web.StreamResponse()
                resp.enable_chunked_encoding()
                await resp.prepare(request)
                for part in (b"flashmodel_engine_generation ", b"4.0\n", b"x" * 70000):
                    await resp.write(part)
                await resp.write_eof()
                return resp
            if request.path == "/slow":
                await asyncio.sleep(2)
                return web.Response(text="slow")
            if request.path == "/close":
                return web.Response(text="closing", headers={"Connection": "close"})
            if request.path == "/health/poll":
                if self.health_poll is None:
                    return web.Response(text="404: Not Found", status=404)  # aiohttp's own answer
                return web.Response(text=self.health_poll, status=self.health_poll_status)
            if request.path == "/metrics":
                return web.Response(text=TEXT)
            return web.Response(text=request.path, status=503 if request.path == "/readyz" else 200)

        app = web.Application()
        app.router.add_route("GET", "/{path:.*}", handle)
        self.runner = web.AppRunner(app, keepalive_timeout=self.keepalive_timeout)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


async def test_polls_share_one_kept_alive_connection_and_read_status_and_body() -> None:
    async with Shim() as shim:
        conn = ShimConnection("127.0.0.1", shim.port)
        assert await conn.get("/livez", 5) == (200, b"/livez")
        assert await conn.get("/readyz", 5) == (503, b"/readyz")
        status, body = await conn.get("/chunked", 5)
        assert status == 200 and body.startswith(b"flashmodel_engine_generation 4.0\n") and len(body) == 70033
        conn.close()
    assert len(set(shim.peers)) == 1, "each poll opened a new connection"


async def test_a_connection_the_server_closed_is_replaced_without_a_failed_poll() -> None:
    async with Shim(keepalive_timeout=0.2) as shim:
        conn = ShimConnection("127.0.0.1", shim.port)
        assert (await conn.get("/close", 5))[0] == 200
        assert (await conn.get("/livez", 5))[0] == 200
        await asyncio.sleep(0.6)  # the server's keep-alive ends: the next poll meets a closed stream
        assert await conn.get("/livez", 5) == (200, b"/livez")
        conn.close()
    assert len(set(shim.peers)) == 3


async def test_after_a_timed_out_poll_the_next_reads_its_own_answer() -> None:
    async with Shim() as shim:
        conn = ShimConnection("127.0.0.1", shim.port)
        with pytest.raises(TimeoutError):
            await conn.get("/slow", 0.3)
        assert await conn.get("/livez", 5) == (200, b"/livez")
        conn.close()


async def test_an_unreachable_shim_is_a_failed_poll_not_an_error() -> None:
    async with Shim() as shim:
        port = shim.port
    client = ShimClient(None, "127.0.0.1", port=port, connection=ShimConnection("127.0.0.1", port))  # type: ignore[arg-type]
    assert not await client.ready(1)
    assert await client.metrics() is None
    assert await client.poll(1) == (None, False)


async def test_a_poll_is_one_request_to_the_health_poll() -> None:
    async with Shim(health_poll=json.dumps(dict(POLL, ready=False))) as shim:
        client = ShimClient(None, "127.0.0.1", port=shim.port, connection=ShimConnection("127.0.0.1", shim.port))  # type: ignore[arg-type]
        reading, ready = await client.poll(5)
        assert not ready and reading is not None and reading.divergence_recommended and reading.generation == 2.0
        await client.poll(5)
        assert client.connection is not None
        client.connection.close()
    assert shim.paths == ["/health/poll", "/health/poll"]


@pytest.mark.parametrize(
    ("body", "status"),
    [("not json", 200), (json.dumps(POLL), 404), (json.dumps(POLL), 500), (json.dumps(POLL), 503)],
    ids=["garbage", "not-found", "server-error", "unavailable"],
)
async def test_a_health_poll_that_fails_is_a_failed_poll(body: str, status: int) -> None:
    # Any failure reads as no reading and not ready, and the next poll asks the health poll again:
    # no other path is asked.
    async with Shim(health_poll=body, health_poll_status=status) as shim:
        connection = ShimConnection("127.0.0.1", shim.port)
        client = ShimClient(None, "127.0.0.1", port=shim.port, connection=connection)  # type: ignore[arg-type]
        assert await client.poll(5) == (None, False)
        assert await client.poll(5) == (None, False)
        connection.close()
    assert shim.paths == ["/health/poll", "/health/poll"]
