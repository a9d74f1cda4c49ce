"""Prewarm: N warm-up requests (plain, through the chat template, near the context budget) with TTFT."""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

BUILTIN_PROMPTS = (
    "Inspection ticket 4711: the pump on line 3 vibrates above its limit. Summarise the ticket.",
    "Write one short sentence that thanks a customer for reporting a delayed delivery.",
    "Approve or reject: a purchase request for two spare valves, within budget.",
)
# A unit of text repeated to build the near-budget prompt; its token count is measured, not assumed.
FILLER = " the valve on line three was inspected and found within limits"
# Tokens left free below the budget: detokenisation and the server's own accounting may differ by a few.
BUDGET_MARGIN = 8
# Requests sent at once before the last (warm) one, at most (and at most maxNumSeqs). One-at-a-time
# warm-up never runs a batch of several sequences, and in --enforce-eager mode each new kernel
# variant is compiled when first met, stalling every stream in flight for most of a second at the
# first concurrent load, and, after a prewarm batch of only 4, once more at the first load of
# ~20 sequences (docs/benchmarks/slo.md, "Prewarm's batch and the first-use compiles"). Triton
# compiles a variant per integer specialisation (an argument equal to 1, divisible by 16, or
# neither) and vLLM switches decode kernels above a batch size, so the batch's answers have
# staggered lengths: the number of live sequences steps down from the batch size through many
# counts, large and small.
MAX_BATCH_REQUESTS = 96


@dataclass(frozen=True)
class PrewarmResult:
    """What one prewarm run did (the JSON of `POST /prewarm`)."""

    ok: bool
    requests: int
    cold_ttft_ms: float
    warm_ttft_ms: float
    duration_seconds: float
    error: str | None
    completion_tokens: int = 0
    batched: int = 0
    """Requests sent at once (one batch) besides the `requests` sent one after the other."""

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "requests": self.requests, "batchedRequests": self.batched,
                "coldTTFTMs": round(self.cold_ttft_ms, 3), "warmTTFTMs": round(self.warm_ttft_ms, 3),
                "durationSeconds": round(self.duration_seconds, 3), "error": self.error}


@dataclass(frozen=True)
class Timed:
    """One streamed request: time to first token, tokens generated."""

    ttft_seconds: float
    completion_tokens: int


class EngineRequestError(RuntimeError):
    """vLLM answered a request with an error status or an unusable stream."""


async def stream_request(session: aiohttp.ClientSession, base_url: str, payload: dict[str, Any],
                         headers: dict[str, str] | None = None, chat: bool = False) -> Timed:
    """Send one streaming request; return when it finished, with the time to its first token."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {**payload, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft: float | None = None
    tokens = 0
    async with session.post(base_url + path, json=body, headers=headers) as resp:
        if resp.status != 200:
            raise EngineRequestError(f"{path} answered {resp.status}: {(await resp.text())[:300]}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[5:])
            for choice in chunk.get("choices") or []:
                text = choice.get("text") if not chat else (choice.get("delta") or {}).get("content")
                if text and ttft is None:
                    ttft = time.perf_counter() - start
            usage = chunk.get("usage")
            if usage:
                tokens = int(usage.get("completion_tokens") or 0)
    if ttft is None:
        if tokens == 0:
            raise EngineRequestError(f"{path} streamed no token")
        ttft = time.perf_counter() - start  # tokens that decode to nothing still count as generated
    return Timed(ttft_seconds=ttft, completion_tokens=tokens)


async def count_tokens(session: aiohttp.ClientSession, base_url: str, model: str, prompt: str | None = None,
                       messages: list[dict[str, str]] | None = None,
                       headers: dict[str, str] | None = None) -> int:
    """Token count through vLLM's own /tokenize, so the tokenizer is the one serving."""
    body: dict[str, Any] = {"model": model}
    if messages is not None:
        body.update(messages=messages, add_generation_prompt=True)
    else:
        body["prompt"] = prompt
    async with session.post(base_url + "/tokenize", json=body, headers=headers) as resp:
        if resp.status != 200:
            raise EngineRequestError(f"/tokenize answered {resp.status}: {(await resp.text())[:300]}")
        return int((await resp.json())["count"])


async def near_budget_prompt(session: aiohttp.ClientSession, base_url: str, model: str, budget: int,
                             headers: dict[str, str] | None = None) -> str:
    """The longest repetition of FILLER whose token count stays within `budget`."""
    per_unit = max(1, await count_tokens(session, base_url, model, prompt=FILLER * 8, headers=headers) // 8)
    units = max(1, budget // per_unit)
    prompt = FILLER * units
    while units > 1 and await count_tokens(session, base_url, model, prompt=prompt, headers=headers) > budget:
        units = max(1, units - max(1, units // 20))
        prompt = FILLER * units
    return prompt


def plan(prompts: list[str], requests: int, near_budget: str | None) -> list[tuple[str, bool]]:
    """(prompt, through chat template) for each request: first and last the same prompt (cold, warm)."""
    base = prompts or list(BUILTIN_PROMPTS)
    if requests == 1:
        return [(base[0], False)]
    middle: list[tuple[str, bool]] = [(base[0], True)]
    if near_budget is not None:
        middle.append((near_budget, False))
    middle += [(p, i % 2 == 1) for i, p in enumerate(base[1:] or base)]
    while len(middle) < requests - 2:
        middle += middle
    return [(base[0], False), *middle[: requests - 2], (base[0], False)]


async def run_prewarm(base_url: str, model: str, *, requests: int, prompts: list[str], max_tokens: int,
                      timeout_seconds: float, max_model_len: int,
                      headers: dict[str, str] | None = None, batch: int = MAX_BATCH_REQUESTS) -> PrewarmResult:
    """Run the warm-up against vLLM's OpenAI server; never raises, the result says what failed.

    The plan's requests go one after the other; before the last (the warm measurement), `batch`
    plain requests go at once, answers of 1..max_tokens tokens, so that batches of many sizes ran too.
    """
    start = time.perf_counter()
    ttfts: list[float] = []
    tokens = 0
    done = 0
    batched = 0

    async def body(session: aiohttp.ClientSession) -> None:
        nonlocal tokens, done
        near: str | None = None
        if requests >= 4:
            overhead = await count_tokens(session, base_url, model, headers=headers,
                                          messages=[{"role": "user", "content": ""}])
            budget = max_model_len - max_tokens - overhead - BUDGET_MARGIN
            near = await near_budget_prompt(session, base_url, model, budget, headers)
        nonlocal batched
        steps = plan(prompts, requests, near)
        for i, (prompt, chat) in enumerate(steps):
            if i == len(steps) - 1 and len(steps) > 1 and batch > 1:
                base = prompts or list(BUILTIN_PROMPTS)
                # ignore_eos: each answer runs to its own length, so the batch shrinks step by step.
                together = [{"model": model, "max_tokens": 1 + k % max_tokens, "ignore_eos": True, "temperature": 0,
                             "prompt": base[k % len(base)]} for k in range(batch)]
                results = await asyncio.gather(*(stream_request(session, base_url, p, headers) for p in together))
                tokens += sum(r.completion_tokens for r in results)
                batched = len(results)
            payload: dict[str, Any] = {"model": model, "max_tokens": max_tokens, "temperature": 0}
            if chat:
                payload["messages"] = [{"role": "user", "content": prompt}]
            else:
                payload["prompt"] = prompt
            timed = await stream_request(session, base_url, payload, headers, chat=chat)
            ttfts.append(timed.ttft_seconds)
            tokens += timed.completion_tokens
            done += 1

    error: str | None = None
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_seconds)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await asyncio.wait_for(body(session), timeout_seconds)
    except TimeoutError:
        error = f"prewarm did not finish within timeoutSeconds={timeout_seconds} ({done}/{requests} done)"
    except (aiohttp.ClientError, EngineRequestError, ValueError, KeyError) as e:
        error = f"prewarm request {done + 1}/{requests} failed: {type(e).__name__}: {e}"
    cold = ttfts[0] * 1000 if ttfts else 0.0
    warm = ttfts[-1] * 1000 if len(ttfts) > 1 else cold
    return PrewarmResult(ok=error is None and done == requests, requests=done, cold_ttft_ms=cold,
                         warm_ttft_ms=warm, duration_seconds=time.perf_counter() - start, error=error,
                         completion_tokens=tokens, batched=batched)


def median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1000 if values else 0.0
