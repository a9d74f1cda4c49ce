"""Tile attention as a captured CUDA graph replays it: one plan per captured size, persistent buffers.

A graph replays the launches of its capture with their grid, split count and pointers frozen;
only buffer contents change. These tests do on the CPU what a replay does on the GPU: the plan
and every buffer are made once per captured size, then each "replay" writes new sequence lengths,
pages and queries into the same buffers (fewer sequences than the size: the rest are vLLM's
padded slots, length 0, no query token of their own, the null page 0) and launches again with
the frozen plan. The real GPU capture and replay is bench/kernels/cudagraph_gpu.py.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
import torch
from flashmodel_kernels.graph import GraphPlans, LayerShape, plan_for_graph
from flashmodel_kernels.paged_attention import paged_attention
from flashmodel_kernels.plan import PAGE_SIZE, SPLIT_GRANULE, LaunchConfig, plan_launch
from flashmodel_kernels.reference import PagedBatch, reference_attention, relative_error
from flashmodel_kernels.variants import launch_variant, serving_variants

TOLERANCE = 1e-3  # fp16 output rounding is about 2.5e-4; a lost tile or split is off by 1e-1
MAX_MODEL_LEN = 512
KV_HEADS = 2
HEAD_DIM = 64
# 16 multiprocessors: the captured sizes below then cover the merge kernel (8 splits), the fused
# merge (2 and 4 splits) and no split at all.
CAPTURE_SIZES = [2, 4, 8, 16]
SENTINEL = 12345.0  # rows past the captured batch: no launch may write them


def shape_of(group: int) -> LayerShape:
    return LayerShape(
        num_q_heads=group * KV_HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_model_len=MAX_MODEL_LEN,
        multiprocessors=16,
        wide_tiles=False,
    )


@dataclass
class CapturedBatch:
    """The buffers one captured graph reads: allocated once, rewritten before every replay."""

    size: int
    plan: LaunchConfig
    query: torch.Tensor  # [size, q_heads, head_dim]
    out_rows: torch.Tensor  # [size + 2, q_heads, head_dim]: the graph's output, then two sentinel rows
    block_table: torch.Tensor  # [size, max_blocks]
    seq_lens: torch.Tensor  # [size]
    query_start_loc: torch.Tensor  # [size + 1]

    @property
    def out(self) -> torch.Tensor:
        return self.out_rows[: self.size]


def capture(plans: GraphPlans, size: int, device: str) -> CapturedBatch:
    plan = plans.plan(num_seqs=size, num_tokens=size, max_query_len=1)
    assert plan is not None
    shape = plans.shape
    max_blocks = shape.max_model_len // PAGE_SIZE
    rows = (size + 2, shape.num_q_heads, shape.head_dim)
    return CapturedBatch(
        size=size,
        plan=plan,
        query=torch.empty((size, shape.num_q_heads, shape.head_dim), dtype=torch.float16, device=device),
        out_rows=torch.full(rows, SENTINEL, dtype=torch.float16, device=device),
        block_table=torch.zeros((size, max_blocks), dtype=torch.int32, device=device),
        seq_lens=torch.zeros(size, dtype=torch.int32, device=device),
        query_start_loc=torch.zeros(size + 1, dtype=torch.int32, device=device),
    )


def replay(
    captured: CapturedBatch,
    plans: GraphPlans,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    seq_lens: list[int],
    generator: torch.Generator,
) -> PagedBatch:
    """Writes one step into the captured buffers the way vLLM's runner does, then launches.

    Returns the real sequences of the step as a batch for the reference.
    """
    size, real = captured.size, len(seq_lens)
    assert real <= size
    shape = plans.shape
    num_blocks = key_cache.shape[0]
    max_blocks = captured.block_table.shape[1]
    # Pages 1.. shuffled over the real sequences; page 0 is vLLM's null page for padded slots.
    pages = (torch.randperm(num_blocks - 1, generator=generator) + 1).to(torch.int32)
    table = torch.zeros((size, max_blocks), dtype=torch.int32)
    table[:real] = pages[: real * max_blocks].view(real, max_blocks)
    lens = torch.zeros(size, dtype=torch.int32)
    lens[:real] = torch.tensor(seq_lens, dtype=torch.int32)
    starts = torch.full((size + 1,), real, dtype=torch.int32)  # padded slots: no token of their own
    starts[: real + 1] = torch.arange(real + 1, dtype=torch.int32)
    query = torch.randn((size, shape.num_q_heads, shape.head_dim), generator=generator).to(torch.float16)
    captured.block_table.copy_(table)
    captured.seq_lens.copy_(lens)
    captured.query_start_loc.copy_(starts)
    captured.query.copy_(query)
    # Poison: a real row the launch does not write fails the comparison (NaN never passes).
    captured.out.fill_(float("nan"))
    paged_attention(
        captured.query,
        key_cache,
        value_cache,
        captured.block_table,
        captured.seq_lens,
        captured.query_start_loc,
        max_query_len=1,
        max_seq_len=shape.max_model_len,  # what vLLM passes at capture, frozen in the graph
        scale=shape.head_dim**-0.5,
        out=captured.out,
        config=captured.plan,
        workspace=plans.workspace,
    )
    return PagedBatch(
        query=captured.query[:real],
        key_cache=key_cache,
        value_cache=value_cache,
        block_table=captured.block_table[:real],
        seq_lens=captured.seq_lens[:real],
        query_start_loc=captured.query_start_loc[: real + 1],
        query_lens=[1] * real,
        context_lens=[n - 1 for n in seq_lens],
        scale=shape.head_dim**-0.5,
    )


def check_step(captured: CapturedBatch, plans: GraphPlans, batch: PagedBatch, note: str) -> None:
    real = len(batch.query_lens)
    err = relative_error(captured.out[:real], reference_attention(batch))
    assert err < TOLERANCE, f"relative error {err:.3e} on the real rows ({note})"
    padded = captured.out[real:].float()
    # The search-free decode path gives a padded slot its own row and writes zeros there; the
    # searching path gives it no program, so its row keeps what it held (the poison here).
    assert bool(((padded == 0) | padded.isnan()).all()), f"a padded slot's row holds values ({note})"
    if captured.plan.decode_path:
        assert bool(torch.isfinite(padded).all()), f"a padded slot's row is not finite ({note})"
    assert bool((captured.out_rows[captured.size :] == SENTINEL).all()), f"a row past the batch was written ({note})"
    arrivals = int(plans.workspace.arrivals.count_nonzero())
    assert arrivals == 0, f"{arrivals} fused-merge counters left set for the next replay ({note})"


@pytest.fixture
def cache(device: str, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.26's packed cache: enough pages for the largest captured size at max_model_len."""
    num_blocks = 1 + max(CAPTURE_SIZES) * (MAX_MODEL_LEN // PAGE_SIZE)
    kv = torch.randn((num_blocks, PAGE_SIZE, KV_HEADS, 2 * HEAD_DIM), generator=generator).to(torch.float16)
    kv = kv.to(device)
    return kv[..., :HEAD_DIM], kv[..., HEAD_DIM:]


def test_a_captured_size_has_one_plan_whatever_the_step_brings() -> None:
    # The eager rule follows the longest sequence of the step, so its plans differ from step to
    # step; a captured size must get one plan for every step, the eager rule at max_model_len.
    shape = shape_of(6)
    plans = GraphPlans(shape, CAPTURE_SIZES, "cpu")
    for size in CAPTURE_SIZES:
        eager = {
            plan_launch(
                num_seqs=size,
                num_tokens=size,
                max_query_len=1,
                max_seq_len=longest,
                num_kv_heads=KV_HEADS,
                queries_per_kv=6,
                head_dim=HEAD_DIM,
                multiprocessors=16,
            )
            for longest in (1, 17, 100, 300, MAX_MODEL_LEN)
        }
        captured = {plans.plan(num_seqs=size, num_tokens=size, max_query_len=1) for _ in range(3)}
        assert captured == {plan_for_graph(size, shape)}, size
        assert plan_for_graph(size, shape) in eager
    assert len({plans.plans[n].num_splits for n in CAPTURE_SIZES}) == 4, "the sizes should cover 8/4/2/1 splits"
    # Steps that are not uniform single-token decode of a captured size plan eagerly.
    assert plans.plan(num_seqs=4, num_tokens=9, max_query_len=6) is None
    assert plans.plan(num_seqs=5, num_tokens=5, max_query_len=1) is None


@pytest.mark.parametrize("group", [1, 6, 7])
def test_every_captured_plan_fits_the_persistent_workspace(group: int) -> None:
    # A launch that needed scratch beyond the workspace would allocate it inside the capture.
    shape = shape_of(group)
    plans = GraphPlans(shape, [1, 2, 3, 4, 8, 16, 24, 32, 48, 64, 128, 256], "cpu")
    for size, plan in plans.plans.items():
        if plan.num_splits == 1:
            continue
        views = plans.workspace.views(size, shape.num_q_heads, plan.num_splits, HEAD_DIM)
        assert views is not None, f"size {size} ({plan.num_splits} splits) does not fit the workspace"
        assert plans.workspace.arrivals.numel() >= size * KV_HEADS


@pytest.mark.parametrize("group", [1, 6, 7])
def test_replays_with_changing_lengths_and_padding_equal_the_reference(
    group: int, device: str, generator: torch.Generator, cache: tuple[torch.Tensor, torch.Tensor]
) -> None:
    plans = GraphPlans(shape_of(group), CAPTURE_SIZES, device)
    # (captured size, real sequences per replay): a full batch, then fewer (padded slots), with
    # lengths longer and shorter than the step before, a one-token sequence and max_model_len.
    steps = {
        2: [[5, MAX_MODEL_LEN], [300], [1, 33]],
        4: [[40, 7, 129], [MAX_MODEL_LEN, 1, 64, 250], [16]],
        8: [[2, 100, 511, 17, 64], [9] * 8],
        16: [[33 * i + 1 for i in range(11)]],
    }
    for size, replays in steps.items():
        captured = capture(plans, size, device)
        workspace_ptr = plans.workspace.part_out.data_ptr()
        for seq_lens in replays:
            note = f"seed={generator.initial_seed()} group={group} size={size} plan={captured.plan} lens={seq_lens}"
            batch = replay(captured, plans, *cache, seq_lens, generator)
            check_step(captured, plans, batch, note)
        assert plans.workspace.part_out.data_ptr() == workspace_ptr


def test_a_short_sequence_reaches_every_split_it_has_keys_for(
    device: str, generator: torch.Generator, cache: tuple[torch.Tensor, torch.Tensor]
) -> None:
    # The captured plan is made for max_model_len, so its key tiles are long; a short sequence
    # must still be spread over the splits two pages at a time, not leave all but one or two
    # idle (the cost of a long-context plan at a serving batch's few hundred tokens).
    plans = GraphPlans(shape_of(6), CAPTURE_SIZES, device)
    size = 2
    captured = capture(plans, size, device)
    splits = captured.plan.num_splits
    assert splits >= 4 and not captured.plan.fuse_merge, captured.plan  # the merge kernel keeps every split's sum
    assert captured.plan.block_n > SPLIT_GRANULE, captured.plan  # tiles longer than the granules shared out
    lens = [SPLIT_GRANULE * (splits - 1) - 3, SPLIT_GRANULE + 1]
    batch = replay(captured, plans, *cache, lens, generator)
    check_step(captured, plans, batch, f"seed={generator.initial_seed()} plan={captured.plan} lens={lens}")
    views = plans.workspace.views(size, plans.shape.num_q_heads, splits, HEAD_DIM)
    assert views is not None
    used = torch.isfinite(views[1][: len(lens), 0]).sum(dim=1).tolist()  # splits that saw a key, per sequence
    assert used == [splits - 1, 2], f"splits holding keys per sequence: {used} (plan {captured.plan})"


def test_padded_slots_on_the_searching_path(
    device: str, generator: torch.Generator, cache: tuple[torch.Tensor, torch.Tensor]
) -> None:
    # Large captured batches take the searching path (more programs than the decode path was
    # measured faster at): padded slots there own no query token and must write nothing.
    plans = GraphPlans(shape_of(7), CAPTURE_SIZES, device)
    for size in (4, 16):
        captured = capture(plans, size, device)
        captured.plan = replace(captured.plan, decode_path=False)
        for seq_lens in ([300, 2, 77], [1]):
            note = f"seed={generator.initial_seed()} size={size} plan={captured.plan} lens={seq_lens}"
            batch = replay(captured, plans, *cache, seq_lens, generator)
            check_step(captured, plans, batch, note)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a real CUDA graph")
@pytest.mark.parametrize("group", [1, 6, 7])
def test_a_real_cuda_graph_replays_what_the_eager_launch_computes(
    group: int, device: str, generator: torch.Generator, cache: tuple[torch.Tensor, torch.Tensor]
) -> None:
    # On the GPU machine: the launch captured once per size, then replayed on new lengths and
    # padding, equals the reference and, bit for bit, an eager launch of the same plan.
    plans = GraphPlans(shape_of(group), CAPTURE_SIZES, device)
    for size in CAPTURE_SIZES:
        captured = capture(plans, size, device)
        replay(captured, plans, *cache, [1] * size, generator)  # compiles before the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention(
                captured.query,
                *cache,
                captured.block_table,
                captured.seq_lens,
                captured.query_start_loc,
                max_query_len=1,
                max_seq_len=MAX_MODEL_LEN,
                scale=HEAD_DIM**-0.5,
                out=captured.out,
                config=captured.plan,
                workspace=plans.workspace,
            )
        for real in (size, max(1, size // 2)):
            seq_lens = [int(n) for n in torch.randint(1, MAX_MODEL_LEN + 1, (real,), generator=generator)]
            batch = replay(captured, plans, *cache, seq_lens, generator)  # writes the buffers, eager
            eager = captured.out.clone()
            captured.out.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            note = f"seed={generator.initial_seed()} group={group} size={size} lens={seq_lens}"
            check_step(captured, plans, batch, note)
            assert torch.equal(captured.out[:real], eager[:real]), note


# vLLM's default capture sizes up to 256 (1, 2, 4, then steps of 8).
VLLM_CAPTURE_SIZES = [1, 2, 4, *range(8, 257, 8)]


@pytest.mark.parametrize(("multiprocessors", "wide_tiles"), [(40, False), (132, True)])  # T4, H200
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(12, 2), (28, 4), (14, 2)])
def test_every_captured_plan_is_precompiled_before_capture(
    multiprocessors: int, wide_tiles: bool, q_heads: int, kv_heads: int
) -> None:
    # The backend precompiles every variant its engine limits can need on its first eager call
    # (the warm-up before vLLM's first capture): a captured plan outside that set would compile
    # while the graph is being captured, loading a new module into a capturing process.
    shape = LayerShape(q_heads, kv_heads, 128, 4096, multiprocessors, wide_tiles)
    precompiled = serving_variants(
        num_kv_heads=kv_heads,
        queries_per_kv=q_heads // kv_heads,
        head_dim=128,
        multiprocessors=multiprocessors,
        wide_tiles=wide_tiles,
        max_num_seqs=256,
        max_model_len=4096,
        max_num_batched_tokens=4096,
    )
    missing = {
        size: plan
        for size, plan in GraphPlans(shape, VLLM_CAPTURE_SIZES, "cpu").plans.items()
        if launch_variant(plan, decode_batch=True) not in precompiled
    }
    assert missing == {}
