"""Accelerator profiles and the pure function that turns an engine config into vLLM's command line.

Imports nothing heavy: the operator calls `vllm_args` for `status.engineArgs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flashmodel_engine.config import EngineConfig

# Flags the profile owns; extraArgs may not set them (docs/design.md, "Enforced flags").
# The value is the engine-config key to use instead.
ENFORCED_FLAGS: dict[str, str] = {
    "--block-size": "engine.blockSize",
    "--dtype": "engine.dtype",
    "--gpu-memory-utilization": "engine.gpuMemoryUtilization",
    "--max-num-seqs": "engine.maxNumSeqs",
    "--max-model-len": "engine.maxModelLen",
    "--max-num-batched-tokens": "engine.maxNumBatchedTokens",
    "--enforce-eager": "engine.enforceEager",
    # The graph pool the memory plan counts is the one for batches up to maxNumSeqs.
    "--max-cudagraph-capture-size": "engine.maxNumSeqs",
    "--cudagraph-capture-sizes": "engine.maxNumSeqs",
    "--compilation-config": "engine.enforceEager",
    # Either would replace the gpuMemoryUtilization budget the memory plan is made for.
    "--kv-cache-memory-bytes": "engine.gpuMemoryUtilization",
    "--attention-backend": "engine.attentionBackend",
    "--model": "model.path",
    "--served-model-name": "model.servedName",
    "--host": "server.host",
    "--port": "server.enginePort",
    "--api-key": "auth.apiKeyFile",
    # The launcher's drain relies on it (vLLM finishes in-flight requests this long on SIGTERM).
    "--shutdown-timeout": "server.drainTimeoutSeconds",
}
# Spellings vLLM's parser also accepts for the flags above, and ways around them.
_ALIASES: dict[str, str] = {
    "--no-enforce-eager": "--enforce-eager",
    "--config": "--config",  # a vLLM YAML config could set any enforced flag behind our back
}

# vLLM's names for our attentionBackend values on GPUs.
_GPU_ATTENTION: dict[str, str | None] = {"triton": "TRITON_ATTN", "tile": "CUSTOM", "auto": None}


@dataclass(frozen=True)
class AcceleratorProfile:
    """What one accelerator allows and defaults to, and why."""

    name: str
    gpu: bool
    default_block_size: int
    block_size_multiple: int
    fixed_block_size: bool
    default_dtype: str
    allowed_dtypes: tuple[str, ...]
    default_gpu_memory_utilization: float | None
    max_gpu_memory_utilization: float | None
    max_num_seqs: int
    max_model_len: int
    head_size_multiple: int
    min_head_size: int
    card_memory_bytes: int | None
    min_compute_capability: tuple[int, int] | None
    attention_backends: tuple[str, ...]
    default_enforce_eager: bool


PROFILES: dict[str, AcceleratorProfile] = {
    # T4: sm_75, 16 GB (about 15 GiB usable), no bf16; vLLM's Triton attention reads 16-token blocks,
    # 512 sequences run out of memory.
    "t4": AcceleratorProfile(
        name="t4", gpu=True, default_block_size=16, block_size_multiple=16, fixed_block_size=True,
        default_dtype="float16", allowed_dtypes=("float16", "float32", "auto"),
        default_gpu_memory_utilization=0.85, max_gpu_memory_utilization=0.90,
        max_num_seqs=256, max_model_len=4096, head_size_multiple=16, min_head_size=16,
        card_memory_bytes=15 * 1024**3, min_compute_capability=(7, 5),
        attention_backends=("triton", "tile", "auto"),
        # CUDA graphs on: eager decode was 17-19x slower per token at one request and carried 5-7x
        # fewer requests at 8-32 (H200, vLLM 0.26, 1.5B); the graph pool is counted by vLLM's own
        # memory profiler inside gpuMemoryUtilization (docs/benchmarks.md, "The t4 profile").
        default_enforce_eager=False,
    ),
    # vLLM's CPU attention accepts only block sizes that are multiples of 32 and head sizes >= 32.
    "cpu": AcceleratorProfile(
        name="cpu", gpu=False, default_block_size=32, block_size_multiple=32, fixed_block_size=False,
        default_dtype="float32", allowed_dtypes=("float32", "bfloat16", "auto"),
        default_gpu_memory_utilization=None, max_gpu_memory_utilization=None,
        max_num_seqs=256, max_model_len=4096, head_size_multiple=1, min_head_size=32,
        card_memory_bytes=None, min_compute_capability=None,
        attention_backends=("triton", "auto"),
        # No CUDA graphs on a CPU; without eager mode vLLM's CPU backend compiles the model with
        # torch.compile at every start, which a tiny test model does not repay.
        default_enforce_eager=True,
    ),
}


class ProfileError(ValueError):
    """The engine config conflicts with its accelerator profile; `problems` has one line per conflict."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class ResolvedEngine:
    """The engine settings after profile defaults were applied and every rule checked."""

    profile: AcceleratorProfile
    block_size: int
    dtype: str
    gpu_memory_utilization: float | None
    max_num_seqs: int
    max_model_len: int
    max_num_batched_tokens: int
    enforce_eager: bool
    attention_backend: str


def _flag_name(arg: str) -> str:
    name = arg.split("=", 1)[0]
    # vLLM's parser treats --block_size as --block-size.
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def check_extra_args(extra_args: list[str]) -> list[str]:
    """One problem line per extra arg that sets an enforced flag (or could)."""
    problems = []
    chunked = False
    for i, arg in enumerate(extra_args):
        flag = _flag_name(arg)
        target = _ALIASES.get(flag, flag)
        if target == "--config":
            problems.append(
                f"engine.extraArgs[{i}] {arg!r}: a vLLM config file could override enforced flags; "
                "put its settings into the FlashModel spec instead"
            )
        elif target in ENFORCED_FLAGS:
            problems.append(
                f"engine.extraArgs[{i}] {arg!r} sets the enforced flag {target}; "
                f"remove it and set {ENFORCED_FLAGS[target]} instead"
            )
        chunked = chunked or flag == "--enable-chunked-prefill"
    return problems


def resolve(config: EngineConfig) -> ResolvedEngine:
    """Apply the profile's defaults and rules; raise ProfileError listing every conflict."""
    profile = PROFILES[config.accelerator]
    e = config.engine
    problems: list[str] = []
    where = f"on {profile.name}"

    block_size = e.block_size if e.block_size is not None else profile.default_block_size
    if profile.fixed_block_size and block_size != profile.default_block_size:
        problems.append(
            f"engine.blockSize is {block_size}; it must be {profile.default_block_size} {where}: "
            "the T4 attention kernel reads the KV cache in 16-token blocks"
        )
    elif block_size % profile.block_size_multiple:
        problems.append(
            f"engine.blockSize is {block_size}; it must be a multiple of {profile.block_size_multiple} {where}: "
            "vLLM's CPU attention only supports such blocks (use 32)"
        )

    dtype = e.dtype or profile.default_dtype
    if dtype not in profile.allowed_dtypes:
        why = "the T4 (sm_75) has no bfloat16; use float16" if profile.name == "t4" else "unsupported here"
        problems.append(
            f"engine.dtype is {dtype}; allowed {where}: {', '.join(profile.allowed_dtypes)} ({why})"
        )

    gmu: float | None = None
    if profile.gpu:
        gmu = e.gpu_memory_utilization if e.gpu_memory_utilization is not None else (
            profile.default_gpu_memory_utilization)
        if gmu is not None and profile.max_gpu_memory_utilization is not None and (
                gmu > profile.max_gpu_memory_utilization):
            problems.append(
                f"engine.gpuMemoryUtilization is {gmu}; it must be <= {profile.max_gpu_memory_utilization} "
                f"{where}: the CUDA context and activations need the rest (0.85 is the tested value)"
            )

    max_num_seqs = e.max_num_seqs if e.max_num_seqs is not None else profile.max_num_seqs
    if max_num_seqs > profile.max_num_seqs:
        problems.append(
            f"engine.maxNumSeqs is {max_num_seqs}; it must be <= {profile.max_num_seqs} {where}: "
            "more sequences run the card out of memory (512 does on a T4)"
        )

    max_model_len = e.max_model_len if e.max_model_len is not None else profile.max_model_len
    if max_model_len > profile.max_model_len:
        problems.append(
            f"engine.maxModelLen is {max_model_len}; it must be <= {profile.max_model_len} {where}: "
            "longer contexts leave too little KV cache for concurrent requests"
        )

    mnbt = e.max_num_batched_tokens if e.max_num_batched_tokens is not None else max_model_len
    chunked = any(_flag_name(a) == "--enable-chunked-prefill" for a in e.extra_args)
    if mnbt < max_model_len and not chunked:
        problems.append(
            f"engine.maxNumBatchedTokens is {mnbt}, below maxModelLen {max_model_len}: a full-length prompt "
            "could never be scheduled; raise it or add --enable-chunked-prefill to extraArgs"
        )

    if e.attention_backend not in profile.attention_backends:
        problems.append(
            f"engine.attentionBackend is {e.attention_backend}; allowed {where}: "
            f"{', '.join(profile.attention_backends)} (the tile kernel needs a GPU)"
        )

    problems.extend(check_extra_args(e.extra_args))
    if problems:
        raise ProfileError(problems)
    return ResolvedEngine(
        profile=profile, block_size=block_size, dtype=dtype, gpu_memory_utilization=gmu,
        max_num_seqs=max_num_seqs, max_model_len=max_model_len, max_num_batched_tokens=mnbt,
        enforce_eager=profile.default_enforce_eager if e.enforce_eager is None else e.enforce_eager,
        attention_backend=e.attention_backend,
    )


def vllm_args(config: EngineConfig) -> list[str]:
    """vLLM's OpenAI-server flags for this config (without the interpreter and module).

    The API key is not a flag: it would show in `ps` and in status.engineArgs, so the launcher
    hands it to vLLM as VLLM_API_KEY (see `vllm_env`).
    """
    r = resolve(config)
    args = [
        "--model", config.model.path,
        "--served-model-name", config.model.served_name,
        "--host", config.server.host,
        "--port", str(config.server.engine_port),
        "--block-size", str(r.block_size),
        "--dtype", r.dtype,
        "--max-num-seqs", str(r.max_num_seqs),
        "--max-model-len", str(r.max_model_len),
        "--max-num-batched-tokens", str(r.max_num_batched_tokens),
        "--shutdown-timeout", str(math.ceil(config.server.drain_timeout_seconds)),
    ]
    if r.gpu_memory_utilization is not None:
        args += ["--gpu-memory-utilization", str(r.gpu_memory_utilization)]
    if r.enforce_eager:
        args.append("--enforce-eager")
    elif r.profile.gpu:
        # vLLM captures graphs up to min(2 x maxNumSeqs, 512) by default; a decode batch never
        # exceeds maxNumSeqs, so larger graphs only cost pool memory and start-up time.
        args += ["--max-cudagraph-capture-size", str(r.max_num_seqs)]
    if r.profile.gpu:
        backend = _GPU_ATTENTION[r.attention_backend]
        if backend is not None:
            args += ["--attention-backend", backend]
    return args + list(config.engine.extra_args)


def vllm_env(config: EngineConfig) -> dict[str, str]:
    """Environment variables the profile sets for vLLM (the API key is added by the launcher)."""
    if config.accelerator == "cpu":
        # vLLM's CPU backend sizes its KV cache from this, not from gpu-memory-utilization.
        return {"VLLM_CPU_KVCACHE_SPACE": str(config.engine.cpu_kv_cache_space_gib)}
    return {}
