"""The compiled variants of tile attention an engine can meet, and compiling them all before it serves."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch

from flashmodel_kernels._triton import triton
from flashmodel_kernels.merge import _merge_splits_kernel
from flashmodel_kernels.paged_attention import _paged_attention_kernel, paged_attention
from flashmodel_kernels.plan import (
    DECODE_PATH_MAX_PROGRAMS_PER_SM,
    MAX_SPLITS,
    MIN_TOKENS_PER_SPLIT,
    PAGE_SIZE,
    PROGRAMS_PER_SM,
    WIDE_BLOCK_N,
    LaunchConfig,
    multiprocessor_count,
    plan_launch,
    wide_tiles_fit,
)

__all__ = ["Variant", "compiled_variants", "launch_variant", "precompile", "serving_variants"]


def compiled_variants() -> int | None:
    """How many compiled variants of the two kernels this process holds (None under the interpreter).

    Each new one is a JIT compile on first use; a serving engine that meets one mid-traffic
    stalls for it. The vLLM backend logs every rise, so a run shows which batches compiled.
    """
    total = 0
    for kernel in (_paged_attention_kernel, _merge_splits_kernel):
        caches = getattr(kernel, "device_caches", None)
        if caches is None:
            return None
        # Triton 3.6/3.7: device -> (kernel_cache, ...); the first element maps keys to kernels.
        total += sum(len(entry[0]) for entry in caches.values())
    return total


@dataclass(frozen=True)
class Variant:
    """What one launch compiles: two launches with equal variants share one compiled kernel.

    Everything else a launch passes (sizes, split count, pointers, strides) is either a runtime
    argument or fixed for a model, so a serving engine meets only the variants its plans pick.
    """

    block_q: int
    block_n: int
    split: bool
    decode: bool
    """The search-free decode path (the kernel's DECODE), not merely a decode batch."""
    fuse_merge: bool
    merge_splits_pad: int
    """NUM_SPLITS_PAD of the merge kernel, which compiles once per value; 0 when it does not run."""
    num_warps: int
    num_stages: int


def launch_variant(config: LaunchConfig, *, decode_batch: bool) -> Variant:
    """The variant ``paged_attention`` compiles for ``config`` on a decode or a mixed batch."""
    split = config.num_splits > 1
    merge_kernel = split and not config.fuse_merge
    return Variant(
        block_q=config.block_q,
        block_n=config.block_n,
        split=split,
        decode=config.decode_path and decode_batch,
        fuse_merge=split and config.fuse_merge,
        merge_splits_pad=triton.next_power_of_2(config.num_splits) if merge_kernel else 0,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )


def _breakpoints(limit: int, step_lengths: tuple[int, ...], max_splits: int) -> list[int]:
    """Context lengths up to ``limit`` around every point where a plan can change.

    A plan changes where ``max_seq_len // min_tokens_per_split`` steps (multiples of the split
    floor) and where one split's keys cross a key-tile size (a tile size times a split count);
    one below, at and one above each such point, plus the limit, reach every plan in between.
    """
    points = {1, 2, limit}
    for splits in range(1, max_splits + 2):
        for length in step_lengths:
            for delta in (-1, 0, 1):
                value = length * splits + delta
                if 1 <= value <= limit:
                    points.add(value)
    return sorted(points)


def serving_variants(
    *,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    multiprocessors: int,
    wide_tiles: bool,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> dict[Variant, LaunchConfig]:
    """Every variant ``plan_launch`` can pick for an engine's limits, each with a config that picks it.

    An engine compiles a variant the first time a batch needs it, which stalls every request in
    flight for as long as the compile takes (a second or more). ``precompile`` compiles all of
    these before traffic instead.
    """
    target = PROGRAMS_PER_SM * multiprocessors
    # Batch sizes: the plan depends on the batch only through the program count while it is
    # below the occupancy target, then only through the decode path's limit; past both, one
    # size stands for all.
    last_on_decode_path = int(DECODE_PATH_MAX_PROGRAMS_PER_SM * multiprocessors) // num_kv_heads
    edges = {max_num_seqs, last_on_decode_path, last_on_decode_path + 1}
    seq_counts = sorted(set(range(1, math.ceil(target / num_kv_heads) + 2)) | edges)
    seq_counts = [n for n in seq_counts if 1 <= n <= max_num_seqs]
    lengths = _breakpoints(max_model_len, tuple(sorted({MIN_TOKENS_PER_SPLIT, 16, 32, 64, WIDE_BLOCK_N})), MAX_SPLITS)
    found: dict[Variant, LaunchConfig] = {}
    plan = partial(
        plan_launch,
        num_kv_heads=num_kv_heads,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        multiprocessors=multiprocessors,
        wide_tiles=wide_tiles,
    )
    for num_seqs in seq_counts:
        for max_seq_len in lengths:
            # A decode batch, and the smallest mixed batch of as many sequences (most splits).
            for num_tokens, max_query_len in ((num_seqs, 1), (num_seqs + 1, 2)):
                if max_query_len > max_seq_len or num_tokens > max_num_batched_tokens:
                    continue
                config = plan(
                    num_seqs=num_seqs, num_tokens=num_tokens, max_query_len=max_query_len, max_seq_len=max_seq_len
                )
                found.setdefault(launch_variant(config, decode_batch=max_query_len == 1), config)
    # A full chunked-prefill batch: many programs, so no split.
    full = plan(
        num_seqs=max_num_seqs,
        num_tokens=max_num_batched_tokens,
        max_query_len=max(2, min(max_model_len, max_num_batched_tokens)),
        max_seq_len=max_model_len,
    )
    found.setdefault(launch_variant(full, decode_batch=False), full)
    return found


def precompile(
    query: torch.Tensor,  # the engine's [num_tokens, num_q_heads, head_dim]: its strides are copied
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # the engine's: its row stride is copied
    *,
    scale: float,
    max_num_seqs: int,
    max_model_len: int,
    max_num_batched_tokens: int,
) -> list[Variant]:
    """Compile every variant an engine with these limits can meet, before it serves.

    Each variant is launched once on a one-sequence batch with the engine's own cache, query
    strides and block-table stride, so Triton compiles exactly the kernel serving would (it
    specialises on dtypes, pointer alignment and integer divisibility, all taken from these).
    The launches read page 0 of the cache and write only their own scratch output.
    """
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = key_cache.shape[2]
    variants = serving_variants(
        num_kv_heads=num_kv_heads,
        queries_per_kv=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        multiprocessors=multiprocessor_count(query.device),
        wide_tiles=wide_tiles_fit(query.device),
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        max_num_batched_tokens=max_num_batched_tokens,
    )
    pages = block_table.stride(0)
    table = torch.zeros((1, pages), dtype=block_table.dtype, device=block_table.device)
    for variant, config in variants.items():
        # A batch off the decode path compiles the same kernel whatever its query lengths.
        query_len = 1 if variant.decode else 2
        # One key tile per split; enough keys that every split has some.
        seq_len = min(pages * PAGE_SIZE, max(query_len, config.num_splits * config.block_n))
        scratch_query = torch.empty_strided(
            (query_len, num_q_heads, head_dim), query.stride(), dtype=query.dtype, device=query.device
        )
        scratch_query.normal_()
        paged_attention(
            scratch_query,
            key_cache,
            value_cache,
            table,
            torch.tensor([seq_len], dtype=torch.int32, device=query.device),
            torch.tensor([0, query_len], dtype=torch.int32, device=query.device),
            max_query_len=query_len,
            max_seq_len=seq_len,
            scale=scale,
            out=torch.empty((query_len, num_q_heads, head_dim), dtype=query.dtype, device=query.device),
            config=config,
        )
    return list(variants)
