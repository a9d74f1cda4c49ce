"""The goodput benchmark's pure parts: the SLO, the field workload's lengths, the envelope, the cross-check."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.slo import goodput_gpu, loadgen


def _summary(**kw: Any) -> dict[str, Any]:
    return {"errors": 0, "ok": 10, "ttft_p99_ms": 100.0, "tpot_p99_ms": 20.0} | kw


def test_goodput_needs_ttft_and_tpot_within_their_limits() -> None:
    assert loadgen.meets_slo(_summary(), 300, 50)
    assert not loadgen.meets_slo(_summary(tpot_p99_ms=50.5), 300, 50)  # a stalling stream fails
    assert not loadgen.meets_slo(_summary(ttft_p99_ms=301.0), 300, 50)
    assert not loadgen.meets_slo(_summary(tpot_p99_ms=None), 300, 50)  # no TPOT measured: no pass
    assert not loadgen.meets_slo(_summary(errors=1), 300, 50)
    assert loadgen.meets_slo(_summary(tpot_p99_ms=500.0), 300)  # TTFT alone: the older SLO


class WordTokenizer:
    """One word, one token: enough for the workload's length arithmetic."""

    async def encode(self, text: str) -> list[int]:
        return [len(w) for w in text.split()]

    async def decode(self, ids: Any) -> str:
        return " ".join("a" * max(1, i) for i in ids)


def test_the_field_workload_spreads_output_lengths_and_sends_each_request_its_own() -> None:
    work = loadgen.run_async(goodput_gpu.field_workload(WordTokenizer(), 400, seed=3))  # type: ignore[arg-type]
    outs = [p.max_tokens for p in work.prompts]
    assert all(o is not None and 30 <= o <= 64 for o in outs)
    assert min(outs) == 30 and max(outs) == 64  # type: ignore[type-var]
    assert work.output_range() == (30, 64)
    ins = [p.tokens for p in work.prompts]
    assert min(ins) >= 138 and max(ins) <= 296
    path, body = loadgen.request_body(loadgen.Target("http://x", "m"), work, work.prompts[0], None)
    assert body["max_tokens"] == outs[0] and body["ignore_eos"] is True and path == "/v1/completions"
    # The same seed gives the same workload: the rounds of the cross-check compare like with like.
    again = loadgen.run_async(goodput_gpu.field_workload(WordTokenizer(), 400, seed=3))  # type: ignore[arg-type]
    assert [p.max_tokens for p in again.prompts] == outs


def test_the_spread_matches_vllm_bench_serve_random_range() -> None:
    # vllm/benchmarks/datasets/utils.py: floor(len * (1 - r)), ceil(len * (1 + r))
    assert goodput_gpu.spread(217, 0.36) == (138, 296)
    assert goodput_gpu.spread(47, 0.36) == (30, 64)


def test_the_benchmark_runs_the_flags_the_launcher_renders() -> None:
    cases = {c.name: c for c in goodput_gpu.plan(smoke=False)}
    t4 = cases["t4-1.5b"].args
    assert "--enforce-eager" not in t4 and t4[t4.index("--max-cudagraph-capture-size") + 1] == "4096"
    assert "--enforce-eager" in cases["eager-1.5b"].args
    assert cases["defaults-1.5b"].args == []
    assert not {"--model", "--port", "--host", "--gpu-memory-utilization"} & set(t4)
    # A candidate's flag comes after the profile's, so vLLM's parser (the last value wins) takes it.
    graphs = cases["t4-graphs256-1.5b"].args
    assert (
        graphs[: len(t4)] == t4
        and graphs[len(graphs) - 1 - graphs[::-1].index("--max-cudagraph-capture-size") + 1] == "256"
    )


def test_the_envelope_gives_every_case_the_kv_cache_a_t4_would_have(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({}))
    with (tmp_path / "model.safetensors").open("wb") as f:
        f.truncate(3 * 1024**3)
    args, plan = goodput_gpu.envelope_args(tmp_path)
    kv = int(args[args.index("--kv-cache-memory-bytes") + 1])
    assert kv == int(0.85 * 15 * 1024**3) - 3 * 1024**3 - 1024**3
    assert plan["weights_bytes"] + plan["kv_cache_bytes"] + plan["headroom_bytes"] == plan["envelope_bytes"]
    assert args[args.index("--attention-backend") + 1] == "TRITON_ATTN"  # sm_75 has no FlashAttention
    with (tmp_path / "model.safetensors").open("wb") as f:
        f.truncate(14 * 1024**3)  # a 7B model in fp16
    with pytest.raises(ValueError, match="leave no KV cache"):
        goodput_gpu.envelope_args(tmp_path)


def test_the_cross_check_compares_medians_over_rounds() -> None:
    runs = [{"concurrency": 8, "tool": "loadgen", "ttft_p50_ms": v, "tpot_p50_ms": 3.0} for v in (40.0, 44.0, 90.0)] + [
        {"concurrency": 8, "tool": "vllm-bench", "ttft_p50_ms": v, "tpot_p50_ms": 3.5} for v in (41.0, 42.0, 43.0)
    ]
    by = {v["metric"]: v for v in goodput_gpu.cross_verdict(runs)}
    assert by["ttft_p50_ms"]["loadgen"] == 44.0 and by["ttft_p50_ms"]["agree"]  # one outlier round does not decide
    assert by["tpot_p50_ms"]["ratio"] == pytest.approx(3.0 / 3.5, abs=1e-3) and not by["tpot_p50_ms"]["agree"]


def test_ratios_pair_each_t4_case_with_its_baselines() -> None:
    def r(profile: str, shape: str, rps: float, failing: float, tpot: float) -> dict[str, Any]:
        return {
            "profile": profile,
            "shape": shape,
            "goodput_rps": rps,
            "first_failing_rps": failing,
            "tpot_p50_c1_ms": tpot,
        }

    rows = {
        "t4-1.5b": r("t4", "1.5b", 128, 192, 2.0),
        "defaults-1.5b": r("defaults", "1.5b", 96, 128, 2.1),
        "eager-1.5b": r("eager", "1.5b", 16, 32, 30.0),
        "t4-mnbt1024-1.5b": r("t4-mnbt1024", "1.5b", 112, 128, 2.0),
    }
    got = {(e["case"], e["baseline"]): e for e in goodput_gpu.ratios(rows)}
    assert set(got) == {("t4-1.5b", "defaults-1.5b"), ("t4-1.5b", "eager-1.5b"), ("t4-mnbt1024-1.5b", "t4-1.5b")}
    d = got[("t4-1.5b", "defaults-1.5b")]
    assert d["ratio"] == pytest.approx(128 / 96, abs=1e-3)
    assert d["ratio_low"] == 1.0 and d["ratio_high"] == 2.0  # 128/128 and 192/96: the brackets
    assert got[("t4-1.5b", "eager-1.5b")]["ratio"] == 8.0


def test_ttft_only_maximum_counts_only_counted_trials() -> None:
    search = {
        "trials": [
            {"rate_rps": 64, "counted": True, "summary": _summary(tpot_p99_ms=80.0)},
            {"rate_rps": 128, "counted": False, "summary": _summary()},
            {"rate_rps": 128, "counted": True, "summary": _summary(ttft_p99_ms=900.0)},
        ]
    }
    assert goodput_gpu.ttft_only_max(search) == 64


def test_tpot_spans_first_to_last_token_not_the_stream_trailer() -> None:
    """vLLM's benchmark ends a request's decode at its last token; the usage chunk and [DONE] that
    follow are protocol, not decode time."""
    r = loadgen.RequestResult(
        index=0, prompt_tokens=10, scheduled_s=0.0, ok=True, ttft_s=0.1, e2e_s=0.6, output_tokens=11, last_token_s=0.5
    )
    assert r.tpot_s == pytest.approx(0.04)
    r.last_token_s = None  # a result without it (older files) falls back to the end of the stream
    assert r.tpot_s == pytest.approx(0.05)


def test_the_quantization_plan_forces_the_kernel_a_t4_runs_and_compares_with_fp16(tmp_path: Path) -> None:
    cases = {c.name: c for c in goodput_gpu.quant_plan()}
    awq = cases["awq-marlin-7b"].args
    assert awq[awq.index("--quantization") + 1] == "awq" and awq[awq.index("--linear-backend") + 1] == "marlin"
    assert "--linear-backend" not in cases["awq-machete-1.5b"].args  # what the H200 itself picks
    assert "--quantization" not in cases["fp16-7b"].args
    t4 = goodput_gpu.profile_args("t4")
    assert all(c.args[: len(t4)] == t4 for c in cases.values() if c.profile != "t4-mnbt1024")  # the t4 profile
    assert {goodput_gpu.model_dir(c) for c in cases.values()} >= {"qwen3-4b-awq", "7b-gptq", "1.5b-fp16"}
    rows = {
        n: {
            "shape": c.shape,
            "profile": c.profile,
            "checkpoint": c.checkpoint,
            "goodput_rps": 64.0,
            "first_failing_rps": 96.0,
            "tpot_p50_c1_ms": 2.0,
        }
        for n, c in cases.items()
    }
    got = {e["case"]: e["baseline"] for e in goodput_gpu.ratios(rows)}
    assert got["gptq-marlin-4b"] == "fp16-4b" and got["t4-mnbt1024-1.5b"] == "fp16-1.5b"
    assert "fp16-7b" not in got
    with (tmp_path / "model.safetensors").open("wb") as f:
        f.truncate(5 * 1024**3)  # a 7B AWQ checkpoint
    args, memory = goodput_gpu.quant_memory_args(tmp_path, 140 * 1024**3)
    assert int(args[args.index("--kv-cache-memory-bytes") + 1]) == goodput_gpu.QUANT_KV_BYTES
    assert args[args.index("--gpu-memory-utilization") + 1] == "0.08"  # (5 + 3 + 2) / 140, rounded up
    assert memory["fits_t4_envelope"]
    with (tmp_path / "model.safetensors").open("wb") as f:
        f.truncate(14 * 1024**3)  # the 7B in fp16
    assert not goodput_gpu.quant_memory_args(tmp_path, 140 * 1024**3)[1]["fits_t4_envelope"]


def test_a_third_bisection_halves_the_goodput_bracket(tmp_path: Path) -> None:
    from bench.slo import slo_gpu

    env = slo_gpu.Env(out=tmp_path, work=tmp_path, models=tmp_path, python="python3", smoke=False)
    env.deadline = 10**9
    case = goodput_gpu.plan(smoke=False)[0]
    seen = {64.0: True, 128.0: True, 256.0: True, 512.0: False, 384.0: False, 320.0: False}
    # After two bisections (384, 320; the default) the search stops at 256 passing and 320
    # failing: a bracket of 1.25x. A third tries 288.
    assert loadgen.next_rate(seen, 2, goodput_gpu.search_settings(case, env, 90.0)) is None
    env.bisect_steps = 3
    finer = goodput_gpu.search_settings(case, env, 90.0)
    assert loadgen.next_rate(seen, 2, finer) == 288.0
    assert loadgen.next_rate(seen | {288.0: True}, 3, finer) is None
