"""The engine config (`/etc/flashmodel/engine.yaml`) as strict pydantic models, per docs/design.md."""

from __future__ import annotations

from pathlib import Path, PurePosixPath
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from pydantic.alias_generators import to_camel

from flashmodel_engine.contract import ENGINE_PORT, SHIM_PORT
from flashmodel_engine.quantization import Quantization

Accelerator = Literal["t4", "cpu"]
Dtype = Literal["float16", "bfloat16", "float32", "auto"]
AttentionBackend = Literal["triton", "tile", "auto"]
ArgText = Annotated[str, Field(max_length=1024)]
"""One vLLM command-line token; bounded so the API server's CEL cost estimator can bound its rules."""


class _Strict(BaseModel):
    """camelCase on the wire (the operator renders the FlashModel's keys), snake_case in Python."""

    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class ModelSource(_Strict):
    """Where the weights are and what clients call the model."""

    path: str = Field(min_length=1, description="Model directory (or hub id for hub sources), vLLM's --model.")
    served_name: str = Field(min_length=1, description="The name clients send as `model`.")
    quantization: Quantization = Field(
        default="auto",
        description="Weight quantization: auto (config.json's quant_method), none, or a vLLM method; "
        "the launcher passes it as --quantization.",
    )
    revision: str | None = Field(
        default=None, min_length=1,
        description="Hub branch, tag or commit of the weights, the tokenizer and any remote code (--revision, "
        "--code-revision); None: the hub's default branch.",
    )
    trust_remote_code: bool = Field(
        default=False,
        description=(
            "Run the model's own Python code from its source, for architectures vLLM does not implement "
            "(--trust-remote-code). A hub model must pin hub.revision to a full 40-hex commit id and an image "
            "model its reference to a sha256 digest, so every pod runs the code that was reviewed; a pvc model "
            "runs the code on its claim. Default false."
        ),
    )

    @field_validator("path")
    @classmethod
    def _inside_source(cls, path: str) -> str:
        # The operator renders /models/<pvc path> or /model-image/<image path>: a `..` would leave the
        # volume. A hub id (org/name) has none either.
        if ".." in PurePosixPath(path).parts:
            raise ValueError(f"model.path {path!r} has a '..' segment; the model must stay inside its volume")
        return path


class EngineSettings(_Strict):
    """The FlashModel's `spec.engine`; None means 'the accelerator profile's default'.

    The one definition of each field's type, bounds and description: the operator's spec
    (flashmodel_operator.model.EngineSpec) takes them from here and adds the CRD's defaults, and the
    CRD is generated from that. A new vLLM setting is one field here (plus its flag in
    profiles.ENFORCED_FLAGS or ENFORCED_WHEN_SET, and a profile limit where a card needs one).
    """

    image: str | None = Field(default=None, description="Engine image; informational inside the pod.")
    block_size: int | None = Field(
        default=None, ge=1, le=256,
        description="KV-cache block size in tokens (--block-size); t4 must be 16, cpu a multiple of 32.",
    )
    gpu_memory_utilization: float | None = Field(
        default=None, ge=0.1, le=0.95,
        description="Fraction of GPU memory vLLM may use (--gpu-memory-utilization); t4 at most 0.90.",
    )
    max_num_seqs: int | None = Field(
        default=None, ge=1, le=1024,
        description="Most sequences batched at once (--max-num-seqs); t4 at most 256.",
    )
    max_model_len: int | None = Field(
        default=None, ge=128, le=131072,
        description=(
            "Context length in tokens, prompt plus output (--max-model-len); t4 at most 4096. The chat "
            "template takes about 17 tokens of it."
        ),
    )
    max_num_batched_tokens: int | None = Field(
        default=None, ge=16, le=131072,
        description=(
            "The prefill cap: most tokens scheduled in one step (--max-num-batched-tokens); at least "
            "maxModelLen unless extraArgs has --enable-chunked-prefill. On t4 CUDA graphs are captured for "
            "steps up to it, so it also sizes the graph pool."
        ),
    )
    dtype: Dtype | None = Field(
        default=None,
        description="Weights and activations dtype (--dtype); t4 refuses bfloat16, cpu refuses float16.",
    )
    enforce_eager: bool | None = Field(
        default=None,
        description=(
            "Skip CUDA graphs (--enforce-eager). Unset: the profile decides (t4: graphs on, captured for "
            "steps up to maxNumBatchedTokens; cpu: eager). Eager saves the graph pool (about 1.5 GiB at "
            "1.5B with the default 4096-token budget) and the capture at start-up, and makes every step slower."
        ),
    )
    enable_prefix_caching: bool | None = Field(
        default=None,
        description=(
            "Whether vLLM keeps the KV cache of prompt prefixes for later requests that share them, such as "
            "a long system prompt (--enable-prefix-caching or --no-enable-prefix-caching). Unset: vLLM's "
            "default, on for most models. Set, extraArgs may not name either flag."
        ),
    )
    attention_backend: AttentionBackend = Field(
        default="triton",
        description=(
            "Attention implementation: triton is vLLM's Triton backend, tile is flashmodel's kernel (GPU "
            "only), auto lets vLLM choose."
        ),
    )
    extra_args: list[ArgText] = Field(
        default_factory=list, max_length=64,
        description=(
            "More vLLM server flags, one token per entry. Each must be on the allow-list of flags known to be "
            "safe under the profile (sampling, tool and reasoning parsers, logging, scheduling order), or on the "
            "cluster admin's addition to it (the chart's engineExtraArgs.allowed); a refusal names the flag and "
            "what to do instead, such as the FlashModel field that sets it."
        ),
    )
    extra_args_allowed: list[ArgText] = Field(
        default_factory=list, max_length=64,
        description=(
            "The cluster admin's additions to the extraArgs allow-list that extraArgs use (the chart's "
            "engineExtraArgs.allowed; the operator writes it, no FlashModel field sets it)."
        ),
    )
    cpu_kv_cache_space_gib: int = Field(
        default=1, ge=1, le=1024, alias="cpuKVCacheSpaceGiB",
        description="cpu profile only: VLLM_CPU_KVCACHE_SPACE, the KV cache size in GiB.",
    )


LoraRank = Literal[1, 8, 16, 32, 64, 128, 256, 320, 512]
"""The ranks vLLM accepts as --max-lora-rank (vllm.config.lora.MaxLoRARanks)."""


class LoraSettings(_Strict):
    """LoRA adapters on the base model; present, vLLM serves them (--enable-lora) and the shim loads them.

    The adapters themselves are not here: the operator sends the set to the shim at run time
    (`PUT /adapters`, flashmodel_engine.contract.ADAPTERS_PATH), so adding one restarts nothing.
    None means 'the accelerator profile's default'.
    """

    max_loras: int | None = Field(
        default=None, ge=1, le=64,
        description=(
            "Adapters one batch may use at once (--max-loras); vLLM preallocates their weight buffers on the "
            "card, counted in the memory plan. Unset: the profile's default (4)."
        ),
    )
    max_rank: LoraRank | None = Field(
        default=None,
        description=(
            "The largest adapter rank `r` served (--max-lora-rank), one of vLLM's 1, 8, 16, 32, 64, 128, 256, 320, "
            "512; the buffers are sized for it. Unset: the profile's default (16)."
        ),
    )
    max_cpu_loras: int | None = Field(
        default=None, ge=1, le=256,
        description=(
            "Adapters loaded at once, in host memory (--max-cpu-loras); a PUT /adapters with more is refused. "
            "At least maxLoras. Unset: the larger of maxLoras and 16."
        ),
    )
    adapter_roots: list[Annotated[str, Field(min_length=2, max_length=1024)]] = Field(
        default_factory=lambda: ["/adapters"], min_length=1, max_length=16,
        description=(
            "Absolute folders an adapter's path must lie in (after symlinks are resolved); the hub cache is "
            "added to them."
        ),
    )
    hub_cache_dir: str = Field(
        default="/cache/adapters", min_length=2,
        description="Where hub adapters are downloaded (a writable folder of the pod), one folder per repo and commit.",
    )
    await_adapters_seconds: float = Field(
        default=120, ge=0, le=3600,
        description=(
            "How long the prewarm at start waits for the operator's first PUT /adapters, so the gate opens with "
            "every adapter loaded and prewarmed; past it the base model's prewarm runs alone."
        ),
    )

    @field_validator("adapter_roots", "hub_cache_dir")
    @classmethod
    def _absolute(cls, value: str | list[str]) -> str | list[str]:
        for path in [value] if isinstance(value, str) else value:
            p = PurePosixPath(path)
            if not p.is_absolute() or ".." in p.parts:
                raise ValueError(f"{path!r} must be an absolute path without '..'")
        return value


class PrewarmSettings(_Strict):
    """Warm-up requests a pod must answer before it takes traffic.

    The one definition of each prewarm, health and remediation field: the operator's spec
    (flashmodel_operator.model) takes type, bounds and description from here, narrowing a bound
    only where a FlashModel may set less than the engine reads.
    """

    enabled: bool = Field(
        default=True, description="Whether a pod waits for a successful prewarm before it gets traffic."
    )
    requests: int = Field(
        default=5, ge=1, le=100,
        description="Number of warm-up requests (five fix the slow first requests after start).",
    )
    prompts: list[Annotated[str, Field(max_length=8192)]] = Field(
        default_factory=list, max_length=32, description="Warm-up prompts; empty means the engine's built-in prompts."
    )
    max_tokens: int = Field(default=16, ge=1, le=4096, description="The max_tokens of each warm-up request, in tokens.")
    timeout_seconds: float = Field(
        default=120, gt=0, le=3600,
        description="Deadline for the whole prewarm, in seconds; past it the pod stays out of the Service.",
    )


class HealthSettings(_Strict):
    """Deadlines for the health shim's probes."""

    readiness_deadline_seconds: float = Field(
        default=5, gt=0, le=300,
        description="Seconds within which the one-token generation behind /readyz must finish.",
    )
    readiness_cache_seconds: float = Field(
        default=5, ge=0, le=300,
        description="Seconds a /readyz result is reused, so probes do not load the engine; 0 means never.",
    )
    startup_timeout_seconds: float = Field(
        default=900, gt=0, le=7200,
        description="Seconds model loading may take before the pod is restarted.",
    )


class RemediationSettings(_Strict):
    """When a pod's memory diverges or its generation hangs, and how often the operator may replace it."""

    enabled: bool = Field(default=True, description="Whether the operator replaces pods on its own.")
    divergence_ratio: float = Field(
        default=0.10, gt=0, le=1,
        description=(
            "GPU memory above the post-prewarm baseline, as a fraction of the total, that counts as divergence."
        ),
    )
    divergence_window_seconds: float = Field(
        default=300, ge=0, le=86400, description="Seconds divergence must last before it counts."
    )
    low_kv_cache_usage: float = Field(
        default=0.5, ge=0, le=1, alias="lowKVCacheUsage",
        description=(
            "Divergence counts only while vLLM's KV-cache usage, a fraction 0..1, is below this (a full cache "
            "explains the memory)."
        ),
    )
    # The operator's alone: the engine reports divergence, the operator spends the budget.
    max_restarts_per_hour: int = Field(
        default=2, ge=0, le=60,
        description=(
            "The restart budget per FlashModel, in pod evictions per hour (a sliding hour); 0 records the "
            "decision but evicts nothing."
        ),
    )
    hung_readiness_seconds: float = Field(
        default=120, gt=0, le=3600,
        description="Seconds of /readyz failing while /livez is fine that mean generation hangs; the pod is replaced.",
    )


class AuthSettings(_Strict):
    """API key for vLLM's OpenAI server; the shim sends it too."""

    api_key_file: str = Field(min_length=1, description="File holding the API key (a mounted Secret).")


class ObservabilitySettings(_Strict):
    """Where vLLM sends its OpenTelemetry request spans."""

    otlp_traces_endpoint: str | None = Field(
        default=None, min_length=1, description="OTLP collector URL (--otlp-traces-endpoint); None: no tracing."
    )
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] = Field(
        default="grpc", description="OTLP transport (OTEL_EXPORTER_OTLP_TRACES_PROTOCOL); grpc is vLLM's default."
    )


class ServerSettings(_Strict):
    """Where the engine and the shim listen."""

    host: str = Field(default="0.0.0.0", description="Bind address of both the engine and the shim.")
    engine_port: int = Field(default=ENGINE_PORT, ge=1, le=65535, description="vLLM's OpenAI server port.")
    shim_port: int = Field(default=SHIM_PORT, ge=1, le=65535, description="The health shim's port (probes).")
    drain_timeout_seconds: float = Field(
        default=25, ge=0,
        description="On SIGTERM, wait this long for in-flight requests; keep below terminationGracePeriod.",
    )
    compile_cache_dir: str | None = Field(
        default=None, min_length=1,
        description=(
            "A folder the model's pods share (a claim) for vLLM's, Inductor's and Triton's compile caches, keyed "
            "per vLLM, torch, accelerator and command line (flashmodel_engine.compile_cache); None: the pod's own."
        ),
    )
    control_token_file: str | None = Field(
        default=None, min_length=1,
        description="File with the token POST /prewarm requires (the operator's per-model Secret); None: none.",
    )


class EngineConfig(_Strict):
    """The whole engine config the operator renders into the `<name>-engine` ConfigMap."""

    accelerator: Accelerator = Field(default="t4", description="Accelerator profile: t4 or cpu.")
    model: ModelSource = Field(description="Model source.")
    engine: EngineSettings = Field(default_factory=EngineSettings, description="vLLM settings.")
    prewarm: PrewarmSettings = Field(default_factory=PrewarmSettings, description="Warm-up.")
    health: HealthSettings = Field(default_factory=HealthSettings, description="Probes.")
    remediation: RemediationSettings = Field(default_factory=RemediationSettings, description="Signals.")
    auth: AuthSettings | None = Field(default=None, description="Absent: no API key.")
    lora: LoraSettings | None = Field(default=None, description="LoRA adapters; absent: none (no --enable-lora).")
    observability: ObservabilitySettings = Field(default_factory=ObservabilitySettings, description="Tracing.")
    server: ServerSettings = Field(default_factory=ServerSettings, description="Ports and bind address.")


class ConfigError(ValueError):
    """The engine config file is missing, not YAML, or does not match the schema."""


def _describe(err: ValidationError) -> str:
    parts = []
    for e in err.errors():
        where = ".".join(str(p) for p in e["loc"]) or "<root>"
        parts.append(f"{where}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(parts)


def parse_config(data: object, source: str = "<inline>") -> EngineConfig:
    """Validate already-loaded YAML/JSON data; errors name the key, the value and the fix."""
    try:
        return EngineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(
            f"engine config {source} is invalid: {_describe(e)}; fix the FlashModel spec (docs/design.md)"
        ) from e


def load_config(path: str | Path) -> EngineConfig:
    """Read and validate the engine config file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"engine config {p} cannot be read ({e.strerror}); mount the ConfigMap there") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"engine config {p} is not YAML: {e}") from e
    return parse_config(data, str(p))
