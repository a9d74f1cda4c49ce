"""The benchmark's layout baselines measure what they say: consecutive pages, and a gather of the scattered ones."""

from __future__ import annotations

import torch
from flashmodel_kernels.reference import relative_error

from bench.kernels.bench_attention import (
    contiguous_pages,
    decode_inputs,
    decode_reference,
    gather_kernel,
    tile_kernel,
)


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
