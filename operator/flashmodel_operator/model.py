"""The FlashModel spec and status as strict pydantic models (the CRD schema is the contract)."""

from __future__ import annotations

from typing import Any, Literal

# spec.model.quantization's values: the engine's table is the one list (the CRD's enum is checked against it).
from flashmodel_engine.quantization import Quantization as Quantization
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


class _Spec(BaseModel):
    # camelCase on the wire, snake_case in Python; unknown fields are a bug in the CRD or here.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class PVCSource(_Spec):
    """A model directory on a PersistentVolumeClaim, mounted read-only at /models."""

    claim_name: str
    path: str = ""


class ImageSource(_Spec):
    """A model packaged in an OCI image, mounted as an image volume."""

    reference: str
    path: str = "/"


class HubTokenRef(_Spec):
    """The Secret key whose value the engine gets as HF_TOKEN, for gated or private hub models."""

    name: str
    key: str = "token"


class CachePVC(_Spec):
    """A PersistentVolumeClaim, in the FlashModel's namespace, that holds the hub cache."""

    claim_name: str


class HubCache(_Spec):
    """Where the hub cache (HF_HOME) lives; absent: the pod's emptyDir, filled again at every pod start."""

    pvc: CachePVC


class HubSource(_Spec):
    """A model id that vLLM resolves itself (a hub id or a path inside the engine image)."""

    id: str
    revision: str = "main"
    token_secret_ref: HubTokenRef | None = None
    cache: HubCache | None = None


class ModelSpec(_Spec):
    """Where the weights come from, how they are quantized, and the name clients ask for."""

    pvc: PVCSource | None = None
    image: ImageSource | None = None
    hub: HubSource | None = None
    served_name: str | None = None
    quantization: Quantization = "auto"

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        sources = [s for s in (self.pvc, self.image, self.hub) if s is not None]
        if len(sources) != 1:
            raise ValueError(f"spec.model needs exactly one of pvc, image, hub; got {len(sources)}")
        return self


class EngineSpec(_Spec):
    """vLLM settings; the accelerator profile decides which values are allowed."""

    image: str = "ghcr.io/flashmodel/engine:0.1.0"
    # No default here: the accelerator profile decides (16 on t4, 32 on cpu).
    block_size: int | None = None
    gpu_memory_utilization: float = 0.85
    max_num_seqs: int = 256
    max_model_len: int = 4096
    max_num_batched_tokens: int = 4096
    dtype: Literal["float16", "bfloat16", "float32", "auto"] | None = None
    # No default here: the accelerator profile decides (graphs on t4, eager on cpu).
    enforce_eager: bool | None = None
    attention_backend: Literal["triton", "tile", "auto"] = "triton"
    extra_args: list[str] = Field(default_factory=list)


class PrewarmSpec(_Spec):
    """Warm-up requests a pod must answer before it takes traffic."""

    enabled: bool = True
    requests: int = 5
    prompts: list[str] = Field(default_factory=list)
    max_tokens: int = 16
    timeout_seconds: int = 120


class HealthSpec(_Spec):
    """Deadlines for the health shim's probes."""

    readiness_deadline_seconds: float = 5
    readiness_cache_seconds: float = 5
    startup_timeout_seconds: int = 900


class RemediationSpec(_Spec):
    """When and how often the operator may replace a pod whose memory diverges or whose generation hangs."""

    enabled: bool = True
    divergence_ratio: float = 0.10
    divergence_window_seconds: int = 300
    low_kv_cache_usage: float = Field(default=0.5, alias="lowKVCacheUsage")
    max_restarts_per_hour: int = 2
    hung_readiness_seconds: int = 120


class AutoscalingSpec(_Spec):
    """Replica bounds and per-replica targets; the autoscaler scales the FlashModel through its scale subresource."""

    scaler: Literal["keda", "hpa"] = "keda"
    min_replicas: int = Field(default=1, ge=1)
    max_replicas: int
    target_requests_per_second: float = 8
    target_queue_depth: float | None = None
    target_kv_cache_usage: float | None = Field(default=None, alias="targetKVCacheUsage")
    target_ttft_milliseconds: float | None = Field(default=None, alias="targetTTFTMilliseconds")
    window_seconds: int = 60
    scale_up_stabilization_seconds: int = 60
    scale_down_stabilization_seconds: int = 300


class SecretKeyRef(_Spec):
    name: str
    key: str = "api-key"


class AuthSpec(_Spec):
    api_key_secret_ref: SecretKeyRef


class ObservabilitySpec(_Spec):
    """Where the engine sends its OpenTelemetry request spans."""

    otlp_traces_endpoint: str | None = None
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] = "grpc"


class FlashModelSpec(_Spec):
    """What the user asks for."""

    model: ModelSpec
    accelerator: Literal["t4", "cpu"] = "t4"
    replicas: int = 1
    engine: EngineSpec = Field(default_factory=EngineSpec)
    prewarm: PrewarmSpec = Field(default_factory=PrewarmSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    remediation: RemediationSpec = Field(default_factory=RemediationSpec)
    autoscaling: AutoscalingSpec | None = None
    auth: AuthSpec | None = None
    observability: ObservabilitySpec | None = None
    # Core Kubernetes types pass through untouched: the API server already validated them.
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    affinity: dict[str, Any] = Field(default_factory=dict)
    pod_template_patch: dict[str, Any] = Field(default_factory=dict)


class FlashModel(BaseModel):
    """The parts of a FlashModel object the operator needs: identity and spec."""

    model_config = ConfigDict(frozen=True)

    name: str
    namespace: str
    uid: str
    generation: int
    spec: FlashModelSpec

    @property
    def served_name(self) -> str:
        return self.spec.model.served_name or self.name

    @classmethod
    def from_body(cls, body: dict[str, Any] | Any) -> FlashModel:
        meta = body["metadata"]
        return cls(
            name=meta["name"],
            namespace=meta["namespace"],
            uid=meta["uid"],
            generation=int(meta.get("generation", 1)),
            spec=FlashModelSpec.model_validate(dict(body.get("spec", {}))),
        )
