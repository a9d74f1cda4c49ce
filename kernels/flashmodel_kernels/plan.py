"""The launch plan of tile attention: how one call is tiled and split, from host-side sizes only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from flashmodel_kernels._triton import INTERPRETING, triton

__all__ = [
    "PAGE_SIZE",
    "SHORT_BLOCK_N",
    "SPLIT_GRANULE",
    "LaunchConfig",
    "multiprocessor_count",
    "plan_launch",
    "wide_tiles_fit",
]

PAGE_SIZE = 16
"""Tokens per KV-cache block: the T4 profile fixes vLLM's ``--block-size 16``."""

# The constants below are the answers of the kernel benchmark's design questions; each one's
# figures are in docs/benchmarks/kernels.md, "The launch plan's constants".
MIN_TOKENS_PER_SPLIT = 32
"""A split holds at least this many keys (two 16-token pages): shorter, its merge costs more than it saves.

With this floor and tile fitting the decode split rule is slower than vLLM's Triton kernel on
none of the benchmark's decode shapes; 256 keys per split left too few programs at small batches."""

SPLIT_GRANULE = MIN_TOKENS_PER_SPLIT
"""The kernel shares a sequence's keys out over the splits in runs of this many (two pages): the
same floor, applied on the device to the sequence's own length, where a captured graph's plan
only knows ``max_model_len``."""

SHORT_BLOCK_N = 32
"""Keys per loop step of a split of at most twice this many keys, whatever the plan's BLOCK_N.

A captured graph's plan is made for ``max_model_len``; on a short sequence its splits hold 16-32
keys, and 128-key tiles over them load mostly masked keys. Short tiles make the graph plan as
fast as the eager plan on those splits."""

PROGRAMS_PER_SM = 2.0
"""Decode splits the key range until there are about this many programs per multiprocessor."""

MAX_SPLITS = 32

MAX_FUSED_SPLITS = 10
"""Split launches of 2..10 parts merge inside the attention kernel: the largest count timed fused.

The fused merge was faster than the merge kernel on the large split shapes timed at 2-10 splits.
The merging program reads its splits one after another, so larger counts go to the merge kernel.
"""

MAX_FUSED_SPLITS_NARROW = 5
"""With 64-key (or shorter) tiles, only launches of 2..5 splits fuse the merge: at 9 splits the
merge kernel was faster on every shape timed."""

WIDE_BLOCK_N = 128
"""Keys per loop step of a decode split on a GPU with the shared memory for it (``wide_tiles``).

Twice the keys per step halves a short split's dependent page-then-K/V round trips: faster than
64-key tiles at 3 or more splits of >= 128 keys, slower at 2 splits and unsplit, so only launches
of at least ``WIDE_TILE_MIN_SPLITS`` take them.
"""
WIDE_TILE_MIN_SPLITS = 3
WIDE_TILE_SHARED_BYTES = 160 * 1024
"""A 128-key step stages K and V (2 x 128 x 128 x 2 B) twice (2 stages): 128 KB plus the query.
sm_80/sm_90 allow 163/227 KB per block; sm_86/89 (99 KB) and the T4 (64 KB) do not."""

DECODE_PATH_MAX_PROGRAMS_PER_SM = 4.0
"""An unsplit decode launch takes the search-free path up to this many programs per SM: faster at
about 4 programs per SM, slower at 8."""

FIT_BLOCK_N_TO_SPLIT = True
"""Decode key tiles no longer than one split: a 32-key split read with 64-key tiles loads half masked keys."""

SHARED_BUDGET_BYTES = 48 * 1024
"""Shared memory one program may plan for: the T4 allows 64 KB per block; the rest is headroom."""


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is tiled; ``plan_launch`` picks it, tests and benchmarks may force it."""

    block_q: int
    """Query tokens per program; times the padded GQA group it is the tile's M (>= 16 for tl.dot)."""
    block_n: int
    """Keys per inner-loop step: a multiple of the 16-token page, so one step reads whole pages."""
    num_splits: int
    """Parts the key range is cut into (split-KV); 1 writes the output directly, no merge."""
    num_warps: int = 4
    num_stages: int = 2
    fuse_merge: bool = False
    """Split results merged by the last split to finish, in the same kernel, not by a second one."""
    decode_path: bool = True
    """A pure decode batch takes the search-free path (program i is sequence i); False searches."""
    prefetch_pages: bool = False

    @property
    def short_block_n(self) -> int:
        """Keys per loop step of a short split (``SHORT_BLOCK_N``), never more than ``block_n``."""
        return min(SHORT_BLOCK_N, self.block_n)


@lru_cache(maxsize=8)
def wide_tiles_fit(device: torch.device) -> bool:
    """Whether one program may stage 128-key K and V tiles (``WIDE_TILE_SHARED_BYTES``)."""
    if device.type != "cuda" or INTERPRETING:
        return False
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "shared_memory_per_block_optin", 0)) >= WIDE_TILE_SHARED_BYTES


@lru_cache(maxsize=8)
def multiprocessor_count(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``: the occupancy the plan splits for."""
    if device.type != "cuda":
        return 8  # the interpreter: a small "GPU", so CI exercises split-KV on small shapes
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def plan_launch(
    *,
    num_seqs: int,
    num_tokens: int,
    max_query_len: int,
    max_seq_len: int,
    num_kv_heads: int,
    queries_per_kv: int,
    head_dim: int,
    multiprocessors: int,
    min_tokens_per_split: int = MIN_TOKENS_PER_SPLIT,
    programs_per_sm: float = PROGRAMS_PER_SM,
    max_splits: int = MAX_SPLITS,
    fit_block_n_to_split: bool = FIT_BLOCK_N_TO_SPLIT,
    decode_block_n: int | None = None,
    wide_tiles: bool = False,
) -> LaunchConfig:
    """Choose the tiling for one call from host-side sizes only (no device sync, graph-safe).

    Decode (every sequence brings one token) is memory-bound: M is the smallest tile tl.dot takes
    and the key range is split until there are about ``programs_per_sm`` programs per
    multiprocessor, keeping at least ``min_tokens_per_split`` keys per split and at most
    ``max_splits`` splits. A decode tile takes the most keys (BLOCK_N) the shared-memory budget
    allows, at most ``decode_block_n`` when given (a power of two >= 16), and with
    ``fit_block_n_to_split`` no more than one split holds, so short splits load no masked keys.
    With ``wide_tiles`` (the GPU has the shared memory, see ``WIDE_BLOCK_N``) a launch of at least
    ``WIDE_TILE_MIN_SPLITS`` splits takes 128-key tiles (head_dim <= 128).
    Prefill is compute-bound: a larger M reuses each K/V tile for more query rows. The keyword
    defaults are the rule in use, chosen from measurements (see ``MIN_TOKENS_PER_SPLIT``); a
    benchmark may pass others to compare rules. The split count is a runtime kernel argument, so
    a new pick costs no compile.
    """
    group_pad = triton.next_power_of_2(queries_per_kv)
    decode = max_query_len <= 1
    # On sm_75 Triton lowers tl.dot to fp32 FMA and stages both operands in shared memory as
    # fp32: (M + N) * head_dim_pad * 4 bytes. Keep that within 48 KB of the T4's 64 KB.
    rows = SHARED_BUDGET_BYTES // (4 * triton.next_power_of_2(head_dim))
    block_m = 16 if decode else min(64, max(16, rows - 32))
    block_q = max(1, block_m // group_pad)
    spare = max(16, min(64 if decode else 32, rows - block_q * group_pad))
    block_n = 1 << (spare.bit_length() - 1)  # tl.arange takes powers of two
    q_tiles = num_seqs if decode else num_tokens // block_q + num_seqs
    programs = q_tiles * num_kv_heads
    splits = 1
    target = programs_per_sm * multiprocessors
    if programs < target:
        by_length = max(1, max_seq_len // max(1, min_tokens_per_split))
        splits = max(1, min(math.ceil(target / programs), by_length, max_splits))
    if decode and wide_tiles and splits >= WIDE_TILE_MIN_SPLITS and triton.next_power_of_2(head_dim) <= 128:
        block_n = WIDE_BLOCK_N
    if decode and decode_block_n is not None:
        block_n = max(16, min(block_n, triton.next_power_of_2(decode_block_n)))
    if decode and fit_block_n_to_split and splits > 1:
        keys_per_split = math.ceil(max_seq_len / splits)
        while block_n > 16 and block_n > keys_per_split:
            block_n //= 2
    # Measured side by side (see MAX_FUSED_SPLITS, MAX_FUSED_SPLITS_NARROW and
    # DECODE_PATH_MAX_PROGRAMS_PER_SM): the search-free decode path is faster where the launch
    # splits and, unsplit, up to about 4 programs per SM; above that (7B batch 256) it is 5-8 %
    # slower, so the searching path stays there.
    fused_limit = MAX_FUSED_SPLITS if block_n >= WIDE_BLOCK_N else MAX_FUSED_SPLITS_NARROW
    return LaunchConfig(
        block_q=block_q,
        block_n=block_n,
        num_splits=splits,
        fuse_merge=1 < splits <= fused_limit,
        decode_path=splits > 1 or programs <= DECODE_PATH_MAX_PROGRAMS_PER_SM * multiprocessors,
    )
