"""The decode table of the split rule in use, read from a benchmark run's side-by-side variants.

A bench run (``bench_attention.py``) times, on the same inputs, the plan of its day and that plan
with single choices turned (the other path, the other merge, 128-key tiles). When the rule in use
(``plan_launch`` now) picks a configuration that one of those variants ran, its time is a
measurement from that run, not a prediction; a pick no variant ran is reported as unmeasured.

    python bench/kernels/rule_from_run.py bench/kernels/results/h200-2026-12-03-run6/bench_attention.json

Runs here, no GPU (plan_launch is plain Python; Triton is imported for next_power_of_2 only).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "kernels"))

from fit_splits import BANDWIDTH_GOAL, plan_config, shapes_and_rows
from flashmodel_kernels.paged_attention import LaunchConfig

GOAL_MIN_BATCH = 32
GOAL_MIN_CONTEXT = 1024


@dataclass(frozen=True)
class Pick:
    num_splits: int
    block_n: int
    fuse_merge: bool
    decode_path: bool
    num_warps: int = 4
    num_stages: int = 2
    prefetch_pages: bool = False
    gathered_merge: bool = False


def _pick(config: LaunchConfig) -> Pick:
    split = config.num_splits > 1
    return Pick(
        config.num_splits,
        config.block_n,
        config.fuse_merge and split,
        config.decode_path,
        config.num_warps,
        config.num_stages,
        config.prefetch_pages,
        config.gathered_merge and config.fuse_merge and split,
    )


def variants_of(row: dict[str, Any], day_plan: LaunchConfig) -> dict[str, Pick]:
    """What each variant of the run ran for this row (bench_attention.bench_decode's dictionary)."""
    base = _pick(day_plan)
    ran = {name for name in row["us"] if name.startswith("tile")}
    out = {
        "tile": base,
        "tile_other_path": replace(base, decode_path=not base.decode_path),
        "tile_other_merge": replace(base, fuse_merge=not base.fuse_merge),
        "tile_fused_2x": Pick(min(2 * base.num_splits, 32), base.block_n, True, base.decode_path),
        "tile_bn128": replace(base, block_n=128),
        "tile_bn128_w8": replace(base, block_n=128, num_warps=8),
        "tile_prefetch": replace(base, prefetch_pages=True),
        "tile_prefetch_s3": replace(base, prefetch_pages=True, num_stages=3),
        "tile_prefetch_s3_bn64": replace(base, prefetch_pages=True, num_stages=3, block_n=64),
        "tile_gathered_merge": replace(base, gathered_merge=True),
    }
    return {name: pick for name, pick in out.items() if name in ran}


def day_plan(row: dict[str, Any], max_fused: int = 10) -> LaunchConfig:
    """The plan the run's ``tile`` column ran. Runs from 8 on record every choice; runs 5-6
    recorded (block_q, block_n, splits), and their other choices were fused merge for 2-10
    splits and the decode path only when split."""
    p = row["plan"]
    if "decode_path" in p:
        return LaunchConfig(**p)
    splits = int(p["num_splits"])
    return LaunchConfig(
        block_q=int(p["block_q"]),
        block_n=int(p["block_n"]),
        num_splits=splits,
        fuse_merge=1 < splits <= max_fused,
        decode_path=splits > 1,
    )


def table(run: dict[str, Any], wide_tiles: bool) -> tuple[list[dict[str, Any]], list[str]]:
    bandwidth = float(run["copy_bandwidth_Bps"])
    rows, lines = [], []
    lines.append(
        "| model | batch | context | splits | block_n | merge | path | measured as | µs | bw | vLLM Triton µs | "
        "tr/tile | FA3 µs | fa3/tile | day's plan µs |"
    )
    lines.append("|" + "---|" * 15)
    for shape, row in shapes_and_rows(run):
        pick = _pick(plan_config(shape, {"wide_tiles": wide_tiles}))
        ran = variants_of(row, day_plan(row))
        name = next((n for n, p in ran.items() if p == pick), None)
        us = row["us"].get(name) if name else None
        entry = {
            "model": row["model"],
            "batch": row["batch"],
            "context": row["context"],
            "pick": pick,
            "variant": name,
            "us": us,
            "bw": row["bytes"] / (us * 1e-6) / bandwidth if us else None,
            "triton": row["us"].get("vllm_triton"),
            "fa3": row["us"].get("fa3"),
            "day": row["us"].get("tile"),
        }
        rows.append(entry)

        def num(x: float | None, fmt: str = "{:.1f}") -> str:
            return fmt.format(x) if x is not None else "-"

        lines.append(
            f"| {row['model'].removeprefix('qwen2.5-')} | {row['batch']} | {row['context']} | {pick.num_splits} | "
            f"{pick.block_n} | {'fused' if pick.fuse_merge else ('kernel' if pick.num_splits > 1 else '-')} | "
            f"{'decode' if pick.decode_path else 'search'} | {name or 'UNMEASURED'} | {num(us)} | "
            f"{num(entry['bw'] * 100 if entry['bw'] else None, '{:.0f}%')} | {num(entry['triton'])} | "
            f"{num(entry['triton'] / us if us and entry['triton'] else None, '{:.2f}')} | {num(entry['fa3'])} | "
            f"{num(entry['fa3'] / us if us and entry['fa3'] else None, '{:.2f}')} | {num(entry['day'])} |"
        )
    return rows, lines


def summary(rows: list[dict[str, Any]]) -> list[str]:
    timed = [r for r in rows if r["us"]]
    goal = [r for r in timed if r["batch"] >= GOAL_MIN_BATCH and r["context"] >= GOAL_MIN_CONTEXT]
    slower = [r for r in timed if r["triton"] and r["us"] > r["triton"]]
    fa3_faster = [r for r in timed if r["fa3"] and r["fa3"] < r["us"]]
    worst = min((r["triton"] / r["us"] for r in timed if r["triton"]), default=float("nan"))
    faster_than_day = [r for r in timed if r["day"] and r["us"] < r["day"]]
    return [
        f"measured picks: {len(timed)} of {len(rows)} shapes",
        f">= {BANDWIDTH_GOAL:.0%} of copy bandwidth at batch >= {GOAL_MIN_BATCH}, context >= {GOAL_MIN_CONTEXT}: "
        f"{sum(r['bw'] >= BANDWIDTH_GOAL for r in goal)} of {len(goal)}",
        f"slower than vLLM Triton: {len(slower)} (worst triton/tile {worst:.2f})",
        f"FA3 faster: {len(fa3_faster)} shapes, by up to "
        f"{max((r['us'] / r['fa3'] for r in fa3_faster), default=1.0):.2f}x",
        f"faster than the day's plan: {len(faster_than_day)} shapes",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", type=Path, help="bench_attention.json of one run")
    parser.add_argument("--no-wide-tiles", action="store_true", help="plan as for a GPU without the shared memory")
    args = parser.parse_args()
    run = json.loads(args.run.read_text())
    rows, lines = table(run, wide_tiles=not args.no_wide_tiles)
    print("\n".join(lines))
    print()
    print("\n".join(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
