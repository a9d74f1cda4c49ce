"""Tile attention on the GPU machine: correctness at real shapes, then decode time against vLLM's
Triton unified attention and FlashAttention-3 on the same inputs, in one run.

    PYTHONPATH=/tmp/site:kernels:. python3 -m bench.kernels.bench_attention --out $OUT [--sweep]

Writes ``bench_attention.json`` (every number; rewritten after each decode shape, so a run cut
short keeps what it measured) and prints a table. Bytes per decode call are the fewest the call
must move: every cached K and V element once, the queries once, the output once. Each timed call
reads its own copy of the inputs (rotated inside one CUDA graph), so calls whose inputs fit the
60 MB L2 together are not timed out of the cache where that can be avoided.

``tile_graph`` is tile with the plan a captured CUDA graph of that batch size uses in vLLM
(``graph.plan_for_graph``: the split count from the batch size and ``--max-model-len``, not the
context): what serving under full CUDA graphs runs. ``--kernels`` times only the named ones.

``--sweep`` also times tile at other (splits, block_n) configs on the same inputs, to compare
split rules on measurements: power-of-two split counts, then smaller key tiles at batch <= 64;
both stop once ``--sweep-budget-s`` is spent. Each sweep output is checked fully
written and compared with the default tile output.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch
from flashmodel_kernels.graph import LayerShape, plan_for_graph
from flashmodel_kernels.paged_attention import paged_attention
from flashmodel_kernels.plan import MAX_FUSED_SPLITS, LaunchConfig, plan_launch, wide_tiles_fit
from flashmodel_kernels.reference import PagedBatch, random_paged_batch, reference_attention, relative_error

MODELS: dict[str, tuple[int, int, int]] = {  # q heads, kv heads, head dim
    "qwen2.5-1.5b": (12, 2, 128),
    "qwen2.5-7b": (28, 4, 128),
}
BATCHES = [1, 4, 16, 32, 64, 128, 256]
CONTEXTS = [128, 256, 512, 1024, 2048, 4096]
"""Decode contexts; ``--min-context`` (default 512) drops the shorter ones. A serving batch's
contexts are a few hundred tokens (the field workload's prompts), where a plan fixed for
``max_model_len`` (``tile_graph``) is furthest from its shape."""
ROTATION_BYTES = 256 * 1024 * 1024  # about 4x the H200's L2
MAX_COPIES = 64
SAMPLE_SECONDS = 2e-3  # GPU time per timing sample (whole graph replays); the median of 5 is kept
SWEEP_SPLITS = (1, 2, 4, 8, 16, 32)
SWEEP_SMALL_BLOCK_N = (16, 32)

Kernel = Callable[[int], None]  # runs the kernel on input copy i


@dataclass
class DecodeInputs:
    keys: torch.Tensor  # [num_blocks, 16, kv_heads, head_dim]
    values: torch.Tensor
    queries: torch.Tensor  # [copies, batch, q_heads, head_dim]
    outs: torch.Tensor  # [copies, batch, q_heads, head_dim]
    tables: torch.Tensor  # [copies, batch, blocks_per_seq] int32
    seq_lens: torch.Tensor  # [batch] int32
    query_start_loc: torch.Tensor  # [batch + 1] int32
    context: int
    copies: int
    plan: LaunchConfig = field(default_factory=lambda: LaunchConfig(block_q=1, block_n=16, num_splits=1))
    """plan_launch's pick for this shape (set by bench_decode), for the side-by-side variants."""
    graph_plan: LaunchConfig | None = None
    """The plan of a captured CUDA graph of this batch size (set by bench_decode)."""


@dataclass
class DecodeRow:
    model: str
    batch: int
    context: int
    q_heads: int
    kv_heads: int
    head_dim: int
    bytes: int
    copies: int
    us: dict[str, float] = field(default_factory=dict)
    bandwidth_fraction: dict[str, float] = field(default_factory=dict)
    rel_diff_vs_tile: dict[str, float] = field(default_factory=dict)
    rel_err_vs_float64: dict[str, float] = field(default_factory=dict)
    num_splits: int = 1
    plan: dict[str, int | bool] = field(default_factory=dict)
    """plan_launch's config on this device (``tile`` above ran with it)."""
    graph_plan: dict[str, int | bool] = field(default_factory=dict)
    """The captured-graph plan (``tile_graph`` ran with it)."""
    errors: dict[str, str] = field(default_factory=dict)
    tile_sweep: list[dict[str, Any]] = field(default_factory=list)
    """One entry per timed config: splits, block_n, us, tier, rel_diff_vs_tile."""


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


def plan_config(shape: Shape, *, wide_tiles: bool) -> LaunchConfig:
    """``plan_launch``'s config for this decode shape."""
    return plan_launch(
        num_seqs=shape.batch,
        num_tokens=shape.batch,
        max_query_len=1,
        max_seq_len=shape.context,
        num_kv_heads=shape.kv_heads,
        queries_per_kv=shape.q_heads // shape.kv_heads,
        head_dim=shape.head_dim,
        multiprocessors=shape.multiprocessors,
        wide_tiles=wide_tiles,
    )


def graph_plan_fused(plan: LaunchConfig | None) -> LaunchConfig:
    """``plan`` with at most ``MAX_FUSED_SPLITS`` splits, merged in the kernel where it splits."""
    if plan is None:
        raise ValueError("no graph plan for this shape")
    splits = min(plan.num_splits, MAX_FUSED_SPLITS)
    return replace(plan, num_splits=splits, fuse_merge=splits > 1)


def cuda_event() -> torch.cuda.Event:
    return torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]


def copy_bandwidth(device: torch.device) -> float:
    """Device-to-device copy of 4 GiB, bytes read plus written over the median time, in B/s."""
    src = torch.empty(4 << 30, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        start, end = cuda_event(), cuda_event()
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return float(2 * (4 << 30) / statistics.median(times))


def decode_inputs(
    batch: int, context: int, shape: tuple[int, int, int], dtype: torch.dtype, device: torch.device
) -> DecodeInputs:
    q_heads, kv_heads, head_dim = shape
    kv_bytes = batch * context * kv_heads * head_dim * 2 * 2
    copies = max(1, min(MAX_COPIES, math.ceil(ROTATION_BYTES / kv_bytes)))
    blocks_per_seq = math.ceil(context / 16)
    num_blocks = copies * batch * blocks_per_seq
    keys = torch.randn(num_blocks, 16, kv_heads, head_dim, device=device, dtype=dtype)
    values = torch.randn(num_blocks, 16, kv_heads, head_dim, device=device, dtype=dtype)
    # Pages scattered over the whole pool, as after hours of serving.
    tables = torch.randperm(num_blocks, device=device, dtype=torch.int32).view(copies, batch, blocks_per_seq)
    queries = torch.randn(copies, batch, q_heads, head_dim, device=device, dtype=dtype)
    return DecodeInputs(
        keys=keys,
        values=values,
        queries=queries,
        outs=torch.full_like(queries, float("nan")),
        tables=tables.contiguous(),
        seq_lens=torch.full((batch,), context, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device),
        context=context,
        copies=copies,
    )


def tile_kernel(x: DecodeInputs, scale: float, config: LaunchConfig | None = None) -> Kernel:
    def run(i: int) -> None:
        paged_attention(
            x.queries[i],
            x.keys,
            x.values,
            x.tables[i],
            x.seq_lens,
            x.query_start_loc,
            max_query_len=1,
            max_seq_len=x.context,
            scale=scale,
            out=x.outs[i],
            config=config,
        )

    return run


def copy_kernel(x: DecodeInputs) -> tuple[Kernel, int]:
    """A device copy of one call's keys (read and written: as many bytes as K and V read once).

    The ceiling for one kernel of this size: launch, ramp-up and drain cost the copy too. Its
    destination is reused by every call, so at sizes that fit the L2 the copy is, if anything,
    flattered; its fraction is an upper bound, not a goal the attention could be held to.
    """
    elements = x.tables.shape[1] * x.context * x.keys.shape[2] * x.keys.shape[3]
    source = x.keys.view(-1)
    target = torch.empty(elements, dtype=x.keys.dtype, device=x.keys.device)

    def run(i: int) -> None:
        target.copy_(source[i * elements : (i + 1) * elements])

    return run, 2 * elements * x.keys.element_size()


def gather_kernel(x: DecodeInputs) -> tuple[Kernel, int, torch.Tensor]:
    """A gather of one call's key pages in block-table order, as many bytes as ``copy_kernel`` moves.

    The copy reads one contiguous range; attention reads 16-token pages scattered over the pool.
    This is the ceiling for that access pattern: if it shows the same fixed excess over the copy
    as the attention kernels (8-13 us per call on an H200), the excess is the layout's, not the
    kernel's.
    """
    pages = [x.tables[i].flatten().long() for i in range(x.copies)]
    target = torch.empty((pages[0].numel(), *x.keys.shape[1:]), dtype=x.keys.dtype, device=x.keys.device)

    def run(i: int) -> None:
        torch.index_select(x.keys, 0, pages[i], out=target)

    return run, 2 * target.numel() * x.keys.element_size(), target


def contiguous_pages(x: DecodeInputs) -> DecodeInputs:
    """The same inputs with each sequence's pages consecutive in the pool (no scatter)."""
    tables = torch.arange(x.tables.numel(), dtype=torch.int32, device=x.tables.device).view(x.tables.shape)
    return replace(x, tables=tables)


def vllm_triton_kernel(x: DecodeInputs, scale: float) -> Kernel:
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention

    batch, q_heads, head_dim = x.queries.shape[1:]
    kv_heads = x.keys.shape[2]
    # What vLLM's TritonAttentionMetadataBuilder allocates in eager mode (the T4 profile).
    threshold = 128 // kv_heads
    segments = 16
    pad = 1 << (head_dim - 1).bit_length()
    dev = x.keys.device
    seg_out = torch.empty(threshold, q_heads, segments, pad, dtype=torch.float32, device=dev)
    seg_max = torch.empty(threshold, q_heads, segments, dtype=torch.float32, device=dev)
    seg_sum = torch.empty(threshold, q_heads, segments, dtype=torch.float32, device=dev)
    descale = torch.ones((), dtype=torch.float32, device=dev).expand(batch, kv_heads)

    def run(i: int) -> None:
        unified_attention(
            q=x.queries[i],
            k=x.keys,
            v=x.values,
            out=x.outs[i],
            cu_seqlens_q=x.query_start_loc,
            max_seqlen_q=1,
            seqused_k=x.seq_lens,
            max_seqlen_k=x.context,
            softmax_scale=scale,
            causal=True,
            window_size=(-1, -1),
            block_table=x.tables[i],
            softcap=0,
            q_descale=None,
            k_descale=descale,
            v_descale=descale,
            seq_threshold_3D=threshold,
            num_par_softmax_segments=segments,
            softmax_segm_output=seg_out,
            softmax_segm_max=seg_max,
            softmax_segm_expsum=seg_sum,
        )

    return run


def fa3_kernel(x: DecodeInputs, scale: float) -> Kernel:
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    def run(i: int) -> None:
        flash_attn_varlen_func(
            q=x.queries[i],
            k=x.keys,
            v=x.values,
            out=x.outs[i],
            cu_seqlens_q=x.query_start_loc,
            max_seqlen_q=1,
            seqused_k=x.seq_lens,
            max_seqlen_k=x.context,
            softmax_scale=scale,
            causal=True,
            block_table=x.tables[i],
            fa_version=3,
        )

    return run


def time_graph(run: Kernel, copies: int) -> float:
    """Seconds per call: one CUDA graph of ``copies`` calls (one per input copy), median of 5 samples.

    A sample replays the graph enough times to cover ``SAMPLE_SECONDS`` of GPU time (2 to 50
    replays), so a sweep of hundreds of configs spends its time on the GPU, not in Python.
    """
    run(0)  # compile and warm
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    with torch.cuda.stream(stream):
        run(0)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            for i in range(copies):
                run(i)
    torch.cuda.synchronize()
    for _ in range(3):
        graph.replay()
    start, end = cuda_event(), cuda_event()
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(2, min(50, math.ceil(SAMPLE_SECONDS / max(start.elapsed_time(end) / 1e3, 1e-7))))
    samples = []
    for _ in range(5):
        start, end = cuda_event(), cuda_event()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / replays / copies)
    del graph
    return float(statistics.median(samples))


def decode_reference(x: DecodeInputs, scale: float, copy: int) -> torch.Tensor:
    """Float64 attention of one copy's decode batch (all keys visible: one query per sequence)."""
    q_heads = x.queries.shape[2]
    group = q_heads // x.keys.shape[2]
    pos = torch.arange(x.context, device=x.keys.device)
    pages = x.tables[copy][:, pos // 16].long()  # [batch, context]
    k = x.keys[pages, pos % 16].double().repeat_interleave(group, dim=2)  # [batch, ctx, heads, d]
    v = x.values[pages, pos % 16].double().repeat_interleave(group, dim=2)
    s = torch.einsum("bhd,bkhd->bhk", x.queries[copy].double(), k) * scale
    return torch.einsum("bhk,bkhd->bhd", s.softmax(dim=-1), v)


def sweep_configs(shape: Shape, plan: LaunchConfig) -> list[tuple[int, int, int]]:
    """(splits, block_n, tier) to time beyond the main run, most wanted first, without repeats.

    Tier 0: the plan's pick (never skipped). Tier 1: power-of-two split counts at the planned block_n. Tier 2:
    smaller key tiles at power-of-two splits where batches are small enough to be latency-bound.
    Splits of less than one 16-token page, or beyond 16 programs per SM, are not timed.
    """
    planned = (plan.num_splits, plan.block_n)
    tier0 = {planned}
    sane = [
        s
        for s in SWEEP_SPLITS
        if s == 1 or (shape.context // s >= 16 and s * shape.programs <= 16 * shape.multiprocessors)
    ]
    tier1 = [(s, plan.block_n) for s in sane]
    tier2 = [(s, n) for s in sane for n in SWEEP_SMALL_BLOCK_N if shape.batch <= 64 and n < plan.block_n]
    ordered: list[tuple[int, int, int]] = []
    seen: set[tuple[int, int]] = set()
    for tier, configs in enumerate((sorted(tier0), tier1, tier2)):
        for cfg in configs:
            if cfg not in seen:
                seen.add(cfg)
                ordered.append((cfg[0], cfg[1], tier))
    return ordered


def bench_decode(
    device: torch.device,
    bandwidth: float,
    log: Callable[[str], None],
    save: Callable[[list[dict[str, Any]]], None],
    sweep: bool = False,
    sweep_budget_s: float = float("inf"),
    only: set[str] | None = None,
    max_model_len: int = 4096,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    kernels: dict[str, Callable[[DecodeInputs, float], Kernel]] = {
        "tile": tile_kernel,
        "tile_graph": lambda x, scale: tile_kernel(x, scale, x.graph_plan),
        # The graph plan held to the fused merge's split limit: one kernel per call instead of two
        # where the graph plan's split count (from max_model_len) goes past it.
        "tile_graph_fused": lambda x, scale: tile_kernel(x, scale, graph_plan_fused(x.graph_plan)),
        # The plan's pick with each of its measured choices turned the other way, side by side:
        # the searching path for the decode path (or back), the merge kernel for the fused merge
        # (or back), and the fused merge at twice the splits.
        "tile_other_path": lambda x, scale: tile_kernel(x, scale, replace(x.plan, decode_path=not x.plan.decode_path)),
        "tile_other_merge": lambda x, scale: tile_kernel(x, scale, replace(x.plan, fuse_merge=not x.plan.fuse_merge)),
        "tile_fused_2x": lambda x, scale: tile_kernel(
            x, scale, replace(x.plan, fuse_merge=True, num_splits=min(2 * x.plan.num_splits, 32))
        ),
        # Twice the keys per loop step, so each program has half the steps and twice the bytes in
        # flight per load; sm_80/sm_90 only (a T4's shared memory holds 64 keys).
        "tile_bn128": lambda x, scale: tile_kernel(x, scale, replace(x.plan, block_n=128)),
        "tile_bn128_w8": lambda x, scale: tile_kernel(x, scale, replace(x.plan, block_n=128, num_warps=8)),
        "vllm_triton": vllm_triton_kernel,
        "fa3": fa3_kernel,
    }
    if only is not None:
        unknown = only - set(kernels)
        if unknown:
            raise ValueError(f"--kernels: unknown {sorted(unknown)}; known: {sorted(kernels)}")
        kernels = {name: make for name, make in kernels.items() if name in only or name == "tile"}
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count
    t0 = time.time()
    budget_logged = False
    for model, (q_heads, kv_heads, head_dim) in MODELS.items():
        scale = head_dim**-0.5
        for context in CONTEXTS:
            for batch in BATCHES:
                x = decode_inputs(batch, context, (q_heads, kv_heads, head_dim), torch.float16, device)
                shape = Shape(model, batch, context, q_heads, kv_heads, head_dim, multiprocessors)
                row = DecodeRow(
                    model=model,
                    batch=batch,
                    context=context,
                    q_heads=q_heads,
                    kv_heads=kv_heads,
                    head_dim=head_dim,
                    copies=x.copies,
                    bytes=batch * context * kv_heads * head_dim * 2 * 2 + 2 * batch * q_heads * head_dim * 2,
                )
                plan = plan_config(shape, wide_tiles=wide_tiles_fit(device))  # as paged_attention plans
                x.plan = plan
                row.num_splits = plan.num_splits
                row.plan = asdict(plan)  # every choice, so a later rule can tell which variant ran its pick
                layer = LayerShape(q_heads, kv_heads, head_dim, max_model_len, multiprocessors, wide_tiles_fit(device))
                x.graph_plan = plan_for_graph(batch, layer)
                row.graph_plan = asdict(x.graph_plan)
                small = batch * context <= 16 * 4096
                ref = decode_reference(x, scale, 0) if small else None
                tile_out: torch.Tensor | None = None
                for name, make in kernels.items():
                    if name in ("tile_other_merge", "tile_fused_2x") and plan.num_splits == 1:
                        continue  # nothing to merge
                    if name == "tile_graph_fused" and (
                        x.graph_plan is None or x.graph_plan.num_splits <= MAX_FUSED_SPLITS
                    ):
                        continue  # the graph plan itself
                    if name.startswith("tile_bn128") and context // plan.num_splits < 128:
                        continue  # a split shorter than the tile: masked keys, nothing to learn
                    try:
                        x.outs.fill_(float("nan"))
                        run = make(x, scale)
                        seconds = time_graph(run, x.copies)
                        if torch.isnan(x.outs).any():
                            raise RuntimeError("output not fully written")
                        row.us[name] = seconds * 1e6
                        row.bandwidth_fraction[name] = row.bytes / seconds / bandwidth
                        out0 = x.outs[0].clone()
                        if name == "tile":
                            tile_out = out0
                        elif tile_out is not None:
                            row.rel_diff_vs_tile[name] = relative_error(out0, tile_out)
                        if ref is not None:
                            row.rel_err_vs_float64[name] = relative_error(out0, ref)
                    except Exception as exc:  # one failing baseline must not end the run
                        row.errors[name] = f"{type(exc).__name__}: {exc}"[:300]
                # The copy, consecutive pages and the gather explain the fixed excess; --kernels skips them.
                if only is None:
                    try:
                        run, moved = copy_kernel(x)
                        seconds = time_graph(run, x.copies)
                        row.us["copy"] = seconds * 1e6
                        row.bandwidth_fraction["copy"] = moved / seconds / bandwidth
                    except Exception as exc:
                        row.errors["copy"] = f"{type(exc).__name__}: {exc}"[:300]
                    # Is the fixed excess over the copy the scattered pages or the kernel? The plan's
                    # pick on consecutive pages, and a gather of the scattered ones (same bytes).
                    try:
                        contiguous = contiguous_pages(x)
                        x.outs.fill_(float("nan"))
                        seconds = time_graph(tile_kernel(contiguous, scale, plan), x.copies)
                        if torch.isnan(x.outs).any():
                            raise RuntimeError("output not fully written")
                        row.us["tile_contiguous"] = seconds * 1e6
                        row.bandwidth_fraction["tile_contiguous"] = row.bytes / seconds / bandwidth
                        if small:
                            reference = decode_reference(contiguous, scale, 0)
                            row.rel_err_vs_float64["tile_contiguous"] = relative_error(x.outs[0], reference)
                    except Exception as exc:
                        row.errors["tile_contiguous"] = f"{type(exc).__name__}: {exc}"[:300]
                    try:
                        run, moved, _ = gather_kernel(x)
                        seconds = time_graph(run, x.copies)
                        row.us["gather"] = seconds * 1e6
                        row.bandwidth_fraction["gather"] = moved / seconds / bandwidth
                    except Exception as exc:
                        row.errors["gather"] = f"{type(exc).__name__}: {exc}"[:300]
                if sweep:
                    for num_splits, sweep_block_n, tier in sweep_configs(shape, plan):
                        if tier > 0 and time.time() - t0 > sweep_budget_s:
                            if not budget_logged:
                                log(f"sweep budget {sweep_budget_s:.0f}s spent: tiers 1-2 skipped from here")
                                budget_logged = True
                            continue
                        forced = LaunchConfig(plan.block_q, sweep_block_n, num_splits)
                        entry: dict[str, Any] = {"splits": num_splits, "block_n": sweep_block_n, "tier": tier}
                        try:
                            x.outs.fill_(float("nan"))
                            entry["us"] = time_graph(tile_kernel(x, scale, forced), x.copies) * 1e6
                            if torch.isnan(x.outs).any():
                                raise RuntimeError("output not fully written")
                            if tile_out is not None:
                                entry["rel_diff_vs_tile"] = relative_error(x.outs[0], tile_out)
                        except Exception as exc:
                            entry["us"] = None
                            entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
                        row.tile_sweep.append(entry)
                rows.append(asdict(row))
                save(rows)
                log(format_row(row))
                del x
                torch.cuda.empty_cache()
    return rows


def format_row(row: DecodeRow) -> str:
    def us(name: str) -> str:
        return f"{row.us[name]:8.1f}" if name in row.us else "     n/a"

    frac = row.bandwidth_fraction.get("tile", float("nan"))
    vs_triton = row.us["vllm_triton"] / row.us["tile"] if {"tile", "vllm_triton"} <= row.us.keys() else float("nan")
    vs_fa3 = row.us["fa3"] / row.us["tile"] if {"tile", "fa3"} <= row.us.keys() else float("nan")
    timed = [e for e in row.tile_sweep if e.get("us") is not None]
    best = min(timed, key=lambda e: e["us"]) if timed else None
    return (
        f"{row.model:13s} b={row.batch:4d} ctx={row.context:5d} splits={row.num_splits:2d} "
        f"tile={us('tile')}us graph={us('tile_graph')}us graph_fused={us('tile_graph_fused')}us "
        f"triton={us('vllm_triton')}us fa3={us('fa3')}us "
        f"other_path={us('tile_other_path')}us other_merge={us('tile_other_merge')}us "
        f"fused2x={us('tile_fused_2x')}us bn128={us('tile_bn128')}us bn128w8={us('tile_bn128_w8')}us "
        f"contiguous={us('tile_contiguous')}us gather={us('gather')}us copy={us('copy')}us "
        f"tile_bw={frac:6.1%} copy_bw={row.bandwidth_fraction.get('copy', float('nan')):6.1%} "
        f"triton/tile={vs_triton:5.2f} fa3/tile={vs_fa3:5.2f} "
        f"err64={row.rel_err_vs_float64.get('tile', float('nan')):.1e} "
        f"d_triton={row.rel_diff_vs_tile.get('vllm_triton', float('nan')):.1e} "
        f"d_fa3={row.rel_diff_vs_tile.get('fa3', float('nan')):.1e}"
        + (f" sweep={len(timed)} best=({best['splits']},{best['block_n']}) {best['us']:.1f}us" if best else "")
        + (f" errors={row.errors}" if row.errors else "")
    )


def correctness_real_shapes(device: torch.device, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Mixed prefill/decode batches at the Qwen shapes, fp16 and bf16, against float64."""
    results = []
    gen = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    cases = [
        ([1000, 1, 1, 517, 64], [0, 4000, 900, 1500, 37]),  # prompts, long decodes, chunked prefill
        ([1] * 48, [int(n) for n in torch.randint(1, 4095, (48,), generator=gen)]),  # decode batch
        ([1], [4095]),  # one long decode: splits
    ]
    for model, (q_heads, kv_heads, head_dim) in MODELS.items():
        for dtype in (torch.float16, torch.bfloat16):
            for query_lens, context_lens in cases:
                batch = random_paged_batch(
                    query_lens,
                    context_lens,
                    num_q_heads=q_heads,
                    num_kv_heads=kv_heads,
                    head_dim=head_dim,
                    dtype=dtype,
                    device=device,
                    generator=gen,
                )
                out = torch.full_like(batch.query, float("nan"))
                paged_attention(
                    batch.query,
                    batch.key_cache,
                    batch.value_cache,
                    batch.block_table,
                    batch.seq_lens,
                    batch.query_start_loc,
                    max_query_len=batch.max_query_len,
                    max_seq_len=batch.max_seq_len,
                    scale=batch.scale,
                    out=out,
                )
                torch.cuda.synchronize()
                result = {
                    "model": model,
                    "dtype": str(dtype),
                    "query_lens": query_lens[:6],
                    "num_seqs": len(query_lens),
                    "max_seq_len": batch.max_seq_len,
                    "unwritten": int(torch.isnan(out).sum()),
                    "rel_err_vs_float64": relative_error(out, reference_attention(batch)),
                    "seed": gen.initial_seed(),
                }
                results.append(result)
                log(f"correctness {json.dumps(result)}")
    return results


def prefill_runs(b: PagedBatch, out: torch.Tensor, kv_heads: int) -> dict[str, Callable[[], Any]]:
    from vllm.v1.attention.ops.triton_unified_attention import unified_attention
    from vllm.vllm_flash_attn import flash_attn_varlen_func

    descale = torch.ones((), dtype=torch.float32, device=out.device).expand(b.seq_lens.shape[0], kv_heads)
    n = b.max_query_len
    return {
        "tile": lambda: paged_attention(
            b.query,
            b.key_cache,
            b.value_cache,
            b.block_table,
            b.seq_lens,
            b.query_start_loc,
            max_query_len=n,
            max_seq_len=n,
            scale=b.scale,
            out=out,
        ),
        "vllm_triton": lambda: unified_attention(
            q=b.query,
            k=b.key_cache,
            v=b.value_cache,
            out=out,
            cu_seqlens_q=b.query_start_loc,
            max_seqlen_q=n,
            seqused_k=b.seq_lens,
            max_seqlen_k=n,
            softmax_scale=b.scale,
            causal=True,
            window_size=(-1, -1),
            block_table=b.block_table,
            softcap=0,
            q_descale=None,
            k_descale=descale,
            v_descale=descale,
        ),
        "fa3": lambda: flash_attn_varlen_func(
            q=b.query,
            k=b.key_cache,
            v=b.value_cache,
            out=out,
            cu_seqlens_q=b.query_start_loc,
            max_seqlen_q=n,
            seqused_k=b.seq_lens,
            max_seqlen_k=n,
            softmax_scale=b.scale,
            causal=True,
            block_table=b.block_table,
            fa_version=3,
        ),
    }


def bench_prefill(device: torch.device, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Four 1024-token prompts in one batch (no cache yet): tile vs vLLM Triton vs FA3."""
    rows = []
    gen = torch.Generator().manual_seed(1)
    for model, (q_heads, kv_heads, head_dim) in MODELS.items():
        b = random_paged_batch(
            [1024] * 4,
            [0] * 4,
            num_q_heads=q_heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            dtype=torch.float16,
            device=device,
            generator=gen,
            packed_kv=False,
        )
        runs = prefill_runs(b, torch.empty_like(b.query), kv_heads)
        flops = 4 * 4 * (1024 * 1025 / 2) * q_heads * head_dim  # causal: QK^T and PV
        row: dict[str, Any] = {"model": model, "prompts": 4, "prompt_len": 1024, "us": {}, "tflops": {}}
        for name, fn in runs.items():
            try:
                import triton.testing

                ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
                row["us"][name] = ms * 1e3
                row["tflops"][name] = flops / (ms / 1e3) / 1e12
            except Exception as exc:
                row.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
        rows.append(row)
        log(f"prefill {json.dumps(row)}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--min-batch", type=int, default=1, help="decode batches from this size")
    parser.add_argument("--min-context", type=int, default=512, help="decode contexts from this length")
    parser.add_argument("--sweep", action="store_true", help="also time tile at other (splits, block_n) per shape")
    parser.add_argument(
        "--kernels", default="", help="comma list of decode kernels to time (tile always); default: all and the copy"
    )
    parser.add_argument("--max-model-len", type=int, default=4096, help="the engine limit tile_graph plans for")
    parser.add_argument(
        "--sweep-budget-s", type=float, default=float("inf"), help="decode seconds after which sweep tiers 1-2 stop"
    )
    args = parser.parse_args()
    BATCHES[:] = [b for b in BATCHES if b >= args.min_batch]
    CONTEXTS[:] = [c for c in CONTEXTS if c >= args.min_context]
    device = torch.device("cuda")
    path = os.path.join(args.out, "bench_attention.json")

    def log(line: str) -> None:
        print(line, flush=True)

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device),
        "multiprocessors": torch.cuda.get_device_properties(device).multi_processor_count,
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "argv": sys.argv[1:],
    }

    def save(decode_rows: list[dict[str, Any]] | None = None) -> None:
        if decode_rows is not None:
            report["decode"] = decode_rows
        with open(path, "w") as f:
            json.dump(report, f, indent=1)

    try:
        import triton

        report["triton"] = triton.__version__
        import vllm

        report["vllm"] = vllm.__version__
    except Exception as exc:
        report["import_error"] = repr(exc)
    sections: list[tuple[str, Callable[[], Any]]] = [
        ("copy_bandwidth_Bps", lambda: copy_bandwidth(device)),
        ("correctness", lambda: correctness_real_shapes(device, log)),
    ]
    if not args.skip_prefill:
        sections.append(("prefill", lambda: bench_prefill(device, log)))
    if not args.skip_decode:
        sections.append(
            (
                "decode",
                lambda: bench_decode(
                    device,
                    report["copy_bandwidth_Bps"],
                    log,
                    save,
                    args.sweep,
                    args.sweep_budget_s,
                    only=set(args.kernels.split(",")) if args.kernels else None,
                    max_model_len=args.max_model_len,
                ),
            )
        )
    for name, section in sections:
        t0 = time.time()
        try:
            report[name] = section()
        except Exception:
            report[f"{name}_error"] = traceback.format_exc()[-3000:]
            log(f"section {name} failed: {report[f'{name}_error']}")
        log(f"section {name} took {time.time() - t0:.1f}s")
        save()
    log(f"copy bandwidth {report.get('copy_bandwidth_Bps', float('nan')) / 1e12:.2f} TB/s")


if __name__ == "__main__":
    main()
