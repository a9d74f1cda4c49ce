"""A loopback HTTPS proxy in front of the test API server that fails a chosen share of requests.

The operator's kubeconfig points here; the proxy serves with the API server's own certificate, so
the operator trusts it unchanged, and forwards everything (watch streams too) to the API server.
With `rate` above 0 it fails that share of requests the way a busy or flaky control plane does:
429 with Retry-After, 500, a connection closed without an answer, or a 2 s delay. Bounded: it
listens on 127.0.0.1 only, holds at most MAX_CONNECTIONS requests at once, and stops with its
fixture.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import ssl
import threading
from collections import Counter
from pathlib import Path

import aiohttp
from aiohttp import web

FAULTS = ("429", "500", "close", "delay")
DELAY_SECONDS = 2.0
MAX_CONNECTIONS = 512
# Hop-by-hop headers, and those aiohttp sets itself for the body it sends.
_DROP = {"host", "content-length", "transfer-encoding", "connection", "keep-alive"}


class FaultProxy:
    """`url` forwards to `upstream`; set `rate` (0..1) to inject faults into that share of requests."""

    def __init__(self, upstream: str, cert: Path, key: Path, ca: Path, seed: int = 15) -> None:
        self.upstream = upstream.rstrip("/")
        self.rate = 0.0
        self.injected: Counter[str] = Counter()
        self.requests = 0
        self._random = random.Random(seed)
        self._server_ssl = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_ssl.load_cert_chain(cert, key)
        self._client_ssl = ssl.create_default_context(cafile=str(ca))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="fault-proxy", daemon=True)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)
        self.port = 0

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def start(self) -> FaultProxy:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        if not self._thread.is_alive():
            self._loop.close()

    async def _start(self) -> None:
        # Watches stay open for minutes: no total timeout on the upstream side.
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10),
            auto_decompress=False,
            connector=aiohttp.TCPConnector(ssl=self._client_ssl, limit=MAX_CONNECTIONS),
        )
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        await self._runner.setup()
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])
        # Open watch streams must not hold the fixture's teardown for aiohttp's default minute.
        site = web.TCPSite(self._runner, "127.0.0.1", self.port, ssl_context=self._server_ssl, shutdown_timeout=1.0)
        await site.start()

    async def _stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    def _fault(self) -> str | None:
        return self._random.choice(FAULTS) if self.rate > 0 and self._random.random() < self.rate else None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        async with self._slots:
            self.requests += 1
            fault = self._fault()
            if fault is not None:
                self.injected[fault] += 1
            if fault == "429":
                return web.json_response(
                    {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "TooManyRequests",
                     "message": "injected by the e2e fault proxy", "code": 429},
                    status=429, headers={"Retry-After": "1"},
                )
            if fault == "500":
                return web.json_response(
                    {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "InternalError",
                     "message": "injected by the e2e fault proxy", "code": 500},
                    status=500,
                )
            if fault == "close":
                if request.transport is not None:
                    request.transport.close()
                return web.Response(status=502)  # never reaches the client: the connection is gone
            if fault == "delay":
                await asyncio.sleep(DELAY_SECONDS)
            return await self._forward(request)

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _DROP}
        body = await request.read()
        # Forward exactly the headers sent: aiohttp would otherwise add Content-Type
        # application/octet-stream to a body that came without one, which the API server refuses (415).
        skip = [] if "Content-Type" in request.headers else ["Content-Type"]
        async with self._session.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body or None,
            skip_auto_headers=skip,
        ) as upstream:
            response = web.StreamResponse(
                status=upstream.status,
                headers={k: v for k, v in upstream.headers.items() if k.lower() not in _DROP},
            )
            await response.prepare(request)
            with contextlib.suppress(ConnectionResetError, aiohttp.ClientError):
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            with contextlib.suppress(ConnectionResetError):
                await response.write_eof()
            return response
