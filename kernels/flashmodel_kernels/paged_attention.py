# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton JIT functions take untyped pointer and stride arguments by design: Triton reads their
# annotations only for constexpr. The typed launcher beside them carries the types.)
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
tile to finish (``fuse_merge``) or by the merge kernel (``merge.py``). A pure decode batch (one new token per
sequence) can skip the search that maps programs to sequences (``decode_path``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from flashmodel_kernels._triton import INTERPRETING, tl, triton
from flashmodel_kernels.merge import merge_split_rows, merge_splits
from flashmodel_kernels.plan import (
    PAGE_SIZE,
    SPLIT_GRANULE,
    LaunchConfig,
    multiprocessor_count,
    plan_launch,
    wide_tiles_fit,
)

__all__ = ["SplitWorkspace", "paged_attention"]


@triton.jit
def split_keys(kv_end, split, num_splits, GRANULE: tl.constexpr):
    """Keys [begin, end) of one split of a key range of ``kv_end`` keys: whole granules (a few
    pages) shared out evenly.

    Granules, not key tiles, are what is shared out: a plan fixed for a long sequence (a captured
    CUDA graph plans for ``max_model_len``) then still spreads a short one over as many splits as
    it has granules, instead of leaving all but one or two of them empty. A split's last tile may
    run past its end: those keys are masked and never loaded. ``end <= begin`` for an empty split.
    """
    granules_per_split = tl.cdiv(tl.cdiv(kv_end, GRANULE), num_splits)
    key_begin = split * granules_per_split * GRANULE
    return key_begin, tl.minimum(key_begin + granules_per_split * GRANULE, kv_end)


@triton.jit
def attend_keys(
    q,
    m_i,
    l_i,
    acc,
    key_begin,
    key_end,
    k_cache_ptr,
    v_cache_ptr,
    block_row,
    kv_head,
    q_pos,
    row_valid,
    offs_d,
    dim_valid,
    qk_scale_log2,
    stride_k_blk,
    stride_k_tok,
    stride_k_head,
    stride_k_dim,
    stride_v_blk,
    stride_v_tok,
    stride_v_head,
    stride_v_dim,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    INTERPRETER_BF16: tl.constexpr,
):
    """The online softmax over keys [key_begin, key_end) in BLOCK_N-key steps: returns m_i, l_i, acc."""
    offs_n = tl.arange(0, BLOCK_N)
    for kv_tile in range(0, tl.cdiv(tl.maximum(key_end - key_begin, 0), BLOCK_N)):
        key_pos = key_begin + kv_tile * BLOCK_N + offs_n
        key_valid = key_pos < key_end
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
    return m_i, l_i, acc


# num_splits is a runtime argument, not a constexpr: a new split count (a new batch size in eager
# serving, or a benchmark sweep) must not cost a compile. Only whether to split is compiled in.
# num_seqs likewise: Triton would otherwise compile a variant for 1, for multiples of 16 and for
# the rest, and a serving engine meets all three as its batch changes, each a stall of a second
# or so on first use, stalling every request in flight.
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
    SHORT_BLOCK_N: tl.constexpr,
    SPLIT_GRANULE: tl.constexpr,
    SPLIT_KV: tl.constexpr,
    DECODE: tl.constexpr,
    FUSE_MERGE: tl.constexpr,
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
    key_begin, key_end = split_keys(kv_end, split, num_splits, SPLIT_GRANULE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_row = block_table_ptr + seq * stride_bt_seq
    if SHORT_BLOCK_N < BLOCK_N:
        # A split much shorter than a tile (a short sequence under a plan made for a long one,
        # as a captured graph's is) takes short tiles: a long one would be mostly masked keys
        # whose products and softmax are computed all the same.
        if key_end - key_begin <= 2 * SHORT_BLOCK_N:
            m_i, l_i, acc = attend_keys(
                q, m_i, l_i, acc, key_begin, key_end, k_cache_ptr, v_cache_ptr, block_row, kv_head,
                q_pos, row_valid, offs_d, dim_valid, qk_scale_log2,
                stride_k_blk, stride_k_tok, stride_k_head, stride_k_dim,
                stride_v_blk, stride_v_tok, stride_v_head, stride_v_dim,
                PAGE_SIZE, SHORT_BLOCK_N, INTERPRETER_BF16,
            )  # fmt: skip
        else:
            m_i, l_i, acc = attend_keys(
                q, m_i, l_i, acc, key_begin, key_end, k_cache_ptr, v_cache_ptr, block_row, kv_head,
                q_pos, row_valid, offs_d, dim_valid, qk_scale_log2,
                stride_k_blk, stride_k_tok, stride_k_head, stride_k_dim,
                stride_v_blk, stride_v_tok, stride_v_head, stride_v_dim,
                PAGE_SIZE, BLOCK_N, INTERPRETER_BF16,
            )  # fmt: skip
    else:
        m_i, l_i, acc = attend_keys(
            q, m_i, l_i, acc, key_begin, key_end, k_cache_ptr, v_cache_ptr, block_row, kv_head,
            q_pos, row_valid, offs_d, dim_valid, qk_scale_log2,
            stride_k_blk, stride_k_tok, stride_k_head, stride_k_dim,
            stride_v_blk, stride_v_tok, stride_v_head, stride_v_dim,
            PAGE_SIZE, BLOCK_N, INTERPRETER_BF16,
        )  # fmt: skip

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
                merged = merge_split_rows(
                    part_out_ptr, part_lse_ptr, first_row, row_valid, num_splits, BLOCK_M, HEAD_DIM_PAD
                )
                o_rows = tok_global * stride_o_tok + q_head * stride_o_head
                tl.store(
                    out_ptr + o_rows[:, None] + offs_d[None, :],
                    merged.to(out_ptr.dtype.element_ty),
                    mask=row_valid[:, None] & dim_valid[None, :],
                )
                tl.store(arrivals, 0)  # zero again for the next call: no memset per call


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


@dataclass(frozen=True)
class SplitWorkspace:
    """Split-KV scratch allocated once and read by every call: what a captured CUDA graph needs.

    A graph replays the pointers it captured, so the scratch of a split launch must outlive the
    capture and be the same memory on every replay (vLLM's own backends keep theirs the same way).
    ``part_out`` and ``part_lse`` are flat fp32 buffers of ``rows`` split rows; ``arrivals`` the
    fused merge's counters, zero between calls (the merging program zeroes its own again).
    """

    part_out: torch.Tensor
    part_lse: torch.Tensor
    arrivals: torch.Tensor

    @classmethod
    def allocate(cls, *, rows: int, head_dim: int, counters: int, device: torch.device | str) -> SplitWorkspace:
        head_dim_pad = triton.next_power_of_2(head_dim)
        return cls(
            part_out=torch.empty(max(1, rows) * head_dim_pad, dtype=torch.float32, device=device),
            part_lse=torch.empty(max(1, rows), dtype=torch.float32, device=device),
            arrivals=torch.zeros(max(1, counters), dtype=torch.int32, device=device),
        )

    def views(
        self, num_tokens: int, num_q_heads: int, num_splits: int, head_dim_pad: int
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``part_out`` and ``part_lse`` shaped for one launch, or None where they are too small."""
        rows = num_tokens * num_q_heads * num_splits
        if rows > self.part_lse.numel() or rows * head_dim_pad > self.part_out.numel():
            return None
        return (
            self.part_out[: rows * head_dim_pad].view(num_tokens, num_q_heads, num_splits, head_dim_pad),
            self.part_lse[:rows].view(num_tokens, num_q_heads, num_splits),
        )


def _checked_out(query: torch.Tensor, key_cache: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``out`` (allocated like ``query`` when None) once the shapes, dtypes and strides are ones the kernel reads."""
    num_q_heads, head_dim = query.shape[1:]
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
    return out


def _split_scratch(
    query: torch.Tensor,
    out: torch.Tensor,
    config: LaunchConfig,
    workspace: SplitWorkspace | None,
    grid: tuple[int, int, int],
    head_dim_pad: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(part_out, part_lse, the fused merge's counters or None) of one launch: the workspace's where they fit."""
    num_tokens, num_q_heads = query.shape[:2]
    splits = config.num_splits
    if splits == 1:
        return out, out, None  # never touched: without SPLIT_KV that branch is compiled out
    views = workspace.views(num_tokens, num_q_heads, splits, head_dim_pad) if workspace else None
    if views is not None:
        part_out, part_lse = views
    else:
        part_out = torch.empty(
            (num_tokens, num_q_heads, splits, head_dim_pad), dtype=torch.float32, device=query.device
        )
        part_lse = torch.empty((num_tokens, num_q_heads, splits), dtype=torch.float32, device=query.device)
    if not config.fuse_merge:
        return part_out, part_lse, None
    needed = grid[0] * grid[1]
    if workspace is not None and workspace.arrivals.numel() >= needed:
        return part_out, part_lse, workspace.arrivals
    return part_out, part_lse, _arrival_counters(query.device, needed)


def _device_plan(
    query: torch.Tensor, num_kv_heads: int, num_seqs: int, max_query_len: int, max_seq_len: int
) -> LaunchConfig:
    """``plan_launch``'s tiling for this call on the query's device."""
    num_tokens, num_q_heads, head_dim = query.shape
    return plan_launch(
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        num_kv_heads=num_kv_heads,
        queries_per_kv=num_q_heads // num_kv_heads,
        head_dim=head_dim,
        multiprocessors=multiprocessor_count(query.device),
        wide_tiles=wide_tiles_fit(query.device),
    )


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
    workspace: SplitWorkspace | None = None,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached keys and values.

    The new tokens' keys and values must already be in the cache (vLLM writes them first).
    ``max_query_len`` and ``max_seq_len`` are host-side bounds used only to pick the tiling.
    A split launch keeps its scratch in ``workspace`` where it fits, else allocates it. Nothing
    here reads a device value on the host: every per-sequence length is read by the kernel, so a
    launch captured in a CUDA graph stays right for any lengths a replay brings (``graph.py``).
    Returns ``out`` (allocated like ``query`` when not given).
    """
    out = _checked_out(query, key_cache, out)
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    if num_tokens == 0:
        return out
    num_seqs = seq_lens.shape[0]
    queries_per_kv = num_q_heads // num_kv_heads
    if config is None:
        config = _device_plan(query, num_kv_heads, num_seqs, max_query_len, max_seq_len)
    head_dim_pad = triton.next_power_of_2(head_dim)
    splits = config.num_splits
    # A pure decode batch (one new token per sequence) may take the kernel's search-free path.
    decode = config.decode_path and max_query_len <= 1 and num_tokens == num_seqs
    grid = (num_seqs if decode else num_tokens // config.block_q + num_seqs, num_kv_heads, splits)
    part_out, part_lse, arrivals = _split_scratch(query, out, config, workspace, grid, head_dim_pad)
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
        SHORT_BLOCK_N=config.short_block_n,
        SPLIT_GRANULE=SPLIT_GRANULE,
        SPLIT_KV=splits > 1,
        DECODE=decode,
        FUSE_MERGE=arrivals is not None,
        INTERPRETER_BF16=INTERPRETING and query.dtype == torch.bfloat16,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    if splits > 1 and arrivals is None:
        merge_splits(out, part_out, part_lse)
    return out
