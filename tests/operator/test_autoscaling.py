"""The autoscaler a FlashModel gets (KEDA ScaledObject or HPA) and how its HPA's state reads in status."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from flashmodel_operator.autoscaling import hpa_name, render_hpa, render_scaled_object, scaler_state, targets
from flashmodel_operator.conditions import AUTOSCALING, Observation, build_conditions
from flashmodel_operator.model import FlashModel
from flashmodel_operator.placement import t4_node_selector
from flashmodel_operator.reconcile import unschedulable

from tests.operator.specs import FULL_T4

PROM = "http://prometheus.monitoring.svc:9090"


def model(**autoscaling: Any) -> FlashModel:
    body = copy.deepcopy(FULL_T4)
    body["spec"]["autoscaling"] = {"minReplicas": 1, "maxReplicas": 3, **autoscaling}
    return FlashModel.from_body(body)


def test_keda_triggers_are_promql_over_the_models_own_series_with_per_replica_thresholds() -> None:
    fm = model(targetQueueDepth=4, targetKVCacheUsage=0.7, targetTTFTMilliseconds=300, windowSeconds=30)
    so = render_scaled_object(fm, {"name": fm.name}, PROM)
    spec = so["spec"]
    assert spec["scaleTargetRef"] == {"apiVersion": "serving.flashmodel.io/v1alpha1", "kind": "FlashModel",
                                      "name": fm.name}
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (1, 3)
    by_name = {t["name"]: t for t in spec["triggers"]}
    assert list(by_name) == ["requests-per-second", "queue-depth", "kv-cache-usage", "ttft-p90-milliseconds"]
    sel = f'{{namespace="{fm.namespace}",flashmodel="{fm.name}"}}'
    rps = by_name["requests-per-second"]
    assert rps["metadata"] == {
        "serverAddress": PROM,
        "query": f"sum(rate(flashmodel_requests_finished_total{sel}[30s])) or vector(0)",
        "threshold": "8",
    }
    # Totals over the model's pods, divided by the replica count by the HPA ...
    assert {by_name[n]["metricType"] for n in ("requests-per-second", "queue-depth", "kv-cache-usage")} == {
        "AverageValue"}
    # ... but a latency is a level to hold, not a total to share out.
    ttft = by_name["ttft-p90-milliseconds"]
    assert ttft["metricType"] == "Value" and ttft["metadata"]["threshold"] == "300"
    assert "histogram_quantile(0.9" in ttft["metadata"]["query"] and "[30s]" in ttft["metadata"]["query"]
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    assert behavior["scaleDown"]["stabilizationWindowSeconds"] == 300
    assert behavior["scaleUp"]["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]


def test_only_the_targets_set_become_triggers() -> None:
    assert [t.name for t in targets(model(), model().spec.autoscaling)] == ["requests-per-second"]  # type: ignore[arg-type]


def test_hpa_scaler_renders_pods_metrics_for_an_adapter() -> None:
    fm = model(scaler="hpa", targetQueueDepth=4, scaleDownStabilizationSeconds=30)
    hpa = render_hpa(fm, {"name": fm.name})
    metrics = [(m["pods"]["metric"]["name"], m["pods"]["target"]["averageValue"]) for m in hpa["spec"]["metrics"]]
    assert metrics == [("flashmodel_requests_per_second", "8"), ("flashmodel_requests_waiting", "4")]
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] == 30
    assert hpa_name(fm) == fm.name and hpa_name(model()) == f"keda-hpa-{fm.name}"


def _hpa(conditions: list[tuple[str, str, str, str]], desired: int = 2, current: int = 1) -> dict[str, Any]:
    return {
        "status": {
            "currentReplicas": current,
            "desiredReplicas": desired,
            "currentMetrics": [
                {
                    "type": "External",
                    "external": {"metric": {"name": "s0-prometheus"}, "current": {"averageValue": "12"}},
                }
            ],
            "conditions": [{"type": t, "status": s, "reason": r, "message": m} for t, s, r, m in conditions],
        }
    }


def test_a_scaling_hpa_reads_as_active_with_its_counts_and_metrics() -> None:
    hpa = _hpa([("AbleToScale", "True", "SucceededRescale", ""), ("ScalingActive", "True", "ValidMetricFound", ""),
                ("ScalingLimited", "True", "TooManyReplicas", "the desired replica count is more than the maximum")])
    state = scaler_state(model(), hpa, {"status": {"conditions": [{"type": "Ready", "status": "True"}]}})
    assert state.active and state.reason == "ScalingActive"
    assert "2 desired, 1 current" in state.message and "s0-prometheus=12" in state.message
    assert "TooManyReplicas" in state.message
    assert state.status["desiredReplicas"] == 2 and state.status["metrics"] == ["s0-prometheus=12"]


def test_an_hpa_that_cannot_read_its_metric_says_why() -> None:
    msg = 'unable to get external metric default/s0-prometheus: connection refused to 127.0.0.1:9090'
    hpa = _hpa([("AbleToScale", "True", "SucceededGetScale", ""),
                ("ScalingActive", "False", "FailedGetExternalMetric", msg)])
    state = scaler_state(model(), hpa, None)
    assert not state.active and state.reason == "FailedGetExternalMetric" and "connection refused" in state.message


def test_missing_pieces_each_have_their_reason() -> None:
    assert scaler_state(model(), None, None, "KEDA is not installed").reason == "ScalerUnavailable"
    assert scaler_state(model(), None, None).reason == "HPANotFound"
    not_ready = {"status": {"conditions": [{"type": "Ready", "status": "False", "reason": "ScaledObjectCheckFailed",
                                            "message": "Target resource doesn't exist"}]}}
    state = scaler_state(model(), _hpa([]), not_ready)
    assert state.reason == "ScaledObjectNotReady" and "Target resource" in state.message
    assert scaler_state(model(), _hpa([]), None).reason == "HPANotSynced"


def test_autoscaling_condition_only_with_an_autoscaler() -> None:
    obs = Observation(generation=1, desired_replicas=1)
    assert AUTOSCALING not in {c["type"] for c in build_conditions(obs, [], "t")}
    obs = Observation(generation=1, desired_replicas=1, autoscaling=(False, "FailedGetExternalMetric", "no Prometheus"))
    cond = {c["type"]: c for c in build_conditions(obs, [], "t")}[AUTOSCALING]
    assert (cond["status"], cond["reason"]) == ("False", "FailedGetExternalMetric")


def test_a_pending_pod_shows_the_schedulers_reason() -> None:
    pod = {
        "metadata": {"name": "qwen-abc"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": "0/3 nodes are available: 3 node(s) didn't match Pod's node affinity/selector.",
                }
            ],
        },
    }
    why = unschedulable([pod])
    assert why is not None and "qwen-abc" in why and "didn't match" in why
    obs = Observation(generation=1, desired_replicas=1, replicas=1, updated_replicas=1,
                      deployment_generation_observed=True, unschedulable=why)
    ready = {c["type"]: c for c in build_conditions(obs, [], "t")}["Ready"]
    assert ready["reason"] == "Unschedulable" and "didn't match" in ready["message"]
    assert unschedulable([{**pod, "status": {"phase": "Running"}}]) is None


def test_the_t4_node_selector_is_the_clusters_setting_and_a_bad_one_is_refused_at_start() -> None:
    assert t4_node_selector(None) == {"nvidia.com/gpu.product": "Tesla-T4"}
    gke = '{"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}'
    assert t4_node_selector(gke) == {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}
    for bad in ("gke-accelerator=t4", "{}", '{"a": 1}', "[]"):
        with pytest.raises(ValueError, match="FLASHMODEL_T4_NODE_SELECTOR"):
            t4_node_selector(bad)
