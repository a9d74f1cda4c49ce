"""The guard of vLLM's control routes (engine_guard.ControlRoutes), driven as ASGI: every spelling of a route."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
from flashmodel_engine.config import EngineConfig, parse_config
from flashmodel_engine.engine_guard import (
    CONTROL_HEADER,
    CONTROL_ROUTES,
    MIDDLEWARE,
    TOKEN_FILE_ENV,
    ControlRoutes,
    Message,
    Receive,
    Scope,
    Send,
    control_route,
)
from flashmodel_engine.engine_process import engine_environment
from flashmodel_engine.profiles import NEVER_ALLOWED, vllm_args

TOKEN = "control-token-5c2b"


class Downstream:
    """vLLM's app behind the guard: records the paths that reach it and answers 200."""

    def __init__(self) -> None:
        self.reached: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.reached.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def call(guard: ControlRoutes, path: str, headers: list[tuple[bytes, bytes]] | None = None, *,
         raw_path: bytes | None = None, root_path: str = "", kind: str = "http") -> tuple[int, dict[str, Any]]:
    """(status, JSON body) of one request through the guard; websocket closes read as 403 with no body."""
    sent: list[Message] = []
    scope: Scope = {"type": kind, "method": "POST", "path": path, "root_path": root_path, "headers": headers or [],
             "raw_path": raw_path if raw_path is not None else path.encode()}

    async def receive() -> Message:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Message) -> None:
        sent.append(message)

    asyncio.run(guard(scope, receive, send))
    if sent[0]["type"] == "websocket.close":
        return 403, {}
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "control-token"
    path.write_text(TOKEN + "\n")
    return path


@pytest.fixture
def app() -> Downstream:
    return Downstream()


@pytest.fixture
def guard(app: Downstream, token_file: Path) -> ControlRoutes:
    return ControlRoutes(app, token_file=str(token_file))


SPELLINGS = [
    "/v1/load_lora_adapter",
    "/v1/load_lora_adapter/",
    "//v1//load_lora_adapter",
    "/V1/Load_LoRA_Adapter",
    "/v1/load%5Flora%5Fadapter",
    "/v1/load%255Flora_adapter",  # decoded twice (one hop, then the next)
    "/v1%2Fload_lora_adapter",
    "/v1/./load_lora_adapter",
    "/x/../v1/load_lora_adapter",
    "/v1/load_lora_adapter;a=b",
    "\\v1\\load_lora_adapter",
    "/v1/load_lora_adapter%20",
    "/prefix/v1/load_lora_adapter",  # a root path or a mount before it
]


@pytest.mark.parametrize("path", SPELLINGS)
def test_every_spelling_of_a_control_route_is_refused(guard: ControlRoutes, app: Downstream, path: str) -> None:
    status, body = call(guard, path)
    assert status == 403, path
    assert "/v1/load_lora_adapter is a control route" in body["error"]["message"]
    assert CONTROL_HEADER in body["error"]["message"]
    assert app.reached == []


@pytest.mark.parametrize("route", CONTROL_ROUTES)
def test_each_control_route_is_refused_without_the_token(guard: ControlRoutes, app: Downstream, route: str) -> None:
    assert call(guard, route)[0] == 403
    assert call(guard, route.upper() + "/")[0] == 403
    assert app.reached == []


@pytest.mark.parametrize("path", ["/adapters", "/adapters/support", "/ADAPTERS/support/", "/adapters%2Fsupport"])
def test_sagemakers_adapter_routes_are_control_routes(guard: ControlRoutes, path: str) -> None:
    assert call(guard, path)[0] == 403


def test_the_raw_path_is_judged_too(guard: ControlRoutes, app: Downstream) -> None:
    # A server that routes on the undecoded path must not see something the decoded path hides.
    assert call(guard, "/v1/models", raw_path=b"/v1/unload_lora_adapter")[0] == 403
    assert call(guard, "/load_lora_adapter", root_path="/v1")[0] == 403
    assert app.reached == []


def test_a_websocket_to_a_control_route_is_closed(guard: ControlRoutes, app: Downstream) -> None:
    assert call(guard, "/sleep", kind="websocket")[0] == 403
    assert app.reached == []


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
                                  "/tokenize", "/load", "/version", "/v1/responses/resp_1", "/ping", "/invocations"])
def test_client_routes_pass(guard: ControlRoutes, app: Downstream, path: str) -> None:
    assert call(guard, path)[0] == 200
    assert app.reached == [path]


def test_the_token_opens_a_control_route(guard: ControlRoutes, app: Downstream) -> None:
    header = CONTROL_HEADER.encode()
    assert call(guard, "/v1/load_lora_adapter", [(header, TOKEN.encode())])[0] == 200
    assert call(guard, "/v1/load_lora_adapter", [(header.lower(), TOKEN.encode())])[0] == 200
    assert app.reached == ["/v1/load_lora_adapter", "/v1/load_lora_adapter"]


@pytest.mark.parametrize("headers", [
    [(CONTROL_HEADER.encode(), b"wrong")],
    [(CONTROL_HEADER.encode(), TOKEN.encode() + b"x")],
    [(CONTROL_HEADER.encode(), b"")],
    [(b"authorization", b"Bearer " + TOKEN.encode())],  # the clients' header is not the control header
    [(CONTROL_HEADER.encode(), b"wrong"), (CONTROL_HEADER.encode(), TOKEN.encode())],  # exactly one
])
def test_a_wrong_token_is_refused(guard: ControlRoutes, app: Downstream, headers: list[tuple[bytes, bytes]]) -> None:
    assert call(guard, "/v1/load_lora_adapter", headers)[0] == 403
    assert app.reached == []


def test_without_a_token_every_control_route_is_refused(app: Downstream, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_FILE_ENV, raising=False)
    guard = ControlRoutes(app)
    status, body = call(guard, "/v1/load_lora_adapter", [(CONTROL_HEADER.encode(), b"")])
    assert status == 403
    assert "no control token" in body["error"]["message"]
    assert call(guard, "/v1/completions")[0] == 200


def test_the_token_file_comes_from_the_environment(app: Downstream, token_file: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TOKEN_FILE_ENV, str(token_file))
    guard = ControlRoutes(app)  # as vLLM builds it: app.add_middleware(ControlRoutes)
    assert call(guard, "/sleep", [(CONTROL_HEADER.encode(), TOKEN.encode())])[0] == 200


@pytest.mark.parametrize("content", [None, ""])
def test_an_unreadable_or_empty_token_file_stops_the_engine(app: Downstream, tmp_path: Path,
                                                            content: str | None) -> None:
    path = tmp_path / "token"
    if content is not None:
        path.write_text(content)
    with pytest.raises(RuntimeError, match=TOKEN_FILE_ENV):
        ControlRoutes(app, token_file=str(path))


def test_lifespan_passes_through(guard: ControlRoutes) -> None:
    seen: list[str] = []

    async def inner(scope: Scope, receive: Receive, send: Send) -> None:
        seen.append(scope["type"])

    async def go() -> None:
        await ControlRoutes(inner, token_file=None)({"type": "lifespan"}, None, None)  # type: ignore[arg-type]

    asyncio.run(go())
    assert seen == ["lifespan"]


def test_control_route_names_the_route() -> None:
    assert control_route("/a/b/Scale_Elastic_EP/") == "/scale_elastic_ep"
    assert control_route("/inference/v1/abort_requests") == "/inference/v1/abort_requests"
    assert control_route("/v1/completions") is None
    assert control_route("/v1/load_lora") is None


def engine_config(tmp_path: Path, token: bool) -> EngineConfig:
    server: dict[str, Any] = {}
    if token:
        (tmp_path / "token").write_text(TOKEN)
        server["controlTokenFile"] = str(tmp_path / "token")
    return parse_config({"accelerator": "cpu", "model": {"path": "/models/tiny", "servedName": "tiny"},
                         "server": server})


def test_the_launcher_always_renders_the_guard(tmp_path: Path) -> None:
    args = vllm_args(engine_config(tmp_path, token=False))
    assert args[args.index("--middleware") + 1] == MIDDLEWARE
    assert args.count("--middleware") == 1
    # Reserved: extraArgs cannot add a middleware of their own (or drop this one).
    assert "--middleware" in NEVER_ALLOWED


def test_the_launcher_hands_vllm_the_token_file_and_drops_the_resolvers(tmp_path: Path) -> None:
    base = {TOKEN_FILE_ENV: "/stale", "VLLM_LORA_RESOLVER_CACHE_DIR": "/adapters",
            "VLLM_LORA_RESOLVER_HF_REPO_LIST": "org/repo", "PATH": "/bin"}
    env = engine_environment(engine_config(tmp_path, token=True), base)
    assert env[TOKEN_FILE_ENV] == str(tmp_path / "token")
    assert "VLLM_LORA_RESOLVER_CACHE_DIR" not in env and "VLLM_LORA_RESOLVER_HF_REPO_LIST" not in env
    assert TOKEN_FILE_ENV not in engine_environment(engine_config(tmp_path, token=False), base)
