"""The FlashModel status as pydantic models: the one source of the CRD's status schema.

scripts/gen_crd.py writes it into crds/flashmodel.yaml beside the spec's. The operator writes status
as plain dicts (reconcile, model_status); these models say which keys it may write and what each
means in `kubectl explain`. Every field is optional: a status is written in parts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict

_INT32: JsonDict = {"format": "int32"}
_INT64: JsonDict = {"format": "int64"}
_TIME: JsonDict = {"format": "date-time"}


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True)


class Condition(_Status):
    type: str = Field(description="Ready, Available, Progressing, Degraded, Autoscaling, Routing or AdaptersReady.")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(default=None, description="CamelCase reason for the last transition.")
    message: str | None = Field(default=None, description="Human-readable detail.")
    observed_generation: int | None = Field(
        default=None, json_schema_extra=_INT64, description="The metadata.generation this condition describes."
    )
    last_transition_time: str | None = Field(
        default=None, json_schema_extra=_TIME, description="When status last changed."
    )


class StartupPhases(_Status):
    """Seconds of one engine start by phase; they add up to startupSeconds. A phase not reported is absent."""

    launcher: float | None = Field(
        default=None, description="Process start to the health shim listening: the preflight's checks."
    )
    engine_other: float | None = Field(
        default=None,
        description="vLLM's start less the phases it times itself: its imports, the tokenizer, the API server.",
    )
    weights: float | None = Field(
        default=None, description="vLLM's model load: reading the weights and placing the model on the device."
    )
    compile: float | None = Field(default=None, description="torch.compile, as vLLM reports it.")
    graph_capture: float | None = Field(default=None, description="CUDA graph capture (absent in eager mode).")
    kv_init: float | None = Field(
        default=None,
        description="The rest of vLLM's engine initialisation: memory profiling, the KV cache, warm-up runs.",
    )
    prewarm: float | None = Field(default=None, description="The warm-up requests before the pod takes traffic.")


class StartupSummary(_Status):
    last_pod: str | None = Field(default=None, description="The newest pod whose start-up is known.")
    last_pod_seconds: float | None = Field(
        default=None, description="Its start-up, process start to prewarmed, in seconds."
    )
    slowest_phase: str | None = Field(
        default=None, description="Its longest phase (a key of status.pods[].startupPhases)."
    )
    slowest_phase_seconds: float | None = Field(default=None, description="That phase's seconds.")


class PodRecord(_Status):
    name: str | None = Field(default=None, description="Pod name.")
    prewarmed: bool | None = Field(
        default=None,
        description="Whether the pod's prewarm succeeded (its readiness gate is True unless it is a standby).",
    )
    standby: bool | None = Field(
        default=None, description="The pod is prewarmed and waits out of the Service as a standby."
    )
    prewarm_failures: int | None = Field(
        default=None, description="Failed prewarm attempts since the pod's engine last started."
    )
    reason: str | None = Field(
        default=None, description="CamelCase reason of the pod's last gate change, e.g. PrewarmFailed."
    )
    cold_ttft_ms: float | None = Field(
        default=None, alias="coldTTFTMs",
        description="Time to first token of the first warm-up request, in milliseconds.",
    )
    warm_ttft_ms: float | None = Field(
        default=None, alias="warmTTFTMs",
        description="Time to first token of the last warm-up request, in milliseconds.",
    )
    last_prewarm_time: str | None = Field(
        default=None, json_schema_extra=_TIME, description="When the last prewarm finished."
    )
    startup_seconds: float | None = Field(
        default=None,
        description="The engine's last start, process start to prewarmed, in seconds (the sum of startupPhases).",
    )
    startup_phases: StartupPhases | None = Field(
        default=None, description="Where that start's seconds went, as the engine measured them."
    )


class AdapterStatus(_Status):
    name: str | None = Field(default=None, description="The adapter's name (spec.adapters[].name).")
    loaded_pods: int | None = Field(
        default=None, json_schema_extra=_INT32,
        description="Serving and standby pods that report the adapter, as the spec has it now, loaded.",
    )
    pods: int | None = Field(
        default=None, json_schema_extra=_INT32, description="Serving and standby pods (prewarmed) of the model."
    )
    reason: str | None = Field(
        default=None,
        description="Why it is not loaded, as the first pod where it failed answered: `<pod>: <reason>`.",
    )


class Remediation(_Status):
    pod: str | None = Field(default=None, description="The pod that was drained and evicted.")
    reason: str | None = Field(
        default=None, description="CamelCase reason, e.g. MemoryDivergence or GenerationHung."
    )
    message: str | None = Field(default=None, description="Human-readable detail.")
    divergence_ratio: float | None = Field(
        default=None, description="The divergence observed when the decision was made."
    )
    time: str | None = Field(default=None, json_schema_extra=_TIME, description="When the pod was evicted.")


class AutoscalerStatus(_Status):
    kind: str | None = Field(
        default=None, description="ScaledObject or HorizontalPodAutoscaler, named after the model."
    )
    name: str | None = Field(default=None, description="The ScaledObject's or HPA's name.")
    hpa: str | None = Field(
        default=None,
        description="The HorizontalPodAutoscaler that scales the model (KEDA's is keda-hpa-<model>).",
    )
    desired_replicas: int | None = Field(default=None, description="The replica count the HPA computed last.")
    current_replicas: int | None = Field(default=None, description="The replica count the HPA saw last.")
    spec_replicas: int | None = Field(
        default=None, description="spec.replicas at the last pass (a change is reported as a Scaled event)."
    )
    last_scale_time: str | None = Field(
        default=None, json_schema_extra=_TIME, description="When the HPA last changed the replica count."
    )
    metrics: list[str] | None = Field(default=None, description="The HPA's last metric readings, name=value.")


class RoutingStatus(_Status):
    pool: str | None = Field(default=None, description="The model's InferencePool (named after the model).")
    endpoint_picker: str | None = Field(default=None, description="The endpoint picker's Deployment and Service.")
    picker_ready: bool | None = Field(default=None, description="Whether the endpoint picker has an available pod.")
    gateway: str | None = Field(default=None, description="namespace/name of the Gateway the HTTPRoute attaches to.")
    conflict: str | None = Field(
        default=None,
        description="namespace/name of the older FlashModel whose route claims the same requests: no HTTPRoute here.",
    )


class PreflightRefusal(_Status):
    config_hash: str | None = Field(
        default=None, description="The pod-template config hash the refusal applies to."
    )
    retry: str | None = Field(
        default=None, description="The value of the retry annotation when the refusal was recorded."
    )
    pod: str | None = Field(default=None, description="The pod whose preflight failed.")
    message: str | None = Field(default=None, description="What the preflight reported.")


class FlashModelStatus(_Status):
    """What the operator observed and did, written once per reconcile."""

    observed_generation: int | None = Field(
        default=None, json_schema_extra=_INT64, description="The metadata.generation this status describes."
    )
    replicas: int | None = Field(
        default=None, json_schema_extra=_INT32,
        description=(
            "Engine pods that exist, standby pods not counted (the scale subresource's status replicas, which "
            "an autoscaler reads as the serving count)."
        ),
    )
    ready_replicas: int | None = Field(
        default=None, json_schema_extra=_INT32,
        description="Engine pods that are Ready (prewarmed and answering generation).",
    )
    prewarmed_replicas: int | None = Field(
        default=None, json_schema_extra=_INT32,
        description="Engine pods whose prewarm succeeded and that serve (standby pods not counted).",
    )
    standby_replicas: int | None = Field(
        default=None, json_schema_extra=_INT32,
        description="Prewarmed engine pods held out of the Service as standbys (spec.standbyReplicas).",
    )
    served_name: Annotated[str, Field(max_length=253)] | None = Field(
        default=None, description="The model name clients send (spec.model.servedName, or metadata.name)."
    )
    replicas_summary: str | None = Field(
        default=None, description="readyReplicas/spec.replicas, e.g. 2/3 (the Replicas printer column)."
    )
    selector: str | None = Field(
        default=None, description="Label selector of the engine pods, for the scale subresource and the HPA."
    )
    endpoint: str | None = Field(default=None, description="The in-cluster OpenAI API base URL.")
    engine_args: list[str] | None = Field(
        default=None, description="The vLLM flags the engine runs with, as computed from the profile."
    )
    conditions: list[Condition] | None = Field(
        default=None,
        # One entry per type: a server-side apply of one condition merges with the others.
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
        description=(
            "Ready (every desired pod serves), Available (at least one pod serves), Progressing, Degraded, "
            "Autoscaling where spec.autoscaling is set, Routing where spec.routing is, and AdaptersReady where "
            "LoRA is on (spec.adapters or spec.lora)."
        ),
    )
    pods: list[PodRecord] | None = Field(default=None, description="Per-pod prewarm results and start-up times.")
    startup: StartupSummary | None = Field(
        default=None, description="The newest pod's start-up: its seconds and its slowest phase."
    )
    adapters: list[AdapterStatus] | None = Field(
        default=None,
        # The operator writes null to clear it once LoRA is turned off.
        json_schema_extra={"nullable": True},
        description=(
            "Per LoRA adapter of spec.adapters: on how many serving and standby pods it is loaded, and why "
            "not where it failed (also in the AdaptersReady condition)."
        ),
    )
    remediations: list[Remediation] | None = Field(
        default=None, max_length=60,
        description=(
            "The last remediations, newest last: at least 10, and as many as spec.remediation.maxRestartsPerHour "
            "(the restart budget counts them)."
        ),
    )
    autoscaling: bool | None = Field(
        default=None,
        description=(
            "Whether the operator rendered an autoscaler, so it deletes it once spec.autoscaling is removed."
        ),
    )
    network_policy: bool | None = Field(
        default=None,
        json_schema_extra={"nullable": True},
        description="Whether the operator made the model's NetworkPolicy, so it deletes it once it is turned off.",
    )
    autoscaler: AutoscalerStatus | None = Field(
        default=None,
        # The operator writes null to clear it once the autoscaler is gone.
        json_schema_extra={"nullable": True},
        description="What the model's autoscaler reported at the last pass (also in the Autoscaling condition).",
    )
    routing: RoutingStatus | None = Field(
        default=None,
        # The operator writes null to clear it once spec.routing is removed and its children are gone.
        json_schema_extra={"nullable": True},
        description="The model's InferencePool and endpoint picker at the last pass (also in the Routing condition).",
    )
    preflight_refusal: PreflightRefusal | None = Field(
        default=None,
        description=(
            "Set while the engine's preflight refused this spec: the Deployment is held at 0 replicas until the "
            "spec changes or the retry annotation does."
        ),
    )
