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
    BBR_MANAGED_LABEL,
    MODEL_NAME_HEADER,
    PickerSettings,
    model_names_name,
    picker_config,
    render_routing,
    route_conflict,
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


def _routed(routing: dict[str, Any], name: str = "routed", **spec: Any) -> FlashModel:
    return FlashModel.from_body(body(name, {"model": PVC_MODEL, "routing": routing, **spec}))


def _adapters(*names: str) -> list[dict[str, Any]]:
    return [{"name": n, "pvc": {"claimName": "lora", "path": n}} for n in names]


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


def _weights(config: str) -> dict[str, Any]:
    return {p["pluginRef"]: p.get("weight") for p in yaml.safe_load(config)["schedulingProfiles"][0]["plugins"]}


def test_with_lora_on_the_picker_scores_lora_affinity_and_reads_vllms_lora_metric() -> None:
    with_adapters = _routed({}, adapters=_adapters("support"))
    config = yaml.safe_load(_names(with_adapters)["ConfigMap/routed-epp"]["data"]["picker.yaml"])
    assert "lora-affinity-scorer" in {p["type"] for p in config["plugins"]}
    assert _weights(yaml.safe_dump(config))["lora-affinity-scorer"] == 1
    # The metrics source GIE's extractor reads vllm:lora_requests_info from: vLLM's own /metrics.
    assert {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}} in config["plugins"]
    # spec.lora alone turns LoRA on (adapters may come later); the weight is the model's; 0 drops the scorer.
    lora_only = _routed({"picker": {"loraAffinity": 4}}, lora={"maxLoras": 2})
    assert _weights(_names(lora_only)["ConfigMap/routed-epp"]["data"]["picker.yaml"])["lora-affinity-scorer"] == 4
    off = _routed({"picker": {"loraAffinity": 0}}, adapters=_adapters("support"))
    assert "lora-affinity-scorer" not in _names(off)["ConfigMap/routed-epp"]["data"]["picker.yaml"]
    # Without LoRA vLLM exports no such metric: no scorer, whatever the weight.
    plain = _routed({"picker": {"loraAffinity": 7}})
    assert "lora-affinity-scorer" not in _weights(_names(plain)["ConfigMap/routed-epp"]["data"]["picker.yaml"])


def _names(fm: FlashModel) -> dict[str, dict[str, Any]]:
    """The rendered children by kind/name."""
    rendered = render_routing(fm, common_labels(fm), selector_labels(fm), PickerSettings())
    return {f"{c['kind']}/{c['metadata']['name']}": c for c in rendered}


def test_the_body_based_router_maps_the_adapters_to_the_routes_served_name() -> None:
    fm = _routed({"gateway": {"name": "edge"}}, adapters=_adapters("triage", "support"))
    names = _names(fm)[f"ConfigMap/{model_names_name(fm)}"]
    assert names["metadata"]["labels"][BBR_MANAGED_LABEL] == "true"
    assert names["metadata"]["ownerReferences"][0]["name"] == "routed"
    # GIE's adapters store reads baseModel as a string and adapters as a YAML list of strings.
    assert names["data"]["baseModel"] == "qwen"
    assert yaml.safe_load(names["data"]["adapters"]) == ["support", "triage"]
    # The route still matches the base model's name: the router sets it for the adapters' requests too.
    route = _names(fm)["HTTPRoute/routed"]
    assert route["spec"]["rules"][0]["matches"][0]["headers"] == [
        {"type": "Exact", "name": MODEL_NAME_HEADER.lower(), "value": "qwen"}]
    # A base model without adapters is named too: GIE v1.5's router sets "" for a name no ConfigMap lists.
    bare = _names(_routed({"gateway": {"name": "edge"}}))["ConfigMap/routed-model-names"]
    assert bare["data"]["baseModel"] == "qwen" and yaml.safe_load(bare["data"]["adapters"]) == []
    # No route on model names, no map: without a Gateway, or with matchModelName false.
    for routing in ({}, {"gateway": {"name": "edge"}, "matchModelName": False,
                         "headers": [{"name": "X-Task-Type", "value": "chat"}]}):
        rendered = _names(_routed(routing, adapters=_adapters("support")))
        assert f"ConfigMap/{model_names_name(fm)}" not in rendered, routing


def test_a_model_name_another_model_already_maps_to_another_base_is_a_conflict_on_any_gateway() -> None:
    def stored(name: str, created: str, served: str, gateway: str, adapters: list[str]) -> dict[str, Any]:
        found = body(name, {"model": {**PVC_MODEL, "servedName": served}, "adapters": _adapters(*adapters),
                            "routing": {"gateway": {"name": gateway}}})
        found["metadata"]["creationTimestamp"] = created
        return found

    older = stored("a-older", "2026-12-01T00:00:00Z", "qwen", "edge", ["support"])
    fleet = [older]
    cases = {
        # The router keeps one base per name, whichever Gateway the models use.
        "the same adapter name on another base": (stored("b", "2026-12-02T00:00:00Z", "mistral", "other", ["support"]),
                                                  ("support",)),
        "an adapter named as the older model's served name": (
            stored("c", "2026-12-02T00:00:00Z", "mistral", "edge", ["qwen"]), ("qwen",)),
        "a served name the older model has as an adapter": (stored("d", "2026-12-02T00:00:00Z", "support", "other", []),
                                                            ("support",)),
    }
    for why, (younger, names) in cases.items():
        conflict = route_conflict(FlashModel.from_body(younger), "2026-12-02T00:00:00Z", fleet)
        assert conflict is not None and conflict.winner == "serving/a-older" and conflict.names == names, why
        assert route_conflict(FlashModel.from_body(older), "2026-12-01T00:00:00Z", [*fleet, younger]) is None, why
    # The same adapter under the same base name maps to one base: the routes' headers tell the models apart.
    twin = body("e", {"model": PVC_MODEL, "adapters": _adapters("support"),
                      "routing": {"gateway": {"name": "edge"}, "headers": [{"name": "X-Task-Type", "value": "b"}]}})
    assert route_conflict(FlashModel.from_body(twin), "2026-12-02T00:00:00Z", fleet) is None


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


def test_an_adapter_named_as_an_older_models_served_name_loses_its_route_and_name_map(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    _establish(control_plane, POOL_CRD, POOL_CRD_NAME)
    ns = k8s_namespace
    models = WatchedModels()
    watching = Cluster(cluster.api, models=models)
    routing = {"gateway": {"name": "edge"}}
    first = apply_model(control_plane, ns, "first", {"model": PVC_MODEL, "replicas": 1, "routing": routing})
    models.event("ADDED", first)
    time.sleep(1.1)  # creation timestamps have whole seconds
    spec: dict[str, Any] = {"model": {**PVC_MODEL, "servedName": "mistral"}, "replicas": 1, "routing": routing}
    second = apply_model(control_plane, ns, "second", spec)
    models.event("ADDED", second)
    outcome = reconcile(watching, second)
    assert outcome.applied["ConfigMap/second-model-names"] == "created"
    # The younger model takes the older one's served name as an adapter: the router would send the older
    # model's requests here, so this model's name map goes (its route was never applied: no Gateway API CRDs).
    spec["adapters"] = _adapters("qwen")
    second = apply_model(control_plane, ns, "second", spec)
    models.event("MODIFIED", second)
    reconcile(watching, second)
    assert cluster.get("v1", "ConfigMap", ns, "second-model-names") is None
    stored = apply_model(control_plane, ns, "second", spec)
    condition = _condition(stored, "Routing")
    assert condition is not None and condition["reason"] == "RouteConflict", condition
    assert f"{ns}/first" in condition["message"] and "model name(s) qwen" in condition["message"]
