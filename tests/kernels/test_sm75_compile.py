"""The fp16 path compiles for the T4 (sm_75) within its limits, without a T4: Triton needs no device."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from flashmodel_kernels.plan import LaunchConfig, plan_launch
from flashmodel_kernels.targets import (
    T4_SHARED_MEMORY_BYTES,
    EngineLayout,
    compile_tile_attention,
    launch_argument_specialization,
)

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


@pytest.mark.parametrize("specialize", [True, False])
def test_argument_specialization_is_tritons(specialize: bool) -> None:
    # The report compiles what a launch compiles only if it specialises integers as Triton does.
    jit = pytest.importorskip("triton.runtime.jit")
    native = getattr(jit, "native_specialize_impl", None)
    if native is None:
        pytest.skip("this Triton has no native_specialize_impl to compare with")
    from triton.backends.compiler import BaseBackend

    for value in (1, 2, 6, 12, 16, 48, 128, 256, 1536, 2**31 - 16, 2**31 + 16, 2**33):
        kind, attrs = launch_argument_specialization(value, specialize=specialize)
        theirs = native(BaseBackend, value, False, specialize, True)
        assert kind == theirs[0], (value, kind, theirs)
        if kind != "constexpr":
            assert bool(attrs) == (theirs[1] == "D"), (value, attrs, theirs)


def test_sm90_report_is_the_pipelined_kernel() -> None:
    # Compiled with a launch's specialisation (unit K/V dim stride, strides divisible by 16), the
    # decode loop's K/V loads become cp.async on sm_90, which only vectorised loads can; without
    # it they did not, a kernel no GPU runs.
    config = LaunchConfig(block_q=2, block_n=64, num_splits=3, fuse_merge=True)
    pipelined = compile_tile_attention(
        dtype=torch.float16, head_dim=128, queries_per_kv=6, config=config, arch=90, decode=True
    )
    assert pipelined[0].async_copies > 0, pipelined[0]
    unpipelined = compile_tile_attention(
        dtype=torch.float16,
        head_dim=128,
        queries_per_kv=6,
        config=replace(config, num_stages=1),
        arch=90,
        decode=True,
    )
    assert unpipelined[0].async_copies == 0, unpipelined[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compares with a kernel a GPU launch compiled")
def test_report_compiles_the_kernel_a_launch_runs() -> None:
    from flashmodel_kernels.paged_attention import _paged_attention_kernel, paged_attention

    kv_heads, queries_per_kv, head_dim, max_model_len, seqs = 2, 6, 128, 4096, 4
    q_heads = kv_heads * queries_per_kv
    device = torch.device("cuda")
    # As vLLM passes them: the query a view of the fused QKV output, the cache [blocks, 16, kv, d].
    qkv = torch.randn(seqs, (q_heads + 2 * kv_heads) * head_dim, dtype=torch.float16, device=device)
    query = qkv[:, : q_heads * head_dim].view(seqs, q_heads, head_dim)
    key_cache = torch.randn(64, 16, kv_heads, head_dim, dtype=torch.float16, device=device)
    value_cache = torch.randn_like(key_cache)
    block_table = torch.randint(0, 64, (seqs, max_model_len // 16), dtype=torch.int32, device=device)
    seq_lens = torch.full((seqs,), 300, dtype=torch.int32, device=device)
    query_start_loc = torch.arange(seqs + 1, dtype=torch.int32, device=device)
    config = LaunchConfig(block_q=2, block_n=64, num_splits=3, fuse_merge=True)
    caches = [entry[0] for entry in _paged_attention_kernel.device_caches.values()]
    kept = [dict(cache) for cache in caches]
    for cache in caches:
        cache.clear()  # so the launch below compiles (or loads from disk) exactly one kernel
    try:
        paged_attention(
            query,
            key_cache,
            value_cache,
            block_table,
            seq_lens,
            query_start_loc,
            max_query_len=1,
            max_seq_len=300,
            scale=head_dim**-0.5,
            config=config,
        )
        torch.cuda.synchronize()
        launched = [k for entry in _paged_attention_kernel.device_caches.values() for k in entry[0].values()]
    finally:
        for cache, old in zip(caches, kept, strict=True):
            cache.update(old)
    assert len(launched) == 1, launched
    major, minor = torch.cuda.get_device_capability(device)
    report = compile_tile_attention(
        dtype=torch.float16,
        head_dim=head_dim,
        queries_per_kv=queries_per_kv,
        config=config,
        arch=10 * major + minor,
        decode=True,
        layout=EngineLayout(num_kv_heads=kv_heads, max_model_len=max_model_len),
    )[0]
    ptx = launched[0].asm["ptx"]
    assert report.shared_bytes == launched[0].metadata.shared, (report, launched[0].metadata.shared)
    assert report.async_copies == sum(1 for line in ptx.splitlines() if "cp.async" in line), report
