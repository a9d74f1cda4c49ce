"""Tile attention equals a float64 reference within fp16/bf16 rounding, on fresh random inputs."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
import torch
from flashmodel_kernels.paged_attention import _ARRIVALS, paged_attention
from flashmodel_kernels.plan import (
    MAX_FUSED_SPLITS,
    MAX_FUSED_SPLITS_NARROW,
    WIDE_BLOCK_N,
    LaunchConfig,
    plan_launch,
)
from flashmodel_kernels.reference import (
    PagedBatch,
    random_paged_batch,
    reference_attention,
    relative_error,
)
from flashmodel_kernels.variants import compiled_variants, launch_variant, precompile, serving_variants

# ‖out − ref‖/‖ref‖ bounds: a correct kernel lands at the output dtype's rounding (about 2.5e-4
# for fp16, 2e-3 for bf16, seen here); a softmax that loses one tile is off by 1e-1 or more.
TOLERANCE = {torch.float16: 1e-3, torch.bfloat16: 8e-3}


def run_and_check(
    batch: PagedBatch,
    dtype: torch.dtype,
    seed_note: str,
    config: LaunchConfig | None = None,
    max_query_len: int | None = None,
) -> torch.Tensor:
    """Runs the kernel (``max_query_len`` overrides the batch's host-side bound) and checks it."""
    # Poison: NaN in every output element, so one that the kernel does not write fails the check.
    out = torch.full_like(batch.query, float("nan"))
    result = paged_attention(
        batch.query,
        batch.key_cache,
        batch.value_cache,
        batch.block_table,
        batch.seq_lens,
        batch.query_start_loc,
        max_query_len=batch.max_query_len if max_query_len is None else max_query_len,
        max_seq_len=batch.max_seq_len,
        scale=batch.scale,
        out=out,
        config=config,
    )
    assert result is out
    unwritten = int(torch.isnan(out).sum())
    assert unwritten == 0, f"{unwritten} output elements not written ({seed_note})"
    err = relative_error(out, reference_attention(batch))
    assert err < TOLERANCE[dtype], f"relative error {err:.3e} >= {TOLERANCE[dtype]:.0e} ({seed_note})"
    return out


def make(
    query_lens: list[int],
    context_lens: list[int],
    *,
    group: int,
    kv_heads: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float16,
    device: str,
    generator: torch.Generator,
    packed_kv: bool = True,
) -> tuple[PagedBatch, str]:
    seed_note = f"seed={generator.initial_seed()} q={query_lens} ctx={context_lens} group={group}"
    batch = random_paged_batch(
        query_lens,
        context_lens,
        num_q_heads=group * kv_heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        packed_kv=packed_kv,
        generator=generator,
    )
    return batch, seed_note


@pytest.mark.parametrize("group", [1, 6, 7])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_many_sequences_mixed_lengths(
    group: int, dtype: torch.dtype, device: str, generator: torch.Generator
) -> None:
    # Context lengths around page edges: a sequence ending exactly on a full page (15 + 1 = 16,
    # 31 + 1 = 32), one token into a fresh page (16 + 1), and lengths that are not multiples of 16.
    ctx = [0, 15, 16, 31, 47, 100]
    batch, note = make([1] * len(ctx), ctx, group=group, dtype=dtype, device=device, generator=generator)
    run_and_check(batch, dtype, note)


@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_decode_one_sequence_head_dims(head_dim: int, device: str, generator: torch.Generator) -> None:
    batch, note = make([1], [203], group=6, head_dim=head_dim, device=device, generator=generator)
    run_and_check(batch, torch.float16, note)


@pytest.mark.parametrize("group", [1, 6, 7])
def test_prefill_and_decode_mixed_batch(group: int, device: str, generator: torch.Generator) -> None:
    # A fresh prompt, a chunked prefill continuing a cached prefix, and two decodes in one batch.
    batch, note = make([37, 20, 1, 1], [0, 29, 16, 70], group=group, device=device, generator=generator)
    run_and_check(batch, torch.float16, note)


def test_prefill_one_long_prompt_crosses_query_tiles(device: str, generator: torch.Generator) -> None:
    batch, note = make([83], [0], group=7, kv_heads=1, device=device, generator=generator)
    run_and_check(batch, torch.bfloat16 if device == "cuda" else torch.float16, note)


@pytest.mark.parametrize(("splits", "block_n"), [(2, 32), (3, 32), (8, 32), (17, 16), (3, 128)])
def test_split_kv_merges_exactly(splits: int, block_n: int, device: str, generator: torch.Generator) -> None:
    # 8 splits over a 20-token sequence leaves whole splits empty: their weight must be zero.
    # 17 (not a power of two, one 16-key tile per split) checks the merge masks its padded slots.
    batch, note = make([1, 1, 3], [300, 19, 150], group=6, device=device, generator=generator)
    run_and_check(batch, torch.float16, note, LaunchConfig(block_q=2, block_n=block_n, num_splits=splits))


@pytest.mark.parametrize(("splits", "block_n"), [(2, 32), (8, 32), (17, 16), (3, 128)])
@pytest.mark.parametrize("query_lens", [[1, 1, 3], [1, 1, 1, 1]])
def test_fused_merge_equals_the_merge_kernel(
    splits: int, block_n: int, query_lens: list[int], device: str, generator: torch.Generator
) -> None:
    # The last split to arrive merges inside the attention kernel; the same splits merged by the
    # second kernel must give the same output, and the counters must be left at zero (twice:
    # the second call finds the counters the first one reset).
    batch, note = make(query_lens, [300, 19, 150, 0][: len(query_lens)], group=6, device=device, generator=generator)
    separate = run_and_check(batch, torch.float16, note, LaunchConfig(2, block_n, splits))
    for _ in range(2):
        fused = run_and_check(batch, torch.float16, note, LaunchConfig(2, block_n, splits, fuse_merge=True))
        torch.testing.assert_close(fused, separate, rtol=1e-3, atol=1e-3, msg=note)
        assert all(int(c.count_nonzero()) == 0 for c in _ARRIVALS.values()), "an arrival counter was left set"


@pytest.mark.parametrize(("splits", "block_n"), [(1, 64), (3, 32), (17, 16)])
def test_decode_path_equals_the_searching_path(
    splits: int, block_n: int, device: str, generator: torch.Generator
) -> None:
    # One token per sequence: the search-free decode path and the searching path run the same
    # tiles and the same arithmetic, so the outputs must be identical, split or not, empty
    # context included. A looser host bound (max_query_len 2, as a host may give) must search.
    batch, note = make([1, 1, 1, 1], [300, 19, 150, 0], group=7, device=device, generator=generator)
    config = LaunchConfig(block_q=2, block_n=block_n, num_splits=splits)
    decode = run_and_check(batch, torch.float16, note, config)
    searching = run_and_check(batch, torch.float16, note, replace(config, decode_path=False))
    loose_bound = run_and_check(batch, torch.float16, note, config, max_query_len=2)
    assert torch.equal(decode, searching), note
    assert torch.equal(decode, loose_bound), note


def test_separate_contiguous_caches(device: str, generator: torch.Generator) -> None:
    # Two contiguous tensors instead of vLLM 0.26's packed one: only the strides differ.
    batch, note = make([1, 5], [33, 64], group=6, device=device, generator=generator, packed_kv=False)
    run_and_check(batch, torch.float16, note)


def test_reads_nothing_past_the_sequence(device: str, generator: torch.Generator) -> None:
    """NaN in every cache slot no sequence owns: a read past seq_len would poison the output."""
    batch, note = make([1, 4], [20, 9], group=6, device=device, generator=generator, packed_kv=False)
    owned = torch.zeros(batch.key_cache.shape[:2], dtype=torch.bool)
    for i, seq_len in enumerate(batch.seq_lens.tolist()):
        for pos in range(seq_len):
            owned[int(batch.block_table[i, pos // 16]), pos % 16] = True
    for cache in (batch.key_cache, batch.value_cache):
        cache[~owned.to(cache.device)] = float("nan")
    run_and_check(batch, torch.float16, note)


def test_softmax_is_exact_across_tiles_with_one_dominant_key(device: str, generator: torch.Generator) -> None:
    """A key far above all others in the last tile: a per-tile softmax without rescaling fails."""
    batch, note = make([1], [130], group=1, kv_heads=1, device=device, generator=generator, packed_kv=False)
    q = batch.query[0, 0].float()
    last = 130
    page = int(batch.block_table[0, last // 16])
    batch.key_cache[page, last % 16, 0] = (q * 8.0 / q.norm()).to(batch.key_cache.dtype)
    run_and_check(batch, torch.float16, note, LaunchConfig(block_q=16, block_n=16, num_splits=1))


def test_empty_batch_returns_without_launch(device: str, generator: torch.Generator) -> None:
    batch, _ = make([1], [3], group=1, device=device, generator=generator)
    q = batch.query[:0]
    out = paged_attention(
        q,
        batch.key_cache,
        batch.value_cache,
        batch.block_table[:0],
        batch.seq_lens[:0],
        batch.query_start_loc[:1],
        max_query_len=0,
        max_seq_len=0,
        scale=1.0,
    )
    assert out.shape == q.shape


def test_rejects_a_cache_that_is_not_16_token_blocks(device: str, generator: torch.Generator) -> None:
    batch, _ = make([1], [3], group=1, device=device, generator=generator)
    k32 = (
        batch.key_cache.reshape(-1, 32, *batch.key_cache.shape[2:])
        if batch.key_cache.shape[0] % 2 == 0
        else torch.zeros(2, 32, *batch.key_cache.shape[2:], dtype=batch.key_cache.dtype)
    )
    with pytest.raises(ValueError, match="16-token blocks"):
        paged_attention(
            batch.query,
            k32,
            k32,
            batch.block_table,
            batch.seq_lens,
            batch.query_start_loc,
            max_query_len=1,
            max_seq_len=4,
            scale=1.0,
        )


class TestPlanLaunch:
    def plan(self, **overrides: int | float | bool | None) -> LaunchConfig:
        sizes: dict[str, Any] = dict(
            num_seqs=1,
            num_tokens=1,
            max_query_len=1,
            max_seq_len=4096,
            num_kv_heads=2,
            queries_per_kv=6,
            head_dim=128,
            multiprocessors=132,
        )
        sizes.update(overrides)
        return plan_launch(**sizes)

    def test_small_decode_batch_splits_the_key_range(self) -> None:
        assert self.plan().num_splits > 1

    def test_large_decode_batch_does_not_split(self) -> None:
        assert self.plan(num_seqs=256, num_tokens=256).num_splits == 1

    def test_decode_path_and_fused_merge_where_they_were_measured_faster(self) -> None:
        # Measured on an H200 (MAX_FUSED_SPLITS, DECODE_PATH_MAX_PROGRAMS_PER_SM): both faster on
        # split launches of 2-5 parts; unsplit, the decode path is faster up to 512 programs
        # (7B batch 128) and slower at 1024 (7B batch 256).
        split = self.plan(num_seqs=32, num_tokens=32, max_seq_len=1024)
        assert 1 < split.num_splits <= MAX_FUSED_SPLITS_NARROW
        assert split.decode_path and split.fuse_merge
        whole = self.plan(num_seqs=256, num_tokens=256, num_kv_heads=4, queries_per_kv=7)
        assert whole.num_splits == 1 and not whole.decode_path and not whole.fuse_merge
        half = self.plan(num_seqs=128, num_tokens=128, num_kv_heads=4, queries_per_kv=7)
        assert half.num_splits == 1 and half.decode_path and not half.fuse_merge
        # 9 splits of 64-key tiles (1.5B batch 16): the merge kernel is faster there.
        nine = self.plan(num_seqs=16, num_tokens=16, max_seq_len=1024)
        assert nine.num_splits == 9 and nine.block_n == 64 and not nine.fuse_merge
        # Far more splits than were timed fused go to the merge kernel.
        many = self.plan(num_seqs=1, num_tokens=1, max_seq_len=4096)
        assert many.num_splits > MAX_FUSED_SPLITS and many.decode_path and not many.fuse_merge

    def test_wide_tiles_only_where_they_were_measured_faster(self) -> None:
        # Measured on an H200 (WIDE_BLOCK_N): 128-key tiles faster at >= 3 splits of >= 128 keys,
        # slower at 1-2 splits.
        wide = {"wide_tiles": True}
        five = self.plan(num_seqs=32, num_tokens=32, max_seq_len=1024, **wide)
        assert (five.num_splits, five.block_n, five.fuse_merge) == (5, WIDE_BLOCK_N, True)
        nine = self.plan(num_seqs=16, num_tokens=16, max_seq_len=2048, **wide)
        assert (nine.num_splits, nine.block_n, nine.fuse_merge) == (9, WIDE_BLOCK_N, True)
        short = self.plan(num_seqs=16, num_tokens=16, max_seq_len=1024, **wide)  # 114 keys per split
        assert (short.num_splits, short.block_n, short.fuse_merge) == (9, 64, False)
        two = self.plan(num_seqs=128, num_tokens=128, max_seq_len=4096, **wide)
        assert (two.num_splits, two.block_n) == (2, 64)
        assert self.plan(num_seqs=256, num_tokens=256, **wide).block_n == 64
        # Not on a T4 (the default) and not for heads over 128: their shared memory does not hold it.
        assert self.plan(num_seqs=32, num_tokens=32, max_seq_len=1024).block_n == 64
        assert self.plan(num_seqs=32, num_tokens=32, max_seq_len=1024, head_dim=256, **wide).block_n < WIDE_BLOCK_N
        # Prefill keeps its tiles.
        prefill = self.plan(num_seqs=2, num_tokens=400, max_query_len=300, max_seq_len=1024, **wide)
        assert prefill.block_n < WIDE_BLOCK_N

    def test_short_context_does_not_split_below_min_length(self) -> None:
        # 60 keys hold one 32-key split (MIN_TOKENS_PER_SPLIT), not two.
        assert self.plan(max_seq_len=60).num_splits == 1
        assert self.plan(max_seq_len=300, min_tokens_per_split=256).num_splits == 1

    def test_rule_in_use_matches_the_measured_h200_run(self) -> None:
        # The split rule's decode table (bench/kernels/results/h200-2026-12-02-run2) was measured
        # at these picks (1.5B: 2 kv heads, GQA 6, 132 SMs). (splits, block_n):
        picks = {
            (1, 512): (16, 32),  # 2 programs: 512 // 32 = 16 splits of 32 keys, 32-key tiles
            (1, 1024): (32, 32),  # MAX_SPLITS
            (16, 512): (9, 32),  # ceil(264 / 32) = 9 splits of 57 keys: 32-key tiles
            (16, 4096): (9, 64),
            (128, 1024): (2, 64),
            (256, 1024): (1, 64),  # 512 programs >= 2 per SM: no split
        }
        for (batch, context), expected in picks.items():
            cfg = self.plan(num_seqs=batch, num_tokens=batch, max_seq_len=context)
            assert (cfg.num_splits, cfg.block_n) == expected, (batch, context)

    def test_interpreter_default_plan_splits_the_test_shapes(self) -> None:
        # On the CPU interpreter (8 "SMs") the correctness tests above take the split-KV path by
        # default: one sequence at 203 keys splits 203 // 32 = 6 ways, with 32-key tiles.
        cfg = self.plan(max_seq_len=203, multiprocessors=8)
        assert (cfg.num_splits, cfg.block_n) == (6, 32)

    def test_occupancy_target_and_split_floor_are_parameters(self) -> None:
        base = self.plan(num_seqs=16, num_tokens=16)
        assert self.plan(num_seqs=16, num_tokens=16, programs_per_sm=8).num_splits > base.num_splits
        # One sequence, 2 programs: the 512-token context allows 512 // 64 = 8 splits of 64 keys.
        assert self.plan(max_seq_len=512, min_tokens_per_split=64).num_splits == 8
        assert self.plan(max_seq_len=512, min_tokens_per_split=16, max_splits=12).num_splits == 12

    def test_decode_key_tile_can_follow_the_split_or_a_cap(self) -> None:
        assert self.plan(max_seq_len=512, min_tokens_per_split=32, fit_block_n_to_split=False).block_n == 64
        fitted = self.plan(max_seq_len=512, min_tokens_per_split=32, fit_block_n_to_split=True)
        assert (fitted.num_splits, fitted.block_n) == (16, 32)
        assert self.plan(decode_block_n=32).block_n == 32
        prefill = self.plan(max_query_len=512, num_tokens=512, decode_block_n=16, fit_block_n_to_split=True)
        assert prefill.block_n == self.plan(max_query_len=512, num_tokens=512).block_n

    @pytest.mark.parametrize("head_dim", [64, 80, 128, 256])
    @pytest.mark.parametrize("queries_per_kv", [1, 6, 7, 8])
    @pytest.mark.parametrize("max_query_len", [1, 512])
    def test_tile_fits_t4_shared_memory_and_tl_dot(
        self, head_dim: int, queries_per_kv: int, max_query_len: int
    ) -> None:
        cfg = self.plan(
            head_dim=head_dim, queries_per_kv=queries_per_kv, max_query_len=max_query_len, num_tokens=max_query_len
        )
        block_m = cfg.block_q * (1 << (queries_per_kv - 1).bit_length())
        pad = 1 << (head_dim - 1).bit_length()
        assert block_m >= 16 and cfg.block_n >= 16 and cfg.block_n % 16 == 0
        # fp32 operand staging on sm_75, the budget plan_launch keeps (checked by compiling too).
        assert (block_m + cfg.block_n) * pad * 4 <= 48 * 1024


def test_compiled_variants_counts_compiles_and_num_seqs_costs_none(device: str, generator: torch.Generator) -> None:
    # The vLLM backend logs each rise of this count (a JIT compile while serving). On a GPU: a
    # batch of a new size class (1, a multiple of 16, other) must not compile again, because
    # num_seqs is not specialised; a new constexpr (the split) must. Head size 96 with GQA 5 is
    # used by no other test, so every compile here is this test's. The interpreter compiles
    # nothing: there the count is None.
    config = LaunchConfig(block_q=1, block_n=32, num_splits=1)
    one, note_one = make([1], [40], group=5, head_dim=96, device=device, generator=generator)
    start = compiled_variants()
    run_and_check(one, torch.float16, note_one, config)
    after_one = compiled_variants()
    if device != "cuda":
        assert start is None and after_one is None
        return
    assert start is not None and after_one == start + 1
    for seqs in (16, 5):
        batch, note = make([1] * seqs, [40] * seqs, group=5, head_dim=96, device=device, generator=generator)
        run_and_check(batch, torch.float16, note, config)
    assert compiled_variants() == after_one, "a new batch size compiled the kernel again"
    run_and_check(one, torch.float16, note_one, replace(config, num_splits=2))
    assert compiled_variants() == after_one + 2  # the split kernel and its merge kernel


@pytest.mark.parametrize(
    ("kv_heads", "group", "head_dim", "multiprocessors", "wide"),
    [(2, 6, 128, 132, True), (4, 7, 128, 132, True), (2, 7, 64, 40, False), (2, 6, 128, 8, False)],
)
def test_serving_variants_cover_every_plan(
    kv_heads: int, group: int, head_dim: int, multiprocessors: int, wide: bool, generator: torch.Generator
) -> None:
    # precompile compiles what serving_variants lists; a batch whose plan is missing from it
    # would compile mid-serving, the stall precompiling exists to remove. Random batches within
    # the engine's limits (1.5B/7B/0.5B shapes on an H200, on a 40-SM T4 and on the interpreter).
    limits = {"max_num_seqs": 256, "max_model_len": 4096, "max_num_batched_tokens": 4096}
    variants = serving_variants(
        num_kv_heads=kv_heads,
        queries_per_kv=group,
        head_dim=head_dim,
        multiprocessors=multiprocessors,
        wide_tiles=wide,
        **limits,
    )
    picked = set()
    for _ in range(3000):
        num_seqs = int(torch.randint(1, 257, (1,), generator=generator))
        max_seq_len = int(torch.randint(1, 4097, (1,), generator=generator))
        decode = bool(torch.randint(0, 2, (1,), generator=generator))
        num_tokens = num_seqs if decode else int(torch.randint(num_seqs + 1, 4097, (1,), generator=generator))
        max_query_len = 1 if decode else min(max_seq_len, num_tokens - num_seqs + 1)
        config = plan_launch(
            num_seqs=num_seqs,
            num_tokens=num_tokens,
            max_query_len=max(1, max_query_len),
            max_seq_len=max_seq_len,
            num_kv_heads=kv_heads,
            queries_per_kv=group,
            head_dim=head_dim,
            multiprocessors=multiprocessors,
            wide_tiles=wide,
        )
        variant = launch_variant(config, decode_batch=max_query_len <= 1)
        note = f"seed={generator.initial_seed()} seqs={num_seqs} tokens={num_tokens} max_seq_len={max_seq_len}"
        assert variant in variants, f"{variant} not precompiled ({note})"
        picked.add(variant)
    # Each listed config is one that compiles its variant (decode or mixed batch).
    for variant, config in variants.items():
        assert variant in (launch_variant(config, decode_batch=True), launch_variant(config, decode_batch=False))
    assert len(picked) >= 4


def test_precompile_then_serving_compiles_nothing(device: str, generator: torch.Generator) -> None:
    # The engine's own strides (here a block table 64 pages wide, the packed K/V cache) are what
    # precompile copies. Head size 112 with GQA 3 is used by no other test. On a GPU: after
    # precompile, batches of every kind within the limits add no compiled variant. Under the
    # interpreter (nothing compiles) every variant still launches and writes its output.
    limits = {"max_num_seqs": 24, "max_model_len": 1024, "max_num_batched_tokens": 256}
    width = 64
    engine, _ = make([1], [40], group=3, kv_heads=2, head_dim=112, device=device, generator=generator)
    engine_table = torch.zeros((limits["max_num_seqs"], width), dtype=torch.int32, device=device)
    variants = precompile(
        engine.query,
        engine.key_cache,
        engine.value_cache,
        engine_table,
        scale=engine.scale,
        **limits,
    )
    assert len(variants) >= 4 and len(set(variants)) == len(variants)
    after = compiled_variants()
    if device == "cuda":
        assert after is not None and after >= len(variants)
    cases = [([1] * 24, [900] * 24), ([1] * 3, [700, 60, 1000]), ([1], [5]), ([30, 1, 1], [0, 500, 80]), ([200], [600])]
    for query_lens, context_lens in cases:
        batch, note = make(
            query_lens, context_lens, group=3, kv_heads=2, head_dim=112, device=device, generator=generator
        )
        padded = torch.zeros((len(query_lens), width), dtype=torch.int32, device=device)
        padded[:, : batch.block_table.shape[1]] = batch.block_table
        batch = replace(batch, block_table=padded)
        run_and_check(batch, torch.float16, note)
        assert compiled_variants() == after, f"serving compiled a variant precompile missed ({note})"
