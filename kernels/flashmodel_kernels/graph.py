"""Tile attention inside CUDA graphs: one launch plan per captured batch size, and its scratch.

A captured graph replays the kernel launches of its capture: the grid, the split count, the
compiled variant and every pointer are frozen then, and only the contents of the buffers the
launches read may change between replays. So for each batch size vLLM captures (uniform
single-token decode, the sequences padded up to the captured size):

- the plan depends only on what is fixed for that graph: the padded batch size, the model's
  heads and head size, the GPU, and the engine's ``max_model_len`` in place of the batch's
  longest sequence (which changes every step). The kernel reads each sequence's length on the
  device and shares that sequence's keys out over the splits there in two-page runs, with short
  key tiles where a split is short, so a plan made for ``max_model_len`` is right for any shorter
  length and still spreads a short sequence over as many splits as it has runs; splits a short
  sequence leaves empty carry weight zero in the merge.
- the split scratch and the fused merge's counters are one ``SplitWorkspace``, allocated once
  for the largest captured size, so every replay reads and writes the same memory.
- padded slots (sequence length 0, no query token of their own in ``query_start_loc``) write at
  most their own output row, with zeros, never another row.

``GraphPlans`` holds both for one attention layer shape; the vLLM backend builds it once per
metadata builder and hands the plan of a captured size to every call of that size, eager or
captured, so a replay computes exactly what the eager call before capture computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashmodel_kernels.paged_attention import SplitWorkspace
from flashmodel_kernels.plan import LaunchConfig, multiprocessor_count, plan_launch, wide_tiles_fit

__all__ = ["GraphPlans", "LayerShape", "plan_for_graph"]


@dataclass(frozen=True)
class LayerShape:
    """What a captured plan may depend on besides the batch size: fixed for an engine's life."""

    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    multiprocessors: int
    wide_tiles: bool

    @classmethod
    def on_device(
        cls, *, num_q_heads: int, num_kv_heads: int, head_dim: int, max_model_len: int, device: torch.device
    ) -> LayerShape:
        return cls(
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_model_len=max_model_len,
            multiprocessors=multiprocessor_count(device),
            wide_tiles=wide_tiles_fit(device),
        )


def plan_for_graph(num_seqs: int, shape: LayerShape) -> LaunchConfig:
    """The plan of a uniform single-token decode batch of ``num_seqs`` (padded) sequences.

    The same rule as eager decode (``plan_launch``), given ``max_model_len`` as the longest
    sequence: the split count then follows the batch size (occupancy) alone, and the key tile
    fits a split of the longest sequence the engine admits.
    """
    if num_seqs < 1:
        raise ValueError(f"a captured batch holds at least one sequence, not {num_seqs}")
    return plan_launch(
        num_seqs=num_seqs,
        num_tokens=num_seqs,
        max_query_len=1,
        max_seq_len=shape.max_model_len,
        num_kv_heads=shape.num_kv_heads,
        queries_per_kv=shape.num_q_heads // shape.num_kv_heads,
        head_dim=shape.head_dim,
        multiprocessors=shape.multiprocessors,
        wide_tiles=shape.wide_tiles,
    )


class GraphPlans:
    """The plan of every captured decode size and the one workspace they all fit in."""

    def __init__(self, shape: LayerShape, capture_sizes: list[int], device: torch.device | str) -> None:
        self.shape = shape
        self.plans: dict[int, LaunchConfig] = {n: plan_for_graph(n, shape) for n in sorted(set(capture_sizes))}
        rows = counters = 0
        for n, plan in self.plans.items():
            if plan.num_splits > 1:
                rows = max(rows, n * shape.num_q_heads * plan.num_splits)
                counters = max(counters, n * shape.num_kv_heads)
        self.workspace = SplitWorkspace.allocate(rows=rows, head_dim=shape.head_dim, counters=counters, device=device)

    def plan(self, num_seqs: int, num_tokens: int, max_query_len: int) -> LaunchConfig | None:
        """The captured plan for a uniform single-token decode batch of a captured size, else None."""
        if max_query_len != 1 or num_tokens != num_seqs:
            return None
        return self.plans.get(num_seqs)

    def workspace_bytes(self) -> int:
        ws = self.workspace
        return sum(t.numel() * t.element_size() for t in (ws.part_out, ws.part_lse, ws.arrivals))

    def describe(self) -> str:
        """One line per distinct plan, for the engine log: which sizes split how."""
        groups: dict[LaunchConfig, list[int]] = {}
        for n, plan in self.plans.items():
            groups.setdefault(plan, []).append(n)
        parts = [
            f"sizes={_ranges(sizes)} splits={p.num_splits} block_n={p.block_n} fused={p.fuse_merge} "
            f"decode_path={p.decode_path}"
            for p, sizes in groups.items()
        ]
        return "; ".join(parts) + f"; workspace={self.workspace_bytes() / 2**20:.1f} MiB"


def _ranges(sizes: list[int]) -> str:
    return f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}..{sizes[-1]}({len(sizes)})"
