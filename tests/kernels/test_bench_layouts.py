"""The benchmark's layout experiment measures what it says: consecutive pages, and a gather of the scattered ones."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench", "kernels"))
from bench_attention import (
    contiguous_pages,
    decode_inputs,
    decode_reference,
    floor_kernel,
    gather_kernel,
    tile_kernel,
)
from flashmodel_kernels.paged_attention import LaunchConfig
from flashmodel_kernels.reference import relative_error
from load_floor import load_floor


def test_contiguous_pages_are_consecutive_and_attention_on_them_is_exact(device: str) -> None:
    x = decode_inputs(3, 40, (6, 2, 64), torch.float16, torch.device(device))
    contiguous = contiguous_pages(x)
    pages = contiguous.tables.flatten()
    assert torch.equal(pages.cpu(), torch.arange(x.tables.numel(), dtype=torch.int32))
    assert sorted(pages.tolist()) == sorted(x.tables.flatten().tolist())  # the same pool, reordered
    scale = 64**-0.5
    x.outs.fill_(float("nan"))
    tile_kernel(contiguous, scale)(0)
    assert not torch.isnan(x.outs[0]).any()
    assert relative_error(x.outs[0], decode_reference(contiguous, scale, 0)) < 1e-3
    contiguous_out = x.outs[0].clone()
    # The scattered call reads other pages, so other keys: a different result, also exact.
    tile_kernel(x, scale)(0)
    assert relative_error(x.outs[0], decode_reference(x, scale, 0)) < 1e-3
    assert relative_error(x.outs[0], contiguous_out) > 1e-2


def test_gather_reads_the_tables_pages_in_order_and_moves_the_copys_bytes(device: str) -> None:
    x = decode_inputs(2, 48, (6, 2, 64), torch.float16, torch.device(device))
    run, moved, target = gather_kernel(x)
    assert moved == 2 * 2 * 48 * 2 * 64 * 2  # read + write of batch x context x kv_heads x head_dim fp16
    for copy in range(x.copies):
        target.fill_(float("nan"))
        run(copy)
        assert torch.equal(target, x.keys[x.tables[copy].flatten().long()])


@pytest.mark.parametrize(("splits", "block_n"), [(1, 16), (3, 32), (5, 64)])
def test_load_floor_reads_exactly_the_pages_a_split_launch_reads(splits: int, block_n: int, device: str) -> None:
    # Its sums per (sequence, kv head, split) must be the sums of exactly the keys and values of
    # that split's range; a wrong page, a key past seq_len or a missed tile changes a sum.
    x = decode_inputs(3, 75, (6, 2, 64), torch.float16, torch.device(device))
    x.seq_lens[1] = 40  # one shorter sequence: its later splits are empty and must sum to zero
    config = LaunchConfig(block_q=2, block_n=block_n, num_splits=splits)
    copy = x.copies - 1
    floor_kernel(x, config)(copy)  # what the benchmark times: runs on its inputs
    got = load_floor(x.keys, x.values, x.tables[copy], x.seq_lens, config)
    for seq, seq_len in enumerate(x.seq_lens.tolist()):
        tiles = -(-seq_len // block_n)
        per_split = -(-tiles // splits)
        for split in range(splits):
            begin = min(seq_len, split * per_split * block_n)
            end = min(seq_len, (split + 1) * per_split * block_n)
            pos = torch.arange(begin, end, device=x.keys.device)
            pages = x.tables[copy][seq, pos // 16].long()
            for cache, which in ((x.keys, 0), (x.values, 1)):
                want = cache[pages, pos % 16].float().sum(dim=0)  # [kv_heads, head_dim]
                torch.testing.assert_close(got[seq, :, split, which], want, rtol=1e-4, atol=1e-3)
