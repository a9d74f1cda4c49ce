# mypy: disable-error-code="untyped-decorator,no-untyped-def"
# (Triton JIT functions take untyped pointer and stride arguments by design: Triton reads their
# annotations only for constexpr. The typed launcher beside them carries the types.)
"""Merging split-KV results: each split's normalised output weighted by its log2-sum-exp2.

Split ``s`` of a row wrote ``part_out[s]`` (its softmax-normalised output) and ``part_lse[s]``
(log2 of its exp2-sum, -inf for a split that saw no key); the merged row is
``sum_s 2**part_lse[s] * part_out[s] / sum_s 2**part_lse[s]``. ``merge_split_rows`` does it
inside the attention kernel (the fused merge), ``merge_splits`` as a second kernel.
"""

from __future__ import annotations

import torch

from flashmodel_kernels._triton import tl, triton

__all__ = ["merge_split_rows", "merge_splits"]


@triton.jit
def merge_split_rows(
    part_out_ptr,  # [num_tokens, num_q_heads, num_splits, HEAD_DIM_PAD] fp32, each split normalised
    part_lse_ptr,  # [num_tokens, num_q_heads, num_splits] fp32, log2 of each split's exp2-sum
    first_row,  # [BLOCK_M] index of each row's first split in part_lse
    row_valid,  # [BLOCK_M]
    num_splits,
    BLOCK_M: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """The fused merge: splits read in a loop, each rescaling the running result.

    Returns the merged rows, [BLOCK_M, HEAD_DIM_PAD] fp32.
    """
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
    # A real token sees at least itself, so one split has a finite log-sum; a padded slot of a
    # CUDA-graph batch (sequence length 0) has none and must still come out finite: zeros.
    lse_max = tl.max(lse, axis=0)
    weight = tl.exp2(lse - tl.where(lse_max == float("-inf"), 0.0, lse_max))  # [NUM_SPLITS_PAD]
    part = tl.load(
        part_out_ptr + (row + offs_s)[:, None] * HEAD_DIM_PAD + offs_d[None, :],
        mask=(offs_s < num_splits)[:, None],
        other=0.0,
    )  # [NUM_SPLITS_PAD, HEAD_DIM_PAD]
    weight_sum = tl.sum(weight, axis=0)
    merged = tl.sum(part * weight[:, None], axis=0) / tl.where(weight_sum > 0.0, weight_sum, 1.0)
    tl.store(
        out_ptr + tok * stride_o_tok + head * stride_o_head + offs_d,
        merged.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def merge_splits(out: torch.Tensor, part_out: torch.Tensor, part_lse: torch.Tensor) -> None:
    """Write each row of ``out`` ([num_tokens, num_q_heads, head_dim]) merged from its splits.

    ``part_out`` is [num_tokens, num_q_heads, num_splits, head_dim_pad] fp32 and contiguous,
    ``part_lse`` [num_tokens, num_q_heads, num_splits] fp32 and contiguous.
    """
    num_tokens, num_q_heads, head_dim = out.shape
    splits, head_dim_pad = part_out.shape[2], part_out.shape[3]
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
