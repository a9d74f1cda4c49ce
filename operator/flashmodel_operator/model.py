"""The FlashModel spec as strict pydantic models: the one source of the CRD's spec schema.

Each field's type, default, bounds and description, and each CEL rule, are what the API server
enforces and `kubectl explain` shows: scripts/gen_crd.py writes them into crds/flashmodel.yaml.
spec.engine's fields are the engine's (flashmodel_engine.config.EngineSettings, via spec_fields), and
the rules that restate the engine's profile, quantization and flag tables come from spec_rules.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

from flashmodel_engine.config import (
    Accelerator,
    ArgText,
    AttentionBackend,
    Dtype,
    EngineSettings,
    HealthSettings,
    ModelSource,
    PrewarmSettings,
    RemediationSettings,
)
from flashmodel_engine.profiles import PROFILES

# spec.model.quantization's values: the engine's table is the one list (the CRD's enum is generated from it).
from flashmodel_engine.quantization import Quantization as Quantization
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.alias_generators import to_camel

from flashmodel_operator.spec_fields import engine_field
from flashmodel_operator.spec_rules import Rule as Rule
from flashmodel_operator.spec_rules import accelerator_rules, extra_args_rules, when_set_rules


class _Spec(BaseModel):
    # camelCase on the wire, snake_case in Python; unknown fields are a bug in the CRD or here.
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)

    # The CRD's CEL rules on this object, and on single fields (by attribute name); pydantic ignores them.
    rules: ClassVar[tuple[Rule, ...]] = ()
    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {}


PINNED_REVISION = "^[0-9a-f]{40}$"
"""A hub commit id in full: the only revision that cannot move."""
PINNED_IMAGE = "@sha256:[0-9a-f]{64}$"

# The accelerator a FlashModel gets when it names none; its profile gives the CRD's engine defaults.
_DEFAULT_ACCELERATOR: Accelerator = "t4"
_DEFAULT_PROFILE = PROFILES[_DEFAULT_ACCELERATOR]

# Bounds shared by several fields. Strings and lists are bounded so that the API server's CEL cost
# estimator can bound every rule.
ObjectName = Annotated[str, Field(min_length=1, max_length=253)]
ModelName = Annotated[str, Field(min_length=1, max_length=256)]
PathText = Annotated[str, Field(max_length=1024)]

# A path inside a model source stays inside it: the engine gets /models/<path> or /model-image/<path>.
_NO_PARENT_SEGMENT = "!self.matches('(^|/)[.][.](/|$)')"


def _inside_rule(field: str, instead: str = "name the directory from the source's root, e.g. models/qwen") -> Rule:
    return Rule(
        _NO_PARENT_SEGMENT, f"{field} must not have a '..' segment: the model must stay inside its source; {instead}"
    )


def _inside(path: str, field: str, subject: str = "the model", fix: str = "") -> str:
    """The operator's own check of _inside_rule, for objects stored before the CRD had it."""
    if ".." in path.split("/"):
        raise ValueError(f"{field} {path!r} has a '..' segment: {subject} must stay inside its source{fix}")
    return path


class PVCSource(_Spec):
    """A model directory on a PersistentVolumeClaim, mounted read-only at /models."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {"path": (_inside_rule("pvc.path"),)}

    claim_name: ObjectName = Field(
        description="Name of the PersistentVolumeClaim in the FlashModel's namespace.",
    )
    path: PathText = Field(
        default="",
        description="Directory of the model inside the claim; empty means the claim's root. No '..' segments.",
    )

    @field_validator("path")
    @classmethod
    def _path_inside(cls, path: str) -> str:
        return _inside(path, "spec.model.pvc.path")


class ImageSource(_Spec):
    """A model packaged in an OCI image, mounted as an image volume."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {"path": (_inside_rule("image.path"),)}

    reference: Annotated[str, Field(min_length=1, max_length=1024)] = Field(
        description="Image reference, e.g. registry.example.com/models/qwen:1.5b.",
    )
    path: PathText = Field(
        default="/",
        description="Directory of the model inside the image. No '..' segments.",
    )

    @field_validator("path")
    @classmethod
    def _path_inside(cls, path: str) -> str:
        return _inside(path, "spec.model.image.path")


class HubTokenRef(_Spec):
    """The Secret key whose value the engine gets as HF_TOKEN, for gated or private hub models."""

    name: ObjectName = Field(
        description="Secret name in the FlashModel's namespace.",
    )
    key: ObjectName = Field(
        default="token",
        description="Key inside the Secret. Default token.",
    )


class CachePVC(_Spec):
    """A PersistentVolumeClaim, in the FlashModel's namespace, that holds the hub cache."""

    claim_name: ObjectName = Field(
        description="Name of the PersistentVolumeClaim in the FlashModel's namespace.",
    )


class HubCache(_Spec):
    """Where the hub cache (HF_HOME) lives; absent: the pod's emptyDir, filled again at every pod start."""

    pvc: CachePVC = Field(
        description=(
            "A PersistentVolumeClaim mounted read-write at HF_HOME; the engine runs as uid and gid 1000, so "
            "the volume must be writable by one of them (NFS ignores fsGroup). With more than one replica or "
            "pods on several nodes it must be ReadWriteMany (NFS, CephFS, Filestore, EFS); a ReadWriteOnce "
            "claim holds every pod to one node."
        ),
    )


class CompileCache(_Spec):
    """Where the model's pods keep what vLLM, Inductor and Triton compile, so a new pod loads it instead."""

    pvc: CachePVC = Field(
        description=(
            "A PersistentVolumeClaim the model's pods share, mounted read-write at /compile-cache; each "
            "vLLM, torch, accelerator and engine command line gets a folder of its own there, so an upgrade "
            "or a spec change starts a new one and never reuses a wrong entry. Writable by uid or gid 1000; "
            "ReadWriteMany where pods run on several nodes. Old folders are yours to prune."
        ),
    )


class HubSource(_Spec):
    """A model id that vLLM resolves itself (a hub id or a path inside the engine image)."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {
        "id": (_inside_rule("hub.id", "write a hub id (org/name) or a path inside the engine image without '..'"),)
    }

    id: ModelName = Field(
        description="Hub model id, e.g. Qwen/Qwen2.5-1.5B-Instruct.",
    )

    @field_validator("id")
    @classmethod
    def _id_inside(cls, model_id: str) -> str:
        return _inside(model_id, "spec.model.hub.id")
    revision: ModelName = Field(
        default="main",
        description=(
            "Branch, tag or commit of the hub model, passed to vLLM as --revision and --code-revision (the "
            "weights, the tokenizer and any remote code come from it). Default main, the hub's default branch; "
            "a commit id pins exactly what every pod loads, and trustRemoteCode needs one."
        ),
    )
    token_secret_ref: HubTokenRef | None = Field(
        default=None,
        description=(
            "The Secret key holding a hub access token, for gated or private models. The engine container "
            "gets it as HF_TOKEN from the Secret when it starts; it is never written into the pod spec, the "
            "engine ConfigMap or the status. Absent means anonymous downloads. Until the Secret exists no pod "
            "starts (status reason HubTokenSecretNotFound)."
        ),
    )
    cache: HubCache | None = Field(
        default=None,
        description=(
            "Where the hub cache (HF_HOME, /cache/huggingface in the engine container) lives. Absent means "
            "the pod's emptyDir: every new pod downloads the model again. With a claim, the first pod "
            "downloads and the others load from it. Every model whose pods mount the claim can write to it, "
            "so share one only between models that trust each other. A node-local hostPath cache is not "
            "offered: it would give pods write access to a node directory that other namespaces' pods read, "
            "and Pod Security's baseline level refuses hostPath; a claim from a node-local storage class "
            "gives the same."
        ),
    )


class ModelSpec(_Spec):
    """Where the weights come from, how they are quantized, and the name clients ask for."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "(has(self.pvc) ? 1 : 0) + (has(self.image) ? 1 : 0) + (has(self.hub) ? 1 : 0) == 1",
            "spec.model needs exactly one source: set one of pvc, image or hub (the engine loads one model per pod)",
        ),
        # Remote code runs in the engine past every check: it must be the code that was reviewed, not
        # whatever a branch, tag or image tag points at when a pod starts.
        Rule(
            f"!has(self.trustRemoteCode) || !self.trustRemoteCode || !has(self.hub) || "
            f"self.hub.revision.matches('{PINNED_REVISION}')",
            "trustRemoteCode needs spec.model.hub.revision pinned to a full 40-hex commit id: the model's code "
            "runs in the engine, and a branch or tag can change it under running pods; set revision to the "
            "commit you reviewed (the hub's commit history lists it)",
            field_path=".hub.revision",
            reason="FieldValueInvalid",
        ),
        Rule(
            f"!has(self.trustRemoteCode) || !self.trustRemoteCode || !has(self.image) || "
            f"self.image.reference.matches('{PINNED_IMAGE}')",
            "trustRemoteCode needs spec.model.image.reference pinned to a digest (...@sha256:<64 hex>): the "
            "model's code runs in the engine, and a tag can change it under running pods",
            field_path=".image.reference",
            reason="FieldValueInvalid",
        ),
    )

    pvc: PVCSource | None = Field(
        default=None,
        description="A model directory on a PersistentVolumeClaim, mounted read-only at /models.",
    )
    image: ImageSource | None = Field(
        default=None,
        description=(
            "A model packaged in an OCI image, mounted as an image volume: on by default from Kubernetes "
            "1.35; on 1.33 and 1.34 only where the ImageVolume feature gate is on."
        ),
    )
    hub: HubSource | None = Field(
        default=None,
        description="A model id that vLLM resolves itself (a hub id, or a path inside the engine image).",
    )
    served_name: ModelName | None = Field(
        default=None,
        description='The name clients send as "model" in API requests; absent means metadata.name.',
    )
    quantization: Quantization = Field(
        default="auto",
        description=(
            "How the checkpoint's weights are quantized, passed to vLLM as --quantization so it cannot pick a "
            "kernel the card lacks. Default auto: the engine's preflight reads config.json's "
            "quantization_config.quant_method (no flag when there is none); none: the weights must be "
            "unquantized (fp16/bf16/fp32); a method must be the one the checkpoint declares. t4 runs awq, "
            "gptq, fp8 (weight-only Marlin), compressed-tensors, bitsandbytes, moe_wna16 and modelopt_fp4; "
            "cpu runs awq and gptq in bfloat16 on an AVX-512 host. The others are refused, with a message "
            "that names the card's missing capability."
        ),
    )

    trust_remote_code: bool = engine_field(ModelSource, "trust_remote_code")

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        sources = [s for s in (self.pvc, self.image, self.hub) if s is not None]
        if len(sources) != 1:
            raise ValueError(f"spec.model needs exactly one of pvc, image, hub; got {len(sources)}")
        return self

    @model_validator(mode="after")
    def _pinned_code(self) -> ModelSpec:
        # The CRD's rules above, again for objects stored before the CRD had them.
        if self.trust_remote_code and self.hub is not None and not re.match(PINNED_REVISION, self.hub.revision):
            raise ValueError(f"trustRemoteCode needs spec.model.hub.revision pinned to a full 40-hex commit id, "
                             f"not {self.hub.revision!r}")
        if self.trust_remote_code and self.image is not None and not re.search(PINNED_IMAGE, self.image.reference):
            raise ValueError("trustRemoteCode needs spec.model.image.reference pinned to a digest (@sha256:...)")
        return self


class EngineSpec(_Spec):
    """vLLM settings; the accelerator profile decides which values are allowed."""

    rules: ClassVar[tuple[Rule, ...]] = (
        # vLLM cannot schedule a prompt longer than one step's token budget unless it may split the
        # prefill across steps.
        Rule(
            (
                "!has(self.maxNumBatchedTokens) || !has(self.maxModelLen) || self.maxNumBatchedTokens >= "
                "self.maxModelLen || (has(self.extraArgs) && self.extraArgs.exists(a, a == "
                "'--enable-chunked-prefill'))"
            ),
            (
                "maxNumBatchedTokens must be >= maxModelLen: a full-length prompt could never be scheduled; raise "
                "spec.engine.maxNumBatchedTokens or add --enable-chunked-prefill to spec.engine.extraArgs"
            ),
            field_path=".maxNumBatchedTokens",
            reason="FieldValueInvalid",
        ),
        *when_set_rules(),
    )
    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {
        "extra_args": (
            # Generated from the engine's flag tables (flashmodel_operator.spec_rules).
            *extra_args_rules(),
            # Short flags (-O3, -tp 2, -q awq, -cc ...) set compilation, parallelism and quantization;
            # `--` would make every later entry a positional argument.
            Rule(
                "!self.exists(a, a == '--' || a.matches('^-[A-Za-z]'))",
                (
                    "extraArgs must use vLLM's long flags: short ones (-O, -tp, -q, -cc, ...) set enforced or "
                    "memory-plan settings, and '--' ends the options; write the flag as --name"
                ),
            ),
        ),
    }

    # No default: the cluster's image comes from the operator's configuration (engine_image.py).
    image: Annotated[str, Field(min_length=1, max_length=1024)] | None = Field(
        default=None,
        description=(
            "An engine image (vLLM + flashmodel_engine) other than the cluster's, which the operator's "
            "configuration sets (the chart's engineImage). Allowed only where the cluster admin lists it in "
            "engineImage.allowed: the image's launcher is what enforces the profile. Absent: the cluster's."
        ),
    )
    # The engine's definitions (flashmodel_engine.config.EngineSettings) with the CRD's defaults: those
    # of the default accelerator's profile. Fields without one are the profile's to decide per card
    # (blockSize 16 on t4 and 32 on cpu, dtype, eager mode) or vLLM's (prefix caching).
    block_size: int | None = engine_field(EngineSettings, "block_size")
    gpu_memory_utilization: float = engine_field(
        EngineSettings, "gpu_memory_utilization", default=_DEFAULT_PROFILE.default_gpu_memory_utilization
    )
    max_num_seqs: int = engine_field(EngineSettings, "max_num_seqs", default=_DEFAULT_PROFILE.max_num_seqs)
    max_model_len: int = engine_field(EngineSettings, "max_model_len", default=_DEFAULT_PROFILE.max_model_len)
    # The whole context in one step, so no extraArgs are needed for a full-length prompt.
    max_num_batched_tokens: int = engine_field(
        EngineSettings, "max_num_batched_tokens", default=_DEFAULT_PROFILE.max_model_len
    )
    dtype: Dtype | None = engine_field(EngineSettings, "dtype")
    enforce_eager: bool | None = engine_field(EngineSettings, "enforce_eager")
    enable_prefix_caching: bool | None = engine_field(EngineSettings, "enable_prefix_caching")
    attention_backend: AttentionBackend = engine_field(EngineSettings, "attention_backend")
    extra_args: list[ArgText] = engine_field(EngineSettings, "extra_args")


# The engine's definitions (flashmodel_engine.config), read by the pod's launcher and shim. The spec
# takes whole seconds, and floors where a shorter value would make a real pod flap: the engine's own
# tests run with windows of a few seconds.
class PrewarmSpec(_Spec):
    """Warm-up requests a pod must answer before it takes traffic."""

    enabled: bool = engine_field(PrewarmSettings, "enabled")
    requests: int = engine_field(PrewarmSettings, "requests")
    prompts: list[Annotated[str, Field(max_length=8192)]] = engine_field(PrewarmSettings, "prompts")
    max_tokens: int = engine_field(PrewarmSettings, "max_tokens")
    timeout_seconds: int = engine_field(PrewarmSettings, "timeout_seconds", ge=1)


class HealthSpec(_Spec):
    """Deadlines for the health shim's probes."""

    readiness_deadline_seconds: int = engine_field(HealthSettings, "readiness_deadline_seconds", ge=1)
    readiness_cache_seconds: int = engine_field(HealthSettings, "readiness_cache_seconds")
    # Below 30 s not even a tiny model's engine starts; the pod would be restarted forever.
    startup_timeout_seconds: int = engine_field(HealthSettings, "startup_timeout_seconds", ge=30)


class RemediationSpec(_Spec):
    """When and how often the operator may replace a pod whose memory diverges or whose generation hangs."""

    enabled: bool = engine_field(RemediationSettings, "enabled")
    # Below 1 % the allocator's own variation after prewarm would count as divergence.
    divergence_ratio: float = engine_field(RemediationSettings, "divergence_ratio", ge=0.01)
    # The shim samples memory every few seconds: a shorter window is one sample.
    divergence_window_seconds: int = engine_field(RemediationSettings, "divergence_window_seconds", ge=10)
    low_kv_cache_usage: float = engine_field(RemediationSettings, "low_kv_cache_usage")
    max_restarts_per_hour: int = engine_field(RemediationSettings, "max_restarts_per_hour")
    # Probes fail for seconds under a burst; only a longer failure means a hung generation.
    hung_readiness_seconds: int = engine_field(RemediationSettings, "hung_readiness_seconds", ge=10)


SCALE_TO_ZERO_NEEDS_GATEWAY = (
    "autoscaling.minReplicas: 0 needs spec.routing and scaler: keda: with no pod running, only the gateway's "
    "endpoint picker can hold a request and tell KEDA to wake a pod; add spec.routing, or set minReplicas: 1"
)


class AutoscalingSpec(_Spec):
    """Replica bounds and per-replica targets; the autoscaler scales the FlashModel through its scale subresource."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.minReplicas) || self.minReplicas <= self.maxReplicas",
            (
                "autoscaling.minReplicas must be <= maxReplicas: the HPA cannot keep more replicas than it may "
                "create; raise maxReplicas or lower minReplicas"
            ),
        ),
        Rule(
            '!has(self.targetTTFTMilliseconds) || !has(self.scaler) || self.scaler == "keda"',
            (
                "autoscaling.targetTTFTMilliseconds needs scaler: keda (a p90 from vLLM's TTFT histogram is a "
                "PromQL query, not a per-pod metric an HPA can average); remove it or use scaler: keda"
            ),
        ),
    )

    scaler: Literal["keda", "hpa"] = Field(
        default="keda",
        description=(
            "keda (default): a KEDA ScaledObject whose Prometheus triggers are PromQL over the engine pods' "
            "counters and histograms; needs KEDA and the operator's Prometheus address (chart value "
            "autoscaling.prometheusAddress). hpa: a HorizontalPodAutoscaler on Pods metrics "
            "(flashmodel_requests_per_second, flashmodel_requests_waiting, flashmodel_kv_cache_usage_ratio), "
            "which needs a custom-metrics adapter serving them."
        ),
    )
    min_replicas: int = Field(
        default=1,
        ge=0,
        le=1000,
        json_schema_extra={"format": "int32"},
        description=(
            "Fewest replicas kept (each one is a GPU). Default 1. 0 scales the model to zero while idle; it needs "
            "spec.routing and scaler: keda, because with no pod running only the gateway's endpoint picker can "
            "hold a request (up to spec.routing.holdSeconds) and signal KEDA to wake a pod."
        ),
    )
    max_replicas: int = Field(
        ge=1,
        le=1000,
        json_schema_extra={"format": "int32"},
        description="Most replicas the autoscaler creates (each one is a GPU).",
    )
    scale_to_zero_after_seconds: int = Field(
        default=300,
        ge=10,
        le=86400,
        json_schema_extra={"format": "int32"},
        description=(
            "With minReplicas 0: seconds the model must see no request (none finished, none held at the "
            "gateway) before its last pod is removed (KEDA's cooldownPeriod). Default 300."
        ),
    )
    target_requests_per_second: float = Field(
        default=8,
        ge=0.1,
        le=10000,
        description=(
            "Client requests finished per second per replica to aim for (probes and prewarm excluded), "
            "averaged over windowSeconds. Default 8, the per-card goal."
        ),
    )
    target_queue_depth: float | None = Field(
        default=None,
        ge=0.1,
        le=10000,
        description=(
            "Optional: requests waiting in vLLM's queue per replica (vllm:num_requests_waiting) to aim for. A "
            "queue that grows means the replicas are saturated."
        ),
    )
    target_kv_cache_usage: float | None = Field(
        default=None,
        ge=0.05,
        le=1,
        alias="targetKVCacheUsage",
        description=(
            "Optional target for KV-cache usage per replica, a fraction 0.05..1 (flashmodel_kv_cache_usage_ratio)."
        ),
    )
    target_ttft_milliseconds: float | None = Field(
        default=None,
        ge=1,
        le=600000,
        alias="targetTTFTMilliseconds",
        description=(
            "Optional latency SLO, milliseconds: the p90 time to first token over windowSeconds (from vLLM's "
            "TTFT histogram) to hold; above it the autoscaler adds replicas in proportion. Needs scaler keda."
        ),
    )
    window_seconds: int = Field(
        default=60,
        ge=10,
        le=3600,
        description=(
            "The PromQL rate window, in seconds, for the request rate and the TTFT p90 (at least 4 scrape "
            "intervals). Default 60."
        ),
    )
    scale_up_stabilization_seconds: int = Field(
        default=60,
        ge=0,
        le=3600,
        description=(
            "Seconds of higher replica counts the HPA must see before it scales up (its "
            "behavior.scaleUp.stabilizationWindowSeconds); at most one pod is added per minute. Default 60."
        ),
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=3600,
        description=(
            "Seconds of lower replica counts the HPA must see before it scales down (its "
            "behavior.scaleDown.stabilizationWindowSeconds); at most one pod is removed per minute, and a "
            "removed pod finishes its in-flight requests before it exits. Default 300."
        ),
    )


class SecretKeyRef(_Spec):
    name: ObjectName = Field(
        description="Secret name in the FlashModel's namespace.",
    )
    key: ObjectName = Field(
        default="api-key",
        description="Key inside the Secret.",
    )


class AuthSpec(_Spec):
    api_key_secret_ref: SecretKeyRef = Field(
        description="The Secret key that holds the API key clients send as a Bearer token.",
    )


class ObservabilitySpec(_Spec):
    """Where the engine sends its OpenTelemetry request spans."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {
        "otlp_traces_endpoint": (
            Rule(
                "self.matches('^https?://[^/?#@\\\\s]+(/[^\\\\s]*)?$')",
                (
                    "otlpTracesEndpoint must be an http:// or https:// URL with a host and no credentials, e.g. "
                    "http://otel-collector.monitoring:4317; fix spec.observability.otlpTracesEndpoint"
                ),
            ),
        ),
    }

    otlp_traces_endpoint: Annotated[str, Field(min_length=8, max_length=1024)] | None = Field(
        default=None,
        description=(
            "OpenTelemetry collector URL that vLLM sends a span per request to (--otlp-traces-endpoint), with "
            "service.name set to the served model name. Absent means no tracing. For grpc, http://host:4317 "
            "(vLLM sends grpc in plaintext); for http/protobuf, the full traces URL, e.g. "
            "https://collector.example:4318/v1/traces. It shows in status.engineArgs, so it carries no "
            "credentials."
        ),
    )
    otlp_traces_protocol: Literal["grpc", "http/protobuf"] = Field(
        default="grpc",
        description=(
            "OTLP transport of the traces: grpc (default, vLLM's) or http/protobuf. Used only with otlpTracesEndpoint."
        ),
    )


class GatewayRef(_Spec):
    """The Gateway (gateway.networking.k8s.io) whose HTTPRoute sends this model's requests to its pool."""

    name: ObjectName = Field(description="The Gateway's name.")
    namespace: ObjectName | None = Field(
        default=None, description="The Gateway's namespace; absent: the FlashModel's. It must allow routes from here."
    )
    section_name: Annotated[str, Field(min_length=1, max_length=253)] | None = Field(
        default=None, description="One listener of the Gateway by name; absent: every listener that allows the route."
    )


class HeaderMatch(_Spec):
    """One request header a route matches exactly."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {
        "name": (
            Rule(
                "self.matches('^[A-Za-z0-9][A-Za-z0-9-]*$')",
                "a header name is letters, digits and '-' (for example X-Task-Type)",
            ),
        ),
    }

    name: Annotated[str, Field(min_length=1, max_length=256)] = Field(
        description="The header's name (case-insensitive), for example X-Task-Type."
    )
    value: Annotated[str, Field(min_length=1, max_length=4096)] = Field(description="The header's exact value.")


class PickerWeights(_Spec):
    """How much each of the endpoint picker's scorers counts when it picks a pod for a request."""

    queue: int = Field(
        default=2, ge=0, le=100,
        description="Relative weight of the queue scorer (fewer waiting requests on the pod score higher). Default 2.",
    )
    kv_cache_utilization: int = Field(
        default=2, ge=0, le=100,
        description="Relative weight of the KV-cache utilization scorer (a less full cache scores higher). Default 2.",
    )
    prefix_cache: int = Field(
        default=3, ge=0, le=100,
        description=(
            "Relative weight of the prefix-cache scorer (a pod that likely holds the prompt's prefix in its "
            "cache scores higher). Default 3."
        ),
    )
    lora_affinity: int = Field(
        default=1, ge=0, le=100,
        description=(
            "Relative weight of the LoRA-affinity scorer, used only where LoRA is on: a pod already running "
            "requests for the asked adapter scores 1, one with a free adapter slot 0.8, one whose slots are "
            "all busy with other adapters 0. Default 1 (GIE's weight for a scorer given none): a tie-break "
            "beside queue and KV cache, since every pod holds every adapter."
        ),
    )


class RoutingSpec(_Spec):
    """The model behind a Gateway API Inference Extension pool: an endpoint picker chooses the pod per request."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "!has(self.gateway) || self.matchModelName || (has(self.headers) && size(self.headers) > 0)",
            "a routing.gateway route needs something to match: keep matchModelName true or list headers, "
            "or the route would take every request the Gateway gets",
            field_path=".gateway",
        ),
    )

    gateway: GatewayRef | None = Field(
        default=None,
        description=(
            "Attach the pool to this Gateway with an HTTPRoute; absent: the operator makes the pool and its "
            "endpoint picker, and the cluster's own routes point at the pool."
        ),
    )
    match_model_name: bool = Field(
        default=True,
        description=(
            "The route matches requests whose OpenAI `model` is this model's served name, through the header "
            "X-Gateway-Base-Model-Name that the Gateway's body-based router sets. Default true."
        ),
    )
    headers: list[HeaderMatch] = Field(
        default_factory=list, max_length=8,
        description="Request headers the route matches too, all of them (for example X-Task-Type: summarize).",
    )
    picker: PickerWeights = Field(
        default_factory=PickerWeights, description="The endpoint picker's scorer weights."
    )
    # Below Envoy's longest ext_proc message timeout (1 h), so the picker's 503 comes before the Gateway's 504.
    hold_seconds: int = Field(
        default=240,
        ge=1,
        le=1800,
        json_schema_extra={"format": "int32"},
        description=(
            "With autoscaling.minReplicas 0: seconds the endpoint picker holds a request while no pod of the "
            "model can take it (scaled to zero, waking, or every pod saturated) before the client gets HTTP 503 "
            "(the Gateway should add Retry-After). Set it above the model's cold start (status.startup) so the "
            "request that wakes the model is answered. Default 240, under Envoy's default stream idle timeout (300 s)."
        ),
    )
    failure_mode: Literal["FailClose", "FailOpen"] = Field(
        default="FailClose",
        description=(
            "What the Gateway does while the endpoint picker does not answer: FailClose refuses the request "
            "(a clear 5xx), FailOpen lets the Gateway pick a pod of the pool itself, blind to load and "
            "prefixes. Default FailClose."
        ),
    )


# ---- LoRA adapters ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class LoraLimits:
    """What one accelerator allows of LoRA: how many adapters one pod holds, and their largest rank."""

    max_loras: int
    """The ceiling of spec.lora.maxLoras: each adapter slot takes card memory for its rank's weights."""
    max_rank: int
    """The ceiling of spec.lora.maxRank."""
    default_loras: int
    default_rank: int


# The engine's accelerator profiles are the one source of the limits; the spec states them in the CRD.
LORA_LIMITS: dict[str, LoraLimits] = {
    name: LoraLimits(max_loras=p.max_loras, max_rank=p.max_lora_rank, default_loras=p.default_max_loras,
                     default_rank=p.default_max_lora_rank)
    for name, p in PROFILES.items()
}
LORA_RANKS = (8, 16, 32, 64)
"""vLLM's --max-lora-rank values (its MaxLoRARanks) up to the largest any profile allows."""
ADAPTER_NAME = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
"""A DNS-1123 label: the name clients send as the OpenAI `model`, and a metric label."""

_ADAPTER_INSIDE = Rule(
    _NO_PARENT_SEGMENT,
    "an adapter's path must not have a '..' segment: the adapter must stay inside its source; name the "
    "adapter's directory from the source's root, e.g. adapters/support-v3",
)


def _adapter_inside(path: str, field: str) -> str:
    return _inside(path, field, "the adapter", "; name its directory from the source's root")


class AdapterPVCSource(_Spec):
    """An adapter directory (adapter_config.json, adapter_model.safetensors) on a PersistentVolumeClaim."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {"path": (_ADAPTER_INSIDE,)}

    claim_name: ObjectName = Field(
        description=(
            "Name of the PersistentVolumeClaim in the FlashModel's namespace, mounted read-only. Adapters "
            "from one claim share its volume: adding another adapter from a claim already mounted restarts "
            "no pod; a new claim does (Kubernetes cannot add a volume to a running pod)."
        ),
    )
    path: PathText = Field(
        default="",
        description="Directory of the adapter inside the claim; empty means the claim's root. No '..' segments.",
    )

    @field_validator("path")
    @classmethod
    def _path_inside(cls, path: str) -> str:
        return _adapter_inside(path, "spec.adapters[].pvc.path")


class AdapterImageSource(_Spec):
    """An adapter packaged in an OCI image, mounted read-only as an image volume."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {"path": (_ADAPTER_INSIDE,)}

    reference: Annotated[str, Field(min_length=1, max_length=1024)] = Field(
        description=(
            "Image reference, e.g. registry.example.com/adapters/support:2026-w49. Adapters from one image "
            "share its volume; a new image restarts the pods once (a new volume), as the model's image does."
        ),
    )
    path: PathText = Field(
        default="/",
        description="Directory of the adapter inside the image. No '..' segments.",
    )

    @field_validator("path")
    @classmethod
    def _path_inside(cls, path: str) -> str:
        return _adapter_inside(path, "spec.adapters[].image.path")


class AdapterHubSource(_Spec):
    """An adapter the engine downloads from the hub at a pinned commit."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {
        "id": (Rule(_NO_PARENT_SEGMENT, "an adapter's hub id must not have a '..' segment; write org/name"),),
        "revision": (
            Rule(
                f"self.matches('{PINNED_REVISION}')",
                "an adapter's hub revision must be a full 40-hex commit id: a branch or tag could load different "
                "weights on each pod; set revision to the commit (the hub's commit history lists it)",
            ),
        ),
    }

    id: ModelName = Field(description="Hub id of the adapter, e.g. acme/qwen-support-lora.")
    revision: Annotated[str, Field(max_length=64)] = Field(
        description=(
            "The adapter's commit on the hub, in full (40 hex digits): every pod loads exactly these weights. "
            "A gated or private adapter uses the model's spec.model.hub.tokenSecretRef, where it has one."
        ),
    )

    @field_validator("id")
    @classmethod
    def _id_inside(cls, adapter_id: str) -> str:
        return _adapter_inside(adapter_id, "spec.adapters[].hub.id")

    @field_validator("revision")
    @classmethod
    def _pinned(cls, revision: str) -> str:
        if not re.match(PINNED_REVISION, revision):
            raise ValueError(f"spec.adapters[].hub.revision {revision!r} is not a full 40-hex commit id; pin it "
                             "to the adapter's commit so every pod loads the same weights")
        return revision


class AdapterSpec(_Spec):
    """One LoRA adapter on the base model: clients ask for it by name in the OpenAI `model` field."""

    rules: ClassVar[tuple[Rule, ...]] = (
        Rule(
            "(has(self.pvc) ? 1 : 0) + (has(self.image) ? 1 : 0) + (has(self.hub) ? 1 : 0) == 1",
            "each adapter needs exactly one source: set one of pvc, image or hub",
        ),
    )
    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {
        "name": (
            Rule(
                f"self.matches('{ADAPTER_NAME}')",
                "an adapter's name is lower-case letters, digits and '-', starting and ending with a letter or "
                "digit (a DNS-1123 label, e.g. support-v3): clients send it as the OpenAI model",
            ),
        ),
    }

    name: Annotated[str, Field(min_length=1, max_length=63)] = Field(
        description=(
            "The name clients send as \"model\" to use this adapter; unique among the adapters and not the "
            "model's served name. A DNS-1123 label."
        ),
    )
    pvc: AdapterPVCSource | None = Field(
        default=None, description="An adapter directory on a PersistentVolumeClaim, mounted read-only."
    )
    image: AdapterImageSource | None = Field(
        default=None, description="An adapter in an OCI image, mounted read-only as an image volume."
    )
    hub: AdapterHubSource | None = Field(
        default=None, description="An adapter the engine downloads from the hub at a pinned commit."
    )

    @field_validator("name")
    @classmethod
    def _dns_label(cls, name: str) -> str:
        if not re.match(ADAPTER_NAME, name):
            raise ValueError(f"adapter name {name!r} must be a DNS-1123 label (lower-case letters, digits, '-'), "
                             "e.g. support-v3")
        return name

    @model_validator(mode="after")
    def _one_source(self) -> AdapterSpec:
        count = sum(s is not None for s in (self.pvc, self.image, self.hub))
        if count != 1:
            raise ValueError(f"adapter {self.name!r} needs exactly one of pvc, image, hub; got {count}")
        return self


class LoraSpec(_Spec):
    """How many LoRA adapters one pod holds and their largest rank; absent fields take the profile's."""

    field_rules: ClassVar[dict[str, tuple[Rule, ...]]] = {
        "max_rank": (
            Rule(
                f"self in [{', '.join(str(r) for r in LORA_RANKS)}]",
                f"maxRank must be one of vLLM's LoRA ranks {', '.join(str(r) for r in LORA_RANKS)}: set the "
                "smallest one at least as large as your adapters' rank (adapter_config.json's r)",
            ),
        ),
    }

    max_loras: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra={"format": "int32"},
        description=(
            "How many adapters one pod holds (vLLM's --max-loras); spec.adapters may list at most this many. "
            "Absent: the profile's default (t4 and cpu: 4); at most the profile's ceiling (t4 and cpu: 8)."
        ),
    )
    max_rank: int | None = Field(
        default=None,
        ge=1,
        json_schema_extra={"format": "int32"},
        description=(
            "The largest adapter rank a pod accepts (vLLM's --max-lora-rank), one of 8, 16, 32, 64. Absent: "
            "the profile's default (16); at most the profile's ceiling (64). An adapter of a larger rank is "
            "refused when it loads (status.adapters says so); the base model serves on."
        ),
    )


def _lora_rules() -> tuple[Rule, ...]:
    """Per accelerator: spec.lora within the profile's ceilings, and no more adapters than maxLoras."""
    rules: list[Rule] = []
    for name, limits in LORA_LIMITS.items():
        rules += [
            Rule(
                f"self.accelerator != '{name}' || !has(self.lora) || !has(self.lora.maxLoras) || "
                f"self.lora.maxLoras <= {limits.max_loras}",
                f"lora.maxLoras must be at most {limits.max_loras} on {name}: each adapter slot takes card memory; "
                f"lower spec.lora.maxLoras",
                field_path=".lora.maxLoras",
                reason="FieldValueInvalid",
            ),
            Rule(
                f"self.accelerator != '{name}' || !has(self.lora) || !has(self.lora.maxRank) || "
                f"self.lora.maxRank <= {limits.max_rank}",
                f"lora.maxRank must be at most {limits.max_rank} on {name}: the slots of a larger rank do not fit "
                f"the card's memory plan; lower spec.lora.maxRank (and train the adapters with a smaller r)",
                field_path=".lora.maxRank",
                reason="FieldValueInvalid",
            ),
            Rule(
                f"self.accelerator != '{name}' || !has(self.adapters) || size(self.adapters) <= "
                f"(has(self.lora) && has(self.lora.maxLoras) ? self.lora.maxLoras : {limits.default_loras})",
                f"spec.adapters lists more adapters than a pod holds (spec.lora.maxLoras, {limits.default_loras} by "
                f"default on {name}, at most {limits.max_loras}): raise spec.lora.maxLoras or remove adapters",
                field_path=".adapters",
                reason="FieldValueInvalid",
            ),
        ]
    rules.append(
        Rule(
            "!has(self.adapters) || !has(self.model.servedName) || "
            "!self.adapters.exists(a, a.name == self.model.servedName)",
            "an adapter must not be named like spec.model.servedName: clients choose the base model or an "
            "adapter by that name; rename the adapter",
            field_path=".adapters",
            reason="FieldValueInvalid",
        )
    )
    return tuple(rules)


class FlashModelSpec(_Spec):
    """What the user asks for."""

    rules: ClassVar[tuple[Rule, ...]] = (
        # t4: what the field reports show breaks a T4 (sm_75, 16 GB, no bf16).
        Rule(
            (
                "self.accelerator != 't4' || !has(self.nodeSelector) || !('nvidia.com/gpu.product' in "
                "self.nodeSelector) || self.nodeSelector['nvidia.com/gpu.product'] == 'Tesla-T4'"
            ),
            (
                "nodeSelector nvidia.com/gpu.product must be Tesla-T4 on t4: the t4 profile's settings are made "
                "for that card; remove it, or pick the accelerator of those nodes"
            ),
            field_path=".nodeSelector",
            reason="FieldValueForbidden",
        ),
        # What each accelerator profile and the quantization table limit, generated from them
        # (flashmodel_operator.spec_rules).
        *accelerator_rules(),
        # LoRA: the profile's ceilings, and no more adapters than a pod holds.
        *_lora_rules(),
        Rule(
            (
                "!has(self.autoscaling) || !has(self.autoscaling.minReplicas) || self.autoscaling.minReplicas >= 1 "
                "|| (has(self.routing) && (!has(self.autoscaling.scaler) || self.autoscaling.scaler == 'keda'))"
            ),
            SCALE_TO_ZERO_NEEDS_GATEWAY,
            field_path=".autoscaling",
        ),
    )

    model: ModelSpec = Field(
        description="Where the weights come from (exactly one source) and the name clients ask for.",
    )
    accelerator: Accelerator = Field(
        default=_DEFAULT_ACCELERATOR,
        description=(
            "The accelerator profile: which settings are enforced and where pods run. t4 is one NVIDIA T4 per "
            "pod; cpu is vLLM's CPU backend (tests and laptops)."
        ),
    )
    replicas: int = Field(
        default=1,
        ge=0,
        json_schema_extra={"format": "int32"},
        description="Number of engine pods (replicas), the scale subresource target (kubectl scale, HPA). Default 1.",
    )
    standby_replicas: int = Field(
        default=0,
        ge=0,
        le=4,
        json_schema_extra={"format": "int32"},
        description=(
            "Engine pods kept loaded and prewarmed but out of the Service, on top of replicas (each takes a GPU). "
            "A standby takes a pod's place in seconds instead of a cold start: before a pod is drained for "
            "remediation, when a serving pod is lost, and when replicas grows; a new standby then starts. Standby "
            "pods are not Ready on purpose, so the Deployment never counts all its pods available; the "
            "FlashModel's Ready condition and status.standbyReplicas say how the model stands. Default 0."
        ),
    )
    engine: EngineSpec = Field(
        default_factory=EngineSpec,
        description=(
            "vLLM settings. The accelerator profile decides which values are allowed; fields without a "
            "default here take the profile's (t4: blockSize 16, dtype float16; cpu: blockSize 32, dtype "
            "float32)."
        ),
    )
    prewarm: PrewarmSpec = Field(
        default_factory=PrewarmSpec,
        description="Warm-up requests a pod must answer before it takes traffic (its readiness gate).",
    )
    health: HealthSpec = Field(
        default_factory=HealthSpec,
        description="Deadlines for the health shim's probes (readiness is a real one-token generation).",
    )
    remediation: RemediationSpec = Field(
        default_factory=RemediationSpec,
        description=(
            "When the operator drains and evicts a pod whose GPU memory diverges or whose generation hangs "
            "(one at a time, within the PodDisruptionBudget and a restart budget)."
        ),
    )
    autoscaling: AutoscalingSpec | None = Field(
        default=None,
        description=(
            "Scale the model between minReplicas and maxReplicas on its pods' load. The autoscaler (a KEDA "
            "ScaledObject with Prometheus triggers by default, or a plain HorizontalPodAutoscaler on Pods "
            "metrics) scales the FlashModel through its scale subresource, so it owns spec.replicas. Absent "
            "means spec.replicas is fixed. The autoscaler follows whichever target asks for the most "
            "replicas."
        ),
    )
    auth: AuthSpec | None = Field(
        default=None,
        description="API-key authentication on the OpenAI API; absent means none.",
    )
    observability: ObservabilitySpec | None = Field(
        default=None,
        description="Telemetry the engine sends besides its Prometheus metrics; absent means none.",
    )
    compile_cache: CompileCache | None = Field(
        default=None,
        description=(
            "Compile caches on a claim the model's pods share: a new pod (a scale-up, a replacement) skips "
            "torch.compile and kernel builds an earlier pod did (on an H100, 108 s to serving became 66 s). Absent: "
            "each pod compiles into its own emptyDir, kept only across its container restarts."
        ),
    )
    routing: RoutingSpec | None = Field(
        default=None,
        description=(
            "Serve through the Gateway API Inference Extension: an InferencePool of the pods that serve "
            "(prewarmed, not standby, not draining) and an endpoint picker that chooses one per request by "
            "queue, KV-cache use and prefix cache; with gateway, an HTTPRoute. Absent: the Service only."
        ),
    )
    adapters: list[AdapterSpec] = Field(
        default_factory=list,
        max_length=64,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
        description=(
            "LoRA adapters served on the base model, each asked for by its name in the OpenAI `model` field. "
            "The operator loads the set on every pod (serving and standby) while it runs: adding, changing or "
            "removing an adapter restarts no pod, and a new pod gets the set before its prewarm. Adapters from "
            "a claim or image not mounted yet restart the pods once (a new volume). The first adapter (or "
            "spec.lora) turns LoRA on and removing the last one turns it off: each of those restarts the pods "
            "once (vLLM takes --enable-lora at start). status.adapters says where each is loaded."
        ),
    )
    lora: LoraSpec | None = Field(
        default=None,
        description=(
            "LoRA slots per pod (maxLoras, maxRank); absent fields take the profile's. Setting it turns LoRA "
            "on even without adapters, so the first adapter added later restarts no pod."
        ),
    )
    # Core Kubernetes types pass through untouched: the API server already validated them.
    resources: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "Core ResourceRequirements of the engine container; on t4 nvidia.com/gpu is 1 in the limits and "
            "requests (another count is refused)."
        ),
    )
    node_selector: dict[str, Annotated[str, Field(max_length=253)]] = Field(
        default_factory=dict,
        max_length=64,
        description="Node labels merged with the profile's, which win (t4 - nvidia.com/gpu.product Tesla-T4).",
    )
    tolerations: list[dict[str, Any]] = Field(
        default_factory=list,
        max_length=64,
        description="Core Tolerations appended to the profile's (t4 - nvidia.com/gpu NoSchedule).",
    )
    affinity: dict[str, Any] = Field(
        default_factory=dict,
        description="Core Affinity of the engine pods.",
    )
    pod_template_patch: dict[str, Any] = Field(
        default_factory=dict,
        description=(
            "A patch onto the rendered pod template, merged by Kubernetes' strategic-merge rules, for what "
            "the fields above do not cover. What it may set is an allow-list: on the engine container "
            "extra env outside the reserved names (VLLM_, CUDA_, NVIDIA_, TORCH*, TRITON_, PYTHON*, LD_, HF_, "
            "proxy and CA variables, ...), mounts of its own volumes outside the paths the engine reads, and "
            "cpu and memory (a memory limit no lower than the profile's host side needs); sidecars and init "
            "containers that meet Pod Security restricted with no GPU or other device and none of the "
            "engine's volumes; extra labels and annotations outside the operator's; tolerations, affinity, "
            "topologySpreadConstraints, nodeSelector keys outside the profile's, terminationGracePeriodSeconds "
            "up to 300, imagePullSecrets, readiness gates, volumes of type emptyDir, configMap, secret, "
            "projected, downwardAPI or persistentVolumeClaim, and a priorityClassName the cluster admin "
            "allows. Anything else is "
            "refused (status reason PodTemplateRefused) with the field it changed."
        ),
    )


    @property
    def lora_on(self) -> bool:
        """vLLM runs with --enable-lora: the spec lists adapters or sets spec.lora."""
        return bool(self.adapters) or self.lora is not None

    def lora_limits(self) -> tuple[int, int]:
        """(max loras, max rank) of the pods: spec.lora's, else the profile's defaults."""
        limits = LORA_LIMITS[self.accelerator]
        lora = self.lora or LoraSpec()
        return (
            lora.max_loras if lora.max_loras is not None else limits.default_loras,
            lora.max_rank if lora.max_rank is not None else limits.default_rank,
        )

    @property
    def scales_to_zero(self) -> bool:
        """The autoscaler may take the model to zero pods (the gateway holds requests meanwhile)."""
        return self.autoscaling is not None and self.autoscaling.min_replicas == 0

    @model_validator(mode="after")
    def _scale_to_zero_behind_gateway(self) -> FlashModelSpec:
        # The CRD's rule, again for objects stored before the CRD had it.
        scaling = self.autoscaling
        if scaling is not None and scaling.min_replicas == 0 and (self.routing is None or scaling.scaler != "keda"):
            raise ValueError(SCALE_TO_ZERO_NEEDS_GATEWAY)
        return self

    @model_validator(mode="after")
    def _lora_fits(self) -> FlashModelSpec:
        # The CRD's rules (_lora_rules), again for objects stored before the CRD had them.
        limits = LORA_LIMITS[self.accelerator]
        lora = self.lora or LoraSpec()
        if lora.max_loras is not None and lora.max_loras > limits.max_loras:
            raise ValueError(f"spec.lora.maxLoras is {lora.max_loras}; {self.accelerator} holds at most "
                             f"{limits.max_loras}; lower it")
        if lora.max_rank is not None and (lora.max_rank > limits.max_rank or lora.max_rank not in LORA_RANKS):
            raise ValueError(f"spec.lora.maxRank is {lora.max_rank}; use one of "
                             f"{', '.join(str(r) for r in LORA_RANKS if r <= limits.max_rank)} on {self.accelerator}")
        max_loras, _ = self.lora_limits()
        if len(self.adapters) > max_loras:
            raise ValueError(f"spec.adapters lists {len(self.adapters)} adapters and a pod holds {max_loras} "
                             f"(spec.lora.maxLoras, at most {limits.max_loras} on {self.accelerator}); raise "
                             "spec.lora.maxLoras or remove adapters")
        names = [a.name for a in self.adapters]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"spec.adapters names {', '.join(twice)} more than once; give each adapter its own name")
        if self.model.served_name is not None and self.model.served_name in names:
            raise ValueError(f"adapter {self.model.served_name!r} has the model's served name; rename the adapter")
        return self


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

    @model_validator(mode="after")
    def _adapter_not_served_name(self) -> FlashModel:
        # The CRD can compare against spec.model.servedName only; the default served name is metadata.name.
        if any(a.name == self.served_name for a in self.spec.adapters):
            raise ValueError(f"adapter {self.served_name!r} has the model's served name (metadata.name, as "
                             "spec.model.servedName is unset); clients could not tell them apart; rename the adapter")
        return self

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
