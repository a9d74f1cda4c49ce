"""spec.routing: the InferencePool, endpoint picker and HTTPRoute a FlashModel gets, and their life as children."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml
from flashmodel_operator import FIELD_MANAGER
from flashmodel_operator.apply import Cluster
from flashmodel_operator.model import FlashModel
from flashmodel_operator.reconcile import reconcile
from flashmodel_operator.render import MODEL_LABEL, common_labels, selector_labels
from flashmodel_operator.routing import (
    MODEL_NAME_HEADER,
    PickerSettings,
    picker_config,
    render_routing,
    route_matches,
    route_winner,
)
from flashmodel_operator.watched_models import WatchedModels

from e2e.harness.cluster import ControlPlane
from tests.operator.specs import apply_model, body

ROOT = Path(__file__).resolve().parents[2]
POOL_CRD_NAME = "inferencepools.inference.networking.k8s.io"
CHART_CRDS = ROOT / "charts" / "flashmodel-operator" / "files" / "crds"
POOL_CRD = CHART_CRDS / "inference.networking.k8s.io_inferencepools.yaml"
PVC_MODEL = {"pvc": {"claimName": "models", "path": "qwen"}, "servedName": "qwen"}


def _routed(routing: dict[str, Any], name: str = "routed") -> FlashModel:
    return FlashModel.from_body(body(name, {"model": PVC_MODEL, "routing": routing}))


def _children(fm: FlashModel) -> dict[str, dict[str, Any]]:
    rendered = render_routing(fm, common_labels(fm), selector_labels(fm), PickerSettings())
    return {c["kind"]: c for c in rendered}


def test_no_routing_renders_nothing() -> None:
    fm = FlashModel.from_body(body("plain", {"model": PVC_MODEL}))
    assert render_routing(fm, common_labels(fm), selector_labels(fm)) == []


def test_the_pool_selects_the_engine_pods_and_names_its_picker() -> None:
    fm = _routed({})
    children = _children(fm)
    pool = children["InferencePool"]["spec"]
    assert pool["selector"]["matchLabels"] == selector_labels(fm)
    assert pool["targetPorts"] == [{"number": 8000}]
    assert pool["endpointPickerRef"] == {"kind": "Service", "name": "routed-epp", "port": {"number": 9002},
                                         "failureMode": "FailClose"}
    assert "HTTPRoute" not in children, "no gateway named: the cluster's own routes point at the pool"
    # The picker's Service serves the port the pool names.
    assert children["Service"]["spec"]["ports"][0]["port"] == 9002


def test_the_pickers_pods_are_not_taken_for_engine_pods() -> None:
    """The operator's pod and Deployment watches select managed-by and the model label: the picker has neither,
    and the pool's selector does not match the picker's pods."""
    fm = _routed({})
    children = _children(fm)
    deployment = children["Deployment"]
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    for labels in (pod_labels, deployment["metadata"]["labels"]):
        assert labels.get("app.kubernetes.io/managed-by") != FIELD_MANAGER and MODEL_LABEL not in labels
    selector = children["InferencePool"]["spec"]["selector"]["matchLabels"]
    assert not all(pod_labels.get(k) == v for k, v in selector.items())
    assert deployment["spec"]["template"]["spec"]["serviceAccountName"] == "routed-epp"
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:6] == ["--pool-name", "routed", "--pool-namespace", fm.namespace, "--pool-group",
                        "inference.networking.k8s.io"]


def test_the_pickers_role_reads_only_pods_and_pools_in_the_models_namespace() -> None:
    children = _children(_routed({}))
    rules = children["Role"]["rules"]
    assert {v for r in rules for v in r["verbs"]} == {"get", "list", "watch"}
    assert {res for r in rules for res in r["resources"]} == {
        "pods", "inferencepools", "inferenceobjectives", "inferencemodelrewrites"}
    assert children["RoleBinding"]["roleRef"]["name"] == "routed-epp"


def test_the_scorer_weights_are_the_models_and_a_zero_weight_drops_its_scorer() -> None:
    fm = _routed({"picker": {"queue": 5, "kvCacheUtilization": 0, "prefixCache": 1}})
    assert fm.spec.routing is not None
    config = yaml.safe_load(picker_config(fm.spec.routing))
    [profile] = config["schedulingProfiles"]
    weights = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert weights == {"queue-scorer": 5, "prefix-cache-scorer": 1, "max-score-picker": None}
    assert "kv-cache-utilization-scorer" not in {p["type"] for p in config["plugins"]}
    defaults = yaml.safe_load(picker_config(_routed({}).spec.routing))  # type: ignore[arg-type]
    assert {p["pluginRef"]: p.get("weight") for p in defaults["schedulingProfiles"][0]["plugins"]} == {
        "queue-scorer": 2, "kv-cache-utilization-scorer": 2, "prefix-cache-scorer": 3, "max-score-picker": None}


def test_the_route_matches_the_served_name_and_the_headers_on_the_named_gateway() -> None:
    fm = _routed({"gateway": {"name": "edge", "namespace": "infra"},
                  "headers": [{"name": "X-Task-Type", "value": "summarize"}]})
    route = _children(fm)["HTTPRoute"]["spec"]
    assert route["parentRefs"] == [{"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": "edge",
                                    "namespace": "infra"}]
    [rule] = route["rules"]
    assert rule["backendRefs"] == [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": "routed"}]
    headers = {(h["name"], h["value"]) for h in rule["matches"][0]["headers"]}
    assert headers == {("x-task-type", "summarize"), (MODEL_NAME_HEADER.lower(), "qwen")}
    only_headers = _routed({"gateway": {"name": "edge"}, "matchModelName": False,
                            "headers": [{"name": "X-Task-Type", "value": "chat"}]})
    assert route_matches(only_headers, only_headers.spec.routing) == [("x-task-type", "chat")]  # type: ignore[arg-type]


# Against the real API server: the children, the Routing condition, and their removal.


def _establish(cp: ControlPlane, path: Path, name: str) -> None:
    cp.kubectl("apply", "--server-side", "-f", str(path))
    cp.wait_established(name)


def _condition(fm: dict[str, Any], kind: str) -> dict[str, Any] | None:
    return next((c for c in (fm.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def test_without_the_pool_crd_the_model_serves_through_its_service_and_says_what_to_install(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    # The control plane is shared: a test before this one may have installed the CRD.
    control_plane.kubectl("delete", "crd", POOL_CRD_NAME, "--ignore-not-found", "--wait=true")
    spec = {"model": PVC_MODEL, "replicas": 1, "routing": {}}
    outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, "unrouted", spec))
    assert outcome.applied["Deployment/unrouted"] == "created"
    stored = apply_model(control_plane, k8s_namespace, "unrouted", spec)
    routing = _condition(stored, "Routing")
    assert routing is not None and routing["status"] == "False" and routing["reason"] == "InferencePoolCRDMissing"
    assert "gateway.installInferencePoolCRD" in routing["message"]
    degraded = _condition(stored, "Degraded")
    assert degraded is not None and degraded["status"] == "False", "serving through the Service is no fault"


def test_the_pool_and_picker_are_children_while_routed_and_go_with_spec_routing(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    _establish(control_plane, POOL_CRD, POOL_CRD_NAME)
    ns, name = k8s_namespace, "routed"
    spec = {"model": PVC_MODEL, "replicas": 1, "routing": {"picker": {"prefixCache": 5}}}
    outcome = reconcile(cluster, apply_model(control_plane, ns, name, spec))
    for child in ("InferencePool/routed", "Deployment/routed-epp", "Service/routed-epp", "ConfigMap/routed-epp",
                  "ServiceAccount/routed-epp", "Role/routed-epp", "RoleBinding/routed-epp"):
        assert outcome.applied.get(child) == "created", (child, outcome.applied)
    pool = cluster.get("inference.networking.k8s.io/v1", "InferencePool", ns, name)
    assert pool is not None and pool["spec"]["endpointPickerRef"]["name"] == "routed-epp"
    stored = json.loads(control_plane.kubectl("get", "flashmodel", name, "-n", ns, "-o", "json").stdout)
    # No kubelet runs the picker here: the condition says the Gateway refuses the model's requests.
    routing = _condition(stored, "Routing")
    assert routing is not None and routing["reason"] == "PickerNotReady" and "FailClose" in routing["message"]
    assert stored["status"]["routing"] == {"pool": name, "endpointPicker": "routed-epp", "pickerReady": False}
    # A second pass writes none of them again.
    again = reconcile(cluster, apply_model(control_plane, ns, name, spec))
    assert {k: v for k, v in again.applied.items() if v != "unchanged"} == {}

    reconcile(cluster, apply_model(control_plane, ns, name, {"model": PVC_MODEL, "replicas": 1}))
    assert cluster.get("inference.networking.k8s.io/v1", "InferencePool", ns, name) is None
    assert cluster.get("apps/v1", "Deployment", ns, "routed-epp") is None
    assert cluster.get("rbac.authorization.k8s.io/v1", "Role", ns, "routed-epp") is None
    assert cluster.get("apps/v1", "Deployment", ns, name) is not None, "the engine's own Deployment stays"
    stored = json.loads(control_plane.kubectl("get", "flashmodel", name, "-n", ns, "-o", "json").stdout)
    assert _condition(stored, "Routing") is None and stored["status"].get("routing") is None


def test_of_two_routes_claiming_the_same_requests_the_older_wins_and_the_younger_says_why() -> None:
    def stored(name: str, created: str, routing: dict[str, Any], namespace: str = "serving") -> dict[str, Any]:
        found = body(name, {"model": PVC_MODEL, "routing": routing}, namespace=namespace)
        found["metadata"]["creationTimestamp"] = created
        return found

    edge = {"gateway": {"name": "edge", "namespace": "infra"}, "headers": [{"name": "X-Task-Type", "value": "chat"}]}
    older, younger = stored("a-older", "2026-12-01T00:00:00Z", edge), stored("b-younger", "2026-12-02T00:00:00Z", edge)
    fleet = [older, younger, stored("plain", "2026-11-01T00:00:00Z", {})]
    assert route_winner(FlashModel.from_body(younger), "2026-12-02T00:00:00Z", fleet) == "serving/a-older"
    assert route_winner(FlashModel.from_body(older), "2026-12-01T00:00:00Z", fleet) is None
    # Another header value, another listener or another Gateway is no conflict.
    for other in ({**edge, "headers": [{"name": "X-Task-Type", "value": "summarize"}]},
                  {**edge, "gateway": {"name": "edge", "namespace": "infra", "sectionName": "https"}},
                  {**edge, "gateway": {"name": "edge"}}):
        fm = FlashModel.from_body(stored("c", "2026-12-03T00:00:00Z", other))
        assert route_winner(fm, "2026-12-03T00:00:00Z", fleet) is None, other
    # The same served name and matches from another namespace, on the same Gateway: a conflict.
    elsewhere = stored("a-older", "2026-12-04T00:00:00Z", edge, namespace="team-b")
    assert route_winner(FlashModel.from_body(elsewhere), "2026-12-04T00:00:00Z", fleet) == "serving/a-older"


def test_a_younger_conflicting_model_gets_its_pool_but_no_route_on_the_real_api_server(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    _establish(control_plane, POOL_CRD, POOL_CRD_NAME)
    ns = k8s_namespace
    models = WatchedModels()
    watching = Cluster(cluster.api, models=models)
    routing = {"gateway": {"name": "edge"}, "headers": [{"name": "X-Task-Type", "value": "chat"}]}
    spec = {"model": PVC_MODEL, "replicas": 1, "routing": routing}
    first = apply_model(control_plane, ns, "first", spec)
    models.event("ADDED", first)
    time.sleep(1.1)  # creation timestamps have whole seconds
    second = apply_model(control_plane, ns, "second", spec)
    models.event("ADDED", second)
    # Without the Gateway API CRDs the route itself is refused (404): the younger model's route is not
    # even tried, which the outcome shows.
    outcome = reconcile(watching, second)
    assert "HTTPRoute/second" not in outcome.applied and outcome.applied["InferencePool/second"] == "created"
    stored = apply_model(control_plane, ns, "second", spec)
    routing_condition = _condition(stored, "Routing")
    assert routing_condition is not None and routing_condition["reason"] == "RouteConflict"
    assert f"{ns}/first" in routing_condition["message"] and "x-task-type: chat" in routing_condition["message"]
    assert stored["status"]["routing"]["conflict"] == f"{ns}/first"
    events = control_plane.kubectl(
        "get", "events", "-n", ns, "--field-selector", "involvedObject.name=second,reason=RouteConflict",
        "-o", "jsonpath={.items[*].message}",
    ).stdout
    assert "already routes the same requests" in events
