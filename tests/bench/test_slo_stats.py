"""The load generator's pure parts: percentiles, the Poisson schedule, prompt lengths, the SLO search."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Sequence
from typing import Any

import pytest

from bench.slo import loadgen
from bench.slo.loadgen import RequestResult, SearchSettings, Workload


def test_percentile_interpolates_between_ranks() -> None:
    values = [float(v) for v in range(1, 11)]  # 1..10, shuffled order must not matter
    shuffled = values[::-1]
    assert loadgen.percentile(shuffled, 50) == pytest.approx(5.5)
    assert loadgen.percentile(shuffled, 90) == pytest.approx(9.1)
    assert loadgen.percentile(shuffled, 99) == pytest.approx(9.91)
    assert loadgen.percentile(shuffled, 0) == 1.0
    assert loadgen.percentile(shuffled, 100) == 10.0


def test_percentile_edge_cases() -> None:
    assert loadgen.percentile([], 99) is None
    assert loadgen.percentile([0.25], 99) == 0.25
    with pytest.raises(ValueError, match=r"0\.\.100"):
        loadgen.percentile([1.0], 101)


def test_poisson_schedule_is_seeded_and_has_the_right_rate() -> None:
    a = loadgen.poisson_schedule(8.0, 20000, seed=7)
    assert a == loadgen.poisson_schedule(8.0, 20000, seed=7)
    assert a != loadgen.poisson_schedule(8.0, 20000, seed=8)
    assert a[0] == 0.0
    gaps = [b - x for x, b in itertools.pairwise(a)]
    assert all(g >= 0 for g in gaps)
    # Exponential gaps: mean 1/rate, and P(gap < mean) = 1 - 1/e.
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.03)
    short = sum(1 for g in gaps if g < 1 / 8.0) / len(gaps)
    assert short == pytest.approx(1 - math.exp(-1), abs=0.015)
    # Not a fixed-interval schedule in disguise.
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8.0, rel=0.05)


def test_poisson_schedule_rejects_a_zero_rate() -> None:
    with pytest.raises(ValueError, match="rate must be > 0"):
        loadgen.poisson_schedule(0.0, 3, seed=0)


def test_prompt_lengths_hit_the_mean_exactly_with_a_spread() -> None:
    lengths = loadgen.prompt_lengths(128, 217, 96, seed=0)
    assert len(lengths) == 128
    assert sum(lengths) == 128 * 217
    assert min(lengths) >= 121 and max(lengths) <= 313
    assert statistics.pstdev(lengths) > 30  # a spread, not one length
    assert lengths == loadgen.prompt_lengths(128, 217, 96, seed=0)
    assert lengths != loadgen.prompt_lengths(128, 217, 96, seed=1)


def _result(i: int, ttft: float, e2e: float, tokens: int = 48, ok: bool = True) -> RequestResult:
    return RequestResult(
        index=i,
        prompt_tokens=200,
        scheduled_s=0.0,
        sent_s=0.0,
        ok=ok,
        error=None if ok else "http_503: busy",
        ttft_s=ttft if ok else None,
        e2e_s=e2e if ok else None,
        output_tokens=tokens if ok else 0,
    )


def test_summarize_computes_ttft_tpot_e2e_and_errors() -> None:
    # TTFT 10..100 ms; decode 47 tokens in 0.47 s after it: TPOT exactly 10 ms.
    results = [_result(i, 0.01 * (i + 1), 0.01 * (i + 1) + 0.47) for i in range(10)]
    results.append(_result(10, 0, 0, ok=False))
    s = loadgen.summarize(results, wall_s=2.0)
    assert s["requests"] == 11 and s["ok"] == 10 and s["errors"] == 1
    assert s["error_kinds"] == {"http_503": 1}
    assert s["ttft_p50_ms"] == pytest.approx(55.0)
    assert s["ttft_p99_ms"] == pytest.approx(99.1)
    assert s["tpot_p50_ms"] == pytest.approx(10.0)
    assert s["tpot_p99_ms"] == pytest.approx(10.0)
    assert s["e2e_p50_ms"] == pytest.approx(525.0)
    assert s["achieved_rps"] == pytest.approx(5.0)
    assert s["output_tokens_per_s"] == pytest.approx(240.0)


def test_tpot_needs_two_tokens() -> None:
    assert _result(0, 0.1, 0.2, tokens=1).tpot_s is None
    assert _result(0, 0.1, 0.2, tokens=3).tpot_s == pytest.approx(0.05)


def test_meets_slo_requires_no_errors_and_p99_within() -> None:
    good = loadgen.summarize([_result(i, 0.1, 0.5) for i in range(5)], 1.0)
    assert loadgen.meets_slo(good, 300)
    assert not loadgen.meets_slo(good, 50)
    failed = loadgen.summarize([_result(0, 0.1, 0.5), _result(1, 0, 0, ok=False)], 1.0)
    assert not loadgen.meets_slo(failed, 300)
    assert not loadgen.meets_slo(loadgen.summarize([], 1.0), 300)


def _simulate(capacity: float, s: SearchSettings) -> tuple[float | None, list[float]]:
    """Run the search's decision function against a server that passes up to `capacity`."""
    passed: dict[float, bool] = {}
    tried: list[float] = []
    bisections = 0
    while (rate := loadgen.next_rate(passed, bisections, s)) is not None and rate not in passed:
        best, worst = loadgen.bracket(passed)
        if best is not None and worst is not None:
            bisections += 1
        tried.append(rate)
        passed[rate] = rate <= capacity
    return loadgen.bracket(passed)[0], tried


def test_search_doubles_then_bisects() -> None:
    s = SearchSettings(rate_start=4, rate_max=256, bisect_steps=3)
    best, tried = _simulate(37.0, s)
    assert tried == [4, 8, 16, 32, 64, 48, 40, 36]
    assert best == 36


def test_search_halves_when_the_first_rate_fails_and_stops_at_bounds() -> None:
    best, tried = _simulate(0.6, SearchSettings(rate_start=4, rate_min=0.25, bisect_steps=1))
    assert tried[:4] == [4, 2, 1, 0.5]
    assert best is not None and 0.5 <= best <= 0.6
    best, tried = _simulate(0.1, SearchSettings(rate_start=4, rate_min=0.25))
    assert best is None and min(tried) >= 0.25
    best, tried = _simulate(1e9, SearchSettings(rate_start=4, rate_max=100))
    assert best == 100 and tried[-1] == 100


def test_trial_size_is_bounded() -> None:
    s = SearchSettings(trial_seconds=6, trial_min_requests=32, trial_max_requests=512)
    assert loadgen.trial_requests(1, s) == 32
    assert loadgen.trial_requests(20, s) == 120
    assert loadgen.trial_requests(1000, s) == 512


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://localhost:8081/", "http://[::1]:8000/v1", "http://127.8.9.10:1"]
)
def test_loopback_targets_are_accepted(url: str) -> None:
    base = loadgen.check_loopback(url)
    assert not base.endswith("/") and not base.endswith("/v1")


@pytest.mark.parametrize(
    "url",
    ["http://10.0.0.5:8000", "http://example.com:8000", "http://0.0.0.0:8000", "ftp://127.0.0.1/", "127.0.0.1:8000"],
)
def test_other_targets_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        loadgen.check_loopback(url)


def _body(**kw: Any) -> dict[str, Any]:
    target = loadgen.Target("http://127.0.0.1:8000", "m", "k")
    prompt = loadgen.Prompt("a b c", (1, 2, 3), 3)
    wl = Workload([prompt], **kw)
    path, body = loadgen.request_body(target, wl, prompt, "salt-0")
    body["_path"] = path
    return body


def test_request_body_is_greedy_streaming_fixed_length() -> None:
    b = _body()
    assert b["_path"] == "/v1/completions"
    assert b["temperature"] == 0.0 and b["stream"] is True and b["ignore_eos"] is True
    assert b["max_tokens"] == 48 and b["prompt"] == "a b c" and b["cache_salt"] == "salt-0"
    assert b["stream_options"] == {"include_usage": True}
    assert b["return_token_ids"] is True
    assert _body(prompt_format="ids")["prompt"] == [1, 2, 3]


def test_request_body_json_variant_uses_guided_decoding() -> None:
    c = _body(variant="json")
    assert c["structured_outputs"] == {"json": loadgen.TICKET_SCHEMA}
    assert "ignore_eos" not in c  # the grammar must be able to end the object
    chat = _body(variant="json", api="chat")
    assert chat["_path"] == "/v1/chat/completions"
    assert chat["messages"] == [{"role": "user", "content": "a b c"}]
    assert chat["structured_outputs"]["json"] == loadgen.TICKET_SCHEMA
    portable = _body(variant="json", api="chat", json_via="response_format")
    assert portable["response_format"]["json_schema"]["schema"] == loadgen.TICKET_SCHEMA
    assert "structured_outputs" not in portable
    assert _body(variant="json", json_via="regex")["structured_outputs"] == {"regex": loadgen.TICKET_REGEX}


def test_ticket_regex_accepts_exactly_schema_valid_compact_json() -> None:
    import re

    good = '{"ticket":"gas leak","severity":"high","action":"fix the pipe"}'
    assert re.fullmatch(loadgen.TICKET_REGEX, good)
    d = json.loads(good)
    assert set(d) == set(loadgen.TICKET_SCHEMA["required"])
    assert d["severity"] in loadgen.TICKET_SCHEMA["properties"]["severity"]["enum"]
    assert not re.fullmatch(loadgen.TICKET_REGEX, good.replace("high", "urgent"))
    assert not re.fullmatch(loadgen.TICKET_REGEX, good.replace(",", ", ", 1))


def test_chunk_tokens_counts_empty_text_tokens_but_not_the_role_chunk() -> None:
    assert loadgen.chunk_tokens({"choices": [{"text": "", "token_ids": [196]}]}, "completions") == ("", 1)
    assert loadgen.chunk_tokens({"choices": [{"text": " ab", "token_ids": [5, 6]}]}, "completions") == (" ab", 2)
    assert loadgen.chunk_tokens({"choices": [{"text": " ab"}]}, "completions") == (" ab", 1)
    role = {"choices": [{"delta": {"role": "assistant", "content": ""}}]}
    assert loadgen.chunk_tokens(role, "chat") == ("", 0)
    assert loadgen.chunk_tokens({"choices": [{"delta": {"content": "x"}, "token_ids": [1]}]}, "chat") == ("x", 1)
    assert loadgen.chunk_tokens({"choices": [], "usage": {"completion_tokens": 48}}, "completions") == ("", 0)


class WordTokenizer:
    """An in-process word tokenizer with an unknown-word id, like the test models' tokenizer."""

    def __init__(self, vocab: list[str]) -> None:
        self.ids = {w: i for i, w in enumerate(vocab)}
        self.words = vocab

    async def encode(self, text: str) -> list[int]:
        return [self.ids.get(w, 0) for w in text.split()]

    async def decode(self, ids: Sequence[int]) -> str:
        return "".join(" " + self.words[i] for i in ids)


async def test_workload_prompts_have_their_planned_lengths_and_round_trip() -> None:
    tok = WordTokenizer(["a", *loadgen.WORDS[:40]])  # most words map to the unknown id 0
    wl = await loadgen.build_workload(tok, count=32, mean_tokens=217, spread=96, seed=3)
    assert wl.calibrated
    planned = loadgen.prompt_lengths(32, 217, 96, seed=3)
    assert [p.tokens for p in wl.prompts] == planned
    for p in wl.prompts:
        assert p.token_ids is not None
        assert await tok.encode(p.text) == list(p.token_ids)
        assert await tok.decode(p.token_ids) == p.text


async def test_shared_prefix_variant_starts_every_prompt_with_the_template() -> None:
    tok = WordTokenizer(["a", *loadgen.WORDS])
    wl = await loadgen.build_workload(tok, count=16, variant="shared-prefix", seed=1)
    n = wl.shared_prefix_tokens
    assert n == len(loadgen.TEMPLATE.split()) and n > 50
    heads = {p.token_ids[:n] for p in wl.prompts if p.token_ids}
    assert len(heads) == 1
    assert len({p.token_ids for p in wl.prompts}) == 16  # the rest differs
