"""The control routes of vLLM's OpenAI port, answered only for the shim (vLLM's `--middleware`).

vLLM serves its runtime-control routes on the same port as the OpenAI API, which the Service and
the gateway expose to every client: with VLLM_ALLOW_RUNTIME_LORA_UPDATING, `/v1/load_lora_adapter`
loads any path in the pod past the shim's checks (rank, shapes, adapter roots, pinned revisions);
SageMaker's `/adapters` does the same; with VLLM_SERVER_DEV_MODE, `/sleep`, `/collective_rpc`,
`/update_weights` and the like change or stop the engine. vLLM's API key guards only `/v1` paths
and is the clients' key anyway. So the launcher always renders `--middleware` with
`ControlRoutes`, the outermost layer of vLLM's app: a control route is refused with 403 unless the
request carries the shim's control token (server.controlTokenFile, the operator's per-model
Secret) in CONTROL_HEADER. Without a token every control route is refused.

The path is judged the way any hop might read it, not only the way Starlette routes it today:
percent-decoded until it stops changing, case-folded, `\\` as `/`, empty, `.` and `..` segments
resolved, `;params` dropped, and the route's segments looked for anywhere in the path (so a root
path, a mount prefix or a trailing slash does not hide it). No OpenAI client route contains them.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
from collections.abc import Awaitable, Callable, MutableMapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote

log = logging.getLogger("flashmodel.engine_guard")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

MIDDLEWARE = "flashmodel_engine.engine_guard.ControlRoutes"
"""What the launcher passes as vLLM's --middleware (vLLM imports it and calls app.add_middleware)."""
TOKEN_FILE_ENV = "FLASHMODEL_CONTROL_TOKEN_FILE"
"""The file with the control token, as the launcher hands it to the vLLM process (unset: no token)."""
CONTROL_HEADER = "X-Flashmodel-Control-Token"
"""The header the shim sends its control token in (vLLM's Authorization carries the clients' API key)."""

CONTROL_ROUTES: tuple[str, ...] = (
    # Runtime LoRA (VLLM_ALLOW_RUNTIME_LORA_UPDATING): vLLM's own routes and SageMaker's
    # POST /adapters and DELETE /adapters/{name}, which call the same loader.
    "/v1/load_lora_adapter",
    "/v1/unload_lora_adapter",
    "/adapters",
    # VLLM_SERVER_DEV_MODE: caches, sleep, RPC into the workers, the server's config.
    "/reset_prefix_cache",
    "/reset_mm_cache",
    "/reset_encoder_cache",
    "/collective_rpc",
    "/server_info",
    "/sleep",
    "/wake_up",
    "/is_sleeping",
    "/release_kv_cache_memory",
    # VLLM_SERVER_DEV_MODE's RL routes: pause the engine, replace its weights, abort requests.
    "/pause",
    "/resume",
    "/is_paused",
    "/abort_requests",
    "/init_weight_transfer_engine",
    "/shutdown_weight_transfer_engine",
    "/start_weight_update",
    "/start_draft_weight_update",
    "/update_weights",
    "/finish_weight_update",
    "/update_weight_version",
    "/weight_info",
    "/weight_checker",
    "/get_world_size",
    # Always on for a generating model: data-parallel rescaling (elastic expert parallelism).
    "/scale_elastic_ep",
    "/is_scaling_elastic_ep",
    # --profiler-config: the torch profiler writes traces to the pod's disk.
    "/start_profile",
    "/stop_profile",
    # --enable-scale-out / --tokens-only: aborting any request by id (the other path is /abort_requests).
    "/inference/v1/abort_requests",
    # --enable-fault-tolerance: engine recovery actions.
    "/fault_tolerance/apply",
    "/fault_tolerance/status",
)

# Longest first, so a route is named by the most specific entry it matches.
_ROUTE_SEGMENTS: tuple[tuple[str, tuple[str, ...]], ...] = tuple(sorted(
    ((route, tuple(s for s in route.split("/") if s)) for route in CONTROL_ROUTES), key=lambda r: -len(r[1])
))


def path_segments(path: str) -> list[str]:
    """The path's segments as the most lenient hop would resolve them (decoded, folded, dot segments applied)."""
    decoded = path
    while (again := unquote(decoded)) != decoded:  # each round is shorter, so this ends
        decoded = again
    segments: list[str] = []
    for raw in decoded.replace("\\", "/").casefold().split("/"):
        segment = raw.split(";", 1)[0].strip()
        if segment in ("", "."):
            continue
        if segment == "..":
            if segments:
                segments.pop()
            continue
        segments.append(segment)
    return segments


def control_route(path: str) -> str | None:
    """The control route `path` reaches (however it is spelled), or None for any other path."""
    segments = path_segments(path)
    for route, wanted in _ROUTE_SEGMENTS:
        n = len(wanted)
        if any(tuple(segments[i:i + n]) == wanted for i in range(len(segments) - n + 1)):
            return route
    return None


def scope_route(scope: Scope) -> str | None:
    """The control route of a request, judged on each form of its path the ASGI scope holds."""
    path = str(scope.get("path") or "")
    candidates = [path, str(scope.get("root_path") or "") + path]
    raw = scope.get("raw_path")
    if isinstance(raw, bytes | bytearray):
        candidates.append(bytes(raw).decode("latin-1").split("?", 1)[0])
    for candidate in candidates:
        if (route := control_route(candidate)) is not None:
            return route
    return None


def read_token(token_file: str | None) -> str | None:
    """The control token in `token_file` (None: no file named). An unreadable or empty file is an error."""
    if not token_file:
        return None
    try:
        token = Path(token_file).read_text().strip()
    except OSError as e:
        raise RuntimeError(f"{TOKEN_FILE_ENV}={token_file} cannot be read ({e}); the engine's control routes "
                           "need the shim's control token (server.controlTokenFile)") from None
    if not token:
        raise RuntimeError(f"{TOKEN_FILE_ENV}={token_file} is empty; it must hold the shim's control token")
    return token


class ControlRoutes:
    """ASGI middleware: 403 for a control route unless the request carries the control token."""

    def __init__(self, app: ASGIApp, token_file: str | None = None) -> None:
        self.app = app
        self._token = read_token(token_file if token_file is not None else os.environ.get(TOKEN_FILE_ENV))
        self._header = CONTROL_HEADER.lower().encode()

    def allowed(self, scope: Scope) -> bool:
        """Whether the request carries the control token in exactly one CONTROL_HEADER."""
        if self._token is None:
            return False
        sent = [v for k, v in scope.get("headers") or () if bytes(k).lower() == self._header]
        return len(sent) == 1 and hmac.compare_digest(bytes(sent[0]).strip(), self._token.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        route = scope_route(scope)
        if route is None or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        log.warning("event=control-route-refused route=%s path=%r", route, scope.get("path"))
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_refusal(send, route, configured=self._token is not None)


def refusal_message(route: str, *, configured: bool) -> str:
    why = (f"send the control token in {CONTROL_HEADER}" if configured
           else "this engine has no control token (server.controlTokenFile), so no one may")
    return (f"{route} is a control route of the engine: only the engine pod's shim may call it ({why}). "
            "Adapters are set through the FlashModel's spec.adapters, not on this port.")


async def send_refusal(send: Send, route: str, *, configured: bool) -> None:
    # The shape of vLLM's own error answers, so OpenAI clients show the message.
    body = json.dumps({"error": {"message": refusal_message(route, configured=configured),
                                 "type": "PermissionDeniedError", "param": None, "code": 403}}).encode()
    await send({"type": "http.response.start", "status": 403,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
