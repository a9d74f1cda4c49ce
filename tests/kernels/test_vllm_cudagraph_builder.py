"""The vLLM backend under CUDA graphs, through vLLM's own classes (whichever vLLM is installed).

vLLM keeps ``FULL_AND_PIECEWISE`` with the tile backend (no fallback to piecewise), the builder
hands every uniform decode step of a captured size the same plan and the same workspace, and the
backend's ``forward`` on such a padded step equals the float64 reference. On a GPU machine with
vLLM 0.26 (bench/kernels/gpu_run.sh) this runs against the version the engine image serves.
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import pytest
import torch

pytest.importorskip("vllm.v1.attention.backends.triton_attn", reason="engine tier: needs vLLM")
from flashmodel_kernels.graph import plan_for_graph
from flashmodel_kernels.reference import PagedBatch, reference_attention, relative_error
from flashmodel_kernels.vllm_backend import (
    PRECOMPILE_ENV,
    TileAttentionBackend,
    TileAttentionImpl,
    TileAttentionMetadata,
    TileAttentionMetadataBuilder,
)
from vllm.config import CompilationConfig, CUDAGraphMode
from vllm.config.compilation import CompilationMode
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, CommonAttentionMetadata

KV_HEADS = 2
HEAD_DIM = 64
MAX_MODEL_LEN = 512
CAPTURE_SIZES = [1, 2, 4, 8, 16]
MAX_BLOCKS = MAX_MODEL_LEN // 16


def make_builder(group: int, mode: CUDAGraphMode, device: str) -> TileAttentionMetadataBuilder:
    """The builder as vLLM makes it, from the parts of its config the Triton builder reads."""
    model = types.SimpleNamespace(
        get_num_attention_heads=lambda parallel: group * KV_HEADS,
        get_num_kv_heads=lambda parallel: KV_HEADS,
        get_head_size=lambda: HEAD_DIM,
        max_model_len=MAX_MODEL_LEN,
        rswa_window=None,
    )
    compilation = types.SimpleNamespace(
        # Capture sizes past max_num_seqs, as the t4 profile renders them (up to its batched-token
        # budget): piecewise graphs of mixed batches, never a decode batch.
        cudagraph_mode=mode,
        cudagraph_capture_sizes=[*CAPTURE_SIZES, 24, 32],
        static_forward_context={},
    )
    config = types.SimpleNamespace(
        model_config=model,
        compilation_config=compilation,
        parallel_config=None,
        scheduler_config=types.SimpleNamespace(max_num_seqs=max(CAPTURE_SIZES)),
        speculative_config=None,
    )
    return TileAttentionMetadataBuilder(types.SimpleNamespace(block_size=16), ["layer.0"], config, torch.device(device))


def step(
    query_lens: list[int], seq_lens: list[int], device: str, padded_to: int | None = None
) -> CommonAttentionMetadata:
    """One step as vLLM's runner describes it; ``padded_to``: a graph's padded slots appended."""
    size = padded_to or len(seq_lens)
    pad = size - len(seq_lens)
    starts = [0, *itertools.accumulate(query_lens)]
    starts += [starts[-1]] * pad  # vLLM repeats the last start for padded slots: no token of theirs
    tokens = starts[-1] + pad  # one (padded) token per padded slot
    start_loc = torch.tensor(starts, dtype=torch.int32)
    table = torch.zeros((size, MAX_BLOCKS), dtype=torch.int32)  # padded slots: the null page 0
    for i, n in enumerate(seq_lens):
        blocks = -(-n // 16)
        table[i, :blocks] = torch.arange(1 + i * MAX_BLOCKS, 1 + i * MAX_BLOCKS + blocks, dtype=torch.int32)
    return CommonAttentionMetadata(
        query_start_loc=start_loc.to(device),
        query_start_loc_cpu=start_loc,
        seq_lens=torch.tensor(seq_lens + [0] * pad, dtype=torch.int32, device=device),
        num_reqs=size,
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table.to(device),
        slot_mapping=torch.full((tokens,), -1, dtype=torch.int64, device=device),
        causal=True,
    )


def test_vllm_keeps_full_and_piecewise_graphs_with_the_tile_backend() -> None:
    # vLLM's own resolution, as its runner calls it with the backend's declared support: a
    # backend that declared NEVER is cut back (the log line); this one keeps full graphs
    # for decode and piecewise graphs around attention for mixed batches.
    support = TileAttentionBackend.get_builder_cls().get_cudagraph_support(None, None)  # type: ignore[arg-type]
    assert support == AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    config = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    resolved = config.resolve_cudagraph_mode_and_sizes(support, "TileAttentionBackend")
    assert resolved == CUDAGraphMode.FULL_AND_PIECEWISE
    never = CompilationConfig(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=CUDAGraphMode.FULL_AND_PIECEWISE)
    assert never.resolve_cudagraph_mode_and_sizes(AttentionCGSupport.NEVER, "X") != CUDAGraphMode.FULL_AND_PIECEWISE


def test_uniform_decode_of_a_captured_size_gets_one_plan_and_one_workspace(device: str) -> None:
    builder = make_builder(6, CUDAGraphMode.FULL_AND_PIECEWISE, device)
    plans = builder.graph_plans
    assert sorted(plans.plans) == CAPTURE_SIZES  # the full decode graphs vLLM captures: <= max_num_seqs
    for size in CAPTURE_SIZES:
        expected = plan_for_graph(size, plans.shape)
        # The capture build (vLLM sets every length to 1 there), then steps of other lengths and
        # fewer real sequences: one plan, one workspace, whatever the step brings.
        built = [builder.build_for_cudagraph_capture(step([1] * size, [MAX_MODEL_LEN] * size, device))]
        for real in {size, max(1, size - 1), 1}:
            for longest in (1, 37, MAX_MODEL_LEN):
                lens = [longest] + [1 + i for i in range(real - 1)]
                built.append(builder.build(0, step([1] * real, lens, device, padded_to=size)))
        assert all(isinstance(m, TileAttentionMetadata) for m in built)
        assert {m.tile_plan for m in built} == {expected}, size
        assert all(m.tile_workspace is plans.workspace for m in built)
    # Mixed batches and sizes never captured plan from the step's own sizes, eagerly.
    assert builder.build(0, step([1, 5, 1], [10, 20, 30], device)).tile_plan is None
    assert builder.build(0, step([1] * 3, [10, 20, 30], device)).tile_plan is None


@pytest.mark.parametrize("mode", [CUDAGraphMode.PIECEWISE, CUDAGraphMode.NONE])
def test_without_full_graphs_every_step_plans_eagerly(mode: CUDAGraphMode, device: str) -> None:
    builder = make_builder(6, mode, device)
    assert builder.graph_plans.plans == {}
    assert builder.build(0, step([1] * 4, [10, 20, 30, 40], device)).tile_plan is None


@pytest.mark.parametrize("group", [1, 6, 7])
def test_forward_on_a_padded_captured_step_equals_the_reference(
    group: int, device: str, generator: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The backend's own forward, on what a replay of the size-4 and size-2 graphs reads: two
    # real sequences then padded slots, and one sequence in a graph of two.
    monkeypatch.setenv(PRECOMPILE_ENV, "0")
    builder = make_builder(group, CUDAGraphMode.FULL_AND_PIECEWISE, device)
    impl: Any = TileAttentionImpl(
        group * KV_HEADS, HEAD_DIM, HEAD_DIM**-0.5, KV_HEADS, None, None, "auto", None, AttentionType.DECODER, None
    )
    num_blocks = 1 + max(CAPTURE_SIZES) * MAX_BLOCKS
    # vLLM 0.26's logical cache layout: [num_blocks, num_kv_heads, 16, 2 * head_size].
    kv_cache = torch.randn((num_blocks, KV_HEADS, 16, 2 * HEAD_DIM), generator=generator).to(torch.float16)
    kv_cache = kv_cache.to(device)
    for size, seq_lens in ((4, [300, 17]), (2, [MAX_MODEL_LEN]), (4, [1, 64, 129, 40])):
        metadata = builder.build(0, step([1] * len(seq_lens), seq_lens, device, padded_to=size))
        assert metadata.tile_plan is not None
        query = torch.randn((size, group * KV_HEADS, HEAD_DIM), generator=generator).to(torch.float16).to(device)
        output = torch.full_like(query, float("nan"))
        impl.forward(None, query, query, query, kv_cache, metadata, output)
        kv = kv_cache.transpose(1, 2)
        real = len(seq_lens)
        batch = PagedBatch(
            query=query[:real],
            key_cache=kv[..., :HEAD_DIM],
            value_cache=kv[..., HEAD_DIM:],
            block_table=metadata.block_table[:real],
            seq_lens=metadata.seq_lens[:real],
            query_start_loc=metadata.query_start_loc[: real + 1],
            query_lens=[1] * real,
            context_lens=[n - 1 for n in seq_lens],
            scale=HEAD_DIM**-0.5,
        )
        note = f"seed={generator.initial_seed()} group={group} size={size} lens={seq_lens} plan={metadata.tile_plan}"
        err = relative_error(output[:real], reference_attention(batch))
        assert err < 1e-3, f"relative error {err:.3e} ({note})"
        assert bool((output[real:] == 0).all()), f"padded slots must come out as zeros ({note})"
