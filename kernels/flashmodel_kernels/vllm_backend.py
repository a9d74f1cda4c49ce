# mypy: disallow-subclassing-any=False
# (Where vLLM is not installed, as in CI, its classes are Any; the subclasses are still typed.)
"""Tile attention as a vLLM 0.26 attention backend (imported by vLLM only, through the registry).

The backend reuses what vLLM's own Triton backend does around attention: its metadata builder,
its KV-cache layout and its cache write (``do_kv_cache_update``). Only the attention itself is
ours, so the comparison with TRITON_ATTN is kernel against kernel on the same cache.

Before its first call serves anything, the backend compiles every kernel variant the engine's
limits can need (``precompile``), so no JIT compile stalls serving later;
``FLASHMODEL_TILE_PRECOMPILE=0`` skips that (to measure what it saves).

``FLASHMODEL_TILE_VERIFY=1`` also runs vLLM's Triton kernel on every call and logs the relative
difference (one line per call for the first calls, then every 500th): the proof that the two
agree inside a real engine. It doubles the attention time; never set it in production. Calls
replayed from a CUDA graph run no Python, so it checks eager calls only.

CUDA graphs: the builder declares ``UNIFORM_SINGLE_TOKEN_DECODE``, so under vLLM's default
``FULL_AND_PIECEWISE`` every pure decode step of a captured batch size replays one full graph
and mixed steps run attention eagerly between piecewise graphs. For a captured size the launch
plan comes from ``graph.GraphPlans`` (batch size and ``max_model_len``, never this step's
lengths) and the split scratch is one persistent ``SplitWorkspace``; nothing in ``forward``
reads a device value on the host. (Mixed prefill-decode batches are not captured: their grid
follows the token count, which a captured graph would freeze.)
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import torch
from vllm.v1.attention.backend import AttentionCGSupport, AttentionType, MultipleOf
from vllm.v1.attention.backends.triton_attn import (
    TritonAttentionBackend,
    TritonAttentionImpl,
    TritonAttentionMetadata,
    TritonAttentionMetadataBuilder,
)

from flashmodel_kernels.graph import GraphPlans, LayerShape
from flashmodel_kernels.paged_attention import SplitWorkspace, paged_attention
from flashmodel_kernels.plan import PAGE_SIZE, LaunchConfig
from flashmodel_kernels.variants import compiled_variants, precompile

__all__ = ["TileAttentionBackend", "TileAttentionImpl", "TileAttentionMetadata", "TileAttentionMetadataBuilder"]

logger = logging.getLogger("vllm.plugins.flashmodel_tile_attention")

VERIFY_ENV = "FLASHMODEL_TILE_VERIFY"
PRECOMPILE_ENV = "FLASHMODEL_TILE_PRECOMPILE"
# Used only where vLLM's config cannot be read: its own defaults for these limits.
_DEFAULT_LIMITS = {"max_num_seqs": 256, "max_model_len": 4096, "max_num_batched_tokens": 8192}
_VERIFY_LOG_FIRST = 64
_VERIFY_LOG_EVERY = 500


class _Tally:
    """Calls and worst difference over all layers of the process (each layer has its own impl)."""

    calls = 0
    worst = 0.0
    variants: int | None = 0
    precompiled = False


def _engine_limits() -> dict[str, int]:
    """The limits that decide which kernel variants serving can meet, from vLLM's config."""
    try:
        from vllm.config import get_current_vllm_config

        config = get_current_vllm_config()
        return {
            "max_num_seqs": int(config.scheduler_config.max_num_seqs),
            "max_model_len": int(config.model_config.max_model_len),
            "max_num_batched_tokens": int(config.scheduler_config.max_num_batched_tokens),
        }
    except Exception as err:  # a config vLLM moved must not stop the engine, only widen the set
        logger.warning("flashmodel tile attention: engine limits unreadable (%s); using %s", err, _DEFAULT_LIMITS)
        return dict(_DEFAULT_LIMITS)


@dataclass
class TileAttentionMetadata(TritonAttentionMetadata):
    """vLLM's Triton metadata plus what a captured launch must keep fixed."""

    tile_plan: LaunchConfig | None = None
    """The plan of a captured decode size (``GraphPlans``); None: plan from this step's sizes."""
    tile_workspace: SplitWorkspace | None = None
    """Split scratch that outlives every call, so a captured launch's pointers stay valid."""


_FULL_GRAPH_MODES = ("FULL_AND_PIECEWISE", "FULL_DECODE_ONLY", "FULL")


def _full_graph_capture_sizes(vllm_config: Any) -> list[int]:
    """The decode batch sizes vLLM may capture as full graphs; empty when it captures none.

    vLLM's dispatcher captures full decode graphs only up to ``max_num_seqs`` tokens (a decode
    batch has no more); larger capture sizes are piecewise graphs of mixed batches.
    """
    compilation = vllm_config.compilation_config
    mode = getattr(compilation.cudagraph_mode, "name", str(compilation.cudagraph_mode))
    if mode not in _FULL_GRAPH_MODES:
        return []
    limit = int(vllm_config.scheduler_config.max_num_seqs)
    return sorted({int(n) for n in compilation.cudagraph_capture_sizes or [] if int(n) <= limit})


class TileAttentionMetadataBuilder(TritonAttentionMetadataBuilder):
    """vLLM's Triton metadata, with a fixed plan and persistent scratch for captured decode sizes.

    Uniform single-token decode only: a decode batch's grid is its (padded) sequence count,
    fixed per captured size, while a mixed batch's grid follows its token count.
    """

    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec: Any, layer_names: list[str], vllm_config: Any, device: torch.device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        shape = LayerShape.on_device(
            num_q_heads=self.num_heads_q,
            num_kv_heads=self.num_heads_kv,
            head_dim=self.headdim,
            max_model_len=int(vllm_config.model_config.max_model_len),
            device=torch.device(device),
        )
        sizes = _full_graph_capture_sizes(vllm_config)
        self.graph_plans = GraphPlans(shape, sizes, device)
        if sizes:
            logger.info(
                "flashmodel tile attention CUDA graphs (uniform decode): max_model_len=%d %s",
                shape.max_model_len,
                self.graph_plans.describe(),
            )

    def build_for_cudagraph_capture(self, common_attn_metadata: Any) -> TileAttentionMetadata:
        # vLLM's Triton builder sets every length to 1 here (a fast capture); the captured plan
        # never reads lengths, so the graph is the same as one captured at any other lengths.
        metadata = super().build_for_cudagraph_capture(common_attn_metadata)
        if not isinstance(metadata, TileAttentionMetadata):
            raise TypeError(f"vLLM's capture build returned {type(metadata).__name__}, not this builder's metadata")
        return metadata

    def build(
        self, common_prefix_len: int, common_attn_metadata: Any, fast_build: bool = False
    ) -> TileAttentionMetadata:
        base = super().build(common_prefix_len, common_attn_metadata, fast_build)
        plan = self.graph_plans.plan(
            num_seqs=int(common_attn_metadata.num_reqs),
            num_tokens=int(base.num_actual_tokens),
            max_query_len=int(base.max_query_len),
        )
        return TileAttentionMetadata(
            **{f.name: getattr(base, f.name) for f in fields(base)},
            tile_plan=None if common_prefix_len > 0 else plan,  # cascade attention runs eagerly
            tile_workspace=self.graph_plans.workspace,
        )


class TileAttentionBackend(TritonAttentionBackend):
    """Decoder self-attention over 16-token pages, fp16 or bf16, any head size a multiple of 16."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", "float16", "bfloat16"]

    @staticmethod
    def get_name() -> str:
        # vLLM maps the name back to its enum (AttentionBackendEnum[name]): it must be the slot.
        return "CUSTOM"

    @staticmethod
    def get_impl_cls() -> type[TileAttentionImpl]:
        return TileAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[TileAttentionMetadataBuilder]:
        return TileAttentionMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        # (vLLM 0.26 calls this with no argument; later versions pass the cache spec.)
        return [PAGE_SIZE]

    @classmethod
    def supports_block_size(cls, block_size: int | None) -> bool:
        return block_size is None or block_size == PAGE_SIZE

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size % 16 == 0 and 16 <= head_size <= 256

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return False

    @classmethod
    def supports_sink(cls) -> bool:
        return False

    @classmethod
    def supports_mm_prefix(cls) -> bool:
        return False

    @classmethod
    def supports_non_causal(cls) -> bool:
        return False

    @classmethod
    def supports_alibi_sqrt(cls) -> bool:
        return False

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return False

    @classmethod
    def supports_attn_type(cls, attn_type: str) -> bool:
        return bool(attn_type == AttentionType.DECODER)


class TileAttentionImpl(TritonAttentionImpl):
    """Runs ``paged_attention`` where vLLM's Triton backend runs its unified kernel."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        unsupported = {
            "alibi_slopes": self.alibi_slopes is not None,
            "sliding_window": self.sliding_window != (-1, -1),
            "logits_soft_cap": bool(self.logits_soft_cap),
            "sinks": self.sinks is not None,
            "chunked local attention": self.chunk_lookback != -1,
            f"attn_type={self.attn_type}": self.attn_type != AttentionType.DECODER,
            f"kv_cache_dtype={self.kv_cache_dtype}": self.kv_cache_dtype not in ("auto", "float16", "bfloat16"),
        }
        wanted = [name for name, used in unsupported.items() if used]
        if wanted:
            raise NotImplementedError(
                f"flashmodel tile attention does not support {', '.join(wanted)}; "
                "use --attention-backend TRITON_ATTN for this model"
            )
        self._verify = os.environ.get(VERIFY_ENV, "0") == "1"
        self._precompile = os.environ.get(PRECOMPILE_ENV, "1") != "0"
        # Read here: vLLM sets its current config while it builds the model, not while it serves.
        self._limits = _engine_limits() if self._precompile else {}

    def forward(
        self,
        layer: Any,  # vLLM's base class says AttentionLayer, its Triton impl torch.nn.Module
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,  # logical [num_blocks, num_kv_heads, 16, 2 * head_size]
        attn_metadata: TritonAttentionMetadata,  # TileAttentionMetadata from this backend's builder
        output: torch.Tensor,  # [num_tokens, num_heads, head_size]
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("flashmodel tile attention does not fuse output quantization")
        if attn_metadata is None:
            return output.fill_(0)  # vLLM's memory-profiling pass: no cache yet
        n = attn_metadata.num_actual_tokens
        # vLLM 0.26 packs K and V side by side in the last dimension of one tensor; these are
        # strided views of it, [num_blocks, 16, num_kv_heads, head_size], read through strides.
        kv = kv_cache.transpose(1, 2)
        key_cache, value_cache = kv[..., : self.head_size], kv[..., self.head_size :]
        # While vLLM captures a graph, only the launch below may run on the device: precompiling
        # (many launches) and verifying (a host read) wait for an eager call.
        capturing = query.is_cuda and torch.cuda.is_current_stream_capturing()
        if self._precompile and not _Tally.precompiled and not capturing:
            self._precompile_variants(query, key_cache, value_cache, attn_metadata.block_table)
        tile = attn_metadata if isinstance(attn_metadata, TileAttentionMetadata) else None
        paged_attention(
            query[:n],
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.seq_lens,
            attn_metadata.query_start_loc,
            max_query_len=attn_metadata.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,
            scale=self.scale,
            out=output[:n],
            config=tile.tile_plan if tile else None,
            workspace=tile.tile_workspace if tile else None,
        )
        self._count_call(query, attn_metadata, n)
        if self._verify and not capturing:
            self._compare_with_triton_attn(layer, query, key, value, kv_cache, attn_metadata, output, n)
        return output

    def _precompile_variants(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_table: torch.Tensor
    ) -> None:
        """Compile every kernel variant the engine's limits can need, once per process, and log it."""
        _Tally.precompiled = True
        started = time.monotonic()
        before = compiled_variants()
        precompiled = precompile(query, key_cache, value_cache, block_table, scale=self.scale, **self._limits)
        after = compiled_variants()
        _Tally.variants = after  # so the per-call log reports only compiles while serving
        logger.info(
            "flashmodel tile attention precompiled: variants=%d compiled=%s seconds=%.1f limits=%s",
            len(precompiled),
            None if before is None or after is None else after - before,
            time.monotonic() - started,
            self._limits,
        )

    def _count_call(self, query: torch.Tensor, attn_metadata: TritonAttentionMetadata, n: int) -> None:
        """Count a forward call; log the first and any call that compiled a new kernel variant."""
        if _Tally.calls == 0:
            logger.info(
                "flashmodel tile attention forward: heads=%d kv_heads=%d head_size=%d dtype=%s verify=%s",
                self.num_heads,
                self.num_kv_heads,
                self.head_size,
                query.dtype,
                self._verify,
            )
        _Tally.calls += 1
        variants = compiled_variants()
        if variants is not None and variants != _Tally.variants:
            # A compile on first use: log the batch that needed it (once per new variant).
            logger.info(
                "flashmodel tile attention compiled: variants=%d call=%d tokens=%d seqs=%d max_query_len=%d "
                "max_seq_len=%d",
                variants,
                _Tally.calls,
                n,
                attn_metadata.seq_lens.shape[0],
                attn_metadata.max_query_len,
                attn_metadata.max_seq_len,
            )
            _Tally.variants = variants

    def _compare_with_triton_attn(
        self,
        layer: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TritonAttentionMetadata,
        output: torch.Tensor,
        n: int,
    ) -> None:
        reference = torch.empty_like(output)
        super().forward(layer, query, key, value, kv_cache, attn_metadata, reference)
        ours, theirs = output[:n].double(), reference[:n].double()
        rel = float((ours - theirs).norm() / theirs.norm().clamp_min(1e-30))
        max_abs = float((ours - theirs).abs().max()) if n else 0.0
        _Tally.worst = max(_Tally.worst, rel)
        if _Tally.calls <= _VERIFY_LOG_FIRST or _Tally.calls % _VERIFY_LOG_EVERY == 0:
            logger.info(
                "flashmodel tile verify: call=%d tokens=%d seqs=%d max_query_len=%d max_seq_len=%d "
                "rel_err_vs_triton_attn=%.3e max_abs=%.3e worst_so_far=%.3e",
                _Tally.calls,
                n,
                attn_metadata.seq_lens.shape[0],
                attn_metadata.max_query_len,
                attn_metadata.max_seq_len,
                rel,
                max_abs,
                _Tally.worst,
            )
