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

OLD_RULE = "min_tokens_per_split=256,programs_per_sm=2,fit_block_n_to_split=false"
"""The rule before H200 run 2: it picks (2, 64) where the rule in use picks (16, 32)."""


def report(sweep: dict[tuple[int, int], float], triton_us: float = 10.0) -> dict[str, Any]:
    """One 1.5B decode shape (batch 1, context 512, 132 SMs), run at (2 splits, 64-key tiles)."""
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
                "us": {"tile": sweep.get((2, 64), 99.0), "vllm_triton": triton_us, "fa3": 11.0},
                "tile_sweep": [{"splits": s, "block_n": n, "us": us, "tier": 1} for (s, n), us in sweep.items()],
            }
        ],
    }


def evaluate(data: dict[str, Any], rule: dict[str, Any] | None = None) -> fit_splits.Evaluation:
    return fit_splits.evaluate(data, "test", lambda shape: fit_splits.plan(shape, rule))


def test_rule_in_use_is_scored_at_its_own_pick() -> None:
    ev = evaluate(report({(1, 64): 14.0, (2, 64): 12.0, (16, 32): 9.0, (8, 64): 8.0}))
    (line,) = ev.lines
    assert line.config == (16, 32) and line.tile_us == 9.0
    assert ev.slower_than_triton == 0 and ev.unmeasured == 0
    assert line.best == ((8, 64), 8.0)


def test_candidate_rule_is_scored_at_its_pick() -> None:
    data = report({(1, 64): 14.0, (2, 64): 12.0, (16, 32): 9.0, (8, 64): 8.0})
    old = evaluate(data, fit_splits.parse_rule(OLD_RULE))
    assert old.lines[0].config == (2, 64) and old.lines[0].tile_us == 12.0
    assert old.slower_than_triton == 1
    rule = fit_splits.parse_rule("min_tokens_per_split=64,programs_per_sm=4")
    ev = evaluate(data, rule)
    assert ev.lines[0].config == (8, 64) and ev.lines[0].tile_us == 8.0
    assert ev.slower_than_triton == 0


def test_unmeasured_pick_is_reported_not_interpolated() -> None:
    rule = fit_splits.parse_rule("min_tokens_per_split=128")  # picks 4 splits: not in the sweep
    ev = evaluate(report({(2, 64): 12.0, (8, 64): 8.0}), rule)
    assert ev.lines[0].config == (4, 64) and ev.lines[0].tile_us is None
    assert ev.unmeasured == 1


def test_grid_spells_out_every_policy() -> None:
    # A change of plan_launch's defaults must not change what the grid's rules pick.
    assert all("fit_block_n_to_split" in rule for rule in fit_splits.CANDIDATE_GRID)
    assert len({fit_splits.rule_name(rule) for rule in fit_splits.CANDIDATE_GRID}) == 75


def test_unknown_rule_parameter_says_which_exist() -> None:
    with pytest.raises(SystemExit, match="programs_per_sm"):
        fit_splits.parse_rule("programs_per_multiprocessor=4")


def test_table_candidate_and_emitted_best_table(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = report({(2, 64): 12.0, (16, 32): 11.0, (8, 64): 8.0})
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
