"""PURE: a FlashModel in, the desired children out (plain dicts, ready for server-side apply)."""

from __future__ import annotations

import copy
import hashlib
import json
import math
from typing import Any

import yaml

from flashmodel_operator import FIELD_MANAGER, GROUP, KIND, VERSION
from flashmodel_operator.model import FlashModel
from flashmodel_operator.profiles import pod_profile

ENGINE_PORT = 8000
SHIM_PORT = 8081
CONFIG_DIR = "/etc/flashmodel"
CONFIG_FILE = f"{CONFIG_DIR}/engine.yaml"
AUTH_DIR = f"{CONFIG_DIR}/auth"
PREWARM_GATE = f"{GROUP}/prewarmed"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
APPLIED_HASH_ANNOTATION = f"{GROUP}/applied-hash"
MODEL_LABEL = f"{GROUP}/model"
# The launcher exits with EX_CONFIG (sysexits.h) when preflight refuses the model or settings;
# retrying such a pod cannot succeed until the spec changes.
PREFLIGHT_EXIT_CODE = 78


def selector_labels(fm: FlashModel) -> dict[str, str]:
    """Labels that pick this model's engine pods; free of versions so selectors never change."""
    return {"app.kubernetes.io/name": "flashmodel-engine", "app.kubernetes.io/instance": fm.name}


def common_labels(fm: FlashModel) -> dict[str, str]:
    return {
        **selector_labels(fm),
        "app.kubernetes.io/managed-by": FIELD_MANAGER,
        MODEL_LABEL: fm.name,
    }


def selector_string(fm: FlashModel) -> str:
    """The label selector as a string, for the scale subresource (status.selector)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(fm).items()))


def owner_reference(fm: FlashModel) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": KIND,
        "name": fm.name,
        "uid": fm.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(fm: FlashModel, name: str) -> dict[str, Any]:
    return {
        "name": name,
        "namespace": fm.namespace,
        "labels": common_labels(fm),
        "ownerReferences": [owner_reference(fm)],
    }


def model_path(fm: FlashModel) -> str:
    """Where the engine finds the weights inside the pod (a hub id is passed through to vLLM)."""
    source = fm.spec.model
    if source.pvc is not None:
        return "/models/" + source.pvc.path.strip("/") if source.pvc.path.strip("/") else "/models"
    if source.image is not None:
        return "/model-image/" + source.image.path.strip("/") if source.image.path.strip("/") else "/model-image"
    assert source.hub is not None  # the model validator guarantees exactly one source
    return source.hub.id


def engine_config(fm: FlashModel) -> dict[str, Any]:
    """The engine config file (docs/design.md), camelCase like the spec it comes from."""
    spec = fm.spec
    config: dict[str, Any] = {
        "accelerator": spec.accelerator,
        "model": {"path": model_path(fm), "servedName": fm.served_name},
        "engine": spec.engine.model_dump(by_alias=True, exclude={"image"}, exclude_none=True),
        "prewarm": spec.prewarm.model_dump(by_alias=True),
        "health": spec.health.model_dump(by_alias=True),
        "remediation": spec.remediation.model_dump(by_alias=True),
        "server": {"host": "0.0.0.0", "enginePort": ENGINE_PORT, "shimPort": SHIM_PORT},
    }
    if spec.auth is not None:
        config["auth"] = {"apiKeyFile": f"{AUTH_DIR}/{spec.auth.api_key_secret_ref.key}"}
    return config


def engine_config_yaml(fm: FlashModel) -> str:
    return yaml.safe_dump(engine_config(fm), sort_keys=True, allow_unicode=True)


def content_hash(obj: Any) -> str:
    """A stable hash of a JSON-able value: the same desired state always gives the same hash."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def render_configmap(fm: FlashModel) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(fm, f"{fm.name}-engine"),
        "data": {"engine.yaml": engine_config_yaml(fm)},
    }


def _probe(path: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "health"},
        "periodSeconds": period,
        "timeoutSeconds": timeout,
        "failureThreshold": failures,
    }


def _model_volume(fm: FlashModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    source = fm.spec.model
    if source.pvc is not None:
        return (
            [{"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claim_name, "readOnly": True}}],
            [{"name": "model", "mountPath": "/models", "readOnly": True}],
        )
    if source.image is not None:
        return (
            [{"name": "model", "image": {"reference": source.image.reference, "pullPolicy": "IfNotPresent"}}],
            [{"name": "model", "mountPath": "/model-image", "readOnly": True}],
        )
    return [], []


def render_pod_template(fm: FlashModel) -> dict[str, Any]:
    """The engine pod: profile-enforced settings first, then the user's overrides, then the patch."""
    spec = fm.spec
    profile = pod_profile(spec.accelerator)
    health = spec.health

    resources: dict[str, Any] = copy.deepcopy(spec.resources)
    for resource, amount in profile.limits.items():
        limits = resources.setdefault("limits", {})
        limits.setdefault(resource, amount)
        # Extended resources must have requests equal to limits.
        resources.setdefault("requests", {})[resource] = limits[resource]

    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # Caches go to a writable emptyDir: the root filesystem is read-only. An emptyDir lives as
        # long as the pod, so a restarted container finds vLLM's torch.compile artifacts, Inductor's
        # and Triton's kernels there and loads them instead of compiling again.
        {"name": "HOME", "value": "/cache"},
        {"name": "HF_HOME", "value": "/cache/huggingface"},
        {"name": "VLLM_CACHE_ROOT", "value": "/cache/vllm"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/cache/torchinductor"},
        {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"},
    ]
    env += [{"name": k, "value": v} for k, v in sorted(profile.env.items())]

    model_volumes, model_mounts = _model_volume(fm)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{fm.name}-engine"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.shm_size}},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        *model_volumes,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": "/cache"},
        {"name": "tmp", "mountPath": "/tmp"},
        *model_mounts,
    ]
    if spec.auth is not None:
        ref = spec.auth.api_key_secret_ref
        volumes.append(
            {"name": "auth", "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": ref.key}]}}
        )
        mounts.append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})

    container: dict[str, Any] = {
        "name": "engine",
        "image": spec.engine.image,
        "command": ["python", "-m", "flashmodel_engine", "launch", "--config", CONFIG_FILE],
        "ports": [
            {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
            {"name": "health", "containerPort": SHIM_PORT, "protocol": "TCP"},
        ],
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        # Loading weights takes minutes; liveness and readiness wait until startup succeeded.
        "startupProbe": _probe("/startupz", 10, 5, max(1, math.ceil(health.startup_timeout_seconds / 10))),
        "livenessProbe": _probe("/livez", 10, 5, 3),
        "readinessProbe": _probe("/readyz", 5, math.ceil(health.readiness_deadline_seconds) + 1, 2),
        # The launcher writes its preflight verdict here; logs are the fallback for crashes.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }

    pod_spec: dict[str, Any] = {
        "containers": [container],
        "volumes": volumes,
        # The operator flips this gate only after the pod's prewarm succeeded.
        "readinessGates": [{"conditionType": PREWARM_GATE}],
        # Enough for the launcher to drain in-flight requests after SIGTERM.
        "terminationGracePeriodSeconds": 60,
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": 1000,
            "runAsGroup": 1000,
            # Makes model files on the volume readable by the engine's group (root-only files
            # slow vLLM's start six-fold in the field reports, or stop it).
            "fsGroup": 1000,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "enableServiceLinks": False,
    }
    node_selector = {**profile.node_selector, **spec.node_selector}
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    tolerations = [*profile.tolerations, *spec.tolerations]
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(spec.affinity)

    config_hash = content_hash({"engine.yaml": engine_config_yaml(fm)})
    template: dict[str, Any] = {
        "metadata": {"labels": common_labels(fm), "annotations": {CONFIG_HASH_ANNOTATION: config_hash}},
        "spec": pod_spec,
    }
    if spec.pod_template_patch:
        template = merge_patch(template, spec.pod_template_patch)
    return template


def render_deployment(fm: FlashModel, replicas: int | None = None) -> dict[str, Any]:
    """The engine Deployment; `replicas` overrides the spec (the operator holds 0 after a preflight refusal)."""
    spec = fm.spec
    startup = spec.health.startup_timeout_seconds + (spec.prewarm.timeout_seconds if spec.prewarm.enabled else 0)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(fm, fm.name),
        "spec": {
            "replicas": spec.replicas if replicas is None else replicas,
            "selector": {"matchLabels": selector_labels(fm)},
            # Surge one pod and keep every warm pod serving until its replacement is warm.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "progressDeadlineSeconds": startup + 120,
            "revisionHistoryLimit": 3,
            "template": render_pod_template(fm),
        },
    }


def render_service(fm: FlashModel) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(fm, fm.name),
        "spec": {
            "type": "ClusterIP",
            "selector": selector_labels(fm),
            "ports": [
                {"name": "http", "port": ENGINE_PORT, "targetPort": "http", "protocol": "TCP"},
                {"name": "health", "port": SHIM_PORT, "targetPort": "health", "protocol": "TCP"},
            ],
        },
    }


def render_pdb(fm: FlashModel) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(fm, fm.name),
        "spec": {
            "maxUnavailable": 1,
            "selector": {"matchLabels": selector_labels(fm)},
            # A hung, unready pod must stay evictable, or remediation could never replace it.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_hpa(fm: FlashModel) -> dict[str, Any] | None:
    scaling = fm.spec.autoscaling
    if scaling is None:
        return None
    metrics: list[dict[str, Any]] = [
        {
            "type": "Pods",
            "pods": {
                "metric": {"name": "flashmodel_requests_per_second"},
                "target": {"type": "AverageValue", "averageValue": _quantity(scaling.target_requests_per_second)},
            },
        }
    ]
    if scaling.target_kv_cache_usage is not None:
        metrics.append(
            {
                "type": "Pods",
                "pods": {
                    "metric": {"name": "flashmodel_kv_cache_usage_ratio"},
                    "target": {"type": "AverageValue", "averageValue": _quantity(scaling.target_kv_cache_usage)},
                },
            }
        )
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": _metadata(fm, fm.name),
        "spec": {
            # The HPA scales the FlashModel through its scale subresource, so the operator stays
            # the only writer of the Deployment.
            "scaleTargetRef": {"apiVersion": f"{GROUP}/{VERSION}", "kind": KIND, "name": fm.name},
            "minReplicas": scaling.min_replicas,
            "maxReplicas": scaling.max_replicas,
            "metrics": metrics,
            "behavior": {
                # A GPU pod takes minutes to load and prewarm: add one at a time, remove slowly.
                "scaleUp": {
                    "stabilizationWindowSeconds": 60,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 60}],
                },
                "scaleDown": {
                    "stabilizationWindowSeconds": 300,
                    "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}],
                },
            },
        },
    }


def _quantity(value: float) -> str:
    """A Kubernetes quantity for a float target: milli-units keep 0.8 exact (800m)."""
    milli = round(value * 1000)
    return str(milli // 1000) if milli % 1000 == 0 else f"{milli}m"


def render_children(fm: FlashModel, replicas: int | None = None) -> list[dict[str, Any]]:
    """Every child, in apply order (the ConfigMap before the pods that mount it)."""
    children = [render_configmap(fm), render_deployment(fm, replicas), render_service(fm), render_pdb(fm)]
    hpa = render_hpa(fm)
    if hpa is not None:
        children.append(hpa)
    return children


def merge_patch(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """Merge `patch` into `base` the way users expect of a pod template patch.

    Maps merge key by key, `null` removes a key, and lists of named items (containers,
    volumes, env, volumeMounts, ports) merge by `name` as in a strategic merge patch; any
    other list is replaced whole.
    """
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_patch(out[key], value)
        elif isinstance(value, list) and isinstance(out.get(key), list) and _named(value) and _named(out[key]):
            merged = {item["name"]: item for item in out[key]}
            order = [item["name"] for item in out[key]]
            for item in value:
                if item["name"] in merged:
                    merged[item["name"]] = merge_patch(merged[item["name"]], item)
                else:
                    merged[item["name"]] = copy.deepcopy(item)
                    order.append(item["name"])
            out[key] = [merged[name] for name in order]
        else:
            out[key] = copy.deepcopy(value)
    return out


def _named(items: list[Any]) -> bool:
    return bool(items) and all(isinstance(i, dict) and "name" in i for i in items)
