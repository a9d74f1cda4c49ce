"""PURE: a FlashModel behind the Gateway API Inference Extension (GIE) - its InferencePool, endpoint picker
(EPP) and, with spec.routing.gateway, an HTTPRoute.

The pool selects the model's engine pods; the EPP (one per model, as GIE's own chart deploys it)
uses only those whose Ready condition is True, which the prewarm readiness gate keeps False for a
cold pod, a standby and a pod being drained, so routing inherits what the Service already honours.
The EPP scrapes each pod's vLLM /metrics on the engine port (queue, KV-cache use) and keeps a
prefix index of the prompts it routed; its scorers' weights are the model's (spec.routing.picker).

The EPP's children carry their own labels, not the engine pods' (`app.kubernetes.io/managed-by:
flashmodel-operator` and `serving.flashmodel.io/model`): the operator's pod and Deployment watches
select on those, and an EPP pod taken for an engine pod would be prewarmed and health-polled.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from flashmodel_engine.contract import ENGINE_PORT

from flashmodel_operator import GROUP
from flashmodel_operator.model import FlashModel, RoutingSpec

POOL_API = "inference.networking.k8s.io/v1"
ROUTE_API = "gateway.networking.k8s.io/v1"
EPP_PORT = 9002
"""The ext_proc gRPC port the Gateway calls (GIE's default)."""
EPP_HEALTH_PORT = 9003
EPP_METRICS_PORT = 9090
MODEL_NAME_HEADER = "X-Gateway-Base-Model-Name"
"""Set by GIE's body-based router from the request body's `model` (GIE config/charts/body-based-routing)."""
PICKER_LABEL = f"{GROUP}/picker-for"
PICKER_CONFIG_HASH = f"{GROUP}/picker-config-hash"
DEFAULT_EPP_IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.5.0"
_CONFIG_FILE = "picker.yaml"
FLOW_CONTROL_GATE = "flowControl"
"""GIE's feature gate for request queueing in the EPP (pkg/epp/flowcontrol)."""
HELD_REQUESTS = "inference_extension_flow_control_queue_size"
"""The EPP's gauge of requests its flow control holds (labels inference_pool, model_name, ...)."""


@dataclass(frozen=True)
class PickerSettings:
    """The cluster's endpoint picker: its image and resources (the chart's gateway.endpointPicker)."""

    image: str = DEFAULT_EPP_IMAGE
    """FLASHMODEL_EPP_IMAGE."""
    cpu: str = "500m"
    """FLASHMODEL_EPP_CPU: request and limit; it scrapes every pod of its pool every 50 ms."""
    memory: str = "512Mi"
    """FLASHMODEL_EPP_MEMORY: request and limit."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> PickerSettings:
        return cls(
            environ.get("FLASHMODEL_EPP_IMAGE", "").strip() or DEFAULT_EPP_IMAGE,
            environ.get("FLASHMODEL_EPP_CPU", "").strip() or cls.cpu,
            environ.get("FLASHMODEL_EPP_MEMORY", "").strip() or cls.memory,
        )


def picker_name(fm: FlashModel) -> str:
    return f"{fm.name}-epp"


def picker_labels(fm: FlashModel) -> dict[str, str]:
    return {"app.kubernetes.io/name": "flashmodel-epp", "app.kubernetes.io/instance": fm.name, PICKER_LABEL: fm.name}


def _owner(fm: FlashModel) -> list[dict[str, Any]]:
    return [{"apiVersion": f"{GROUP}/v1alpha1", "kind": "FlashModel", "name": fm.name, "uid": fm.uid,
             "controller": True, "blockOwnerDeletion": True}]


def _meta(fm: FlashModel, name: str, labels: dict[str, str]) -> dict[str, Any]:
    return {"name": name, "namespace": fm.namespace, "labels": labels, "ownerReferences": _owner(fm)}


def render_pool(
    fm: FlashModel, routing: RoutingSpec, engine_labels: dict[str, str], selector: dict[str, str]
) -> dict[str, Any]:
    """The InferencePool: the model's engine pods on the engine port, picked by the model's EPP."""
    return {
        "apiVersion": POOL_API,
        "kind": "InferencePool",
        "metadata": _meta(fm, fm.name, engine_labels),
        "spec": {
            "selector": {"matchLabels": selector},
            "targetPorts": [{"number": ENGINE_PORT}],
            "appProtocol": "http",
            "endpointPickerRef": {
                "kind": "Service",
                "name": picker_name(fm),
                "port": {"number": EPP_PORT},
                "failureMode": routing.failure_mode,
            },
        },
    }


def picker_config(routing: RoutingSpec, hold: bool = False) -> str:
    """The EPP's EndpointPickerConfig: GIE's default profile with the model's weights (a 0 weight drops the scorer).

    `hold` (a model that scales to zero) turns on GIE's flow control: a request that finds no pod
    able to take it (none ready counts as saturated) waits in the picker's queue, which KEDA reads
    to wake a pod, for at most routing.holdSeconds, then gets 503."""
    weights = {
        "queue-scorer": routing.picker.queue,
        "kv-cache-utilization-scorer": routing.picker.kv_cache_utilization,
        "prefix-cache-scorer": routing.picker.prefix_cache,
    }
    scorers = [name for name, weight in weights.items() if weight > 0]
    config: dict[str, Any] = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [
            *({"type": name} for name in scorers),
            {"type": "metrics-data-source", "parameters": {"scheme": "http", "path": "/metrics"}},
            {"type": "core-metrics-extractor"},
            {"type": "max-score-picker"},
        ],
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    *({"pluginRef": name, "weight": weights[name]} for name in scorers),
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }
    if hold:
        config["featureGates"] = [FLOW_CONTROL_GATE]
        config["flowControl"] = {"defaultRequestTTL": f"{routing.hold_seconds}s"}
    return yaml.safe_dump(config, sort_keys=False)


def _picker_rbac(fm: FlashModel, labels: dict[str, str]) -> list[dict[str, Any]]:
    """What GIE's EPP reads, in the model's namespace only: its pool and the pods it selects."""
    name = picker_name(fm)
    read = ["get", "list", "watch"]
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": _meta(fm, name, labels)},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": _meta(fm, name, labels),
            "rules": [
                {"apiGroups": [""], "resources": ["pods"], "verbs": read},
                {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"], "verbs": read},
                {"apiGroups": ["inference.networking.x-k8s.io"],
                 "resources": ["inferenceobjectives", "inferencemodelrewrites"], "verbs": read},
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": _meta(fm, name, labels),
            "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": fm.namespace}],
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        },
    ]


def _picker_container(fm: FlashModel, settings: PickerSettings) -> dict[str, Any]:
    grpc_probe = {"grpc": {"port": EPP_HEALTH_PORT, "service": "inference-extension"}}
    return {
        "name": "epp",
        "image": settings.image,
        "args": [
            "--pool-name", fm.name, "--pool-namespace", fm.namespace, "--pool-group", "inference.networking.k8s.io",
            "--config-file", f"/config/{_CONFIG_FILE}", "--zap-encoder", "json",
            # Its metrics endpoint would check tokens through TokenReviews, a cluster-wide grant per model.
            "--metrics-endpoint-auth=false", "--tracing=false",
        ],
        "env": [
            {"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        ],
        "ports": [
            {"name": "grpc", "containerPort": EPP_PORT, "protocol": "TCP"},
            {"name": "grpc-health", "containerPort": EPP_HEALTH_PORT, "protocol": "TCP"},
            {"name": "metrics", "containerPort": EPP_METRICS_PORT, "protocol": "TCP"},
        ],
        "livenessProbe": {**grpc_probe, "initialDelaySeconds": 5, "periodSeconds": 10},
        "readinessProbe": {**grpc_probe, "periodSeconds": 2},
        "resources": {"requests": {"cpu": settings.cpu, "memory": settings.memory},
                      "limits": {"cpu": settings.cpu, "memory": settings.memory}},
        "securityContext": {
            "allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "runAsNonRoot": True,
            "capabilities": {"drop": ["ALL"]}, "seccompProfile": {"type": "RuntimeDefault"},
        },
        "volumeMounts": [{"name": "config", "mountPath": "/config", "readOnly": True}],
    }


def render_picker(fm: FlashModel, routing: RoutingSpec, settings: PickerSettings) -> list[dict[str, Any]]:
    """The EPP: its RBAC, config, Deployment (one replica: the prefix index lives in its memory) and Service."""
    name, labels = picker_name(fm), picker_labels(fm)
    text = picker_config(routing, hold=fm.spec.scales_to_zero)
    config = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": _meta(fm, name, labels),
              "data": {_CONFIG_FILE: text}}
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(fm, name, labels),
        "spec": {
            "replicas": 1,
            # GIE's chart: the old picker goes before the new one starts, so two never split the prefix index.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": labels},
            "template": {
                # The EPP reads its config once, at start: a changed config rolls the picker.
                "metadata": {"labels": labels,
                             "annotations": {PICKER_CONFIG_HASH: hashlib.sha256(text.encode()).hexdigest()[:16]}},
                "spec": {
                    "serviceAccountName": name,
                    "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
                    "containers": [_picker_container(fm, settings)],
                    "volumes": [{"name": "config", "configMap": {"name": name}}],
                },
            },
        },
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(fm, name, labels),
        "spec": {
            "selector": labels,
            "ports": [
                {"name": "grpc", "port": EPP_PORT, "targetPort": "grpc", "protocol": "TCP", "appProtocol": "http2"},
                {"name": "metrics", "port": EPP_METRICS_PORT, "targetPort": "metrics", "protocol": "TCP"},
            ],
        },
    }
    return [*_picker_rbac(fm, labels), config, deployment, service]


def route_matches(fm: FlashModel, routing: RoutingSpec) -> list[tuple[str, str]]:
    """(header, value) pairs a request must carry to reach this model through its route, sorted."""
    pairs = [(h.name.lower(), h.value) for h in routing.headers]
    if routing.match_model_name:
        pairs.append((MODEL_NAME_HEADER.lower(), fm.served_name))
    return sorted(pairs)


RouteKey = tuple[str, str, tuple[tuple[str, str], ...]]
"""(gateway namespace/name, listener or "", sorted header matches): two routes with one key take the same requests."""


def route_key(fm: FlashModel) -> RouteKey | None:
    """What the model's HTTPRoute claims on its Gateway; None without one."""
    routing = fm.spec.routing
    if routing is None or routing.gateway is None:
        return None
    gateway = f"{routing.gateway.namespace or fm.namespace}/{routing.gateway.name}"
    return gateway, routing.gateway.section_name or "", tuple(route_matches(fm, routing))


def route_winner(fm: FlashModel, created: str, peers: Iterable[Mapping[str, Any]]) -> str | None:
    """namespace/name of an older FlashModel whose route claims exactly what this one's does, or None.

    The oldest wins, by creation time and then namespace/name, which is how the Gateway API resolves
    two routes that match the same requests: refusing the younger route here only says so sooner
    and in the model's status, instead of leaving it attached and silently shadowed.
    """
    key = route_key(fm)
    if key is None:
        return None
    mine = (created, fm.namespace, fm.name)
    for body in peers:
        meta = body.get("metadata") or {}
        if not ((body.get("spec") or {}).get("routing") or {}).get("gateway"):
            continue  # most models have no route: skipped before the costlier parse
        theirs = (str(meta.get("creationTimestamp", "")), meta.get("namespace"), meta.get("name"))
        if theirs[1:] == mine[1:] or meta.get("deletionTimestamp") or not theirs < mine:
            continue
        try:
            peer = FlashModel.from_body(body)
        except (ValueError, KeyError):
            continue  # an invalid peer has no route
        if route_key(peer) == key:
            return f"{peer.namespace}/{peer.name}"
    return None


def render_route(fm: FlashModel, routing: RoutingSpec, engine_labels: dict[str, str]) -> dict[str, Any] | None:
    """The HTTPRoute that attaches the pool to spec.routing.gateway; None without one."""
    gateway = routing.gateway
    if gateway is None:
        return None
    parent: dict[str, Any] = {"group": "gateway.networking.k8s.io", "kind": "Gateway", "name": gateway.name}
    if gateway.namespace is not None:
        parent["namespace"] = gateway.namespace
    if gateway.section_name is not None:
        parent["sectionName"] = gateway.section_name
    headers = [{"type": "Exact", "name": name, "value": value} for name, value in route_matches(fm, routing)]
    return {
        "apiVersion": ROUTE_API,
        "kind": "HTTPRoute",
        "metadata": _meta(fm, fm.name, engine_labels),
        "spec": {
            "parentRefs": [parent],
            "rules": [
                {
                    "matches": [{"path": {"type": "PathPrefix", "value": "/"}, "headers": headers}],
                    "backendRefs": [{"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": fm.name}],
                }
            ],
        },
    }


def render_routing(
    fm: FlashModel, engine_labels: dict[str, str], selector: dict[str, str], settings: PickerSettings | None = None
) -> list[dict[str, Any]]:
    """Every routing child in apply order (the picker before the pool that names it, the route last); [] without."""
    routing = fm.spec.routing
    if routing is None:
        return []
    children = [*render_picker(fm, routing, settings or current()), render_pool(fm, routing, engine_labels, selector)]
    route = render_route(fm, routing, engine_labels)
    return [*children, route] if route is not None else children


_current = PickerSettings()


def current() -> PickerSettings:
    return _current


def load(environ: Mapping[str, str] | None = None) -> PickerSettings:
    """Read the environment once, at start-up, beside the operator's settings."""
    global _current
    _current = PickerSettings.from_environ(os.environ if environ is None else environ)
    return _current


def use(settings: PickerSettings) -> None:
    """Install settings directly (tests)."""
    global _current
    _current = settings
