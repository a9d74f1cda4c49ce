"""A model that scales to zero: what its spec allows, what its picker, autoscaler and conditions become."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from flashmodel_operator.autoscaling import (
    HELD_REQUESTS_PER_REPLICA,
    WAKE_POLLING_SECONDS,
    render_scaled_object,
    scaler_state,
)
from flashmodel_operator.conditions import (
    AVAILABLE,
    READY,
    SCALED_TO_ZERO,
    WAKING,
    Observation,
    build_conditions,
)
from flashmodel_operator.model import SCALE_TO_ZERO_NEEDS_GATEWAY, FlashModel
from flashmodel_operator.routing import PICKER_CONFIG_HASH, PickerSettings, render_picker
from pydantic import ValidationError

from tests.operator.specs import body

PROM = "http://prometheus.monitoring.svc:9090"
MODEL = {"pvc": {"claimName": "models", "path": "qwen"}}


def _model(autoscaling: dict[str, Any], routing: dict[str, Any] | None = None) -> FlashModel:
    spec: dict[str, Any] = {"model": MODEL, "autoscaling": {"maxReplicas": 2, **autoscaling}}
    if routing is not None:
        spec["routing"] = routing
    return FlashModel.from_body(body("idle", spec))


def _picker(fm: FlashModel) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the picker's parsed config, its Deployment)."""
    assert fm.spec.routing is not None
    children = {d["kind"]: d for d in render_picker(fm, fm.spec.routing, PickerSettings())}
    config = yaml.safe_load(children["ConfigMap"]["data"]["picker.yaml"])
    return config, children["Deployment"]


@pytest.mark.parametrize(
    "autoscaling,routing",
    [({"minReplicas": 0}, None), ({"minReplicas": 0, "scaler": "hpa"}, {})],
    ids=["no-routing", "hpa"],
)
def test_zero_replicas_needs_the_gateway_and_keda(autoscaling: dict[str, Any], routing: dict[str, Any] | None) -> None:
    # The CRD's CEL rule says the same (tests/crd/test_cel.py); this is the check for objects stored before it.
    with pytest.raises(ValidationError, match=r"minReplicas: 0 needs spec\.routing"):
        _model(autoscaling, routing)
    assert "add spec.routing, or set minReplicas: 1" in SCALE_TO_ZERO_NEEDS_GATEWAY


def test_the_picker_of_a_model_at_zero_holds_requests_for_hold_seconds() -> None:
    config, _ = _picker(_model({"minReplicas": 0}, {"holdSeconds": 90}))
    assert config["featureGates"] == ["flowControl"]
    assert config["flowControl"] == {"defaultRequestTTL": "90s"}
    # A model that never goes to zero keeps GIE's plain admission: no queue in the picker.
    plain, _ = _picker(_model({"minReplicas": 1}, {"holdSeconds": 90}))
    assert "featureGates" not in plain and "flowControl" not in plain


def test_a_changed_picker_config_rolls_the_picker_and_an_unchanged_one_does_not() -> None:
    # The EPP reads its config file once, at start.
    def config_hash(fm: FlashModel) -> str:
        return str(_picker(fm)[1]["spec"]["template"]["metadata"]["annotations"][PICKER_CONFIG_HASH])

    held = config_hash(_model({"minReplicas": 0}, {"holdSeconds": 90}))
    assert held == config_hash(_model({"minReplicas": 0}, {"holdSeconds": 90}))
    assert held != config_hash(_model({"minReplicas": 0}, {"holdSeconds": 5}))
    assert held != config_hash(_model({"minReplicas": 1}, {"holdSeconds": 90}))


def test_the_scaled_object_wakes_on_held_requests_and_sleeps_after_the_idle_window() -> None:
    fm = _model({"minReplicas": 0, "scaleToZeroAfterSeconds": 45}, {})
    spec = render_scaled_object(fm, {"name": fm.name}, PROM)["spec"]
    assert (spec["minReplicaCount"], spec["maxReplicaCount"]) == (0, 2)
    assert spec["cooldownPeriod"] == 45 and spec["pollingInterval"] == WAKE_POLLING_SECONDS
    by_name = {t["name"]: t for t in spec["triggers"]}
    held = by_name["held-requests"]
    sel = '{namespace="serving",flashmodel="idle"}'
    assert held["metadata"]["query"] == f"sum(inference_extension_flow_control_queue_size{sel}) or vector(0)"
    assert held["metricType"] == "AverageValue"
    assert held["metadata"]["threshold"] == f"{HELD_REQUESTS_PER_REPLICA:g}"
    # Every trigger wakes the model above 0 and lets it sleep only when all read 0.
    assert {t["metadata"]["activationThreshold"] for t in spec["triggers"]} == {"0"}


def test_a_model_that_keeps_a_pod_has_no_wake_trigger_and_keda_defaults() -> None:
    fm = _model({"minReplicas": 1}, {})
    spec = render_scaled_object(fm, {"name": fm.name}, PROM)["spec"]
    assert "held-requests" not in {t["name"] for t in spec["triggers"]}
    assert "cooldownPeriod" not in spec and spec["pollingInterval"] == 15
    assert all("activationThreshold" not in t["metadata"] for t in spec["triggers"])


def _hpa_at_zero() -> dict[str, Any]:
    # What KEDA's HPA says while its target has 0 replicas (the HPA controller's own words).
    return {
        "status": {
            "currentReplicas": 0,
            "desiredReplicas": 0,
            "conditions": [
                {"type": "AbleToScale", "status": "True", "reason": "SucceededGetScale"},
                {"type": "ScalingActive", "status": "False", "reason": "ScalingDisabled",
                 "message": "scaling is disabled since the replica count of the target is zero"},
            ],
        }
    }


def test_an_hpa_standing_aside_at_zero_is_an_active_autoscaler_for_a_model_that_scales_to_zero() -> None:
    state = scaler_state(_model({"minReplicas": 0}, {}), _hpa_at_zero(), None)
    assert (state.active, state.reason) == (True, "ScaledToZero")
    assert "wakes it when the endpoint picker holds a request" in state.message
    # The same HPA for a model that should never be at zero is a scaler that stopped working.
    stuck = scaler_state(_model({"minReplicas": 1}, {}), _hpa_at_zero(), None)
    assert (stuck.active, stuck.reason) == (False, "ScalingDisabled")


def _conditions(obs: Observation) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in build_conditions(obs, [], "2026-12-07T00:00:00Z")}


def test_at_zero_the_model_is_ready_to_wake_and_not_available() -> None:
    conds = _conditions(Observation(2, 0, deployment_generation_observed=True, scales_to_zero=True))
    assert (conds[READY]["status"], conds[READY]["reason"]) == ("True", SCALED_TO_ZERO)
    assert (conds[AVAILABLE]["status"], conds[AVAILABLE]["reason"]) == ("False", SCALED_TO_ZERO)
    assert "the gateway holds the next request" in conds[READY]["message"]
    # replicas: 0 set by hand on a model that cannot wake by itself is stopped, not ready.
    stopped = _conditions(Observation(2, 0, deployment_generation_observed=True))
    assert (stopped[READY]["status"], stopped[READY]["reason"]) == ("False", SCALED_TO_ZERO)


def test_the_first_pod_after_zero_is_waking_until_it_serves() -> None:
    loading = Observation(3, 1, replicas=1, updated_replicas=1, deployment_generation_observed=True,
                          scales_to_zero=True)
    conds = _conditions(loading)
    assert (conds[READY]["status"], conds[READY]["reason"]) == ("False", WAKING)
    assert (conds[AVAILABLE]["status"], conds[AVAILABLE]["reason"]) == ("False", WAKING)
    serving = Observation(3, 1, replicas=1, ready_replicas=1, updated_replicas=1, prewarmed_replicas=1,
                          deployment_generation_observed=True, scales_to_zero=True)
    conds = _conditions(serving)
    assert conds[READY]["reason"] == "AllReplicasReady" and conds[AVAILABLE]["status"] == "True"

