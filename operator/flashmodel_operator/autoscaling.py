"""PURE: the autoscaler of a FlashModel (a KEDA ScaledObject or an HPA) and what its HPA reports.

Either one scales the FlashModel through its scale subresource, so the operator stays the only
writer of the Deployment. With KEDA (the default) the targets are PromQL over the counters and
histograms the engine pods export, scraped by the cluster's Prometheus with the labels
`namespace`, `pod` and `flashmodel` (charts/flashmodel-operator/files/prometheus-scrape-config.yaml
and the chart's PodMonitor give them); KEDA then owns the HPA, named keda-hpa-<model>.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from flashmodel_engine.contract import KV_CACHE_USAGE, REQUESTS_FINISHED, REQUESTS_PER_SECOND, REQUESTS_WAITING

from flashmodel_operator import GROUP, KIND, VERSION
from flashmodel_operator.model import AutoscalingSpec, FlashModel
from flashmodel_operator.routing import HELD_REQUESTS

PROMETHEUS_URL_ENV = "FLASHMODEL_PROMETHEUS_URL"
AUTOSCALING = "Autoscaling"
"""The status condition that carries the HPA's state."""

# Client requests, not the shim's probes and warm-ups (the engine pod subtracts its own).
REQUESTS_FINISHED_TOTAL = f"{REQUESTS_FINISHED}_total"
QUEUE_DEPTH = "vllm:num_requests_waiting"
TTFT_BUCKETS = "vllm:time_to_first_token_seconds_bucket"
HELD_REQUESTS_TARGET = "held-requests"
HELD_REQUESTS_PER_REPLICA = 4.0
"""Held requests per replica to aim for when spec.autoscaling.targetQueueDepth is unset: a few
requests waiting at the gateway are a queue, as they would be in vLLM's."""
WAKE_POLLING_SECONDS = 5
"""KEDA's check interval for a model that scales to zero; the check that wakes it waits up to this long."""


def prometheus_url() -> str:
    """The Prometheus KEDA's triggers query (chart value autoscaling.prometheusAddress)."""
    return os.environ.get(PROMETHEUS_URL_ENV, "").strip()


def _selector(fm: FlashModel) -> str:
    # Namespace and name are DNS labels (the API server checks them), so no quoting is needed.
    return f'{{namespace="{fm.namespace}",flashmodel="{fm.name}"}}'


def _number(value: float) -> str:
    return f"{value:g}"


@dataclass(frozen=True)
class Target:
    """One scaling target: a PromQL query over the model's pods and the value per replica to aim for."""

    name: str
    """The trigger's name, which KEDA shows in the HPA's metrics."""
    query: str
    threshold: float
    metric_type: str
    """AverageValue: the query is a total the HPA divides by the replica count; Value: a level to hold."""


def targets(fm: FlashModel, scaling: AutoscalingSpec) -> list[Target]:
    """The model's scaling targets, in the order the spec lists them; the HPA follows the largest."""
    sel = _selector(fm)
    window = f"{scaling.window_seconds}s"
    # `or vector(0)`: a model with no pod scraped yet, or no request in the window, is zero load,
    # not a failed metric (a failed one stops the HPA from scaling at all).
    out = [
        Target(
            "requests-per-second",
            f"sum(rate({REQUESTS_FINISHED_TOTAL}{sel}[{window}])) or vector(0)",
            scaling.target_requests_per_second,
            "AverageValue",
        )
    ]
    if scaling.target_queue_depth is not None:
        out.append(
            Target("queue-depth", f"sum({QUEUE_DEPTH}{sel}) or vector(0)", scaling.target_queue_depth, "AverageValue")
        )
    if scaling.target_kv_cache_usage is not None:
        out.append(
            Target(
                "kv-cache-usage",
                f"sum({KV_CACHE_USAGE}{sel}) or vector(0)",
                scaling.target_kv_cache_usage,
                "AverageValue",
            )
        )
    if fm.spec.scales_to_zero:
        # Requests the endpoint picker holds while no pod can take them: above zero, KEDA wakes the
        # model (activation); with pods, held requests mean the pods are saturated, like a queue.
        out.append(
            Target(
                HELD_REQUESTS_TARGET,
                f"sum({HELD_REQUESTS}{sel}) or vector(0)",
                scaling.target_queue_depth or HELD_REQUESTS_PER_REPLICA,
                "AverageValue",
            )
        )
    if scaling.target_ttft_milliseconds is not None:
        # p90 over the window; with no request in it the quantile is NaN, which `> 0` drops.
        p90 = f"histogram_quantile(0.9, sum by (le) (rate({TTFT_BUCKETS}{sel}[{window}]))) * 1000"
        out.append(Target("ttft-p90-milliseconds", f"({p90} > 0) or vector(0)", scaling.target_ttft_milliseconds,
                          "Value"))
    return out


def _behavior(scaling: AutoscalingSpec) -> dict[str, Any]:
    # A GPU pod takes minutes to load and prewarm: add one at a time, remove one at a time.
    return {
        "scaleUp": {
            "stabilizationWindowSeconds": scaling.scale_up_stabilization_seconds,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
        },
        "scaleDown": {
            "stabilizationWindowSeconds": scaling.scale_down_stabilization_seconds,
            "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
        },
    }


def _scale_target(fm: FlashModel) -> dict[str, str]:
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": fm.name}


def render_scaled_object(fm: FlashModel, metadata: dict[str, Any], server: str) -> dict[str, Any]:
    scaling = fm.spec.autoscaling
    assert scaling is not None
    triggers: list[dict[str, Any]] = [
        {
            "type": "prometheus",
            "name": t.name,
            "metricType": t.metric_type,
            "metadata": {"serverAddress": server, "query": t.query, "threshold": _number(t.threshold)},
        }
        for t in targets(fm, scaling)
    ]
    spec: dict[str, Any] = {
        "scaleTargetRef": _scale_target(fm),
        "pollingInterval": 15,
        "minReplicaCount": scaling.min_replicas,
        "maxReplicaCount": scaling.max_replicas,
        "advanced": {"horizontalPodAutoscalerConfig": {"behavior": _behavior(scaling)}},
        "triggers": triggers,
    }
    if fm.spec.scales_to_zero:
        # KEDA itself takes the model from 0 to 1 (the HPA cannot): when any trigger reads above its
        # activation threshold (0), checked every pollingInterval, which adds to every wake; and
        # back to 0 once all read 0 for cooldownPeriod.
        spec["pollingInterval"] = WAKE_POLLING_SECONDS
        spec["cooldownPeriod"] = scaling.scale_to_zero_after_seconds
        for trigger in triggers:
            trigger["metadata"]["activationThreshold"] = "0"
    return {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": metadata, "spec": spec}


def _quantity(value: float) -> str:
    """A Kubernetes quantity for a float target: milli-units keep 0.8 exact (800m)."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


# The HPA scaler reads Pods metrics through a custom-metrics adapter (prometheus-adapter rules in
# docs/autoscaling.md): per-pod series under these names.
_POD_METRICS = {
    "requests-per-second": REQUESTS_PER_SECOND,
    "queue-depth": REQUESTS_WAITING,
    "kv-cache-usage": KV_CACHE_USAGE,
}


def render_hpa(fm: FlashModel, metadata: dict[str, Any]) -> dict[str, Any]:
    scaling = fm.spec.autoscaling
    assert scaling is not None
    metrics = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": _POD_METRICS[t.name]},
                "target": {"type": "AverageValue", "averageValue": _quantity(t.threshold)},
            },
        }
        for t in targets(fm, scaling)
        if t.name in _POD_METRICS
    ]
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata,
        "spec": {
            "scaleTargetRef": _scale_target(fm),
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": metrics,
            "behavior": _behavior(scaling),
        },
    }


def hpa_name(fm: FlashModel) -> str:
    """The HPA that scales the model: KEDA names its own keda-hpa-<ScaledObject> (63 characters at most)."""
    scaling = fm.spec.autoscaling
    if scaling is not None and scaling.scaler == "keda":
        return f"keda-hpa-{fm.name}"[:63]
    return fm.name


@dataclass(frozen=True)
class ScalerState:
    """The Autoscaling condition and status.autoscaler for one pass."""

    active: bool
    reason: str
    message: str
    status: dict[str, Any]


def _conditions(obj: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    return {c.get("type", ""): c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def _metric_values(hpa: dict[str, Any]) -> list[str]:
    """The HPA's current metric values as `name=value` (what it last read)."""
    out = []
    for m in (hpa.get("status") or {}).get("currentMetrics") or []:
        kind = m.get("type", "")
        body = m.get(kind[:1].lower() + kind[1:]) or {}
        current = body.get("current") or {}
        value = current.get("averageValue") or current.get("value")
        name = (body.get("metric") or {}).get("name", kind)
        if value is not None:
            out.append(f"{name}={value}")
    return out


def scaler_state(
    fm: FlashModel,
    hpa: dict[str, Any] | None,
    scaled_object: dict[str, Any] | None,
    scaler_missing: str | None = None,
) -> ScalerState:
    """What the model's autoscaler says now, from its HPA and (with KEDA) its ScaledObject.

    `scaler_missing` is why the autoscaler could not be made at all (KEDA not installed, no
    Prometheus configured); it wins over everything else.
    """
    scaling = fm.spec.autoscaling
    assert scaling is not None
    kind = "ScaledObject" if scaling.scaler == "keda" else "HorizontalPodAutoscaler"
    name = hpa_name(fm)
    status: dict[str, Any] = {"kind": kind, "name": fm.name, "hpa": name}
    if scaler_missing is not None:
        return ScalerState(False, "ScalerUnavailable", scaler_missing, status)
    if scaling.scaler == "keda":
        ready = _conditions(scaled_object).get("Ready")
        if ready is not None and ready.get("status") == "False":
            msg = f"ScaledObject {fm.name}: {ready.get('reason')}: {ready.get('message')}"
            return ScalerState(False, "ScaledObjectNotReady", msg, status)
    if hpa is None:
        who = "KEDA has not made it yet; is the KEDA operator running?" if scaling.scaler == "keda" else "not found"
        return ScalerState(False, "HPANotFound", f"HorizontalPodAutoscaler {name}: {who}", status)
    hpa_status = hpa.get("status") or {}
    status.update(
        {
            "currentReplicas": int(hpa_status.get("currentReplicas", 0)),
            "desiredReplicas": int(hpa_status.get("desiredReplicas", 0)),
        }
    )
    if hpa_status.get("lastScaleTime"):
        status["lastScaleTime"] = hpa_status["lastScaleTime"]
    metrics = _metric_values(hpa)
    status["metrics"] = metrics
    conds = _conditions(hpa)
    idle = conds.get("ScalingActive") or {}
    if fm.spec.scales_to_zero and idle.get("status") == "False" and idle.get("reason") == "ScalingDisabled":
        # The HPA stands aside while its target has 0 replicas; KEDA watches the triggers to wake it.
        msg = (
            f"ScaledObject {fm.name}: the model is at 0 replicas while idle; KEDA wakes it when the endpoint "
            f"picker holds a request (checked every {WAKE_POLLING_SECONDS}s)"
        )
        return ScalerState(True, "ScaledToZero", msg, status)
    for cond_type in ("ScalingActive", "AbleToScale"):
        c = conds.get(cond_type)
        if c is not None and c.get("status") == "False":
            msg = f"HPA {name} {cond_type}=False: {c.get('message')}"
            return ScalerState(False, str(c.get("reason") or cond_type), msg, status)
    if "ScalingActive" not in conds:
        return ScalerState(False, "HPANotSynced", f"HPA {name} has not computed a replica count yet", status)
    msg = (
        f"HPA {name}: {status['desiredReplicas']} desired, {status['currentReplicas']} current "
        f"(min {scaling.min_replicas}, max {scaling.max_replicas}); metrics {', '.join(metrics) or 'none read yet'}"
    )
    limited = conds.get("ScalingLimited")
    if limited is not None and limited.get("status") == "True":
        msg += f"; limited: {limited.get('reason')}: {limited.get('message')}"
    return ScalerState(True, "ScalingActive", msg, status)
