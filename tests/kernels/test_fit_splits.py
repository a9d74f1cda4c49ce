"""bench/kernels/fit_splits.py reads a sweep, scores a rule on measured times only, and never interpolates."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "kernels"))
import fit_splits


def report(sweep: dict[int, float], triton_us: float = 10.0) -> dict[str, Any]:
    """One 1.5B decode shape (batch 1, context 512, 132 SMs; the rule in use picks 2 splits)."""
    return {
        "device": "test",
        "multiprocessors": 132,
        "copy_bandwidth_Bps": 4e12,
        "decode": [
            {
                "model": "qwen2.5-1.5b",
                "batch": 1,
                "context": 512,
                "q_heads": 12,
                "kv_heads": 2,
                "head_dim": 128,
                "bytes": 530432,
                "num_splits": 2,
                "plan": {"block_q": 2, "block_n": 64, "num_splits": 2},
                "us": {"tile": sweep.get(2, 99.0), "vllm_triton": triton_us, "fa3": 11.0},
                "tile_sweep": [{"splits": s, "block_n": 64, "us": us, "tier": 1} for s, us in sweep.items()],
            }
        ],
    }


def evaluate(data: dict[str, Any], rule: dict[str, Any] | None = None) -> fit_splits.Evaluation:
    return fit_splits.evaluate(data, "test", lambda shape: fit_splits.plan(shape, rule))


def test_rule_in_use_is_scored_at_its_own_pick() -> None:
    ev = evaluate(report({1: 14.0, 2: 12.0, 8: 8.0}))
    (line,) = ev.lines
    assert line.config == (2, 64) and line.tile_us == 12.0
    assert ev.slower_than_triton == 1 and ev.unmeasured == 0
    assert line.best == ((8, 64), 8.0)


def test_candidate_rule_picks_a_measured_faster_split() -> None:
    rule = fit_splits.parse_rule("min_tokens_per_split=64,programs_per_sm=4")
    ev = evaluate(report({1: 14.0, 2: 12.0, 8: 8.0}), rule)
    assert ev.lines[0].config == (8, 64) and ev.lines[0].tile_us == 8.0
    assert ev.slower_than_triton == 0


def test_unmeasured_pick_is_reported_not_interpolated() -> None:
    rule = fit_splits.parse_rule("min_tokens_per_split=128")  # picks 4 splits: not in the sweep
    ev = evaluate(report({2: 12.0, 8: 8.0}), rule)
    assert ev.lines[0].config == (4, 64) and ev.lines[0].tile_us is None
    assert ev.unmeasured == 1


def test_unknown_rule_parameter_says_which_exist() -> None:
    with pytest.raises(SystemExit, match="programs_per_sm"):
        fit_splits.parse_rule("programs_per_multiprocessor=4")


def test_table_candidate_and_emitted_best_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = report({1: 14.0, 2: 12.0, 8: 8.0})
    results = tmp_path / "bench_attention.json"
    results.write_text(json.dumps(data))
    emitted = tmp_path / "best.json"
    fit_splits.main([str(results), "--emit-table", str(emitted)])
    assert json.loads(emitted.read_text()) == {"2,512": {"splits": 8, "block_n": 64}}
    capsys.readouterr()
    fit_splits.main([str(results), "--table", str(emitted)])
    out = capsys.readouterr().out
    assert "slower_than_vllm_triton=1/1" in out  # the rule in use
    assert "slower_than_vllm_triton=0/1" in out  # the table
