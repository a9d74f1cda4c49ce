"""Decode at the bandwidth-goal shapes (batch >= 32, context >= 1024) under other warp and pipeline
settings, the one launch dimension run 2's split sweep left fixed (4 warps, 2 stages).

    cd bench/kernels && PYTHONPATH=../../kernels python3 warps_stages.py --out $OUT

Needs only torch and Triton (no vLLM). Each config keeps the split rule's pick (splits, block_n)
and changes num_warps / num_stages; its output is compared with the default config's on the
same inputs. Writes ``warps_stages.json`` and prints one line per shape.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from bench_attention import MODELS, copy_bandwidth, decode_inputs, tile_kernel, time_graph
from flashmodel_kernels.paged_attention import plan_launch
from flashmodel_kernels.reference import relative_error

# (num_warps, num_stages); the first is the default the others are compared with.
SETTINGS = [(4, 2), (4, 3), (4, 4), (8, 2), (8, 3), (2, 2), (2, 3)]
BATCHES = [32, 64, 128, 256]
CONTEXTS = [1024, 2048, 4096]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    bandwidth = copy_bandwidth(device)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    rows: list[dict[str, Any]] = []
    started = time.time()
    for model, shape in MODELS.items():
        q_heads, kv_heads, head_dim = shape
        for batch in BATCHES:
            for context in CONTEXTS:
                x = decode_inputs(batch, context, shape, torch.float16, device)
                scale = 1.0 / math.sqrt(head_dim)
                plan = plan_launch(
                    num_seqs=batch,
                    num_tokens=batch,
                    max_query_len=1,
                    max_seq_len=context,
                    num_kv_heads=kv_heads,
                    queries_per_kv=q_heads // kv_heads,
                    head_dim=head_dim,
                    multiprocessors=sms,
                )
                moved = (batch * context * kv_heads * head_dim * 2 + 2 * batch * q_heads * head_dim) * 2
                row: dict[str, Any] = {
                    "model": model,
                    "batch": batch,
                    "context": context,
                    "splits": plan.num_splits,
                    "block_n": plan.block_n,
                    "us": {},
                    "bw": {},
                    "rel_diff": {},
                }
                reference: torch.Tensor | None = None
                for warps, stages in SETTINGS:
                    key = f"w{warps}s{stages}"
                    config = replace(plan, num_warps=warps, num_stages=stages)
                    try:
                        seconds = time_graph(tile_kernel(x, scale, config), x.copies)
                    except Exception as exc:  # e.g. out of shared memory: recorded, not fatal
                        row["us"][key] = None
                        row.setdefault("errors", {})[key] = f"{type(exc).__name__}: {str(exc)[:200]}"
                        continue
                    x.outs.fill_(float("nan"))
                    tile_kernel(x, scale, config)(0)
                    out = x.outs[0].float().clone()
                    if reference is None:
                        reference = out
                    row["us"][key] = round(seconds * 1e6, 2)
                    row["bw"][key] = round(moved / seconds / bandwidth, 4)
                    row["rel_diff"][key] = float(relative_error(out, reference)) if not out.isnan().any() else math.nan
                best = min((k for k in row["us"] if row["us"][k]), key=lambda k: row["us"][k])
                row["best"] = best
                rows.append(row)
                print(
                    f"{model:13s} b={batch:4d} ctx={context:5d} splits={plan.num_splits:2d} "
                    + " ".join(f"{k}={row['bw'].get(k, 0) * 100:5.1f}%" for k in row["us"] if row["us"][k])
                    + f" best={best} ({row['bw'][best] * 100:.1f}%)",
                    flush=True,
                )
                del x
                torch.cuda.empty_cache()
                (args.out / "warps_stages.json").write_text(
                    json.dumps({"copy_bandwidth_Bps": bandwidth, "settings": SETTINGS, "rows": rows}, indent=1)
                )
    met = {k: sum(1 for r in rows if (r["bw"].get(f"w{k[0]}s{k[1]}") or 0) >= 0.8) for k in SETTINGS}
    best_met = sum(1 for r in rows if r["bw"][r["best"]] >= 0.8)
    print(
        f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; shapes >= 80% of it, by setting: "
        + ", ".join(f"w{w}s{s}: {n}/{len(rows)}" for (w, s), n in met.items())
        + f"; best per shape: {best_met}/{len(rows)}; {time.time() - started:.0f}s"
    )


if __name__ == "__main__":
    main()
