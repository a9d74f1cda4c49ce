# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (a Triton JIT function takes untyped pointer and stride arguments by design)
"""The load floor: tile attention's memory walk with nothing else, to split its fixed cost.

Kernel run 8 (docs/benchmarks.md) left a fixed ~11 us per decode call that misses the bandwidth
goal on the smallest goal shapes, and said it is the kernel's chain of dependent steps. This
kernel makes the same walk as a split decode launch of ``paged_attention`` (grid: sequence x kv
head x split; sequence length, then each key tile's page numbers, then its K and V tiles, with
the same split ranges) and only sums what it loads: no dot product, no softmax, no merge. Timed
beside the attention and the copy of the same bytes on the GPU:

- attention minus floor = the arithmetic, the split merge and whatever they stall;
- floor minus copy = the paged walk itself (the dependent loads and the scattered pages).

It writes each program's sums of K and V (fp32, one row per head dimension), which a test
checks against the cache, so the floor is known to read exactly the bytes the attention reads.
"""

from __future__ import annotations

import torch
from flashmodel_kernels._triton import tl, triton
from flashmodel_kernels.paged_attention import PAGE_SIZE, LaunchConfig, split_tiles


@triton.jit(do_not_specialize=["num_splits"])
def _load_floor_kernel(
    sums_ptr,  # [num_seqs, num_kv_heads, num_splits, 2, HEAD_DIM] fp32: sums of K, then of V
    k_cache_ptr,
    v_cache_ptr,
    block_table_ptr,
    seq_lens_ptr,
    num_splits,
    stride_k_blk,
    stride_k_tok,
    stride_k_head,
    stride_v_blk,
    stride_v_tok,
    stride_v_head,
    stride_bt_seq,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    tile_begin, tile_end = split_tiles(seq_len, split, num_splits, BLOCK_N)  # the attention's ranges
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, HEAD_DIM)
    block_row = block_table_ptr + seq * stride_bt_seq
    k_sum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    v_sum = tl.zeros([HEAD_DIM], dtype=tl.float32)
    for kv_tile in range(tile_begin, tile_end):
        key_pos = kv_tile * BLOCK_N + offs_n
        key_valid = key_pos < seq_len
        page = tl.load(block_row + key_pos // PAGE_SIZE, mask=key_valid, other=0).to(tl.int64)
        slot = key_pos % PAGE_SIZE
        k_rows = page * stride_k_blk + slot * stride_k_tok + kv_head * stride_k_head
        v_rows = page * stride_v_blk + slot * stride_v_tok + kv_head * stride_v_head
        k = tl.load(k_cache_ptr + k_rows[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        v = tl.load(v_cache_ptr + v_rows[:, None] + offs_d[None, :], mask=key_valid[:, None], other=0.0)
        k_sum += tl.sum(k.to(tl.float32), axis=0)
        v_sum += tl.sum(v.to(tl.float32), axis=0)
    row = ((seq * tl.num_programs(1) + kv_head) * num_splits + split) * 2
    tl.store(sums_ptr + row * HEAD_DIM + offs_d, k_sum)
    tl.store(sums_ptr + (row + 1) * HEAD_DIM + offs_d, v_sum)


def load_floor(
    key_cache: torch.Tensor,  # [num_blocks, 16, num_kv_heads, head_dim], last dimension contiguous
    value_cache: torch.Tensor,
    block_table: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    config: LaunchConfig,
    sums: torch.Tensor | None = None,  # [num_seqs, num_kv_heads, num_splits, 2, head_dim] fp32
) -> torch.Tensor:
    """Walk the cache as a decode launch with ``config``'s splits and key tile would; return the sums."""
    _, page_size, num_kv_heads, head_dim = key_cache.shape
    if page_size != PAGE_SIZE or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the load floor reads 16-token pages whose head dimension is contiguous")
    if head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim}: the load floor takes powers of two (the goal shapes' 128)")
    num_seqs = seq_lens.shape[0]
    if sums is None:
        sums = torch.empty(
            (num_seqs, num_kv_heads, config.num_splits, 2, head_dim), dtype=torch.float32, device=key_cache.device
        )
    _load_floor_kernel[(num_seqs, num_kv_heads, config.num_splits)](
        sums,
        key_cache,
        value_cache,
        block_table,
        seq_lens,
        config.num_splits,
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_table.stride(0),
        HEAD_DIM=head_dim,
        PAGE_SIZE=PAGE_SIZE,
        BLOCK_N=config.block_n,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return sums
