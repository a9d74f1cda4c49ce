#!/usr/bin/env python3
"""Load generator for OpenAI-compatible LLM servers: Poisson and concurrency sweeps against a TTFT SLO.

    python3 bench/slo/loadgen.py search --url http://127.0.0.1:8000 --slo-ttft-ms 300 --json-out r.json
    python3 bench/slo/loadgen.py run    --url http://127.0.0.1:8000 --rate 8 --num-requests 128
    python3 bench/slo/loadgen.py sweep  --url http://127.0.0.1:8000 --concurrency 1,8,32

The workload is the field reports' one: 128 prompts of about 217 tokens (a spread of lengths),
48 output tokens, greedy, `ignore_eos` so every request decodes the same number of tokens.
Variants: `plain`, `shared-prefix` (one instruction template in front of every prompt, where
prefix caching pays) and `json` (guided decoding to a small ticket schema).

Only loopback targets are accepted: the benchmark is meant for a server on this machine (or a
`kubectl port-forward`), and traffic to any other address is out of bounds for it.
Needs only the standard library and aiohttp.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import ipaddress
import json
import math
import os
import random
import resource
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine, Mapping, Sequence
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import urlsplit

import aiohttp

T = TypeVar("T")
Api = Literal["completions", "chat"]
Variant = Literal["plain", "shared-prefix", "json"]
PromptFormat = Literal["text", "ids"]

# Short lowercase words: they are single tokens in Qwen2.5's tokenizer and in the random-weight
# test models' word tokenizer (gpu/mk.py: every word of up to three letters, and four-letter
# words from a to g, is in its vocabulary), so prompts round-trip through either exactly.
_WORD_TEXT = (
    "a an and any app are arc arm art ask bad bag bar bay bed bit box bus but cab can cap car "
    "cat cut day did dig dim dip dog dry due dust each ear east edge end err eye fab fan far fat "
    "fed few fix flag flow fog for fuse gap gas gate gear get gold gun had has hat hit hot how hub "
    "ice ink ion its jam job key kit lab lag law lay led leg let lid lit log low mad map max men "
    "met mid mix mob mud net new nil nut oak odd off oil old one out own pad pan pen per pet pin "
    "pit pot pro put ram ran raw red rib rig rod row rub run rye sad saw sea set shy sit six "
    "sky sum sun tab tag tan tap tar ten the tie tin tip toe ton top tow toy try tub two use van "
    "vat via war wax way web wet who why win wit yes yet zip"
)
WORDS = _WORD_TEXT.split()

# The instruction every shared-prefix prompt starts with (about 64 tokens): the field reports'
# customer-service back end sends one system instruction in front of each ticket.
TEMPLATE = (
    "you are the bot for our gas and oil ops desk and you get one job log per ask read the log "
    "then say the fix the due day and the cost and if the fix is not yet due say why and who has "
    "to act next and how hot the job is use few words per row and end each row with yes or no "
    "the log is"
)

# Guided decoding target: a ticket triage record, the JSON-output case of the field reports.
TICKET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "ticket": {"type": "string", "minLength": 1, "maxLength": 16},
        "severity": {"type": "string", "enum": ["low", "medium", "high"]},
        "action": {"type": "string", "minLength": 1, "maxLength": 32},
    },
    "required": ["ticket", "severity", "action"],
    "additionalProperties": False,
}
# The same object as a regular expression of compact JSON. vLLM applies "no whitespace" only as
# a server flag (--structured-outputs-config), not per request, and under a schema grammar a
# greedy random-weight model pads with whitespace until max_tokens cuts the object off; a regex
# leaves no room for that, so the benchmark's JSON variant measures guided decoding that ends.
TICKET_REGEX = r'\{"ticket":"[a-z ]{1,16}","severity":"(low|medium|high)","action":"[a-z ]{1,32}"\}'


def log(event: str, **fields: object) -> None:
    """One event per line, key=value, on stderr so stdout stays the results table."""
    parts = [f"event={event}"] + [f"{k}={v}" for k, v in fields.items()]
    print(" ".join(parts), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Statistics and schedules (pure)
# ---------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) by linear interpolation between ranks (numpy's default).

    None for no values, so an empty run reports "no data" rather than a fake zero."""
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within 0..100, got {q}")
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def poisson_schedule(rate: float, count: int, seed: int) -> list[float]:
    """Send offsets (seconds from the start) of `count` Poisson arrivals at `rate` per second.

    The first request goes at 0 so a run does not idle for one mean gap before it begins."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for i in range(count):
        if i:
            t += rng.expovariate(rate)
        offsets.append(t)
    return offsets


def prompt_lengths(count: int, mean: int, spread: int, seed: int) -> list[int]:
    """`count` prompt lengths in [mean - spread, mean + spread] whose mean is exactly `mean`.

    Uniform draws, then nudged one token at a time (random elements, within the bounds) until
    the total is count * mean: the workload promises the field reports' average, not roughly it."""
    if count <= 0 or spread < 0 or mean - spread < 1:
        raise ValueError(f"need count > 0 and 1 <= mean - spread, got count={count} mean={mean} spread={spread}")
    rng = random.Random(seed)
    lo, hi = mean - spread, mean + spread
    lengths = [rng.randint(lo, hi) for _ in range(count)]
    diff = count * mean - sum(lengths)
    while diff:
        i = rng.randrange(count)
        step = 1 if diff > 0 else -1
        if lo <= lengths[i] + step <= hi:
            lengths[i] += step
            diff -= step
    return lengths


@dataclasses.dataclass
class RequestResult:
    """What one request did, in seconds from the run's start and durations in seconds."""

    index: int
    prompt_tokens: int
    scheduled_s: float
    sent_s: float = 0.0
    ok: bool = False
    error: str | None = None
    status: int | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    output_tokens: int = 0
    json_valid: bool | None = None
    # The longest wait between two streamed chunks: a stall the reader sees, which TPOT (a mean)
    # hides; a server that falls behind also coalesces tokens into bursts, which shows here.
    max_gap_s: float | None = None
    # When the last generated token arrived (from the send): the stream's usage chunk and [DONE]
    # come after it and are no decode time.
    last_token_s: float | None = None

    @property
    def tpot_s(self) -> float | None:
        """Mean time per output token after the first, the decode speed a reader sees: first to
        last token over the tokens between (vLLM's own benchmark counts the same span)."""
        if not self.ok or self.ttft_s is None or self.e2e_s is None or self.output_tokens < 2:
            return None
        end = self.last_token_s if self.last_token_s is not None else self.e2e_s
        return (end - self.ttft_s) / (self.output_tokens - 1)


def _ms(v: float | None) -> float | None:
    return None if v is None else round(v * 1000.0, 3)


def summarize(results: Sequence[RequestResult], wall_s: float) -> dict[str, Any]:
    """Counts and p50/p90/p99 of TTFT, TPOT and end-to-end latency (in ms) for one run."""
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [t for t in (r.tpot_s for r in ok) if t is not None]
    e2e = [r.e2e_s for r in ok if r.e2e_s is not None]
    lag = [max(0.0, r.sent_s - r.scheduled_s) for r in results]
    out_tokens = sum(r.output_tokens for r in ok)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = (r.error or "unknown").split(":", 1)[0]
            errors[key] = errors.get(key, 0) + 1
    summary: dict[str, Any] = {
        "requests": len(results),
        "ok": len(ok),
        "errors": len(results) - len(ok),
        "error_kinds": errors,
        "wall_s": round(wall_s, 3),
        "achieved_rps": round(len(ok) / wall_s, 3) if wall_s > 0 else None,
        "output_tokens_per_s": round(out_tokens / wall_s, 1) if wall_s > 0 else None,
        "mean_output_tokens": round(out_tokens / len(ok), 2) if ok else None,
        "mean_prompt_tokens": round(sum(r.prompt_tokens for r in results) / len(results), 2) if results else None,
        "send_lag_p99_ms": _ms(percentile(lag, 99)),
        "max_gap_p99_ms": _ms(percentile([r.max_gap_s for r in ok if r.max_gap_s is not None], 99)),
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)):
        for q in (50, 90, 99):
            summary[f"{name}_p{q}_ms"] = _ms(percentile(vals, q))
    json_checked = [r for r in ok if r.json_valid is not None]
    if json_checked:
        summary["json_valid"] = sum(1 for r in json_checked if r.json_valid)
    return summary


def meets_slo(summary: dict[str, Any], slo_ttft_ms: float, slo_tpot_ms: float = 0.0) -> bool:
    """A rate passes when nothing failed, TTFT p99 is within the SLO and, with `slo_tpot_ms`, so is
    TPOT p99 (goodput: a fast first token followed by a stalling stream is no pass)."""
    p99 = summary.get("ttft_p99_ms")
    if not (summary["errors"] == 0 and summary["ok"] > 0 and p99 is not None and p99 <= slo_ttft_ms):
        return False
    if slo_tpot_ms:
        tpot = summary.get("tpot_p99_ms")
        return tpot is not None and tpot <= slo_tpot_ms
    return True


# ---------------------------------------------------------------------------------------------
# Targets and the workload
# ---------------------------------------------------------------------------------------------


def check_loopback(url: str) -> str:
    """Return the base URL without a trailing slash, or raise if it is not a loopback address."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.scheme not in ("http", "https") or not host:
        raise ValueError(f"--url must be http(s)://HOST:PORT, got {url!r}")
    loopback = host == "localhost"
    with contextlib.suppress(ValueError):
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    if not loopback:
        raise ValueError(
            f"--url host {host!r} is not a loopback address: this load generator only targets "
            "127.0.0.0/8, ::1 or localhost; port-forward the server (kubectl port-forward svc/NAME "
            "8000) and point --url at http://127.0.0.1:8000"
        )
    return url.rstrip("/").removesuffix("/v1")


@dataclasses.dataclass(frozen=True)
class Target:
    """Where to send requests and how to authenticate."""

    base_url: str
    model: str
    api_key: str | None = None

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One prompt: the text, the token ids it encodes to (when a tokenizer was reachable)."""

    text: str
    token_ids: tuple[int, ...] | None
    tokens: int
    max_tokens: int | None = None  # this request's output length; None: the workload's max_tokens


@dataclasses.dataclass
class Workload:
    """The prompts and the request settings every request of a run shares."""

    prompts: list[Prompt]
    api: Api = "completions"
    variant: Variant = "plain"
    prompt_format: PromptFormat = "text"
    max_tokens: int = 48
    ignore_eos: bool = True
    cache_salt: bool = True
    calibrated: bool = False
    shared_prefix_tokens: int = 0
    json_via: Literal["schema", "regex", "response_format"] = "schema"
    token_ids: bool = True

    def output_range(self) -> tuple[int, int] | None:
        """(shortest, longest) per-request output length, or None when every request has max_tokens."""
        own = [p.max_tokens for p in self.prompts if p.max_tokens is not None]
        return (min(own), max(own)) if own else None

    def describe(self) -> dict[str, Any]:
        lengths = [p.tokens for p in self.prompts]
        return {
            "prompts": len(lengths),
            "mean_prompt_tokens": round(sum(lengths) / len(lengths), 2) if lengths else None,
            "min_prompt_tokens": min(lengths, default=None),
            "max_prompt_tokens": max(lengths, default=None),
            "api": self.api,
            "variant": self.variant,
            "prompt_format": self.prompt_format,
            "max_tokens": self.max_tokens,
            "output_tokens_range": self.output_range(),
            "ignore_eos": self.ignore_eos,
            "temperature": 0.0,
            "cache_salt": self.cache_salt,
            "calibrated_with_server_tokenizer": self.calibrated,
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "json_via": self.json_via if self.variant == "json" else None,
            "return_token_ids": self.token_ids,
        }


class TokenizerClient(Protocol):
    """Encode and decode with the served model's own tokenizer."""

    async def encode(self, text: str) -> list[int]: ...

    async def decode(self, ids: Sequence[int]) -> str: ...


class ServerTokenizer:
    """vLLM's /tokenize and /detokenize: the exact tokenizer the server uses, no local copy."""

    def __init__(self, session: aiohttp.ClientSession, target: Target) -> None:
        self._session = session
        self._target = target

    async def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        async with self._session.post(self._target.base_url + path, json=body, headers=self._target.headers()) as resp:
            if resp.status != 200:
                raise RuntimeError(f"{path} answered {resp.status}: {(await resp.text())[:200]}")
            data: dict[str, Any] = await resp.json()
            return data

    async def encode(self, text: str) -> list[int]:
        data = await self._post("/tokenize", {"model": self._target.model, "prompt": text, "add_special_tokens": False})
        return [int(t) for t in data["tokens"]]

    async def decode(self, ids: Sequence[int]) -> str:
        data = await self._post("/detokenize", {"model": self._target.model, "tokens": list(ids)})
        return str(data["prompt"])


def _words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


async def _exact_prompt(tok: TokenizerClient, text: str, target: int) -> Prompt:
    """Cut `text` to `target` tokens at a boundary where decode/encode round-trips exactly."""
    ids = await tok.encode(text)
    if len(ids) < target:
        raise ValueError(f"source text has {len(ids)} tokens, fewer than the {target} needed")
    for cut in range(target, max(target - 4, 0), -1):
        head = ids[:cut]
        decoded = await tok.decode(head)
        again = await tok.encode(decoded)
        if again == head:
            return Prompt(decoded, tuple(head), cut)
    # No clean boundary nearby (a tokenizer that merges across words): keep the re-encoding,
    # which is what the server will see, and report its true length.
    decoded = await tok.decode(ids[:target])
    again = await tok.encode(decoded)
    return Prompt(decoded, tuple(again), len(again))


async def build_workload(
    tok: TokenizerClient | None,
    *,
    count: int = 128,
    mean_tokens: int = 217,
    spread: int = 96,
    variant: Variant = "plain",
    seed: int = 0,
    output_tokens: tuple[int, int] | None = None,
    **settings: Any,
) -> Workload:
    """The field reports' prompts. With a tokenizer, each prompt has exactly its planned length
    and round-trips (text -> ids -> text); without one, one word is assumed to be one token.

    `output_tokens` (lo, hi) gives every request its own output length, uniform in [lo, hi]
    (with ignore_eos, what it generates): the field's answers are 30-50 characters, a spread, and
    one fixed length makes closed-loop clients finish on the same step and restart together."""
    workload = await _build_prompts(tok, count, mean_tokens, spread, variant, seed, settings)
    if output_tokens is not None:
        lo, hi = output_tokens
        if not 1 <= lo <= hi:
            raise ValueError(f"output_tokens must be (lo, hi) with 1 <= lo <= hi, got {output_tokens}")
        rng = random.Random(seed + 2)
        workload.prompts = [dataclasses.replace(p, max_tokens=rng.randint(lo, hi)) for p in workload.prompts]
    return workload


async def _build_prompts(
    tok: TokenizerClient | None,
    count: int,
    mean_tokens: int,
    spread: int,
    variant: Variant,
    seed: int,
    settings: dict[str, Any],
) -> Workload:
    lengths = prompt_lengths(count, mean_tokens, spread, seed)
    rng = random.Random(seed + 1)
    prefix = TEMPLATE if variant == "shared-prefix" else ""
    prefix_tokens = 0
    if tok is None:
        prefix_tokens = len(prefix.split())
        prompts = []
        for n in lengths:
            body = _words(rng, max(1, n - prefix_tokens))
            text = f"{prefix} {body}" if prefix else body
            prompts.append(Prompt(text, None, len(text.split())))
        return Workload(prompts, variant=variant, calibrated=False, shared_prefix_tokens=prefix_tokens, **settings)
    if prefix:
        prefix_tokens = len(await tok.encode(prefix))
        if prefix_tokens >= mean_tokens - spread:
            raise ValueError(
                f"the shared prefix has {prefix_tokens} tokens, not fewer than the "
                f"shortest prompt ({mean_tokens - spread}); raise --mean-input-tokens"
            )
    sources = []
    for n in lengths:
        # 1.5 words per token is ample for word-level and BPE tokenizers alike; the cut is exact.
        body = _words(rng, int(n * 1.5) + 8)
        sources.append(f"{prefix} {body}" if prefix else body)
    # Bounded concurrency: calibration is a few hundred tiny requests, not a load test.
    gate = asyncio.Semaphore(16)

    async def one(text: str, n: int) -> Prompt:
        async with gate:
            return await _exact_prompt(tok, text, n)

    prompts = list(await asyncio.gather(*(one(s, n) for s, n in zip(sources, lengths, strict=True))))
    return Workload(prompts, variant=variant, calibrated=True, shared_prefix_tokens=prefix_tokens, **settings)


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


def request_body(target: Target, workload: Workload, prompt: Prompt, salt: str | None) -> tuple[str, dict[str, Any]]:
    """The path and JSON body of one streaming request."""
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": prompt.max_tokens or workload.max_tokens,
        "temperature": 0.0,
        "stream": True,
        # The last chunk then carries usage.completion_tokens: the true output length, not a
        # count of chunks (a server may pack several tokens into one chunk).
        "stream_options": {"include_usage": True},
    }
    if workload.ignore_eos:
        body["ignore_eos"] = True
    if workload.token_ids:
        body["return_token_ids"] = True
    if salt is not None:
        body["cache_salt"] = salt
    if workload.api == "chat":
        path = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        path = "/v1/completions"
        use_ids = workload.prompt_format == "ids" and prompt.token_ids is not None
        body["prompt"] = list(prompt.token_ids) if use_ids and prompt.token_ids else prompt.text
    if workload.variant == "json":
        if workload.json_via == "response_format":
            # The OpenAI form, for servers other than vLLM.
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "ticket", "schema": TICKET_SCHEMA},
            }
        elif workload.json_via == "regex":
            body["structured_outputs"] = {"regex": TICKET_REGEX}
        else:
            # vLLM's own form (0.12+; `guided_json` is gone).
            body["structured_outputs"] = {"json": TICKET_SCHEMA}
        # A grammar must be allowed to close the object: forcing past EOS would make the output
        # invalid by construction, so the JSON variant stops where the schema does.
        body.pop("ignore_eos", None)
    return path, body


def chunk_tokens(chunk: dict[str, Any], api: Api) -> tuple[str, int]:
    """The text of one SSE chunk and how many generated tokens it carries.

    vLLM streams one chunk per token, but a token that ends inside a UTF-8 character carries
    empty text (random-weight models emit such byte tokens often), so text alone would push
    TTFT late; `token_ids` (asked for with return_token_ids) counts them. A chat stream's first
    chunk holds only the role: no text, no token ids, so it is no first token."""
    choices = chunk.get("choices") or []
    if not choices:
        return "", 0
    c0 = choices[0]
    delta = c0.get("delta") or {}
    text = str((delta.get("content") if api == "chat" else c0.get("text")) or "")
    ids = c0.get("token_ids") or delta.get("token_ids")
    if ids:
        return text, len(ids)
    return text, 1 if text else 0


async def send_one(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    index: int,
    t0: float,
    scheduled_s: float,
    timeout_s: float,
    salt: str | None,
) -> RequestResult:
    """Send one streaming request and time its first token and its end."""
    prompt = workload.prompts[index % len(workload.prompts)]
    res = RequestResult(index=index, prompt_tokens=prompt.tokens, scheduled_s=scheduled_s)
    path, body = request_body(target, workload, prompt, salt)
    start = time.perf_counter()
    res.sent_s = start - t0
    text_parts: list[str] = []
    chunks = 0
    usage_tokens: int | None = None
    last = start
    try:
        async with session.post(
            target.base_url + path,
            json=body,
            headers=target.headers(),
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            res.status = resp.status
            if resp.status != 200:
                res.error = f"http_{resp.status}: {(await resp.text())[:300]}"
                return res
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = f"stream_error: {str(chunk['error'])[:300]}"
                    return res
                piece, n = chunk_tokens(chunk, workload.api)
                if n:
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.max_gap_s = max(res.max_gap_s or 0.0, now - last)
                    last = now
                    res.last_token_s = now - start
                    chunks += n
                    text_parts.append(piece)
                usage = chunk.get("usage")
                if usage and usage.get("completion_tokens") is not None:
                    usage_tokens = int(usage["completion_tokens"])
        res.e2e_s = time.perf_counter() - start
        res.output_tokens = usage_tokens if usage_tokens is not None else chunks
        if res.ttft_s is None:
            res.error = "no_tokens: the stream ended without any generated text"
            return res
        if workload.variant == "json":
            try:
                json.loads("".join(text_parts))
                res.json_valid = True
            except ValueError:
                res.json_valid = False
        res.ok = True
    except TimeoutError:
        res.error = f"timeout: no complete answer within {timeout_s} s"
    except aiohttp.ClientError as e:
        res.error = f"client_error: {type(e).__name__}: {e}"
    except ValueError as e:
        res.error = f"bad_stream: {e}"
    return res


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop where it is installed: at a few hundred requests per second the
    event loop's per-chunk cost decides whether the generator keeps its schedule (send lag)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def raise_fd_limit() -> int:
    """Lift the soft open-files limit to the hard one: the field reports' `ulimit -n 1024` broke
    at about 50 concurrent connections with a misleading error, and this tool must not."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def new_session(max_in_flight: int) -> aiohttp.ClientSession:
    # aiohttp's default pool of 100 connections would silently cap the offered load.
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=max_in_flight, force_close=False))


@dataclasses.dataclass
class RunLimits:
    """Bounds on one run: request count, wall time, per-request timeout, connections in flight."""

    num_requests: int = 128
    max_duration_s: float = 120.0
    request_timeout_s: float = 60.0
    max_in_flight: int = 512


async def _drive(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    limits: RunLimits,
    launch: Callable[[Callable[[int, float], Awaitable[RequestResult]]], Awaitable[list[RequestResult]]],
) -> tuple[list[RequestResult], float]:
    nonce = uuid.uuid4().hex[:12]
    t0 = time.perf_counter()

    def salt_for(index: int) -> str | None:
        # One salt per pass over the prompt list: within a pass only a genuinely shared prefix can
        # hit vLLM's prefix cache; a prompt repeated in a later pass (or a later run) cannot.
        if not workload.cache_salt:
            return None
        return f"{nonce}-{index // len(workload.prompts)}"

    async def fire(index: int, scheduled: float) -> RequestResult:
        return await send_one(
            session, target, workload, index, t0, scheduled, limits.request_timeout_s, salt_for(index)
        )

    results = await launch(fire)
    return results, time.perf_counter() - t0


async def run_open_loop(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    rate: float,
    limits: RunLimits,
    seed: int = 0,
) -> tuple[list[RequestResult], float]:
    """Poisson arrivals at `rate`/s, independent of how fast answers come (an open loop, so a slow
    server sees its queue grow, as with real users)."""
    schedule = poisson_schedule(rate, limits.num_requests, seed)
    gate = asyncio.Semaphore(limits.max_in_flight)

    async def launch(fire: Callable[[int, float], Awaitable[RequestResult]]) -> list[RequestResult]:
        start = time.perf_counter()
        tasks: list[asyncio.Task[RequestResult]] = []

        async def gated(i: int, at: float) -> RequestResult:
            async with gate:
                return await fire(i, at)

        for i, at in enumerate(schedule):
            if at > limits.max_duration_s:
                break
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(gated(i, at)))
        return list(await asyncio.gather(*tasks))

    return await _drive(session, target, workload, limits, launch)


async def run_closed_loop(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    concurrency: int,
    limits: RunLimits,
) -> tuple[list[RequestResult], float]:
    """`concurrency` clients, each sending its next request as soon as the last one ended."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")

    async def launch(fire: Callable[[int, float], Awaitable[RequestResult]]) -> list[RequestResult]:
        start = time.perf_counter()
        next_index = 0
        out: list[RequestResult] = []

        async def client() -> None:
            nonlocal next_index
            while next_index < limits.num_requests and time.perf_counter() - start < limits.max_duration_s:
                i = next_index
                next_index += 1
                out.append(await fire(i, time.perf_counter() - start))

        await asyncio.gather(*(client() for _ in range(concurrency)))
        return sorted(out, key=lambda r: r.index)

    return await _drive(session, target, workload, limits, launch)


# ---------------------------------------------------------------------------------------------
# The SLO search
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SearchSettings:
    """How the search for the highest rate within the TTFT SLO steps and how long each trial is."""

    slo_ttft_ms: float = 300.0
    # TPOT p99 limit for goodput (0: TTFT alone decides, the older SLO). The field reports' "200
    # characters without stalling" at 50 ms a token is 10 s for 200 tokens, a reading pace.
    slo_tpot_ms: float = 0.0
    rate_start: float = 4.0
    rate_min: float = 0.25
    rate_max: float = 256.0
    bisect_steps: int = 2
    trial_seconds: float = 6.0
    trial_min_requests: int = 32
    trial_max_requests: int = 512
    max_total_s: float = 240.0
    # A fresh server pays one-off costs the first time it sees a batch of more than one sequence.
    # On the H200 run of 2026-12-02 (--enforce-eager, most likely Triton JIT compilation) every
    # stream stalled for 0.7-1.3 s in the first trial only, and the search, which never goes back
    # above a failure, reported 7 req/s for engine flags that passed 8-96 req/s once warm. So: one
    # pass at rate_start before the first trial, recorded apart, and a failing rate is run again
    # before it counts (docs/benchmarks/slo.md, "Cases and workload").
    warmup: bool = True
    retries_on_failure: int = 1
    # A failure that is plainly an overload is not run again: TTFT p99 above overload_ttft_ms while
    # the server completed less than overload_fraction of the offered rate (a queue that grew for
    # the whole trial). The retry is for one-off stalls, which lasted 0.7-1.3 s on the H200; in SLO
    # runs 17-18 every failure past 2 s with under 85 % delivered failed its retry too, and each
    # such retry cost 15-25 s of device time. 0 (the default) retries every failure.
    overload_ttft_ms: float = 0.0
    overload_fraction: float = 0.85


def trial_requests(rate: float, s: SearchSettings) -> int:
    """Enough requests for a p99 to mean something, few enough to keep the trial short."""
    return max(s.trial_min_requests, min(s.trial_max_requests, math.ceil(rate * s.trial_seconds)))


def goodput_at_rates(passed: Mapping[float, Sequence[bool]]) -> float | None:
    """The highest rate that passed in most of its rounds, with every lower rate tried doing so too.

    For fixed-rate trials of several servers interleaved over rounds: a search walks each server its
    own way through the rates, so one noisy trial moves its answer by a whole step.
    """
    best: float | None = None
    for rate in sorted(passed):
        rounds = passed[rate]
        if 2 * sum(1 for ok in rounds if ok) <= len(rounds):
            break
        best = rate
    return best


def fixed_trial_requests(rate: float, seconds: float) -> int:
    """Requests in a fixed-rate trial: `seconds` of them at `rate`, at least 64 for a p99 to mean something."""
    return max(64, round(rate * seconds))


async def rate_trial(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    rate: float,
    seconds: float,
    slo: tuple[float, float],
    seed: int = 0,
) -> dict[str, Any]:
    """One Poisson trial of `seconds` at `rate`; passed: within (TTFT, TPOT) p99."""
    limits = RunLimits(num_requests=fixed_trial_requests(rate, seconds), request_timeout_s=60, max_in_flight=1024)
    res, wall = await run_open_loop(session, target, workload, rate, limits, seed)
    summary = summarize(res, wall)
    return {"rate_rps": rate, "passed": meets_slo(summary, *slo), "summary": summary}


def bracket(passed: dict[float, bool]) -> tuple[float | None, float | None]:
    """The highest passing rate and the lowest failing rate above it (None where there is none)."""
    best = max((r for r, ok in passed.items() if ok), default=None)
    worst = min((r for r, ok in passed.items() if not ok and (best is None or r > best)), default=None)
    return best, worst


def next_rate(passed: dict[float, bool], bisections: int, s: SearchSettings) -> float | None:
    """The next rate to try given the outcomes so far, or None when the search is done.

    Doubles from rate_start until a failure (halves towards rate_min while the first ones fail),
    then bisects between the highest pass and the lowest failure above it, bisect_steps times."""
    if not passed:
        return s.rate_start
    best, worst = bracket(passed)
    if best is None:
        low = min(passed)
        return low / 2 if low / 2 >= s.rate_min else None
    if worst is None:
        if best >= s.rate_max:
            return None
        return min(best * 2, s.rate_max)
    if bisections >= s.bisect_steps:
        return None
    return round((best + worst) / 2, 3)


def is_overload(summary: dict[str, Any], rate: float, s: SearchSettings) -> bool:
    """A failed trial whose queue grew all along: no retry can pass it (SearchSettings.overload_*)."""
    ttft, achieved = summary.get("ttft_p99_ms"), summary.get("achieved_rps")
    if not s.overload_ttft_ms or ttft is None or achieved is None:
        return False
    return bool(ttft > s.overload_ttft_ms and achieved < s.overload_fraction * rate)


TrialRunner = Callable[[float, RunLimits], Awaitable[tuple[list[RequestResult], float]]]


async def search_max_rate(
    session: aiohttp.ClientSession,
    target: Target,
    workload: Workload,
    settings: SearchSettings,
    limits: RunLimits,
    seed: int = 0,
    on_trial: Callable[[float, dict[str, Any]], None] | None = None,
    run_trial: TrialRunner | None = None,
) -> dict[str, Any]:
    """The highest Poisson rate whose TTFT p99 stays within the SLO with no errors.

    With `settings.warmup`, one pass at rate_start runs first and is recorded apart ("warmup"),
    never as a trial. A failing trial is run again up to `settings.retries_on_failure` times; the
    last attempt decides (a one-off stall passes on the retry, an overload fails again). Every
    attempt is kept in "trials", the deciding one with "counted": true. `run_trial` replaces the
    open-loop run (tests)."""

    async def default_trial(rate: float, trial_limits: RunLimits) -> tuple[list[RequestResult], float]:
        return await run_open_loop(session, target, workload, rate, trial_limits, seed)

    trial = run_trial or default_trial
    passed: dict[float, bool] = {}
    trials: list[dict[str, Any]] = []
    warmup: dict[str, Any] | None = None
    bisections = 0
    started = time.perf_counter()

    def record(rate: float, results: list[RequestResult], wall: float) -> dict[str, Any]:
        summary = summarize(results, wall)
        return {
            "rate_rps": rate,
            "passed": meets_slo(summary, settings.slo_ttft_ms, settings.slo_tpot_ms),
            "summary": summary,
            "requests": [dataclasses.asdict(r) | {"tpot_s": r.tpot_s} for r in results],
        }

    if settings.warmup:
        first = settings.rate_start
        results, wall = await trial(first, dataclasses.replace(limits, num_requests=trial_requests(first, settings)))
        warmup = record(first, results, wall)
        s = warmup["summary"]
        log(
            "warmup",
            rate=first,
            would_pass=warmup["passed"],
            ttft_p99_ms=s["ttft_p99_ms"],
            max_gap_p99_ms=s["max_gap_p99_ms"],
            errors=s["errors"],
        )
    while True:
        rate = next_rate(passed, bisections, settings)
        if rate is None or rate in passed:
            break
        if time.perf_counter() - started > settings.max_total_s:
            log("search_stopped", reason="max_total_s", max_total_s=settings.max_total_s, next_rate=rate)
            break
        best, worst = bracket(passed)
        if best is not None and worst is not None:
            bisections += 1
        trial_limits = dataclasses.replace(limits, num_requests=trial_requests(rate, settings))
        attempt = 0
        while True:
            results, wall = await trial(rate, trial_limits)
            entry = record(rate, results, wall) | {"attempt": attempt}
            trials.append(entry)
            summary = entry["summary"]
            overload = not entry["passed"] and is_overload(summary, rate, settings)
            retry = (
                not entry["passed"]
                and not overload
                and attempt < settings.retries_on_failure
                and time.perf_counter() - started <= settings.max_total_s
            )
            entry["counted"] = not retry
            if overload:
                entry["overload"] = True
            log(
                "trial",
                rate=rate,
                attempt=attempt,
                passed=entry["passed"],
                counted=entry["counted"],
                overload=overload,
                ttft_p99_ms=summary["ttft_p99_ms"],
                max_gap_p99_ms=summary["max_gap_p99_ms"],
                errors=summary["errors"],
                achieved_rps=summary["achieved_rps"],
            )
            if on_trial:
                on_trial(rate, summary)
            if not retry:
                break
            attempt += 1
        passed[rate] = entry["passed"]
    best, worst = bracket(passed)
    best_trial = next((t for t in trials if t["rate_rps"] == best and t["counted"]), None)
    return {
        "slo_ttft_ms": settings.slo_ttft_ms,
        "slo_tpot_ms": settings.slo_tpot_ms,
        "max_rate_rps": best,
        "at_max": best_trial["summary"] if best_trial else None,
        "first_failing_rps": worst,
        "warmup": warmup,
        "retried_rates": sorted({t["rate_rps"] for t in trials if not t["counted"]}),
        "trials": trials,
        "settings": dataclasses.asdict(settings),
    }


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------

COLUMNS = (
    ("label", 22),
    ("mode", 6),
    ("level", 8),
    ("ok", 5),
    ("err", 4),
    ("rps", 7),
    ("tok/s", 8),
    ("ttft50", 7),
    ("ttft90", 7),
    ("ttft99", 7),
    ("tpot50", 7),
    ("tpot99", 7),
    ("e2e50", 8),
    ("e2e99", 8),
    ("gap99", 7),
)


def table_row(label: str, mode: str, level: float | int, s: dict[str, Any]) -> str:
    def f(v: Any, nd: int = 1) -> str:
        return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)

    cells = [
        label,
        mode,
        f(level, 2) if isinstance(level, float) else str(level),
        str(s["ok"]),
        str(s["errors"]),
        f(s["achieved_rps"], 2),
        f(s["output_tokens_per_s"]),
        f(s["ttft_p50_ms"]),
        f(s["ttft_p90_ms"]),
        f(s["ttft_p99_ms"]),
        f(s["tpot_p50_ms"], 2),
        f(s["tpot_p99_ms"], 2),
        f(s["e2e_p50_ms"]),
        f(s["e2e_p99_ms"]),
        f(s["max_gap_p99_ms"]),
    ]
    return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, COLUMNS, strict=True)))


def table_header() -> str:
    head = "  ".join(n.rjust(w) if i else n.ljust(w) for i, (n, w) in enumerate(COLUMNS))
    return head + "\n" + "-" * len(head) + "   (latencies in ms; rps achieved)"


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


async def first_model(session: aiohttp.ClientSession, target: Target) -> str:
    async with session.get(target.base_url + "/v1/models", headers=target.headers()) as resp:
        if resp.status != 200:
            raise RuntimeError(
                f"GET /v1/models answered {resp.status}: {(await resp.text())[:200]}; "
                "pass --model NAME (and --api-key if the server wants one)"
            )
        data = await resp.json()
        return str(data["data"][0]["id"])


async def prepare(args: argparse.Namespace, session: aiohttp.ClientSession) -> tuple[Target, Workload]:
    """Resolve the model, reach the tokenizer if the server has one, build the workload."""
    base = check_loopback(args.url)
    key = args.api_key or os.environ.get("FLASHMODEL_API_KEY") or None
    target = Target(base, args.model or "", key)
    if not args.model:
        target = dataclasses.replace(target, model=await first_model(session, target))
    tok: TokenizerClient | None = None
    if not args.no_tokenize:
        server_tok = ServerTokenizer(session, target)
        try:
            await server_tok.encode("probe")
            tok = server_tok
        except (RuntimeError, aiohttp.ClientError, KeyError) as e:
            log(
                "tokenizer_unavailable",
                url=base,
                reason=str(e)[:120].replace(" ", "_"),
                fallback="one_word_per_token",
            )
    workload = await build_workload(
        tok,
        count=args.num_prompts,
        mean_tokens=args.mean_input_tokens,
        spread=args.spread,
        variant=args.variant,
        seed=args.seed,
        api=args.api,
        prompt_format=args.prompt_format,
        max_tokens=args.max_tokens,
        output_tokens=_output_range(args.output_tokens),
        ignore_eos=not args.no_ignore_eos,
        cache_salt=not args.no_cache_salt,
        json_via=args.json_via,
        token_ids=not args.no_token_ids,
    )
    log("workload", **{k: v for k, v in workload.describe().items() if v is not None})
    return target, workload


def _output_range(text: str) -> tuple[int, int] | None:
    """--output-tokens LO,HI as a range, '' as None (every request has --max-tokens)."""
    if not text:
        return None
    lo, _, hi = text.partition(",")
    try:
        return int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"--output-tokens must be LO,HI (token counts), got {text!r}") from None


def _levels(text: str, kind: type[float] | type[int]) -> list[Any]:
    return [kind(x) for x in text.split(",") if x.strip()]


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    fds = raise_fd_limit()
    limits = RunLimits(
        num_requests=args.num_requests,
        max_duration_s=args.max_duration,
        request_timeout_s=args.request_timeout,
        max_in_flight=args.max_in_flight,
    )
    if limits.max_in_flight + 64 > fds:
        raise ValueError(
            f"--max-in-flight {limits.max_in_flight} needs more open files than the "
            f"limit {fds}; raise `ulimit -n` or lower --max-in-flight"
        )
    out: dict[str, Any] = {
        "tool": "flashmodel-loadgen",
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "args": vars(args) | {"api_key": "***" if args.api_key else None},
        "runs": [],
    }
    async with new_session(limits.max_in_flight) as session:
        target, workload = await prepare(args, session)
        out["server"] = {"url": target.base_url, "model": target.model}
        out["workload"] = workload.describe()
        print(table_header())
        if args.command == "run":
            for rate in _levels(args.rate, float):
                res, wall = await run_open_loop(session, target, workload, rate, limits, args.seed)
                s = summarize(res, wall)
                print(table_row(args.label, "rate", rate, s), flush=True)
                out["runs"].append(
                    {
                        "mode": "rate",
                        "level": rate,
                        "summary": s,
                        "requests": [dataclasses.asdict(r) | {"tpot_s": r.tpot_s} for r in res],
                    }
                )
        elif args.command == "sweep":
            for c in _levels(args.concurrency, int):
                res, wall = await run_closed_loop(session, target, workload, c, limits)
                s = summarize(res, wall)
                print(table_row(args.label, "conc", c, s), flush=True)
                out["runs"].append(
                    {
                        "mode": "conc",
                        "level": c,
                        "summary": s,
                        "requests": [dataclasses.asdict(r) | {"tpot_s": r.tpot_s} for r in res],
                    }
                )
        else:
            settings = SearchSettings(
                slo_ttft_ms=args.slo_ttft_ms,
                slo_tpot_ms=args.slo_tpot_ms,
                rate_start=args.rate_start,
                rate_max=args.rate_max,
                bisect_steps=args.bisect_steps,
                trial_seconds=args.trial_seconds,
                max_total_s=args.max_duration,
                warmup=not args.no_warmup,
                retries_on_failure=args.retries,
            )
            result = await search_max_rate(
                session,
                target,
                workload,
                settings,
                limits,
                args.seed,
                on_trial=lambda r, s: print(table_row(args.label, "rate", r, s), flush=True),
            )
            out["search"] = result
            print(
                f"max rate with TTFT p99 <= {args.slo_ttft_ms:g} ms"
                + (f" and TPOT p99 <= {args.slo_tpot_ms:g} ms: " if args.slo_tpot_ms else ": ")
                + f"{result['max_rate_rps'] if result['max_rate_rps'] is not None else 'none'} req/s"
                f" (first failing: {result['first_failing_rps']})"
            )
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loadgen",
        description=__doc__.split("\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default="http://127.0.0.1:8000", help="server base URL (loopback only)")
    common.add_argument("--model", default="", help="model name; default: the first of /v1/models")
    common.add_argument("--api-key", default="", help="bearer token; default: $FLASHMODEL_API_KEY")
    common.add_argument("--api", choices=["completions", "chat"], default="completions")
    common.add_argument("--variant", choices=["plain", "shared-prefix", "json"], default="plain")
    common.add_argument(
        "--prompt-format",
        choices=["text", "ids"],
        default="text",
        help="send prompts as text or as token ids (completions API only)",
    )
    common.add_argument("--num-prompts", type=int, default=128)
    common.add_argument("--mean-input-tokens", type=int, default=217)
    common.add_argument("--spread", type=int, default=96, help="prompt lengths are mean +- spread")
    common.add_argument("--max-tokens", type=int, default=48)
    common.add_argument(
        "--output-tokens",
        default="",
        help="LO,HI: each request's output length uniform in [LO, HI] (the field workload: 30,64); "
        "default: every request --max-tokens",
    )
    common.add_argument(
        "--json-via",
        choices=["schema", "regex", "response_format"],
        default="schema",
        help="json variant: vLLM structured_outputs with the JSON schema or with a compact-JSON regex "
        "(for random-weight models), or OpenAI's response_format",
    )
    common.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask for vLLM's return_token_ids (count tokens by text chunks)",
    )
    common.add_argument("--no-ignore-eos", action="store_true", help="for servers without ignore_eos")
    common.add_argument(
        "--no-cache-salt",
        action="store_true",
        help="do not send vLLM's cache_salt (for servers that reject unknown fields)",
    )
    common.add_argument(
        "--no-tokenize",
        action="store_true",
        help="do not calibrate prompt lengths with the server's /tokenize",
    )
    common.add_argument("--num-requests", type=int, default=128, help="per run (run, sweep)")
    common.add_argument(
        "--max-duration",
        type=float,
        default=120.0,
        help="seconds, per run (search: for all its trials together)",
    )
    common.add_argument("--request-timeout", type=float, default=60.0, help="seconds, per request")
    common.add_argument("--max-in-flight", type=int, default=512)
    common.add_argument("--seed", type=int, default=0)
    common.add_argument("--label", default="vllm")
    common.add_argument("--json-out", default="", help="write every request and summary here")
    r = sub.add_parser("run", parents=[common], help="open loop: Poisson arrivals at --rate")
    r.add_argument("--rate", default="4", help="requests/s; a comma list runs each")
    s = sub.add_parser("sweep", parents=[common], help="closed loop: fixed concurrency levels")
    s.add_argument("--concurrency", default="1,8,32")
    q = sub.add_parser("search", parents=[common], help="max Poisson rate with TTFT p99 within the SLO")
    q.add_argument("--slo-ttft-ms", type=float, default=300.0)
    q.add_argument("--slo-tpot-ms", type=float, default=50.0, help="TPOT p99 limit (goodput); 0: TTFT alone")
    q.add_argument("--rate-start", type=float, default=4.0)
    q.add_argument("--rate-max", type=float, default=256.0)
    q.add_argument("--bisect-steps", type=int, default=2)
    q.add_argument("--trial-seconds", type=float, default=6.0)
    q.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the unrecorded pass at --rate-start before the first trial (cold-start costs "
        "such as JIT compilation then land in the first trial)",
    )
    q.add_argument("--retries", type=int, default=1, help="runs of a failing rate before it counts as failed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        out = run_async(main_async(args))
    except (ValueError, RuntimeError, aiohttp.ClientError) as e:
        log("failed", error=type(e).__name__, message=str(e).replace("\n", " "))
        print(f"loadgen: {e}", file=sys.stderr)
        return 2
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(out, f, indent=1)
        log("wrote", path=args.json_out)
    runs = out.get("runs", [])
    failed = any(r["summary"]["ok"] == 0 for r in runs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
