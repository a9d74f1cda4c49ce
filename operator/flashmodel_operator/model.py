"""The FlashModel spec and status as strict pydantic models (the CRD schema is the contract)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

# spec.model.quantization's values: the engine's table is the one list (the CRD's enum is checked against it).
from flashmodel_engine.quantization import Quantization as Quantization
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic.alias_generators import to_camel


class _Spec(BaseModel):
    # camelCase on the wire, snake_case in Python; unknown fields are a bug in the CRD or here.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


# Bounds as the CRD states them (tests/crd/test_model_agrees.py compares the two field by field): the
# API server refuses what lies outside, so a body that reaches the operator always fits.
ObjectName = Annotated[str, Field(min_length=1, max_length=253)]
ModelName = Annotated[str, Field(min_length=1, max_length=256)]
PathText = Annotated[str, Field(max_length=1024)]


class PVCSource(_Spec):
    """A model directory on a PersistentVolumeClaim, mounted read-only at /models."""

    claim_name: ObjectName
    path: PathText = ""


class ImageSource(_Spec):
    """A model packaged in an OCI image, mounted as an image volume."""

    reference: Annotated[str, Field(min_length=1, max_length=1024)]
    path: PathText = "/"


class HubTokenRef(_Spec):
    """The Secret key whose value the engine gets as HF_TOKEN, for gated or private hub models."""

    name: ObjectName
    key: ObjectName = "token"


class CachePVC(_Spec):
    """A PersistentVolumeClaim, in the FlashModel's namespace, that holds the hub cache."""

    claim_name: ObjectName


class HubCache(_Spec):
    """Where the hub cache (HF_HOME) lives; absent: the pod's emptyDir, filled again at every pod start."""

    pvc: CachePVC


class HubSource(_Spec):
    """A model id that vLLM resolves itself (a hub id or a path inside the engine image)."""

    id: ModelName
    revision: ModelName = "main"
    token_secret_ref: HubTokenRef | None = None
    cache: HubCache | None = None


class ModelSpec(_Spec):
    """Where the weights come from, how they are quantized, and the name clients ask for."""

    pvc: PVCSource | None = None
    image: ImageSource | None = None
    hub: HubSource | None = None
    served_name: ModelName | None = None
    quantization: Quantization = "auto"

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        sources = [s for s in (self.pvc, self.image, self.hub) if s is not None]
        if len(sources) != 1:
            raise ValueError(f"spec.model needs exactly one of pvc, image, hub; got {len(sources)}")
        return self


class EngineSpec(_Spec):
    """vLLM settings; the accelerator profile decides which values are allowed."""

    image: Annotated[str, Field(min_length=1, max_length=1024)] = "ghcr.io/flashmodel/engine:0.1.0"
    # No default here: the accelerator profile decides (16 on t4, 32 on cpu).
    block_size: int | None = Field(default=None, ge=1, le=256)
    gpu_memory_utilization: float = Field(default=0.85, ge=0.1, le=0.95)
    max_num_seqs: int = Field(default=256, ge=1, le=1024)
    max_model_len: int = Field(default=4096, ge=128, le=131072)
    max_num_batched_tokens: int = Field(default=4096, ge=16, le=131072)
    dtype: Literal["float16", "bfloat16", "float32", "auto"] | None = None
    # No default here: the accelerator profile decides (graphs on t4, eager on cpu).
    enforce_eager: bool | None = None
    attention_backend: Literal["triton", "tile", "auto"] = "triton"
    extra_args: list[PathText] = Field(default_factory=list, max_length=64)


class PrewarmSpec(_Spec):
    """Warm-up requests a pod must answer before it takes traffic."""

    enabled: bool = True
    requests: int = Field(default=5, ge=1, le=100)
    prompts: list[Annotated[str, Field(max_length=8192)]] = Field(default_factory=list, max_length=32)
    max_tokens: int = Field(default=16, ge=1, le=4096)
    timeout_seconds: int = Field(default=120, ge=1, le=3600)


class HealthSpec(_Spec):
    """Deadlines for the health shim's probes."""

    readiness_deadline_seconds: int = Field(default=5, ge=1, le=300)
    readiness_cache_seconds: int = Field(default=5, ge=0, le=300)
    startup_timeout_seconds: int = Field(default=900, ge=30, le=7200)


class RemediationSpec(_Spec):
    """When and how often the operator may replace a pod whose memory diverges or whose generation hangs."""

    enabled: bool = True
    divergence_ratio: float = Field(default=0.10, ge=0.01, le=1)
    divergence_window_seconds: int = Field(default=300, ge=10, le=86400)
    low_kv_cache_usage: float = Field(default=0.5, ge=0, le=1, alias="lowKVCacheUsage")
    max_restarts_per_hour: int = Field(default=2, ge=0, le=60)
    hung_readiness_seconds: int = Field(default=120, ge=10, le=3600)


class AutoscalingSpec(_Spec):
    """Replica bounds and per-replica targets; the autoscaler scales the FlashModel through its scale subresource."""

    scaler: Literal["keda", "hpa"] = "keda"
    min_replicas: int = Field(default=1, ge=1, le=1000)
    max_replicas: int = Field(ge=1, le=1000)
    target_requests_per_second: float = Field(default=8, ge=0.1, le=10000)
    target_queue_depth: float | None = Field(default=None, ge=0.1, le=10000)
    target_kv_cache_usage: float | None = Field(default=None, ge=0.05, le=1, alias="targetKVCacheUsage")
    target_ttft_milliseconds: float | None = Field(default=None, ge=1, le=600000, alias="targetTTFTMilliseconds")
    window_seconds: int = Field(default=60, ge=10, le=3600)
    scale_up_stabilization_seconds: int = Field(default=60, ge=0, le=3600)
    scale_down_stabilization_seconds: int = Field(default=300, ge=0, le=3600)


class SecretKeyRef(_Spec):
    name: ObjectName
    key: ObjectName = "api-key"


class AuthSpec(_Spec):
    api_key_secret_ref: SecretKeyRef


class ObservabilitySpec(_Spec):
    """Where the engine sends its OpenTelemetry request spans."""

    otlp_traces_endpoint: Annotated[str, Field(min_length=8, max_length=1024)] | None = None
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] = "grpc"


class FlashModelSpec(_Spec):
    """What the user asks for."""

    model: ModelSpec
    accelerator: Literal["t4", "cpu"] = "t4"
    replicas: int = Field(default=1, ge=0)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    prewarm: PrewarmSpec = Field(default_factory=PrewarmSpec)
    health: HealthSpec = Field(default_factory=HealthSpec)
    remediation: RemediationSpec = Field(default_factory=RemediationSpec)
    autoscaling: AutoscalingSpec | None = None
    auth: AuthSpec | None = None
    observability: ObservabilitySpec | None = None
    # Core Kubernetes types pass through untouched: the API server already validated them.
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, Annotated[str, Field(max_length=253)]] = Field(default_factory=dict, max_length=64)
    tolerations: list[dict[str, Any]] = Field(default_factory=list, max_length=64)
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
