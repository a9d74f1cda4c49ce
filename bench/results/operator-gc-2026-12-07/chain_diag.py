"""The paced chain, step by step: the benchmark's DIAG lines (its log) joined with the operator's (its log).

Both processes print time.monotonic(), which is one clock for the whole machine on Linux.
Usage: python chain_diag.py bench.log operator.log
"""

import re
import statistics
import sys
from pathlib import Path

bench: dict[str, tuple[float, float]] = {}
seen: dict[str, dict[str, float]] = {}
for line in Path(sys.argv[1]).read_text().splitlines():
    if m := re.match(r"DIAG bench (\S+) t0=([\d.]+) ret=([\d.]+)", line):
        bench[m[1]] = (float(m[2]), float(m[3]))
    elif m := re.match(r"DIAG seen (\S+) (.*)", line):
        seen[m[1]] = {k: float(v) for k, v in (x.split("=") for x in m[2].split())}
operator: dict[str, dict[str, float]] = {}
for line in Path(sys.argv[2]).read_text().splitlines():
    if not (m := re.search(r"DIAG (event|handler|pass|send|done) (\S+) (.*)", line)):
        continue
    rest = m[3].split()
    key = m[1] if m[1] == "handler" else f"{m[1]} {rest[0]}"
    operator.setdefault(m[2], {}).setdefault(key, float(rest[-1]))
rows: dict[str, list[float]] = {}
for name, (t0, returned) in bench.items():
    steps = {"create call returned": returned - t0}
    steps |= {k: v - t0 for k, v in operator.get(name, {}).items()}
    steps |= {f"seen {k}": v - t0 for k, v in seen.get(name, {}).items()}
    for k, v in steps.items():
        rows.setdefault(k, []).append(1000 * v)
for k, v in sorted(rows.items(), key=lambda kv: statistics.median(kv[1])):
    print(f"{k:28s} p50 {statistics.median(v):6.1f}  min {min(v):6.1f}  max {max(v):6.1f}  n={len(v)}")
