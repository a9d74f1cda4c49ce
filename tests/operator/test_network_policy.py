"""The engine pods' NetworkPolicy: what the chart hands the operator, what it renders, and its life as a child."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from flashmodel_operator import network_policy
from flashmodel_operator.apply import Cluster
from flashmodel_operator.model import FlashModel
from flashmodel_operator.network_policy import ENV, EngineNetworkPolicy
from flashmodel_operator.reconcile import reconcile
from flashmodel_operator.render import render_children, selector_labels

from e2e.harness.cluster import ControlPlane
from tests.chart.test_chart import KUBE_VERSION, helm
from tests.operator.specs import MINIMAL_T4, apply_model

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "flashmodel-operator"
MONITORING = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


@pytest.fixture
def policy_on() -> Iterator[EngineNetworkPolicy]:
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "flashmodel-system"}},
                "podSelector": {"matchLabels": {"app.kubernetes.io/name": "flashmodel-operator"}}}
    policy = EngineNetworkPolicy(True, (operator,), (), (MONITORING,))
    network_policy.use(policy)
    yield policy
    network_policy.use(EngineNetworkPolicy())


def _chart_env(*args: str) -> dict[str, str]:
    out = helm("template", "fm", str(CHART), "-n", "flashmodel-system", "--kube-version", KUBE_VERSION, *args).stdout
    deployment = next(d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment")
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    return {e["name"]: e.get("value", "") for e in env}


@pytest.mark.usefixtures("testbin")
def test_off_by_default_and_no_child() -> None:
    assert ENV not in _chart_env()
    fm = FlashModel.from_body(MINIMAL_T4)
    assert not [c for c in render_children(fm) if c["kind"] == "NetworkPolicy"]


@pytest.mark.usefixtures("testbin")
def test_the_charts_setting_admits_the_api_from_its_peers_and_the_shim_from_the_operator_only() -> None:
    env = _chart_env("--set", "networkPolicy.enabled=true",
                     "--set-json", f"networkPolicy.healthFrom=[{json.dumps(MONITORING)}]")
    policy = EngineNetworkPolicy.from_environ(env)
    assert policy.enabled and policy.health_from == (MONITORING,) and policy.api_from == ()
    [operator] = policy.operator
    assert operator["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": "flashmodel-system"}
    assert operator["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == "fm"

    network_policy.use(policy)
    try:
        fm = FlashModel.from_body(MINIMAL_T4)
        [child] = [c for c in render_children(fm) if c["kind"] == "NetworkPolicy"]
    finally:
        network_policy.use(EngineNetworkPolicy())
    spec = child["spec"]
    assert spec["podSelector"]["matchLabels"] == selector_labels(fm)
    api, health = spec["ingress"]
    # The API port from anywhere (none listed), the shim port from the operator and Prometheus, nothing else.
    assert api == {"ports": [{"port": "http", "protocol": "TCP"}]}
    assert health == {"ports": [{"port": "health", "protocol": "TCP"}], "from": [operator, MONITORING]}
    assert child["metadata"]["ownerReferences"][0]["kind"] == "FlashModel"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        ("{not json", "is not JSON"),
        ('{"operator": [], "apiFrom": []}', "operator is empty"),
        ('{"operator": [{"podSelector": {}}], "apiFrom": [{"hostNetwork": true}]}', "is not a NetworkPolicy peer"),
        ('{"operator": [{"podSelector": {}}], "allowAll": true}', "must be an object with"),
    ],
)
def test_a_wrong_setting_stops_the_operator_with_what_is_wrong(raw: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        EngineNetworkPolicy.from_environ({ENV: raw})


def test_the_policy_is_a_child_while_on_and_goes_when_turned_off(
    control_plane: ControlPlane, k8s_namespace: str, policy_on: EngineNetworkPolicy, cluster: Cluster
) -> None:
    spec = {"model": {"pvc": {"claimName": "models", "path": "qwen"}}, "replicas": 1}
    outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, "guarded", spec))
    assert outcome.applied["NetworkPolicy/guarded-engine"] == "created"
    stored = cluster.get("networking.k8s.io/v1", "NetworkPolicy", k8s_namespace, "guarded-engine")
    assert stored is not None and stored["spec"]["ingress"][1]["from"][1] == MONITORING
    # The status remembers it, so the pass after the setting is turned off looks for it (and only then).
    assert apply_model(control_plane, k8s_namespace, "guarded", spec)["status"]["networkPolicy"] is True
    # A second pass writes nothing.
    again = reconcile(cluster, apply_model(control_plane, k8s_namespace, "guarded", spec))
    assert again.applied.get("NetworkPolicy/guarded-engine", "unchanged") == "unchanged"

    network_policy.use(EngineNetworkPolicy())
    reconcile(cluster, apply_model(control_plane, k8s_namespace, "guarded", spec))
    assert cluster.get("networking.k8s.io/v1", "NetworkPolicy", k8s_namespace, "guarded-engine") is None
    events = control_plane.kubectl(
        "get", "events", "-n", k8s_namespace, "--field-selector", "involvedObject.name=guarded,reason=Deleted",
        "-o", "jsonpath={.items[*].message}",
    ).stdout
    assert "deleted NetworkPolicy guarded-engine: the operator's networkPolicy is off" in events
    assert "networkPolicy" not in (apply_model(control_plane, k8s_namespace, "guarded", spec)["status"])
