# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton JIT functions take untyped pointer and stride arguments by design: Triton reads their
# annotations only for constexpr. The typed launchers beside them carry the types.)
"""Tile attention: one Triton kernel family for decode and prefill/mixed batches over a paged KV cache.

Layout contract (vLLM's, read through strides so a layout change upstream is a view, not a port):

- ``query``  ``[num_tokens, num_q_heads, head_dim]``, the new tokens of all sequences back to back;
- ``key_cache`` / ``value_cache`` ``[num_blocks, PAGE_SIZE, num_kv_heads, head_dim]``, any strides;
- ``block_table`` ``[num_seqs, max_blocks_per_seq]`` int32, page numbers of each sequence in order;
- ``seq_lens`` ``[num_seqs]`` int32, tokens in the cache per sequence, the new ones included;
- ``query_start_loc`` ``[num_seqs + 1]`` int32, where each sequence's new tokens start in ``query``.

Each program owns one kv head, ``BLOCK_Q`` query tokens of one sequence and every query head that
shares that kv head (GQA), so the K/V tile it loads is reused by ``QUERIES_PER_KV`` heads, and one
contiguous part of the key range (split-KV). The softmax is the exact online softmax: a running
maximum and sum per row, rescaled whenever a tile raises the maximum, so tile edges change nothing
but fp32 rounding. Split results are merged from their log-sum-exp, by the last split of each
tile to finish (``fuse_merge``) or by a second kernel. A pure decode batch (one new token per
sequence) can skip the search that maps programs to sequences (``decode_path``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial

import torch

from flashmodel_kernels._triton import INTERPRETING, tl, triton

__all__ = [
    "LaunchConfig",
    "Variant",
    "compiled_variants",
    "paged_attention",
    "plan_launch",
    "precompile",
    "serving_variants",
]

PAGE_SIZE = 16
"""Tokens per KV-cache block: the T4 profile fixes vLLM's ``--block-size 16``."""

# The decode split rule, fitted on the H200 sweep of 2026-12-02 (run 2,
# bench/kernels/results/h200-2026-12-02-run2, ``fit_splits.py --search``): on its 56 decode shapes
# this rule is slower than vLLM's Triton kernel on none (worst triton/tile 1.08, geomean 1.37),
# where the rule before it (256 keys per split, no tile fitting) was slower on 10 (worst 0.59, at
# batch 1-16 with context 512-1024, where too few programs kept the GPU idle). Every pick it makes
# on those shapes was timed there, so docs/benchmarks.md reports measurements, not predictions.
MIN_TOKENS_PER_SPLIT = 32
"""A split holds at least this many keys (two 16-token pages): shorter, its merge costs more than it saves."""

PROGRAMS_PER_SM = 2.0
"""Decode splits the key range until there are about this many programs per multiprocessor."""

MAX_SPLITS = 32

MAX_FUSED_SPLITS = 10
"""Split launches of 2..10 parts merge inside the attention kernel: the largest count timed fused.

H200 runs 5a/5b (2026-12-03, bench/kernels/results/h200-2026-12-03-run5*), the 15 split shapes
of batch >= 32 / context >= 1024: fused faster than the merge kernel on 14 of 15 (by up to
5.0 us of 49; 0.1-0.2 us slower on the 15th), timed at 2-5 splits and at twice that (4-10). The
merging program reads its splits one after another, so far more splits than were timed are left
to the merge kernel.
"""

MAX_FUSED_SPLITS_NARROW = 5
"""With 64-key (or shorter) tiles, only launches of 2..5 splits fuse the merge.

H200 run 6 (2026-12-03, bench/kernels/results/h200-2026-12-03-run6): at 9 splits of 64-key tiles
(1.5B batch 16, contexts 512-4096) the merge kernel was 1.3-1.7 us faster than the fused merge on
all four shapes; at 2-5 splits the fused merge was as fast or faster (runs 5a/5b, run 6).
"""

WIDE_BLOCK_N = 128
"""Keys per loop step of a decode split on a GPU with the shared memory for it (``wide_tiles``).

H200 run 6, side by side on the same inputs: at 3-32 splits with >= 128 keys per split, 128-key
tiles were faster than 64-key tiles on all 20 such shapes (by 0.2-7.8 us, up to 15.5 %: 7B batch
16 / 4096 42.4 vs 50.2 us); at 2 splits slower on all 8 (up to 18.9 %: 160.7 vs 135.1 us) and
unsplit slower on all 12; so only launches of at least ``WIDE_TILE_MIN_SPLITS`` take them.
Twice the keys per step halves a short split's dependent page-then-K/V round trips.
"""
WIDE_TILE_MIN_SPLITS = 3
WIDE_TILE_SHARED_BYTES = 160 * 1024
"""A 128-key step stages K and V (2 x 128 x 128 x 2 B) twice (2 stages): 128 KB plus the query.
sm_80/sm_90 allow 163/227 KB per block; sm_86/89 (99 KB) and the T4 (64 KB) do not."""

DECODE_PATH_MAX_PROGRAMS_PER_SM = 4.0
"""An unsplit decode launch takes the search-free path up to this many programs per SM.

H200 run 6: at 512 programs (3.9 per SM: 1.5B batch 256, 7B batch 128) the decode path was
faster on all 8 shapes (0.4-3.7 us; 7B batch 128 / 512: 40.0 vs 43.7 us), at 1024 (7B batch 256)
slower on all 4 (1.5-36.8 us), as in runs 5a/5b.
"""

FIT_BLOCK_N_TO_SPLIT = True
"""Decode key tiles no longer than one split: a 32-key split read with 64-key tiles loads half masked keys."""

SHARED_BUDGET_BYTES = 48 * 1024
"""Shared memory one program may plan for: the T4 allows 64 KB per block; the rest is headroom."""


@triton.jit
def split_tiles(kv_end, split, num_splits, BLOCK_N: tl.constexpr):
    """Key tiles [begin, end) of one split of a key range of ``kv_end`` keys: whole BLOCK_N tiles,
    shared out evenly (the last splits of a short range may get none)."""
    num_kv_tiles = tl.cdiv(kv_end, BLOCK_N)
    tiles_per_split = tl.cdiv(num_kv_tiles, num_splits)
    tile_begin = split * tiles_per_split
    return tile_begin, tl.minimum(tile_begin + tiles_per_split, num_kv_tiles)


# num_splits is a runtime argument, not a constexpr: a new split count (a new batch size in eager
# serving, or a benchmark sweep) must not cost a compile. Only whether to split is compiled in.
# num_seqs likewise: Triton would otherwise compile a variant for 1, for multiples of 16 and for
# the rest, and a serving engine meets all three as its batch changes, each a stall of a second
# or so on first use (vLLM's JIT monitor logged this kernel compiling during inference, SLO run 6).
# It only bounds the search, so the specialisation buys nothing.
@triton.jit(do_not_specialize=["num_splits", "num_seqs"])
def _paged_attention_kernel(
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM], written when not SPLIT_KV
    part_out_ptr,  # [num_tokens, num_q_heads, num_splits, HEAD_DIM_PAD] fp32, when SPLIT_KV
    part_lse_ptr,  # [num_tokens, num_q_heads, num_splits] fp32 log2-sum-exp2, when SPLIT_KV
    arrivals_ptr,  # [tile slots * num_kv_heads] int32, zero between calls, when FUSE_MERGE
    q_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    k_cache_ptr,  # [num_blocks, PAGE_SIZE, num_kv_heads, HEAD_DIM]
    v_cache_ptr,  # [num_blocks, PAGE_SIZE, num_kv_heads, HEAD_DIM]
    block_table_ptr,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens_ptr,  # [num_seqs] int32
    query_start_loc_ptr,  # [num_seqs + 1] int32
    num_seqs,
    num_q_heads,
    num_splits,
    qk_scale_log2,  # softmax scale * log2(e): the softmax runs in base 2 (exp2 is one instruction)
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_blk,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_blk,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    stride_bt_seq,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    QUERIES_PER_KV_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DECODE: tl.constexpr,
    FUSE_MERGE: tl.constexpr,
    PREFETCH_PAGES: tl.constexpr,
    MERGE_SPLITS_PAD: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
):
    BLOCK_M: tl.constexpr = BLOCK_Q * QUERIES_PER_KV_PAD
    tile_id = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    if DECODE:
        # Every sequence brings exactly one token (the host checked num_tokens == num_seqs with
        # max_query_len 1), so program i is sequence i and token i: no search. This shortens the
        # chain of dependent loads in front of the first K/V tile from about a dozen to two
        # (sequence length, then page numbers), which is most of a short decode call's fixed cost.
        seq = tile_id
        q_begin = tile_id
        query_len = 1
        q_tile = 0
    else:
        # Sequence s owns tile slots [qsl[s] // BLOCK_Q + s, qsl[s + 1] // BLOCK_Q + s + 1): at
        # least cdiv(query_len, BLOCK_Q) of them, so the grid is num_tokens // BLOCK_Q + num_seqs
        # without a host-side pass over the batch. Find the last sequence whose first slot is <= tile_id.
        lo = 0
        hi = num_seqs - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            mid_first_slot = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
            if mid_first_slot <= tile_id:
                lo = mid
            else:
                hi = mid - 1
        seq = lo
        q_begin = tl.load(query_start_loc_ptr + seq)
        query_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
        q_tile = tile_id - (q_begin // BLOCK_Q + seq)
        if q_tile * BLOCK_Q >= query_len:
            return  # a spare slot of this sequence

    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len

    # Row m is query token m // QUERIES_PER_KV_PAD (of this tile) and head m % QUERIES_PER_KV_PAD
    # of this kv head's group: the heads of one token sit side by side and share every K/V load.
    offs_m = tl.arange(0, BLOCK_M)
    tok_in_seq = q_tile * BLOCK_Q + offs_m // QUERIES_PER_KV_PAD
    head_in_group = offs_m % QUERIES_PER_KV_PAD
    row_valid = (tok_in_seq < query_len) & (head_in_group < QUERIES_PER_KV)
    q_head = kv_head * QUERIES_PER_KV + head_in_group
    q_pos = context_len + tok_in_seq  # position in the sequence: the causal bound of the row
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = offs_d < HEAD_DIM

    q_rows = (q_begin + tok_in_seq) * stride_q_tok + q_head * stride_q_head
    q = tl.load(
        q_ptr + q_rows[:, None] + offs_d[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]

    # Keys this tile can see: up to the last valid query token's position, inclusive.
    last_tok = tl.minimum(q_tile * BLOCK_Q + BLOCK_Q, query_len)
    kv_end = context_len + last_tok
    tile_begin, tile_end = split_tiles(kv_end, split, num_splits, BLOCK_N)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    block_row = block_table_ptr + seq * stride_bt_seq

    if PREFETCH_PAGES:
        first_pos = tile_begin * BLOCK_N + offs_n
        next_page = tl.load(block_row + first_pos // PAGE_SIZE, mask=first_pos < kv_end, other=0)
    for kv_tile in range(tile_begin, tile_end):
        key_pos = kv_tile * BLOCK_N + offs_n
        key_valid = key_pos < kv_end
        if PREFETCH_PAGES:
            # The next tile's page numbers are loaded one step ahead, so its K/V loads do not
            # wait behind a block-table read: without this each step is two dependent trips to
            # memory (page numbers, then K/V) that the compiler's pipeliner cannot overlap.
            # Measured (H200 kernel run 8): no better where a program has few steps, and 28 %
            # slower (median) where it has 8 or more, so no plan picks it; kept for the bench.
            page = next_page.to(tl.int64)
            ahead_pos = key_pos + BLOCK_N
            next_page = tl.load(block_row + ahead_pos // PAGE_SIZE, mask=ahead_pos < kv_end, other=0)
        else:
            page = tl.load(block_row + key_pos // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % PAGE_SIZE
        # int64: a cache of a few hundred thousand pages is more than 2**31 elements per layer.
        k_rows = page * stride_k_blk + slot * stride_k_tok + kv_head * stride_k_head
        v_rows = page * stride_v_blk + slot * stride_v_tok + kv_head * stride_v_head
        k = tl.load(
            k_cache_ptr + k_rows[None, :] + offs_d[:, None] * stride_k_dim,
            mask=key_valid[None, :] & dim_valid[:, None],
            other=0.0,
        )  # [HEAD_DIM_PAD, BLOCK_N]
        v = tl.load(
            v_cache_ptr + v_rows[:, None] + offs_d[None, :] * stride_v_dim,
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM_PAD]

        if INTERPRETER_BF16:
            # Triton 3.7's CPU interpreter multiplies bf16 operands as raw bits; fp32 operands
            # give it the same products. Never set on a GPU.
            s = tl.dot(q.to(tl.float32), k.to(tl.float32)) * qk_scale_log2
        else:
            s = tl.dot(q, k) * qk_scale_log2  # [BLOCK_M, BLOCK_N] fp32
        visible = row_valid[:, None] & key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # A row that has seen no visible key yet keeps max -inf; subtracting 0 instead keeps
        # exp2 at exactly 0 for it rather than NaN from (-inf) - (-inf).
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_ref[:, None])
        alpha = tl.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if INTERPRETER_BF16:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype).to(tl.float32), v.to(tl.float32))
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    # Rows with no visible key in this split (padding, or a split before a row's causal bound)
    # have l_i == 0: they write zeros and, for the merge, a log-sum of -inf (weight 0).
    has_keys = l_i > 0.0
    out_tile = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    tok_global = q_begin + tok_in_seq
    if not SPLIT_KV:
        o_rows = tok_global * stride_o_tok + q_head * stride_o_head
        tl.store(
            out_ptr + o_rows[:, None] + offs_d[None, :],
            out_tile.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        part_row = (tok_global * num_q_heads + q_head) * num_splits + split
        tl.store(
            part_out_ptr + part_row[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            out_tile,
            mask=row_valid[:, None],
        )
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + part_row, lse, mask=row_valid)
        if FUSE_MERGE:
            # The last split of this tile to finish merges all of them, so no second kernel
            # (its launch and its own chain of loads) follows. Every thread's stores above are
            # ordered before the arrival by the barrier and the release; the acquire orders the
            # merging program's loads after every other split's release.
            tl.debug_barrier()
            arrivals = arrivals_ptr + tile_id * tl.num_programs(1) + kv_head
            arrived = tl.atomic_add(arrivals, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.debug_barrier()
                first_row = (tok_global * num_q_heads + q_head) * num_splits
                if MERGE_SPLITS_PAD > 0:
                    merged = _merge_gathered(
                        part_out_ptr,
                        part_lse_ptr,
                        first_row,
                        row_valid,
                        num_splits,
                        BLOCK_M,
                        HEAD_DIM_PAD,
                        MERGE_SPLITS_PAD,
                    )
                else:
                    merged = _merge_one_by_one(
                        part_out_ptr, part_lse_ptr, first_row, row_valid, num_splits, BLOCK_M, HEAD_DIM_PAD
                    )
                o_rows = tok_global * stride_o_tok + q_head * stride_o_head
                tl.store(
                    out_ptr + o_rows[:, None] + offs_d[None, :],
                    merged.to(out_ptr.dtype.element_ty),
                    mask=row_valid[:, None] & dim_valid[None, :],
                )
                tl.store(arrivals, 0)  # zero again for the next call: no memset per call


@triton.jit
def _merge_one_by_one(
    part_out_ptr, part_lse_ptr, first_row, row_valid, num_splits, BLOCK_M: tl.constexpr, HEAD_DIM_PAD: tl.constexpr
):
    """The fused merge in use: splits read in a loop, each rescaling the running result."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    m_all = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    w_all = tl.zeros([BLOCK_M], dtype=tl.float32)
    merged = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for part in range(num_splits):
        # .cg: other programs wrote these; read them from L2, never a stale L1 line.
        part_lse = tl.load(part_lse_ptr + first_row + part, mask=row_valid, other=float("-inf"), cache_modifier=".cg")
        part_out = tl.load(
            part_out_ptr + (first_row + part)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            mask=row_valid[:, None],
            other=0.0,
            cache_modifier=".cg",
        )
        m_next = tl.maximum(m_all, part_lse)
        m_safe = tl.where(m_next == float("-inf"), 0.0, m_next)
        scale_old = tl.exp2(m_all - m_safe)
        weight = tl.exp2(part_lse - m_safe)
        w_all = w_all * scale_old + weight
        merged = merged * scale_old[:, None] + part_out * weight[:, None]
        m_all = m_next
    return merged / tl.where(w_all > 0.0, w_all, 1.0)[:, None]


@triton.jit
def _merge_gathered(
    part_out_ptr,
    part_lse_ptr,
    first_row,
    row_valid,
    num_splits,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    """An experiment (``LaunchConfig.gathered_merge``): every split's log-sum in one load, then
    the weighted sum over an unrolled loop whose loads depend on nothing computed before them.

    The loop above waits for each split's two loads in turn (L2 round trips, one after another,
    at the tail of the call where nothing else runs); here the compiler may issue them all at once.
    """
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_s = tl.arange(0, SPLITS_PAD)
    in_range = offs_s < num_splits
    lse = tl.load(
        part_lse_ptr + first_row[:, None] + offs_s[None, :],
        mask=row_valid[:, None] & in_range[None, :],
        other=float("-inf"),
        cache_modifier=".cg",
    )  # [BLOCK_M, SPLITS_PAD]
    m_all = tl.max(lse, axis=1)
    m_safe = tl.where(m_all == float("-inf"), 0.0, m_all)
    weights = tl.exp2(lse - m_safe[:, None])  # 0 for a split without keys and for padding
    w_all = tl.sum(weights, axis=1)
    merged = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    for part in tl.static_range(SPLITS_PAD):
        part_out = tl.load(
            part_out_ptr + (first_row + part)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
            mask=row_valid[:, None] & (part < num_splits),
            other=0.0,
            cache_modifier=".cg",
        )
        weight = tl.sum(tl.where(offs_s[None, :] == part, weights, 0.0), axis=1)
        merged += part_out * weight[:, None]
    return merged / tl.where(w_all > 0.0, w_all, 1.0)[:, None]


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM]
    part_out_ptr,  # [num_tokens, num_q_heads, num_splits, HEAD_DIM_PAD] fp32, each split normalised
    part_lse_ptr,  # [num_tokens, num_q_heads, num_splits] fp32, log2 of each split's exp2-sum
    num_q_heads,
    num_splits,
    stride_o_tok,
    stride_o_head,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS_PAD: tl.constexpr,
):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    row = (tok * num_q_heads + head) * num_splits
    lse = tl.load(part_lse_ptr + row + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    # Every token sees at least itself, so at least one split has a finite log-sum.
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # [NUM_SPLITS_PAD]
    part = tl.load(
        part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=(offs_s < num_splits)[:, None],
        other=0.0,
    )  # [NUM_SPLITS_PAD, HEAD_DIM_PAD]
    merged = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is tiled; ``plan_launch`` picks it, tests and benchmarks may force it."""

    block_q: int
    """Query tokens per program; times the padded GQA group it is the tile's M (>= 16 for tl.dot)."""
    block_n: int
    """Keys per inner-loop step: a multiple of the 16-token page, so one step reads whole pages."""
    num_splits: int
    """Parts the key range is cut into (split-KV); 1 writes the output directly, no merge."""
    num_warps: int = 4
    num_stages: int = 2
    fuse_merge: bool = False
    """Split results merged by the last split to finish, in the same kernel, not by a second one."""
    decode_path: bool = True
    """A pure decode batch takes the search-free path (program i is sequence i); False searches."""
    prefetch_pages: bool = False
    """Each key tile's page numbers read one loop step ahead: an experiment no plan picks (run 8)."""
    gathered_merge: bool = False
    """With ``fuse_merge``: every split's result loaded at once, not one after another (an experiment)."""


@lru_cache(maxsize=8)
def wide_tiles_fit(device: torch.device) -> bool:
    """Whether one program may stage 128-key K and V tiles (``WIDE_TILE_SHARED_BYTES``)."""
    if device.type != "cuda" or INTERPRETING:
        return False
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0)) >= WIDE_TILE_SHARED_BYTES


@lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # the interpreter: a small "GPU", so CI exercises split-KV on small shapes
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


_ARRIVALS: dict[tuple[torch.device, int], torch.Tensor] = {}
MIN_ARRIVAL_COUNTERS = 4096
"""Counters allocated at least: a split plan has fewer programs than 2 x SMs, far below this."""


def _arrival_counters(device: torch.device, needed: int) -> torch.Tensor | None:
    """Zeroed int32 counters for the fused merge, one set per device and stream, kept across calls.

    The merging program zeroes its counter again, so they stay zero between calls without a
    memset. None (use the merge kernel) when more are needed while a CUDA graph is being captured:
    a buffer allocated there would belong to the graph's memory pool.
    """
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    counters = _ARRIVALS.get(key)
    if counters is None or counters.numel() < needed:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        counters = torch.zeros(max(needed, MIN_ARRIVAL_COUNTERS), dtype=torch.int32, device=device)
        _ARRIVALS[key] = counters
    return counters


def plan_launch(
    *,
    num_seqs: int,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    multiprocessors: int,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
    programs_per_sm: float = PROGRAMS_PER_SM,
    max_splits: int = MAX_SPLITS,
    fit_block_n_to_split: bool = FIT_BLOCK_N_TO_SPLIT,
    decode_block_n: int | None = None,
    wide_tiles: bool = False,
) -> LaunchConfig:
    """Choose the tiling for one call from host-side sizes only (no device sync, graph-safe).

    Decode (every sequence brings one token) is memory-bound: M is the smallest tile tl.dot takes
    and the key range is split until there are about ``programs_per_sm`` programs per
    multiprocessor, keeping at least ``min_tokens_per_split`` keys per split and at most
    ``max_splits`` splits. A decode tile takes the most keys (BLOCK_N) the shared-memory budget
    allows, at most ``decode_block_n`` when given (a power of two >= 16), and with
    ``fit_block_n_to_split`` no more than one split holds, so short splits load no masked keys.
    With ``wide_tiles`` (the GPU has the shared memory, see ``WIDE_BLOCK_N``) a launch of at least
    ``WIDE_TILE_MIN_SPLITS`` splits takes 128-key tiles (head_dim <= 128).
    Prefill is compute-bound: a larger M reuses each K/V tile for more query rows. The keyword
    defaults are the rule in use, chosen from measurements (H200 run 2, see ``MIN_TOKENS_PER_SPLIT``);
    ``bench/kernels/fit_splits.py`` passes others to compare rules on measured data. The split count
    is a runtime kernel argument, so a new pick costs no compile.
    """
    group_pad = triton.next_power_of_2(queries_per_kv)
    decode = max_query_len <= 1
    # On sm_75 Triton lowers tl.dot to fp32 FMA and stages both operands in shared memory as
    # fp32: (M + N) * head_dim_pad * 4 bytes. Keep that within 48 KB of the T4's 64 KB.
    rows = SHARED_BUDGET_BYTES // (4 * triton.next_power_of_2(head_dim))
    block_m = 16 if decode else min(64, max(16, rows - 32))
    block_q = max(1, block_m // group_pad)
    spare = max(16, min(64 if decode else 32, rows - block_q * group_pad))
    block_n = 1 << (spare.bit_length() - 1)  # tl.arange takes powers of two
    q_tiles = num_seqs if decode else num_tokens // block_q + num_seqs
    programs = q_tiles * num_kv_heads
    splits = 1
    target = programs_per_sm * multiprocessors
    if programs < target:
        by_length = max(1, max_seq_len // max(1, min_tokens_per_split))
        splits = max(1, min(math.ceil(target / programs), by_length, max_splits))
    if decode and wide_tiles and splits >= WIDE_TILE_MIN_SPLITS and triton.next_power_of_2(head_dim) <= 128:
        block_n = WIDE_BLOCK_N
    if decode and decode_block_n is not None:
        block_n = max(16, min(block_n, triton.next_power_of_2(decode_block_n)))
    if decode and fit_block_n_to_split and splits > 1:
        keys_per_split = math.ceil(max_seq_len / splits)
        while block_n > 16 and block_n > keys_per_split:
            block_n //= 2
    # Measured side by side (runs 5a/5b and 6, see MAX_FUSED_SPLITS, MAX_FUSED_SPLITS_NARROW and
    # DECODE_PATH_MAX_PROGRAMS_PER_SM): the search-free decode path is faster where the launch
    # splits and, unsplit, up to about 4 programs per SM; above that (7B batch 256) it was 5-8 %
    # slower, so the searching path stays there.
    fused_limit = MAX_FUSED_SPLITS if block_n >= WIDE_BLOCK_N else MAX_FUSED_SPLITS_NARROW
    return LaunchConfig(
        block_q=block_q,
        block_n=block_n,
        num_splits=splits,
        fuse_merge=1 < splits <= fused_limit,
        decode_path=splits > 1 or programs <= DECODE_PATH_MAX_PROGRAMS_PER_SM * multiprocessors,
    )


def compiled_variants() -> int | None:
    """How many compiled variants of the two kernels this process holds (None under the interpreter).

    Each new one was a JIT compile on first use; a serving engine that meets one mid-traffic
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
    prefetch_pages: bool = False
    gathered_merge_pad: int = 0
    """The fused merge's MERGE_SPLITS_PAD (compiled per value); 0 for the loop in use."""


def merge_splits_pad(config: LaunchConfig) -> int:
    """MERGE_SPLITS_PAD for a launch: the split count padded to a power of two when the fused
    merge gathers (``gathered_merge``), else 0 (the runtime loop, one compile for every count)."""
    gathered = config.num_splits > 1 and config.fuse_merge and config.gathered_merge
    return triton.next_power_of_2(config.num_splits) if gathered else 0


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
        prefetch_pages=config.prefetch_pages,
        gathered_merge_pad=merge_splits_pad(config),
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
    flight for as long as the compile takes (a second or more). SLO run 6 saw this kernel compile
    in the middle of serving. ``precompile`` compiles all of these before traffic instead.
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
        multiprocessors=_multiprocessors(query.device),
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


def paged_attention(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, 16, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, 16, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    *,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached keys and values.

    The new tokens' keys and values must already be in the cache (vLLM writes them first).
    ``max_query_len`` and ``max_seq_len`` are host-side bounds used only to pick the tiling.
    Returns ``out`` (allocated like ``query`` when not given).
    """
    num_tokens, num_q_heads, head_dim = query.shape
    _, page_size, num_kv_heads, cache_head_dim = key_cache.shape
    if page_size != PAGE_SIZE:
        raise ValueError(f"KV cache block size is {page_size}; tile attention reads {PAGE_SIZE}-token blocks")
    if cache_head_dim != head_dim or head_dim % 16 != 0:
        raise ValueError(f"head_dim {head_dim} (cache {cache_head_dim}) must match and be a multiple of 16")
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"{num_q_heads} query heads do not divide into {num_kv_heads} kv heads")
    if query.dtype not in (torch.float16, torch.bfloat16) or key_cache.dtype != query.dtype:
        raise ValueError(f"query {query.dtype} and cache {key_cache.dtype} must both be float16 or bfloat16")
    if out is None:
        out = torch.empty_like(query)
    if query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError("query and out must be contiguous in their last (head_dim) dimension")
    if num_tokens == 0:
        return out
    num_seqs = seq_lens.shape[0]
    queries_per_kv = num_q_heads // num_kv_heads
    if config is None:
        config = plan_launch(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            num_kv_heads=num_kv_heads,
            queries_per_kv=queries_per_kv,
            head_dim=head_dim,
            multiprocessors=_multiprocessors(query.device),
            wide_tiles=wide_tiles_fit(query.device),
        )
    head_dim_pad = triton.next_power_of_2(head_dim)
    splits = config.num_splits
    if splits > 1:
        part_out = torch.empty(
            (num_tokens, num_q_heads, splits, head_dim_pad), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty((num_tokens, num_q_heads, splits), dtype=torch.float32, device=query.device)
    else:
        part_out = part_lse = out  # never touched: without SPLIT_KV that branch is compiled out
    # A pure decode batch (one new token per sequence) may take the kernel's search-free path.
    decode = config.decode_path and max_query_len <= 1 and num_tokens == num_seqs
    grid = (num_seqs if decode else num_tokens // config.block_q + num_seqs, num_kv_heads, splits)
    arrivals = _arrival_counters(query.device, grid[0] * num_kv_heads) if splits > 1 and config.fuse_merge else None
    _paged_attention_kernel[grid](
        out,
        part_out,
        part_lse,
        seq_lens if arrivals is None else arrivals,  # never touched without FUSE_MERGE
        query,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        query_start_loc,
        num_seqs,
        num_q_heads,
        splits,
        scale * math.log2(math.e),
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        *key_cache.stride(),
        *value_cache.stride(),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        PAGE_SIZE=PAGE_SIZE,
        QUERIES_PER_KV=queries_per_kv,
        QUERIES_PER_KV_PAD=triton.next_power_of_2(queries_per_kv),
        BLOCK_Q=config.block_q,
        BLOCK_N=config.block_n,
        SPLIT_KV=splits > 1,
        DECODE=decode,
        FUSE_MERGE=arrivals is not None,
        PREFETCH_PAGES=config.prefetch_pages,
        MERGE_SPLITS_PAD=merge_splits_pad(config) if arrivals is not None else 0,
        INTERPRETER_BF16=INTERPRETING and query.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1 and arrivals is None:
        _merge_splits_kernel[(num_tokens, num_q_heads)](
            out,
            part_out,
            part_lse,
            num_q_heads,
            splits,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS_PAD=triton.next_power_of_2(splits),
            num_warps=4,
        )
    return out
