"""A throwaway aiohttp server on a free loopback port, for the fakes of fault-injection tests."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web


async def serve_local(handle: Callable[[web.Request], Awaitable[web.StreamResponse]], method: str = "*") -> tuple[
    web.AppRunner, int
]:
    """Serve every path with `handle` on 127.0.0.1; the runner (to clean up) and its port."""
    app = web.Application()
    app.router.add_route(method, "/{path:.*}", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    return runner, runner.addresses[0][1]
