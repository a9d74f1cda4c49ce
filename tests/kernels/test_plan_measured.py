"""Every pick the launch plan makes on the benchmark's decode shapes was timed on a GPU.

The plan's constants cite measurements (``flashmodel_kernels.plan``); this ties them to the
recorded run: when ``plan_launch`` changes, this fails until a benchmark run times the new picks
(``bench/kernels/gpu_run.sh``) and its summary replaces the one read here.
"""

from __future__ import annotations

import csv
from pathlib import Path

from flashmodel_kernels.plan import LaunchConfig, plan_launch

MEASURED = Path(__file__).resolve().parents[2] / "bench/kernels/results/h200-2026-12-03-run8/decode.csv"
H200_MULTIPROCESSORS = 132


def test_every_decode_pick_of_the_plan_is_the_config_the_h200_run_timed() -> None:
    with MEASURED.open() as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == 56, MEASURED
    for row in rows:
        batch, context = int(row["batch"]), int(row["context"])
        kv_heads = int(row["kv_heads"])
        pick = plan_launch(
            num_seqs=batch,
            num_tokens=batch,
            max_query_len=1,
            max_seq_len=context,
            num_kv_heads=kv_heads,
            queries_per_kv=int(row["q_heads"]) // kv_heads,
            head_dim=int(row["head_dim"]),
            multiprocessors=H200_MULTIPROCESSORS,
            wide_tiles=True,
        )
        timed = LaunchConfig(
            block_q=int(row["block_q"]),
            block_n=int(row["block_n"]),
            num_splits=int(row["num_splits"]),
            fuse_merge=row["fuse_merge"] == "1",
            decode_path=row["decode_path"] == "1",
        )
        assert pick == timed, f"{row['model']} batch {batch} context {context}: plan {pick}, timed {timed}"
        assert row["tile_us"], f"{row['model']} batch {batch} context {context}: the pick has no time"
