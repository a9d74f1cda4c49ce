"""The fp16 path compiles for the T4 (sm_75) within its limits, without a T4: Triton needs no device."""

from __future__ import annotations

import pytest
import torch
from flashmodel_kernels.paged_attention import LaunchConfig, plan_launch
from flashmodel_kernels.targets import T4_SHARED_MEMORY_BYTES, compile_tile_attention

# (head_dim, queries_per_kv, max_query_len): Qwen2.5-1.5B and -7B decode and prefill, a 64-wide
# head without GQA, and the widest head the backend accepts.
SHAPES = [(128, 6, 1), (128, 7, 1), (128, 7, 512), (64, 1, 1), (256, 4, 512)]


@pytest.mark.parametrize(("head_dim", "queries_per_kv", "max_query_len"), SHAPES)
def test_fp16_kernels_fit_a_t4(head_dim: int, queries_per_kv: int, max_query_len: int) -> None:
    # num_seqs=1 at a 4096 context makes the plan split, so the merge kernel is compiled too.
    config = plan_launch(
        num_seqs=1,
        num_tokens=max_query_len,
        max_query_len=max_query_len,
        max_seq_len=4096,
        num_kv_heads=2,
        queries_per_kv=queries_per_kv,
        head_dim=head_dim,
        multiprocessors=40,
    )
    reports = compile_tile_attention(
        dtype=torch.float16,
        head_dim=head_dim,
        queries_per_kv=queries_per_kv,
        config=config,
        decode=max_query_len == 1,
    )
    assert len(reports) == (2 if config.num_splits > 1 and not config.fuse_merge else 1)
    for report in reports:
        assert report.target == "sm_75"
        assert report.ptx_lines > 100, report  # a real kernel body, not an empty compile
        assert report.shared_bytes <= T4_SHARED_MEMORY_BYTES, report
        assert report.bf16_instructions == 0, report
        assert report.tf32_instructions == 0, report


def test_fused_merge_compiles_for_a_t4_as_one_kernel() -> None:
    # The merge folded into the attention kernel (an acq_rel atomic: sm_70 and later).
    config = LaunchConfig(block_q=2, block_n=32, num_splits=4, fuse_merge=True)
    reports = compile_tile_attention(dtype=torch.float16, head_dim=128, queries_per_kv=6, config=config, decode=True)
    assert [r.kernel for r in reports] == ["_paged_attention_kernel"]
    assert reports[0].shared_bytes <= T4_SHARED_MEMORY_BYTES, reports[0]
    assert reports[0].bf16_instructions == 0 and reports[0].tf32_instructions == 0, reports[0]
