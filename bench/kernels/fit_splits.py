"""Pick tile attention's decode split rule from a measured sweep: what a rule picks and what that costs.

    python3 bench/kernels/fit_splits.py RESULTS/bench_attention.json              # the rule in use
    python3 bench/kernels/fit_splits.py R.json --candidate programs_per_sm=8,min_tokens_per_split=64
    python3 bench/kernels/fit_splits.py R.json --table table.json                 # a table candidate
    python3 bench/kernels/fit_splits.py R.json --search                           # rank CANDIDATE_GRID
    python3 bench/kernels/fit_splits.py R.json --best --emit-table best.json      # fastest measured

A rule is a set of keyword arguments for ``plan_launch`` (its defaults are the rule in use); a
table maps ``"programs,context"`` (programs = batch x kv heads, the decode grid before splitting)
or ``"model/batch/context"`` to a split count or to ``{"splits": n, "block_n": m}``. Every number
printed is a measurement from the JSON (``bench_attention.py --sweep``); a pick that was not
measured is reported as unmeasured, never interpolated. The bench measures every pick of every
rule in ``CANDIDATE_GRID``, so those compare on measured data only.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import itertools
import json
import math
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

# Run from a checkout without the package installed: fall back to the repository's copy.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "kernels"))

from flashmodel_kernels.paged_attention import LaunchConfig, plan_launch

MODEL_SHAPES: dict[str, tuple[int, int, int]] = {  # q heads, kv heads, head dim (rows of older runs)
    "qwen2.5-1.5b": (12, 2, 128),
    "qwen2.5-7b": (28, 4, 128),
}
H200_MULTIPROCESSORS = 132
BANDWIDTH_GOAL = 0.80
"""Issue 5: >= 80% of measured copy bandwidth at batch >= 32, context >= 1024."""

Rule = dict[str, Any]  # keyword arguments for plan_launch
Config = tuple[int, int]  # (num_splits, block_n)


def candidate_grid() -> list[Rule]:
    """The rules the bench measures every pick of: split floors x occupancy targets x tile policies."""
    rules: list[Rule] = []
    for min_tokens, per_sm, block_policy in itertools.product(
        (16, 32, 64, 128, 256), (1, 2, 4, 8, 16), ("budget", "fit", "32")
    ):
        # Every policy spelled out, so a change of plan_launch's defaults does not change the grid.
        rule: Rule = {
            "min_tokens_per_split": min_tokens,
            "programs_per_sm": per_sm,
            "fit_block_n_to_split": block_policy == "fit",
        }
        if block_policy == "32":
            rule["decode_block_n"] = 32
        rules.append(rule)
    return rules


CANDIDATE_GRID = candidate_grid()


@dataclass(frozen=True)
class Shape:
    """One decode shape of the benchmark: every sequence at ``context`` tokens, one query each."""

    model: str
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    multiprocessors: int

    @property
    def programs(self) -> int:
        return self.batch * self.kv_heads


def plan_config(shape: Shape, rule: Rule | None = None) -> LaunchConfig:
    """``plan_launch``'s config for this decode shape under ``rule`` (None: its defaults)."""
    return plan_launch(
        num_seqs=shape.batch,
        num_tokens=shape.batch,
        max_query_len=1,
        max_seq_len=shape.context,
        num_kv_heads=shape.kv_heads,
        queries_per_kv=shape.q_heads // shape.kv_heads,
        head_dim=shape.head_dim,
        multiprocessors=shape.multiprocessors,
        **(rule or {}),
    )


def plan(shape: Shape, rule: Rule | None = None) -> Config:
    """What ``plan_launch`` picks for this decode shape under ``rule``: (splits, block_n)."""
    config = plan_config(shape, rule)
    return config.num_splits, config.block_n


def parse_rule(text: str) -> Rule:
    """``"programs_per_sm=8,min_tokens_per_split=64,fit_block_n_to_split=true"`` -> kwargs."""
    params = inspect.signature(plan_launch).parameters
    rule: Rule = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, value = item.partition("=")
        name = name.strip()
        if name not in params or params[name].default is inspect.Parameter.empty:
            tunable = [n for n, p in params.items() if p.default is not inspect.Parameter.empty]
            raise SystemExit(f"unknown rule parameter {name!r} in {text!r}; plan_launch takes {tunable}")
        default = params[name].default
        value = value.strip()
        if isinstance(default, bool):
            rule[name] = value.lower() in ("1", "true", "yes")
        elif value.lower() == "none":
            rule[name] = None
        elif isinstance(default, float):
            rule[name] = float(value)
        else:
            rule[name] = int(value)
    return rule


def rule_name(rule: Rule) -> str:
    return ",".join(f"{k}={v}" for k, v in rule.items()) or "plan_launch defaults (the rule in use)"


def shapes_and_rows(report: dict[str, Any]) -> Iterator[tuple[Shape, dict[str, Any]]]:
    for row in report.get("decode", []):
        q_heads, kv_heads, head_dim = MODEL_SHAPES.get(row["model"], (0, 0, 0))
        yield (
            Shape(
                model=row["model"],
                batch=row["batch"],
                context=row["context"],
                q_heads=row.get("q_heads", q_heads),
                kv_heads=row.get("kv_heads", kv_heads),
                head_dim=row.get("head_dim", head_dim),
                multiprocessors=report.get("multiprocessors", H200_MULTIPROCESSORS),
            ),
            row,
        )


def measured_configs(shape: Shape, row: dict[str, Any]) -> dict[Config, float]:
    """Tile µs per (splits, block_n) measured for this shape: the sweep, plus the main tile run."""
    times: dict[Config, float] = {}
    for entry in row.get("tile_sweep", []):
        if entry.get("us") is not None:
            times[(entry["splits"], entry["block_n"])] = entry["us"]
    # Older runs: split counts at the planned block_n, and the main run at the planned config.
    default_block_n = row.get("plan", {}).get("block_n", plan(shape)[1])
    for splits, us in row.get("tile_us_by_splits", {}).items():
        times.setdefault((int(splits), default_block_n), us)
    if "tile" in row.get("us", {}):
        times.setdefault((row["num_splits"], default_block_n), row["us"]["tile"])
    return times


def table_picker(table: dict[str, Any]) -> Callable[[Shape], Config | None]:
    def pick(shape: Shape) -> Config | None:
        entry = table.get(f"{shape.model}/{shape.batch}/{shape.context}")
        if entry is None:
            entry = table.get(f"{shape.programs},{shape.context}")
        if entry is None:
            return None
        if isinstance(entry, dict):
            return int(entry["splits"]), int(entry.get("block_n", plan(shape)[1]))
        return int(entry), plan(shape)[1]

    return pick


@dataclass
class Line:
    shape: Shape
    config: Config | None
    tile_us: float | None
    triton_us: float | None
    fa3_us: float | None
    bandwidth_fraction: float | None
    best: tuple[Config, float] | None


@dataclass
class Evaluation:
    name: str
    lines: list[Line]

    @property
    def unmeasured(self) -> int:
        return sum(1 for line in self.lines if line.tile_us is None)

    @property
    def slower_than_triton(self) -> int:
        return sum(
            1 for ln in self.lines if ln.tile_us is not None and ln.triton_us is not None and ln.tile_us > ln.triton_us
        )

    @property
    def below_bandwidth_goal(self) -> int:
        return sum(
            1
            for ln in self.lines
            if ln.shape.batch >= 32
            and ln.shape.context >= 1024
            and ln.bandwidth_fraction is not None
            and ln.bandwidth_fraction < BANDWIDTH_GOAL
        )

    def geomean(self, ratio: Callable[[Line], float | None]) -> float:
        values = [v for v in map(ratio, self.lines) if v is not None and v > 0]
        return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")

    def worst_vs_triton(self) -> float:
        ratios = [ln.triton_us / ln.tile_us for ln in self.lines if ln.tile_us and ln.triton_us]
        return min(ratios) if ratios else float("nan")

    def summary(self) -> str:
        return (
            f"slower_than_vllm_triton={self.slower_than_triton}/{len(self.lines)} "
            f"worst_triton/tile={self.worst_vs_triton():.2f} "
            f"geomean_triton/tile={self.geomean(lambda ln: _ratio(ln.triton_us, ln.tile_us)):.3f} "
            f"geomean_fa3/tile={self.geomean(lambda ln: _ratio(ln.fa3_us, ln.tile_us)):.3f} "
            f"geomean_tile/best={self.geomean(lambda ln: _ratio(ln.tile_us, ln.best[1] if ln.best else None)):.3f} "
            f"below_80%_bw(batch>=32,ctx>=1024)={self.below_bandwidth_goal} unmeasured={self.unmeasured}"
        )


def _ratio(num: float | None, den: float | None) -> float | None:
    return num / den if num is not None and den else None


def evaluate(report: dict[str, Any], name: str, pick: Callable[[Shape], Config | None]) -> Evaluation:
    bandwidth = report.get("copy_bandwidth_Bps")
    lines = []
    for shape, row in shapes_and_rows(report):
        times = measured_configs(shape, row)
        config = pick(shape)
        tile_us = times.get(config) if config is not None else None
        best = min(times.items(), key=lambda kv: kv[1]) if times else None
        lines.append(
            Line(
                shape=shape,
                config=config,
                tile_us=tile_us,
                triton_us=row.get("us", {}).get("vllm_triton"),
                fa3_us=row.get("us", {}).get("fa3"),
                bandwidth_fraction=row["bytes"] / (tile_us * 1e-6) / bandwidth if tile_us and bandwidth else None,
                best=best,
            )
        )
    return Evaluation(name=name, lines=lines)


def print_table(ev: Evaluation) -> None:
    def f(v: float | None, fmt: str) -> str:
        return format(v, fmt) if v is not None else "n/a"

    print(f"# rule: {ev.name}")
    print(
        f"{'model':13s} {'batch':>5s} {'ctx':>5s} {'splits':>6s} {'bn':>3s} {'tile_us':>8s} {'triton_us':>9s} "
        f"{'fa3_us':>7s} {'tr/tile':>7s} {'fa3/tile':>8s} {'bw':>5s} {'best(s,bn)':>10s} {'best_us':>8s} "
        f"{'tile/best':>9s}"
    )
    for ln in ev.lines:
        splits, block_n = ln.config if ln.config else (0, 0)
        best_cfg = f"{ln.best[0][0]},{ln.best[0][1]}" if ln.best else "n/a"
        print(
            f"{ln.shape.model:13s} {ln.shape.batch:5d} {ln.shape.context:5d} {splits:6d} {block_n:3d} "
            f"{f(ln.tile_us, '8.1f'):>8s} {f(ln.triton_us, '9.1f'):>9s} {f(ln.fa3_us, '7.1f'):>7s} "
            f"{f(_ratio(ln.triton_us, ln.tile_us), '7.2f'):>7s} {f(_ratio(ln.fa3_us, ln.tile_us), '8.2f'):>8s} "
            f"{f(ln.bandwidth_fraction, '5.0%'):>5s} {best_cfg:>10s} {f(ln.best[1] if ln.best else None, '8.1f'):>8s} "
            f"{f(_ratio(ln.tile_us, ln.best[1] if ln.best else None), '9.2f'):>9s}"
            + ("  UNMEASURED" if ln.tile_us is None else "")
            + ("  SLOWER" if ln.tile_us and ln.triton_us and ln.tile_us > ln.triton_us else "")
        )
    print(f"# {ev.summary()}")


def noise(report: dict[str, Any]) -> str:
    """The main tile run and its sweep twin are two measurements of one config: their spread."""
    diffs = []
    for shape, row in shapes_and_rows(report):
        main = row.get("us", {}).get("tile")
        planned = (row["num_splits"], row.get("plan", {}).get("block_n", plan(shape)[1]))
        twins = [e["us"] for e in row.get("tile_sweep", []) if (e["splits"], e["block_n"]) == planned and e.get("us")]
        if main and twins:
            diffs.append(abs(main - twins[0]) / main)
    if not diffs:
        return "noise: no repeated measurement in this file"
    return (
        f"noise (main tile run vs its sweep twin, {len(diffs)} shapes): "
        f"median {statistics.median(diffs):.1%}, max {max(diffs):.1%}"
    )


def sweep_check(report: dict[str, Any]) -> str:
    """Each sweep config's output against the default tile output on the same inputs."""
    entries = [e for row in report.get("decode", []) for e in row.get("tile_sweep", [])]
    diffs = [e["rel_diff_vs_tile"] for e in entries if e.get("rel_diff_vs_tile") is not None]
    failed = sum(1 for e in entries if e.get("us") is None)
    worst = f"{max(diffs):.1e}" if diffs else "n/a"
    return f"sweep: {len(entries)} configs timed, {failed} failed, worst rel diff vs default tile {worst}"


def measured_times(report: dict[str, Any]) -> dict[Shape, dict[Config, float]]:
    return {shape: measured_configs(shape, row) for shape, row in shapes_and_rows(report)}


def fastest_picker(times: dict[Shape, dict[Config, float]]) -> Callable[[Shape], Config | None]:
    def pick(shape: Shape) -> Config | None:
        configs = times.get(shape, {})
        return min(configs, key=configs.__getitem__) if configs else None

    return pick


def best_table(times: dict[Shape, dict[Config, float]]) -> dict[str, dict[str, int]]:
    """Per ``programs,context``: the config measured on every shape sharing the key with least total time.

    Shapes with equal programs and context (1.5B at batch 32 and 7B at batch 16) do the same work
    per program (their GQA groups, 6 and 7, both pad to 8), so one table entry serves both.
    """
    groups: dict[str, list[Shape]] = {}
    for shape in times:
        groups.setdefault(f"{shape.programs},{shape.context}", []).append(shape)
    table = {}
    for key, shapes in sorted(groups.items()):
        common = set.intersection(*(set(times[s]) for s in shapes))
        if common:
            cfg = min(common, key=lambda c: sum(times[s][c] for s in shapes))
            table[key] = {"splits": cfg[0], "block_n": cfg[1]}
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", help="bench_attention.json from bench_attention.py --sweep")
    parser.add_argument("--candidate", action="append", default=[], help="plan_launch kwargs: k=v,k=v (repeatable)")
    parser.add_argument("--table", action="append", default=[], help="JSON table candidate (repeatable)")
    parser.add_argument("--best", action="store_true", help="also the fastest measured config per shape")
    parser.add_argument("--search", action="store_true", help="rank every rule of CANDIDATE_GRID, best first")
    parser.add_argument("--top", type=int, default=15, help="rules listed by --search")
    parser.add_argument("--emit-table", help="write the best measured config per programs,context here")
    args = parser.parse_args(argv)
    with open(args.results) as f:
        report = json.load(f)
    times = measured_times(report)
    bw = report.get("copy_bandwidth_Bps")
    print(
        f"# {args.results}: {report.get('device')} {report.get('date')} "
        f"copy bandwidth {bw / 1e12 if bw else float('nan'):.2f} TB/s, "
        f"{report.get('multiprocessors', H200_MULTIPROCESSORS)} SMs"
    )
    print(f"# {noise(report)}; {sweep_check(report)}")

    evaluations = [evaluate(report, rule_name({}), plan)]
    for text in args.candidate:
        rule = parse_rule(text)
        evaluations.append(evaluate(report, rule_name(rule), functools.partial(plan, rule=rule)))
    for path in args.table:
        with open(path) as f:
            evaluations.append(evaluate(report, f"table {path}", table_picker(json.load(f))))
    if args.best:
        evaluations.append(evaluate(report, "fastest measured per shape", fastest_picker(times)))
    for ev in evaluations:
        print_table(ev)
        print()

    if args.search:
        ranked = sorted(
            (evaluate(report, rule_name(rule), functools.partial(plan, rule=rule)) for rule in CANDIDATE_GRID),
            key=lambda ev: (
                ev.unmeasured,
                ev.slower_than_triton,
                ev.below_bandwidth_goal,
                ev.geomean(lambda ln: _ratio(ln.tile_us, ln.best[1] if ln.best else None)),
            ),
        )
        print(f"# {len(ranked)} rules of CANDIDATE_GRID, best first (unmeasured, slower, below bw goal, tile/best)")
        for ev in ranked[: args.top]:
            print(f"{ev.name:75s} {ev.summary()}")
    if args.emit_table:
        table = best_table(times)
        with open(args.emit_table, "w") as f:
            json.dump(table, f, indent=1, sort_keys=True)
        print(f"# wrote {len(table)} entries to {args.emit_table}")


if __name__ == "__main__":
    main()
