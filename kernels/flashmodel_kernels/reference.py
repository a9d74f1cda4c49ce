"""Float64 reference attention over a paged KV cache, and random paged inputs to test it against.

The reference gathers each sequence's keys and values out of the pages in plain PyTorch and
computes softmax attention in float64: slow, obviously right, and the yardstick for the kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PagedBatch", "random_paged_batch", "reference_attention", "relative_error"]


@dataclass
class PagedBatch:
    """One batch of attention inputs in vLLM's paged layout (the kernels' calling convention)."""

    query: torch.Tensor  # [num_tokens, num_q_heads, head_dim]
    key_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor  # [num_blocks, page_size, num_kv_heads, head_dim]
    block_table: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    query_lens: list[int]
    context_lens: list[int]
    scale: float

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(q + c for q, c in zip(self.query_lens, self.context_lens, strict=True))


def random_paged_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    page_size: int = 16,
    spare_blocks: int = 3,
    packed_kv: bool = True,
    generator: torch.Generator | None = None,
) -> PagedBatch:
    """Random queries and cache contents, pages of each sequence scattered over a shuffled pool.

    ``packed_kv`` lays K and V out the way vLLM 0.26 does (one tensor, K and V side by side in
    the last dimension, so neither view is contiguous); otherwise two contiguous caches. Pages
    nobody owns hold random values too: a kernel that reads past a sequence's end reads noise.
    """
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens must have one entry per sequence")
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_per_seq = [-(-n // page_size) for n in seq_lens]
    max_blocks = max(max(blocks_per_seq), 1)
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    # Unused table entries point at a real page on purpose: only seq_lens may bound the reads.
    block_table = torch.full((len(seq_lens), max_blocks), int(perm[-1]), dtype=torch.int32)
    start = 0
    for i, n in enumerate(blocks_per_seq):
        block_table[i, :n] = perm[start : start + n]
        start += n

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, dtype=torch.float32).to(dtype)

    if packed_kv:
        kv = randn(num_blocks, page_size, num_kv_heads, 2 * head_dim).to(device)
        key_cache, value_cache = kv[..., :head_dim], kv[..., head_dim:]
    else:
        key_cache = randn(num_blocks, page_size, num_kv_heads, head_dim).to(device)
        value_cache = randn(num_blocks, page_size, num_kv_heads, head_dim).to(device)
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return PagedBatch(
        query=randn(starts[-1], num_q_heads, head_dim).to(device),
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=block_table.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        query_lens=list(query_lens),
        context_lens=list(context_lens),
        scale=head_dim**-0.5,
    )


def reference_attention(batch: PagedBatch) -> torch.Tensor:
    """Causal softmax attention in float64 on the inputs' device, ``[num_tokens, num_q_heads, head_dim]``."""
    num_q_heads = batch.query.shape[1]
    page_size, num_kv_heads = batch.key_cache.shape[1], batch.key_cache.shape[2]
    group = num_q_heads // num_kv_heads
    device = batch.query.device
    out = torch.empty(batch.query.shape, dtype=torch.float64, device=device)
    table = batch.block_table.cpu()
    q_start = 0
    for i, (q_len, ctx) in enumerate(zip(batch.query_lens, batch.context_lens, strict=True)):
        seq_len = q_len + ctx
        pos = torch.arange(seq_len)
        pages = table[i, pos // page_size].long().to(device)
        slots = (pos % page_size).to(device)
        k = batch.key_cache[pages, slots].double().repeat_interleave(group, dim=1)  # [seq_len, heads, d]
        v = batch.value_cache[pages, slots].double().repeat_interleave(group, dim=1)
        q = batch.query[q_start : q_start + q_len].double()  # [q_len, heads, d]
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        q_pos = ctx + torch.arange(q_len, device=device)
        causal = pos.to(device)[None, None, :] > q_pos[None, :, None]
        scores = scores.masked_fill(causal, float("-inf"))
        out[q_start : q_start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v)
        q_start += q_len
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere makes it NaN (never passes a < bound)."""
    diff = out.detach().cpu().double() - ref.cpu().double()
    return float(diff.norm() / ref.cpu().double().norm())
