"""The operator's client of an engine pod's health shim: startup, readiness, prewarm, adapters, metrics, polls."""

from __future__ import annotations

import asyncio
import json
import math
import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp
from flashmodel_engine.contract import (
    ADAPTERS_PATH,
    ENGINE_GENERATION,
    HEALTH_POLL_PATH,
    HEALTH_POLL_STARTUP,
    LIVENESS_PATH,
    MEMORY_DIVERGENCE_RATIO,
    MEMORY_DIVERGENCE_REASON,
    METRICS_PATH,
    PREWARM_PATH,
    PREWARM_SUCCEEDED,
    READINESS_PATH,
    REMEDIATION_REASON_LABEL,
    REMEDIATION_RECOMMENDED,
    SHIM_PORT,
    STARTUP_PATH,
)


@dataclass(frozen=True)
class ShimReading:
    """One reading of a pod's shim /metrics: the few series the operator decides on.

    Not the engine's exporter (`flashmodel_engine.metrics.EngineMetrics`), which writes them.
    """

    generation: float
    divergence_ratio: float
    divergence_recommended: bool
    requests_running: float
    requests_waiting: float
    prewarm_succeeded: bool
    state: str | None = None
    """The health poll's `state` (what a held poll waits to change from); None from /metrics, or from a
    health poll answer without one, which the operator follows with a poll every monitor_seconds."""
    startup: tuple[tuple[str, float], ...] = ()
    """The engine's start-up seconds by phase (HEALTH_POLL_STARTUP), for status.pods; empty from /metrics."""


_READ_SERIES = (
    ENGINE_GENERATION,
    MEMORY_DIVERGENCE_RATIO,
    REMEDIATION_RECOMMENDED,
    PREWARM_SUCCEEDED,
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
)


_SAMPLE = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+-?[0-9]+)?")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of the sample lines of the series parse_metrics reads.

    The shim's page carries all of vLLM's series first (a histogram per latency and token count,
    about 33 kB for one model). The Prometheus parser takes about 5 ms of CPU for all of it, and a
    fleet's pods are scraped every few seconds; finding the few lines by name (str.find, in C) and
    reading only those takes a few hundredths of that (docs/benchmarks/operator.md, "What the operator
    does for scale"). Label values are compared, never unescaped.
    """
    page = "\n" + text
    out = []
    for series in _READ_SERIES:
        needle = "\n" + series
        at = page.find(needle)
        while at >= 0:
            end = page.find("\n", at + 1)
            line = page[at + 1 : end if end >= 0 else len(page)].strip()
            match = _SAMPLE.fullmatch(line)
            if match is None:
                raise ValueError(f"unreadable sample line in the shim's /metrics: {line[:200]!r}")
            name, labels, value = match.groups()
            if name == series:  # not a longer name that starts with it
                out.append((name, dict(_LABEL.findall(labels or "")), float(value)))
            at = page.find(needle, at + 1)
    return out


def parse_metrics(text: str) -> ShimReading:
    values: dict[str, float] = {}
    recommended = False
    for name, labels, value in _samples(text):
        if name == REMEDIATION_RECOMMENDED and value >= 1:
            reason = labels.get(REMEDIATION_REASON_LABEL, MEMORY_DIVERGENCE_REASON)
            recommended = recommended or reason == MEMORY_DIVERGENCE_REASON
        elif name.startswith("vllm:num_requests_"):
            # One series per model name; a pod serves one model, summing is safe.
            values[name] = values.get(name, 0.0) + value
        else:
            values.setdefault(name, value)
    return ShimReading(
        generation=values.get(ENGINE_GENERATION, 0.0),
        divergence_ratio=values.get(MEMORY_DIVERGENCE_RATIO, 0.0),
        divergence_recommended=recommended,
        requests_running=values.get("vllm:num_requests_running", 0.0),
        requests_waiting=values.get("vllm:num_requests_waiting", 0.0),
        prewarm_succeeded=values.get(PREWARM_SUCCEEDED, 0.0) >= 1,
    )


def parse_health_poll(body: bytes) -> tuple[ShimReading, bool]:
    """The reading and the readiness result in the shim's HEALTH_POLL_PATH answer; ValueError when unreadable.

    Numbers may come as JSON integers or floats; a flag must be a JSON boolean (a string "false"
    read as true would hide a hung or diverging pod).
    """
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError(f"health poll answer is not a JSON object: {body[:200]!r}")

    def number(key: str) -> float:
        value = doc.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"health poll answer's {key!r} is not a number: {value!r}")
        return float(value)

    def flag(key: str) -> bool:
        value = doc.get(key)
        if not isinstance(value, bool):
            raise ValueError(f"health poll answer's {key!r} is not true or false: {value!r}")
        return value

    state = doc.get("state")
    if state is not None and not isinstance(state, str):
        raise ValueError(f"health poll answer's 'state' is not a string: {state!r}")
    reading = ShimReading(
        generation=number("generation"),
        divergence_ratio=number("divergenceRatio"),
        divergence_recommended=flag("divergenceRecommended"),
        requests_running=number("requestsRunning"),
        requests_waiting=number("requestsWaiting"),
        prewarm_succeeded=flag("prewarmSucceeded"),
        state=state,
        startup=startup_phases(doc.get(HEALTH_POLL_STARTUP)),
    )
    return reading, flag("ready")


def startup_phases(value: object) -> tuple[tuple[str, float], ...]:
    """The health poll's start-up phases as (phase, seconds), sorted; what is not a finite number is left out.

    Never an error: the phases only fill in the status, and a poll refused for them would count the
    pod as failing its health checks.
    """
    if not isinstance(value, dict):
        return ()
    return tuple(sorted(
        (phase, float(seconds))
        for phase, seconds in value.items()
        if isinstance(phase, str)
        and isinstance(seconds, (int, float))
        and not isinstance(seconds, bool)
        and math.isfinite(seconds)
        and seconds >= 0
    ))


@dataclass(frozen=True)
class AdaptersAnswer:
    """The shim's answer to PUT ADAPTERS_PATH: status 0 when there was none (unreachable, a timeout)."""

    status: int
    states: dict[str, tuple[bool, str | None]] | None = None
    """By adapter name, (loaded, reason) from a 200 answer; None otherwise."""
    set_hash: str | None = None
    error: str = ""
    """What went wrong where there is no 200 answer: the shim's reason, or the transport error."""


def parse_adapters(body: str) -> tuple[dict[str, tuple[bool, str | None]], str | None]:
    """The states and set hash of an ADAPTERS_PATH answer; ValueError when it is not the contract's shape."""
    doc = json.loads(body)
    if not isinstance(doc, dict) or not isinstance(doc.get("adapters"), list):
        raise ValueError(f"adapters answer has no 'adapters' list: {body[:200]!r}")
    states: dict[str, tuple[bool, str | None]] = {}
    for item in doc["adapters"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise ValueError(f"adapters answer has an entry without a name: {item!r:.200}")
        state = item.get("state")
        if state not in ("loaded", "failed"):
            raise ValueError(f"adapter {item['name']!r}: state {state!r} is not loaded or failed")
        reason = item.get("reason")
        states[item["name"]] = (state == "loaded", str(reason) if reason else None)
    set_hash = doc.get("set")
    return states, set_hash if isinstance(set_hash, str) else None


class ShimHttpError(Exception):
    """The shim's answer was not HTTP/1.1 this client reads (the poll counts as failed)."""


MAX_POLL_BODY = 4 << 20
"""The largest poll answer read (a /metrics page is tens of kB): a broken peer cannot fill memory."""


class ShimConnection:
    """One kept-alive HTTP/1.1 connection to one pod's shim, for the operator's polls (small GETs).

    The polls are most of the operator's idle CPU: each pod of a fleet is polled every few seconds
    while anything about it is in question, and at least every half minute while it is steady.
    aiohttp's client spends about 0.15 ms of CPU on each request (its request and response objects,
    headers, tracing hooks, timers); a GET written and read on a kept-alive stream spends about
    0.04 ms (docs/benchmarks/operator.md, "What the operator does for scale"). The shim is our own
    aiohttp server, and a poll only needs the status and the body, so this reads exactly that:
    Content-Length or chunked bodies, keep-alive unless the server says close. Prewarm (a POST,
    once per pod) stays on aiohttp.
    """

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self._request_head = f"Host: {host}:{port}\r\nAccept: */*\r\nUser-Agent: flashmodel-operator\r\n\r\n"
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """(status, body) of GET path; raises OSError, TimeoutError or ShimHttpError when there is none."""
        try:
            async with asyncio.timeout(timeout):
                if self._writer is not None:
                    try:
                        return await self._exchange(path)
                    except (OSError, asyncio.IncompleteReadError, ShimHttpError):
                        # The server closed the kept-alive connection between polls (its idle timeout,
                        # a restart): that says nothing about the pod, so ask once more on a new one.
                        self.close()
                self._reader, self._writer = await asyncio.open_connection(self.host, self.port)
                return await self._exchange(path)
        except BaseException:
            # A timeout or a cancellation may leave an answer half read: never reuse that stream.
            self.close()
            raise

    async def _exchange(self, path: str) -> tuple[int, bytes]:
        reader, writer = self._reader, self._writer
        assert reader is not None and writer is not None
        writer.write(f"GET {path} HTTP/1.1\r\n{self._request_head}".encode())
        status_line = await reader.readuntil(b"\r\n")
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1.") or not parts[1].isdigit():
            raise ShimHttpError(f"not an HTTP/1.x status line: {status_line[:80]!r}")
        status = int(parts[1])
        length: int | None = None
        chunked = False
        keep = parts[0] == b"HTTP/1.1"
        while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
            name, _, value = line.partition(b":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = value.endswith(b"chunked")
            elif name == b"connection":
                keep = value != b"close" if keep else value == b"keep-alive"
        if chunked:
            body = bytearray()
            while (size := int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)) > 0:
                if len(body) + size > MAX_POLL_BODY:
                    raise ShimHttpError(f"answer over {MAX_POLL_BODY} bytes")
                body += await reader.readexactly(size)
                await reader.readexactly(2)
            while await reader.readuntil(b"\r\n") != b"\r\n":
                pass  # trailers
            data = bytes(body)
        elif length is not None:
            if length > MAX_POLL_BODY:
                raise ShimHttpError(f"answer of {length} bytes, over {MAX_POLL_BODY}")
            data = await reader.readexactly(length)
        else:
            # No length: the body ends with the connection.
            body = bytearray()
            while chunk := await reader.read(65536):
                body += chunk
                if len(body) > MAX_POLL_BODY:
                    raise ShimHttpError(f"answer over {MAX_POLL_BODY} bytes")
            data, keep = bytes(body), False
        if not keep:
            self.close()
        return status, data

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._reader = self._writer = None


class ShimClient:
    """HTTP calls to one pod's shim at http://<pod IP>:SHIM_PORT."""

    def __init__(
        self,
        session: aiohttp.ClientSession,
        pod_ip: str,
        port: int = SHIM_PORT,
        token: str | None = None,
        connection: ShimConnection | None = None,
    ) -> None:
        self.session = session
        self.pod_ip = pod_ip
        self.base = f"http://{pod_ip}:{port}"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        """The model's control token: the shim runs a prewarm only for the operator."""
        self.connection = connection
        """The pod's kept-alive connection for its polls; without one they go through the session."""

    async def _get(self, path: str, timeout: float) -> tuple[int, bytes]:
        """(status, body), or (0, b"") when the shim could not be reached or answered garbage."""
        try:
            if self.connection is not None:
                return await self.connection.get(path, timeout)
            async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                return resp.status, await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError, asyncio.IncompleteReadError, ShimHttpError, ValueError):
            return 0, b""

    async def _status(self, path: str, timeout: float) -> int:
        return (await self._get(path, timeout))[0]

    async def started(self) -> bool:
        return await self._status(STARTUP_PATH, 5) == 200

    async def live(self) -> bool:
        return await self._status(LIVENESS_PATH, 5) == 200

    async def ready(self, timeout: float) -> bool:
        return await self._status(READINESS_PATH, timeout) == 200

    async def prewarm(self, requests: int, prompts: list[str], timeout: float) -> dict[str, Any]:
        """POST /prewarm; a transport failure is reported like a failed prewarm, never raised."""
        body: dict[str, Any] = {"requests": requests}
        if prompts:
            body["prompts"] = prompts
        try:
            async with self.session.post(
                self.base + PREWARM_PATH, json=body, headers=self.headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return {"ok": False, "error": f"prewarm request failed: {type(exc).__name__}: {exc}"}
        try:
            result: dict[str, Any] = json.loads(text)
        except ValueError:
            return {"ok": False, "error": f"prewarm answered HTTP {resp.status} with non-JSON: {text[:200]}"}
        if resp.status != 200:
            result.setdefault("ok", False)
            result.setdefault("error", result.get("reason") or f"prewarm answered HTTP {resp.status}")
        result["status"] = resp.status
        return result

    async def put_adapters(self, adapters: list[dict[str, str]], timeout: float) -> AdaptersAnswer:
        """PUT the whole desired adapter set (ADAPTERS_PATH, with the control token); never raises."""
        try:
            async with self.session.put(
                self.base + ADAPTERS_PATH,
                json={"adapters": adapters},
                headers=self.headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return AdaptersAnswer(0, error=f"PUT {ADAPTERS_PATH} failed: {type(exc).__name__}: {exc}")
        if status != 200:
            try:
                doc = json.loads(text)
                reason = str(doc.get("reason") or doc.get("error") or "") if isinstance(doc, dict) else ""
            except ValueError:
                reason = text[:200]
            return AdaptersAnswer(status, error=reason or f"PUT {ADAPTERS_PATH} answered HTTP {status}")
        try:
            states, set_hash = parse_adapters(text)
        except ValueError as exc:
            # A 200 the operator cannot read is no answer: asked again after a back-off.
            return AdaptersAnswer(0, error=str(exc))
        return AdaptersAnswer(200, states=states, set_hash=set_hash)

    async def poll(
        self, timeout: float, wait: float = 0.0, unless: str | None = None
    ) -> tuple[ShimReading | None, bool]:
        """One health poll: (the reading, or None when there is none; whether the pod is ready).

        One small request to HEALTH_POLL_PATH; with `wait` and `unless` (the state of the reading the
        caller holds), held by the shim until its answer's state differs or `wait` seconds passed
        (`timeout` is counted after the wait). A shim that cannot be reached or answers anything but
        200 with a well-formed body is a failed poll (no reading, not ready).
        """
        path = HEALTH_POLL_PATH
        if wait > 0 and unless:
            path += "?" + urlencode({"wait": f"{wait:.1f}", "unless": unless})
        status, body = await self._get(path, timeout + (wait if path != HEALTH_POLL_PATH else 0.0))
        if status != 200:
            return None, False
        try:
            return parse_health_poll(body)
        except ValueError:
            return None, False

    async def metrics(self) -> ShimReading | None:
        status, body = await self._get(METRICS_PATH, 5)
        if status != 200:
            return None
        try:
            return parse_metrics(body.decode("utf-8", errors="replace"))
        except ValueError:
            return None
