"""The GPU benchmark driver's pure parts: the roofline arithmetic, vLLM log facts, metric counters."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.slo import loadgen, slo_gpu

QWEN_1_5B: dict[str, object] = {
    "hidden_size": 1536,
    "vocab_size": 151936,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "num_hidden_layers": 28,
    "tie_word_embeddings": True,
}


def _model(tmp_path: Path, cfg: dict[str, object], weight_bytes: int) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with (tmp_path / "model.safetensors").open("wb") as f:
        f.truncate(weight_bytes)  # sparse: only the size matters
    return tmp_path


def test_roofline_counts_weights_and_kv_per_decode_step(tmp_path: Path) -> None:
    model = _model(tmp_path, QWEN_1_5B, 3_087_467_520)
    r = slo_gpu.roofline(model, 4000e9, tpot_ms=2.0, batch=1.0, context=241.0)
    kv = 2 * 28 * 2 * 128 * 2  # K and V, 28 layers, 2 KV heads of 128, fp16
    assert r["kv_bytes_per_token"] == kv == 28672
    step = 3_087_467_520 + 241 * kv
    assert r["step_bytes"] == step
    assert r["tpot_bound_ms"] == pytest.approx(step / 4000e9 * 1000, rel=1e-4)
    assert r["t4_estimate_tpot_bound_ms"] == pytest.approx(step / 320e9 * 1000, rel=1e-3)  # ~9.67 ms
    assert r["fraction_of_roofline"] == pytest.approx(r["tpot_bound_ms"] / 2.0, rel=1e-3)
    assert r["t4_fits_fp16"] is True


def test_roofline_untied_embedding_is_not_read_per_step_and_batch_adds_kv(tmp_path: Path) -> None:
    cfg: dict[str, object] = QWEN_1_5B | {
        "tie_word_embeddings": False,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    }
    weights = 15_231_233_024
    r = slo_gpu.roofline(_model(tmp_path, cfg, weights), 4000e9, None, batch=32.0, context=241.0)
    embed = 151936 * 3584 * 2
    assert r["weights_read_per_step_bytes"] == weights - embed
    assert r["step_bytes"] == weights - embed + 32 * 241 * (2 * 28 * 4 * 128 * 2)
    assert r["fraction_of_roofline"] is None
    assert r["t4_fits_fp16"] is False  # a 7B in fp16 does not fit a T4's 15 GiB at 0.85


def test_log_facts_reads_vllm_start_up_lines() -> None:
    text = "\n".join(
        [
            "(EngineCore pid=1) INFO [gpu_worker.py:1] Available KV cache memory: 112.37 GiB",
            "(EngineCore pid=1) INFO [kv_cache_utils.py:1] GPU KV cache size: 4,208,272 tokens",
            "(EngineCore pid=1) INFO Maximum concurrency for 4,096 tokens per request: 1027.41x",
            "(EngineCore pid=1) INFO [core.py:1] init engine (profile, create kv cache, warmup model) took 21.53 s",
            "(EngineCore pid=1) INFO Model loading took 2.89 GiB memory and 1.2 seconds",
        ]
    )
    facts = slo_gpu.log_facts(text)
    assert facts == {
        "kv_cache_tokens": 4208272.0,
        "kv_cache_gib": 112.37,
        "max_concurrency": 1027.41,
        "init_engine_s": 21.53,
        "model_load_gib": 2.89,
    }


def test_counter_sums_every_label_set_and_skips_comments() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits_total hits\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 120.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 30.0\n'
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 300.0\n'
    )
    assert slo_gpu.counter(text, "vllm:prefix_cache_hits") == 150.0
    assert slo_gpu.counter(text, "vllm:prefix_cache_queries") == 300.0
    assert slo_gpu.counter(text, "vllm:missing") == 0.0


def test_summary_rows_and_markdown_survive_a_failed_case() -> None:
    results = {
        "cases": {
            "ok": {
                "shape": "1.5b",
                "startup_s": 30.0,
                "search": {
                    "max_rate_rps": 64.0,
                    "first_failing_rps": 96.0,
                    "at_max": {"ttft_p99_ms": 250.0, "tpot_p50_ms": 3.1},
                    "warmup": {"rate_rps": 8.0, "summary": {"ttft_p99_ms": 1690.9}},
                    "retried_rates": [96.0, 128.0],
                },
                "first10": {"ttft_ms": [900.0, 30.0]},
                "sustained": {"seconds": 45.0, "passed": True, "summary": {"ttft_p99_ms": 270.5}},
            },
            "broken": {"shape": "7b", "error": "server did not come up"},
        }
    }
    rows = slo_gpu.summary_rows(results)
    assert rows[0]["max_rps_at_slo"] == 64.0 and rows[0]["first_ttft_ms"] == 900.0
    assert rows[0]["warmup_ttft_p99_ms"] == 1690.9 and rows[0]["retried_rps"] == "96,128"
    assert rows[1]["error"] == "server did not come up" and rows[1]["max_rps_at_slo"] is None
    assert rows[1]["warmup_ttft_p99_ms"] is None and rows[1]["retried_rps"] is None
    sustained = (rows[0]["sustained_s"], rows[0]["sustained_passed"], rows[0]["sustained_ttft_p99_ms"])
    assert sustained == (45.0, True, 270.5)
    assert rows[1]["sustained_passed"] is None
    table = slo_gpu.markdown(rows)
    assert table.count("\n") == 3 and "| broken | 7b |" in table


def test_the_plan_puts_the_profile_comparison_first_and_tile_only_when_asked() -> None:
    names = [c.name for c in slo_gpu.plan(smoke=False, tile=False, shim=True)]
    assert names[:2] == ["t4-1.5b", "defaults-1.5b"]
    assert "tile-1.5b" not in names and "t4-launcher-1.5b" in names
    tile = next(c for c in slo_gpu.plan(smoke=False, tile=True, shim=False) if c.name == "tile-1.5b")
    assert "CUSTOM" in tile.args and "TRITON_ATTN" not in tile.args
    t4 = next(c for c in slo_gpu.plan(smoke=False, tile=False, shim=False) if c.name == "t4-1.5b")
    assert t4.args == slo_gpu.T4_ARGS and "--enforce-eager" not in t4.args
    assert next(c for c in slo_gpu.plan(False, False, False) if c.name == "defaults-1.5b").args == []


def test_every_case_gets_empty_triton_and_vllm_caches(tmp_path: Path) -> None:
    """A case must not start with the kernels an earlier case compiled on the same machine."""
    env = slo_gpu.fresh_caches(tmp_path, "t4-1.5b")
    triton, vllm = Path(env["TRITON_CACHE_DIR"]), Path(env["VLLM_CACHE_ROOT"])
    assert triton.is_dir() and vllm.is_dir() and triton != vllm
    (triton / "kernel.cubin").write_bytes(b"x")
    again = slo_gpu.fresh_caches(tmp_path, "t4-1.5b")
    assert again == env and not any(triton.iterdir())
    other = slo_gpu.fresh_caches(tmp_path, "t4-launcher-1.5b")
    assert other["TRITON_CACHE_DIR"] != env["TRITON_CACHE_DIR"]


def test_only_the_model_class_facts_carry_over_to_later_cases(tmp_path: Path) -> None:
    first = slo_gpu.fresh_caches(tmp_path, "t4-0.5b")
    assert not any(Path(first["VLLM_CACHE_ROOT"]).iterdir())  # the first case finds nothing
    info = Path(first["VLLM_CACHE_ROOT"]) / "modelinfos" / "vllm-model_executor-models-qwen2-Qwen2ForCausalLM.json"
    info.parent.mkdir()
    info.write_text('{"modelinfo": {}}')
    (Path(first["VLLM_CACHE_ROOT"]) / "torch_compile_cache").mkdir()  # compiled code stays behind
    (Path(first["TRITON_CACHE_DIR"]) / "kernel.cubin").write_bytes(b"x")
    slo_gpu.keep_modelinfos(tmp_path, "t4-0.5b")
    later = slo_gpu.fresh_caches(tmp_path, "defaults-0.5b")
    carried = sorted(p.relative_to(later["VLLM_CACHE_ROOT"]) for p in Path(later["VLLM_CACHE_ROOT"]).rglob("*"))
    assert carried == [Path("modelinfos"), info.relative_to(first["VLLM_CACHE_ROOT"])]
    assert (Path(later["VLLM_CACHE_ROOT"]) / carried[1]).read_text() == '{"modelinfo": {}}'
    assert not any(Path(later["TRITON_CACHE_DIR"]).iterdir())


def test_longer_trials_hold_their_rate_for_their_whole_length(tmp_path: Path) -> None:
    env = slo_gpu.Env(out=tmp_path, work=tmp_path, models=tmp_path, python="python3", smoke=False)
    env.deadline = 10**9
    case = slo_gpu.plan(smoke=False, tile=False, shim=False)[0]
    default = slo_gpu.search_settings(case, env)
    assert (default.trial_seconds, default.rate_start) == (12.0, 32.0)
    # At 192 req/s a 12 s trial sends 2304 requests: the cap must not cut it back to 3 s worth.
    assert loadgen.trial_requests(192.0, default) == 2304
    env.trial_s, env.rate_start = 3.0, 8.0  # short trials, as --trial-s and --rate-start set them
    short = slo_gpu.search_settings(case, env)
    assert (short.trial_seconds, short.rate_start) == (3.0, 8.0)
    assert loadgen.trial_requests(192.0, short) == 576


def test_rate_max_caps_the_doubling_below_the_default(tmp_path: Path) -> None:
    env = slo_gpu.Env(out=tmp_path, work=tmp_path, models=tmp_path, python="python3", smoke=False)
    env.deadline = 10**9
    case = slo_gpu.plan(smoke=False, tile=False, shim=False)[0]
    assert slo_gpu.search_settings(case, env).rate_max == 512.0
    env.rate_start, env.rate_max = 96.0, 256.0
    capped = slo_gpu.search_settings(case, env)
    # From 96 the doubling goes to 192, then to the cap instead of 384 (a drain that teaches nothing).
    assert loadgen.next_rate({96.0: True}, 0, capped) == 192.0
    assert loadgen.next_rate({96.0: True, 192.0: True}, 0, capped) == 256.0
    assert loadgen.next_rate({96.0: True, 192.0: True, 256.0: True}, 0, capped) is None


def test_hold_rps_without_sustain_s_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Holding a rate for zero seconds would measure nothing and still skip the search.
    monkeypatch.setattr("sys.argv", ["slo_gpu.py", "--out", str(tmp_path), "--hold-rps", "96"])
    with pytest.raises(SystemExit) as exit_info:
        slo_gpu.main()
    assert exit_info.value.code == 2
    assert "--hold-rps holds a rate for --sustain-s seconds" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())  # refused before anything ran or was written


def test_ratios_pair_each_case_with_its_baseline_and_bracket_the_ratio() -> None:
    # A measured pair (H200): t4 passed 96 and failed 112, defaults passed 128 and failed 256.
    rows: list[dict[str, Any]] = [
        {
            "case": "t4-1.5b",
            "shape": "1.5b",
            "max_rps_at_slo": 96.0,
            "first_failing_rps": 112.0,
            "tpot_p50_ms_c1": 20.1,
        },
        {
            "case": "defaults-1.5b",
            "shape": "1.5b",
            "max_rps_at_slo": 128.0,
            "first_failing_rps": 256.0,
            "tpot_p50_ms_c1": 2.57,
        },
        {"case": "tile-1.5b", "shape": "1.5b", "max_rps_at_slo": 112.0, "first_failing_rps": None},
        {"case": "t4-7b", "shape": "7b", "max_rps_at_slo": 112.0, "first_failing_rps": 128.0},  # no baseline ran
        {"case": "defaults-0.5b", "shape": "0.5b", "max_rps_at_slo": None, "error": "server did not come up"},
        {"case": "t4-0.5b", "shape": "0.5b", "max_rps_at_slo": 112.0, "first_failing_rps": 128.0},
    ]
    found = {(e["case"], e["baseline"]): e for e in slo_gpu.ratios(rows)}
    assert set(found) == {("t4-1.5b", "defaults-1.5b"), ("tile-1.5b", "t4-1.5b")}
    t4 = found[("t4-1.5b", "defaults-1.5b")]
    assert (t4["ratio"], t4["ratio_low"], t4["ratio_high"]) == (0.75, 0.375, 0.875)
    assert t4["tpot_c1_ratio"] == 7.82
    tile = found[("tile-1.5b", "t4-1.5b")]
    assert (tile["ratio"], tile["ratio_low"], tile["ratio_high"]) == (1.167, 1.0, None)  # tile never failed
    text = slo_gpu.ratio_text(t4)
    assert text == (
        "ratio t4-1.5b / defaults-1.5b: max req/s 96 / 128 = 0.75 (between 0.375 and 0.875); TPOT p50 at c=1 7.82x"
    )
    assert "and open)" in slo_gpu.ratio_text(tile)


def test_a_hold_is_budgeted_as_start_up_plus_the_hold() -> None:
    cases = [c for c in slo_gpu.plan(False, False, False) if c.name == "t4-1.5b"]
    (held,) = slo_gpu.with_estimates(cases, hold_s=100.0, override_s=None)
    assert held.estimate_s == cases[0].estimate_s - cases[0].search_s + 100.0
    (forced,) = slo_gpu.with_estimates(cases, hold_s=100.0, override_s=150.0)
    assert forced.estimate_s == 150.0
    assert slo_gpu.with_estimates(cases, hold_s=None, override_s=None) == cases


def test_only_runs_the_named_cases_in_the_order_given() -> None:
    # The order is the priority: a run whose budget ends early keeps the pairs named first.
    cases = slo_gpu.plan(False, tile=True, shim=True)
    picked = slo_gpu.select_cases(cases, "t4-7b,defaults-7b,t4-1.5b,t4-7b")
    assert [c.name for c in picked] == ["t4-7b", "defaults-7b", "t4-1.5b"]
    assert slo_gpu.select_cases(cases, "") == cases
    with pytest.raises(ValueError, match=r"tile-1\.5b.*needs --tile"):
        slo_gpu.select_cases(slo_gpu.plan(False, tile=False, shim=True), "t4-1.5b,tile-1.5b")
