"""bench/kernels/rule_from_run.py reports the rule in use only where a variant of the run timed its pick."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "kernels"))
import rule_from_run

RUN6 = Path(__file__).resolve().parents[2] / "bench/kernels/results/h200-2026-12-03-run6/bench_attention.json"


def test_every_pick_of_the_rule_in_use_was_timed_in_run_6() -> None:
    # docs/benchmarks.md's run-6 table of the rule in use is read from this run. When plan_launch
    # changes, this fails until a run times the new picks (or the docs say they are predictions).
    rows, _ = rule_from_run.table(json.loads(RUN6.read_text()), wide_tiles=True)
    assert len(rows) == 56 and all(r["variant"] for r in rows)
    lines = rule_from_run.summary(rows)
    assert "measured picks: 56 of 56 shapes" in lines
    assert any(line.endswith(": 15 of 24") for line in lines)
    assert "slower than vLLM Triton: 0 (worst triton/tile 1.08)" in lines


def test_a_pick_no_variant_ran_is_unmeasured() -> None:
    run = json.loads(RUN6.read_text())
    for row in run["decode"]:
        row["us"].pop("tile_bn128", None)
    rows, lines = rule_from_run.table(run, wide_tiles=True)
    unmeasured = [r for r in rows if r["variant"] is None]
    assert unmeasured and all(r["us"] is None and r["pick"].block_n == 128 for r in unmeasured)
    assert sum("UNMEASURED" in line for line in lines) == len(unmeasured)


def test_without_wide_tiles_the_t4_plan_keeps_64_key_tiles() -> None:
    rows, _ = rule_from_run.table(json.loads(RUN6.read_text()), wide_tiles=False)
    assert all(r["pick"].block_n <= 64 for r in rows)


RUN8 = RUN6.parents[1] / "h200-2026-12-03-run8/bench_attention.json"


def test_run_8_timed_every_pick_of_the_rule_in_use_again() -> None:
    # Run 8 recorded every plan choice per row, so its day's plan is read, not assumed; the rule
    # is the run-6 one, and each pick is its own `tile` column.
    rows, _ = rule_from_run.table(json.loads(RUN8.read_text()), wide_tiles=True)
    assert len(rows) == 56 and all(r["variant"] == "tile" for r in rows)
    lines = rule_from_run.summary(rows)
    assert any(line.endswith(": 15 of 24") for line in lines)
    assert "slower than vLLM Triton: 0 (worst triton/tile 1.01)" in lines
