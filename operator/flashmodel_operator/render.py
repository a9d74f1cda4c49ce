"""PURE: a FlashModel in, the desired children out (plain dicts, ready for server-side apply)."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import math
import posixpath
from typing import Any

import yaml
from flashmodel_engine.contract import (
    CONFIG_DIR,
    CONFIG_FILE,
    CONFIG_KEY,
    ENGINE_PORT,
    LIVENESS_PATH,
    READINESS_PATH,
    SHIM_PORT,
    STARTUP_PATH,
)
from flashmodel_engine.profiles import used_extension
from pydantic import BaseModel

from flashmodel_operator import (
    FIELD_MANAGER,
    GROUP,
    KIND,
    VERSION,
    engine_image,
    extra_args_policy,
    network_policy,
    pod_policy,
)
from flashmodel_operator.autoscaling import render_hpa, render_scaled_object
from flashmodel_operator.model import AdapterSpec, FlashModel
from flashmodel_operator.placement import PodProfile, pod_profile

PRE_STOP_SLEEP_SECONDS = 5
"""Endpoint removal reaches kube-proxy and load balancers within a few seconds."""
AUTH_DIR = f"{CONFIG_DIR}/auth"
CONTROL_DIR = f"{CONFIG_DIR}/control"
CONTROL_TOKEN_KEY = "token"
"""Key of the per-model Secret `<name>-shim` whose token the shim requires on POST /prewarm."""
PREWARM_GATE = f"{GROUP}/prewarmed"
CONFIG_HASH_ANNOTATION = f"{GROUP}/config-hash"
APPLIED_HASH_ANNOTATION = f"{GROUP}/applied-hash"
MODEL_LABEL = f"{GROUP}/model"
CACHE_DIR = "/cache"
HF_HOME = f"{CACHE_DIR}/huggingface"
HUB_CACHE_VOLUME = "hub-cache"
COMPILE_CACHE_VOLUME = "compile-cache"
COMPILE_CACHE_DIR = "/compile-cache"
HUB_DEFAULT_REVISION = "main"


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
    """Where the engine finds the weights inside the pod (a hub id is passed through to vLLM).

    ValueError for a path that would leave its volume (the CRD and the spec model refuse one already).
    """
    source = fm.spec.model
    if source.pvc is not None:
        return _inside("/models", source.pvc.path)
    if source.image is not None:
        return _inside("/model-image", source.image.path)
    assert source.hub is not None  # the model validator guarantees exactly one source
    return source.hub.id


def _inside(mount: str, path: str) -> str:
    inner = path.strip("/")
    if ".." in inner.split("/"):
        raise ValueError(f"model path {path!r} leaves {mount}: a '..' segment; name a directory inside the source")
    return f"{mount}/{inner}" if inner else mount


# The spec fields every engine config has held since the config hash covered it: they are written
# whatever their value (None aside), since leaving one out would change the hash of every existing
# model and roll its pods. A field added to a section later is written only when it differs from its
# default, so adding a field with a default rolls nothing; the engine must then read the same default
# where the key is absent (tests/crd/test_model_agrees.py checks that it does).
ALWAYS_WRITTEN: dict[str, frozenset[str]] = {
    "engine": frozenset({
        "block_size", "gpu_memory_utilization", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
        "dtype", "enforce_eager", "attention_backend", "extra_args",
    }),
    "prewarm": frozenset({"enabled", "requests", "prompts", "max_tokens", "timeout_seconds"}),
    "health": frozenset({"readiness_deadline_seconds", "readiness_cache_seconds", "startup_timeout_seconds"}),
    "remediation": frozenset({
        "enabled", "divergence_ratio", "divergence_window_seconds", "low_kv_cache_usage",
        "max_restarts_per_hour", "hung_readiness_seconds",
    }),
    "observability": frozenset({"otlp_traces_endpoint", "otlp_traces_protocol"}),
}
# Spec fields the engine does not read: the image is the pod's, not a setting.
_NOT_WRITTEN: dict[str, frozenset[str]] = {"engine": frozenset({"image"})}


def engine_section(section: str, values: BaseModel) -> dict[str, Any]:
    """One spec section as the engine config writes it: camelCase, without None and new defaults."""
    written = ALWAYS_WRITTEN[section]
    out: dict[str, Any] = {}
    for name, field in type(values).model_fields.items():
        value = getattr(values, name)
        if value is None or name in _NOT_WRITTEN.get(section, ()):
            continue
        if name not in written and value == field.get_default(call_default_factory=True):
            continue
        out[field.alias or name] = value.model_dump(by_alias=True) if isinstance(value, BaseModel) else value
    return out


def engine_config(fm: FlashModel) -> dict[str, Any]:
    """The engine config file (docs/design.md), camelCase like the spec it comes from."""
    spec = fm.spec
    config: dict[str, Any] = {
        "accelerator": spec.accelerator,
        "model": {"path": model_path(fm), "servedName": fm.served_name},
        "engine": engine_section("engine", spec.engine),
        "prewarm": engine_section("prewarm", spec.prewarm),
        "health": engine_section("health", spec.health),
        "remediation": engine_section("remediation", spec.remediation),
        "server": {
            "host": "0.0.0.0",
            "enginePort": ENGINE_PORT,
            "shimPort": SHIM_PORT,
            "controlTokenFile": f"{CONTROL_DIR}/{CONTROL_TOKEN_KEY}",
        },
    }
    hub = spec.model.hub
    if hub is not None and hub.revision != HUB_DEFAULT_REVISION:
        # Only when pinned: main is what vLLM fetches without the flag, and writing it would change
        # the config hash of every existing hub model.
        config["model"]["revision"] = hub.revision
    if spec.compile_cache is not None:
        # Only when set: the config hash of a model without one stays as it was.
        config["server"]["compileCacheDir"] = COMPILE_CACHE_DIR
    if spec.observability is not None and spec.observability.otlp_traces_endpoint is not None:
        config["observability"] = engine_section("observability", spec.observability)
    if spec.model.trust_remote_code:
        # Only when set, like quantization below: existing models' config hashes stay as they were.
        config["model"]["trustRemoteCode"] = True
    # Only the admin's allow-list entries this model uses: a change to the cluster's list rolls the
    # pods of the models that use what changed, not every model's.
    extension = used_extension(spec.engine.extra_args, extra_args_policy.current())
    if extension:
        config["engine"]["extraArgsAllowed"] = extension
    if spec.model.quantization != "auto":
        # Only when set: auto is the engine's default too, and writing it would change the config
        # hash of every existing model, so upgrading the operator would restart all their pods.
        config["model"]["quantization"] = spec.model.quantization
    if spec.auth is not None:
        config["auth"] = {"apiKeyFile": f"{AUTH_DIR}/{spec.auth.api_key_secret_ref.key}"}
    lora = lora_section(fm)
    if lora is not None:
        # Only when LoRA is on: a model without it keeps its config hash. The adapters themselves are not
        # here: the operator loads them at run time (flashmodel_operator.adapters), so changing them
        # changes neither this file nor the pods.
        config["lora"] = lora
    return config


def lora_section(fm: FlashModel) -> dict[str, Any] | None:
    """The engine config's `lora` section (the engine's LoraSettings: vLLM's --enable-lora, --max-loras,
    --max-lora-rank), or None when off."""
    if not fm.spec.lora_on:
        return None
    max_loras, max_rank = fm.spec.lora_limits()
    # Where the shim may read adapters: their own volumes, and the model's claim or image (an adapter
    # beside the model reads from there). Fixed per model source, so adding an adapter keeps the config.
    roots = [ADAPTERS_DIR]
    if fm.spec.model.pvc is not None:
        roots.append("/models")
    if fm.spec.model.image is not None:
        roots.append("/model-image")
    return {"maxLoras": max_loras, "maxRank": max_rank, "adapterRoots": roots}


_CONFIG_YAML: dict[str, str] = {}
"""engine_config_yaml's memo, by the config's canonical JSON: one render wants it four times, and
PyYAML's emitter (pure Python) takes about 0.9 ms for each, most of a pass's CPU."""
_CONFIG_YAML_ENTRIES = 4096


def engine_config_yaml(fm: FlashModel) -> str:
    config = engine_config(fm)
    key = json.dumps(config, sort_keys=True, separators=(",", ":"))
    text = _CONFIG_YAML.get(key)
    if text is None:
        text = yaml.safe_dump(config, sort_keys=True, allow_unicode=True)
        if len(_CONFIG_YAML) >= _CONFIG_YAML_ENTRIES:
            _CONFIG_YAML.clear()  # a bound, not a policy: a fleet has far fewer distinct configs
        _CONFIG_YAML[key] = text
    return text


def content_hash(obj: Any) -> str:
    """A stable hash of a JSON-able value: the same desired state always gives the same hash."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]


def control_secret_name(fm_name: str) -> str:
    return f"{fm_name}-shim"


def render_control_secret(fm: FlashModel, token: str) -> dict[str, Any]:
    """The Secret with the token only the operator and the model's pods hold (made once, never re-rendered)."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(fm, control_secret_name(fm.name)),
        "type": "Opaque",
        "stringData": {CONTROL_TOKEN_KEY: token},
    }


def render_configmap(fm: FlashModel) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(fm, f"{fm.name}-engine"),
        "data": {CONFIG_KEY: engine_config_yaml(fm)},
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


def _base_pod_template(fm: FlashModel) -> dict[str, Any]:
    """The engine pod before the patch: the profile's settings, then the user's fields."""
    profile = pod_profile(fm.spec.accelerator)
    volumes, mounts = _volumes(fm, profile)
    container = _engine_container(fm, _engine_env(fm, profile), _engine_resources(fm, profile), mounts)
    hashed: dict[str, Any] = {CONFIG_KEY: engine_config_yaml(fm)}
    adapter_volumes = [v for v in volumes if v["name"].startswith("adapter-")]
    if adapter_volumes:
        # A new claim or image is a new volume, which only a new pod gets: the pods that run without it
        # are not current. The adapters' list is not hashed: it changes at run time, without a new pod.
        hashed["adapterVolumes"] = adapter_volumes
    config_hash = content_hash(hashed)
    return {
        "metadata": {"labels": common_labels(fm), "annotations": {CONFIG_HASH_ANNOTATION: config_hash}},
        "spec": _pod_spec(fm, profile, container, volumes),
    }


def _engine_resources(fm: FlashModel, profile: PodProfile) -> dict[str, Any]:
    resources: dict[str, Any] = copy.deepcopy(fm.spec.resources)
    for resource, amount in profile.limits.items():
        # The profile's count wins (a pod with nvidia.com/gpu: 0 ran on a T4 node with no GPU);
        # extended resources must have requests equal to limits.
        resources.setdefault("limits", {})[resource] = amount
        resources.setdefault("requests", {})[resource] = amount
    return resources


def _engine_env(fm: FlashModel, profile: PodProfile) -> list[dict[str, Any]]:
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        # Caches go to a writable emptyDir: the root filesystem is read-only. An emptyDir lives as
        # long as the pod, so a restarted container finds vLLM's torch.compile artifacts, Inductor's
        # and Triton's kernels there and loads them instead of compiling again.
        {"name": "HOME", "value": CACHE_DIR},
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "VLLM_CACHE_ROOT", "value": "/cache/vllm"},
        {"name": "TORCHINDUCTOR_CACHE_DIR", "value": "/cache/torchinductor"},
        {"name": "TRITON_CACHE_DIR", "value": "/cache/triton"},
    ]
    env += [{"name": k, "value": v} for k, v in sorted(profile.env.items())]
    hub = fm.spec.model.hub
    if hub is not None and hub.token_secret_ref is not None:
        # From the Secret at container start: the token is never in the pod spec, the engine
        # ConfigMap or status, and a user reading the Deployment does not see it.
        token = hub.token_secret_ref
        env.append({"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}})
    return env


def _volumes(fm: FlashModel, profile: PodProfile) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The pod's volumes and the engine container's mounts of them."""
    model_volumes, model_mounts = _model_volume(fm)
    volumes: list[dict[str, Any]] = [
        {"name": "config", "configMap": {"name": f"{fm.name}-engine"}},
        {"name": "control", "secret": {"secretName": control_secret_name(fm.name), "defaultMode": 0o440}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": profile.shm_size}},
        {"name": "cache", "emptyDir": {}},
        {"name": "tmp", "emptyDir": {}},
        *model_volumes,
    ]
    mounts: list[dict[str, Any]] = [
        {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
        {"name": "control", "mountPath": CONTROL_DIR, "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "cache", "mountPath": CACHE_DIR},
        {"name": "tmp", "mountPath": "/tmp"},
        *model_mounts,
    ]
    hub = fm.spec.model.hub
    if hub is not None and hub.cache is not None:
        # Mounted over HF_HOME inside the emptyDir: downloads land on the shared claim, and the next
        # pod (on any node) finds the files there instead of fetching them again. The compile caches
        # have a claim of their own (spec.compileCache), keyed by what they were built for.
        volumes.append({"name": HUB_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": hub.cache.pvc.claim_name}})
        mounts.append({"name": HUB_CACHE_VOLUME, "mountPath": HF_HOME})
    if fm.spec.compile_cache is not None:
        # The launcher points vLLM's, Inductor's and Triton's caches at a keyed folder on it
        # (flashmodel_engine.compile_cache); the emptyDir at /cache keeps everything else.
        claim = fm.spec.compile_cache.pvc.claim_name
        volumes.append({"name": COMPILE_CACHE_VOLUME, "persistentVolumeClaim": {"claimName": claim}})
        mounts.append({"name": COMPILE_CACHE_VOLUME, "mountPath": COMPILE_CACHE_DIR})
    if fm.spec.auth is not None:
        ref = fm.spec.auth.api_key_secret_ref
        volumes.append(
            {"name": "auth", "secret": {"secretName": ref.name, "items": [{"key": ref.key, "path": ref.key}]}}
        )
        mounts.append({"name": "auth", "mountPath": AUTH_DIR, "readOnly": True})
    adapter_volumes, adapter_mounts = _adapter_volumes(fm)
    volumes += adapter_volumes
    mounts += adapter_mounts
    return volumes, mounts


ADAPTERS_DIR = "/adapters"
"""Where the adapters' claims and images are mounted in the engine container, one folder per volume."""


def _adapter_volume(fm: FlashModel, adapter: AdapterSpec) -> tuple[str, dict[str, Any]] | None:
    """(volume name, volume) an adapter is read from; None for a hub adapter or one on the model's own volume.

    One volume per distinct claim or image, named by a hash of it: the same adapters in any order give
    the same pod, and another adapter from a claim already mounted changes nothing.
    """
    model = fm.spec.model
    if adapter.pvc is not None:
        claim = adapter.pvc.claim_name
        if model.pvc is not None and model.pvc.claim_name == claim:
            return None
        return f"adapter-{content_hash(['pvc', claim])[:12]}", {
            "persistentVolumeClaim": {"claimName": claim, "readOnly": True}
        }
    if adapter.image is not None:
        reference = adapter.image.reference
        if model.image is not None and model.image.reference == reference:
            return None
        return f"adapter-{content_hash(['image', reference])[:12]}", {
            "image": {"reference": reference, "pullPolicy": "IfNotPresent"}
        }
    return None


def _adapter_volumes(fm: FlashModel) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The adapters' volumes and read-only mounts at /adapters/<volume>, sorted by name."""
    found: dict[str, dict[str, Any]] = {}
    for adapter in fm.spec.adapters:
        volume = _adapter_volume(fm, adapter)
        if volume is not None:
            found[volume[0]] = volume[1]
    names = sorted(found)
    return (
        [{"name": name, **found[name]} for name in names],
        [{"name": name, "mountPath": f"{ADAPTERS_DIR}/{name}", "readOnly": True} for name in names],
    )


def adapter_path(fm: FlashModel, adapter: AdapterSpec) -> str | None:
    """Where the engine reads a pvc or image adapter inside the pod; None for a hub adapter.

    What the operator sends in the shim's PUT /adapters. ValueError for a path that would leave its volume.
    """
    volume = _adapter_volume(fm, adapter)
    if adapter.pvc is not None:
        mount = "/models" if volume is None else f"{ADAPTERS_DIR}/{volume[0]}"
        return posixpath.normpath(_inside(mount, adapter.pvc.path))
    if adapter.image is not None:
        mount = "/model-image" if volume is None else f"{ADAPTERS_DIR}/{volume[0]}"
        return posixpath.normpath(_inside(mount, adapter.image.path))
    return None


def _engine_container(
    fm: FlashModel, env: list[dict[str, Any]], resources: dict[str, Any], mounts: list[dict[str, Any]]
) -> dict[str, Any]:
    health = fm.spec.health
    return {
        "name": "engine",
        "image": engine_image.current().choose(fm.spec.engine.image)[0],
        "command": ["python", "-m", "flashmodel_engine", "launch", "--config", CONFIG_FILE],
        "ports": [
            {"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"},
            {"name": "health", "containerPort": SHIM_PORT, "protocol": "TCP"},
        ],
        "env": env,
        "resources": resources,
        "volumeMounts": mounts,
        # Loading weights takes minutes; liveness and readiness wait until startup succeeded.
        "startupProbe": _probe(STARTUP_PATH, 10, 5, max(1, math.ceil(health.startup_timeout_seconds / 10))),
        "livenessProbe": _probe(LIVENESS_PATH, 10, 5, 3),
        "readinessProbe": _probe(READINESS_PATH, 5, math.ceil(health.readiness_deadline_seconds) + 1, 2),
        # A pod being deleted (a scale-down, a rollout) leaves the Service's endpoints while it still
        # accepts: SIGTERM, which closes vLLM's listener, comes only after clients have stopped
        # picking it, so no request is sent to a closed port; in-flight ones then drain.
        "lifecycle": {"preStop": {"sleep": {"seconds": PRE_STOP_SLEEP_SECONDS}}},
        # The launcher writes its preflight verdict here; logs are the fallback for crashes.
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "runAsNonRoot": True,
            "readOnlyRootFilesystem": True,
            "capabilities": {"drop": ["ALL"]},
        },
    }


def _pod_spec(
    fm: FlashModel, profile: PodProfile, container: dict[str, Any], volumes: list[dict[str, Any]]
) -> dict[str, Any]:
    spec = fm.spec
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
        # The engine never calls the Kubernetes API: no token for a model's code to find and use.
        "automountServiceAccountToken": False,
    }
    pull_secrets = engine_image.current().pull_secrets
    if pull_secrets:
        pod_spec["imagePullSecrets"] = [{"name": name} for name in pull_secrets]
    # The profile's keys win: a user selector for other GPUs would put a T4 engine where it cannot run.
    node_selector = {**spec.node_selector, **profile.node_selector}
    if node_selector:
        pod_spec["nodeSelector"] = node_selector
    tolerations = [*profile.tolerations, *spec.tolerations]
    if tolerations:
        pod_spec["tolerations"] = tolerations
    if spec.affinity:
        pod_spec["affinity"] = copy.deepcopy(spec.affinity)
    return pod_spec


def render_pod_template(fm: FlashModel) -> dict[str, Any]:
    """The engine pod: the profile's settings, the user's fields, and what pod_policy allows of the patch."""
    template, _ = render_pod(fm)
    return template


def pod_template_problems(fm: FlashModel) -> list[str]:
    """What the spec's podTemplatePatch, resources or nodeSelector try to change of the enforced pod.

    The rendered pod holds only what pod_policy's allow-list lets through, whatever these say; the
    reconcile refuses such a spec so that the user learns it, instead of running something other than
    what they wrote.
    """
    _, problems = render_pod(fm)
    return problems


def model_pod_profile(fm: FlashModel) -> PodProfile:
    """The accelerator's pod profile, marked for LoRA where the model turns it on (a higher memory floor)."""
    profile = pod_profile(fm.spec.accelerator)
    return dataclasses.replace(profile, lora=True) if fm.spec.lora_on else profile


def render_pod(fm: FlashModel) -> tuple[dict[str, Any], list[str]]:
    """The engine pod (render_pod_template) and its problems (pod_template_problems), from one render.

    A reconcile pass wants both, and the Deployment built from the same template (render_children's
    `template`): each render costs a YAML dump and a hash of the engine config.
    """
    base = _base_pod_template(fm)
    problems = _spec_problems(fm)
    if not fm.spec.pod_template_patch:
        return base, problems
    try:
        patched = strategic_merge(base, fm.spec.pod_template_patch)
    except PatchError as exc:
        return base, [*problems, f"spec.podTemplatePatch cannot be applied: {exc}"]
    pod, refused = pod_policy.enforce(base, patched, model_pod_profile(fm))
    return pod, problems + refused


def _spec_problems(fm: FlashModel) -> list[str]:
    profile = model_pod_profile(fm)
    problems = []
    _, image_problem = engine_image.current().choose(fm.spec.engine.image)
    if image_problem is not None:
        problems.append(image_problem)
    limits = (fm.spec.resources.get("limits") or {}) if isinstance(fm.spec.resources, dict) else {}
    requests = (fm.spec.resources.get("requests") or {}) if isinstance(fm.spec.resources, dict) else {}
    for resource, amount in profile.limits.items():
        for where, values in (("limits", limits), ("requests", requests)):
            if resource in values and str(values[resource]) != amount:
                problems.append(
                    f"spec.resources.{where}[{resource}] is {values[resource]}; the {profile.name} profile runs each "
                    f"engine on exactly {amount}; remove it (the operator sets it)"
                )
    for key, value in profile.node_selector.items():
        if key in fm.spec.node_selector and fm.spec.node_selector[key] != value:
            problems.append(
                f"spec.nodeSelector[{key}] is {fm.spec.node_selector[key]!r}; the {profile.name} profile runs "
                f"only where it is {value!r}; remove it, or use the accelerator that matches those nodes"
            )
    problems += pod_policy.resource_problems(fm.spec.resources, "spec.resources", profile)
    problems += pod_policy.toleration_problems(fm.spec.tolerations, "spec.tolerations")
    return problems


def render_deployment(
    fm: FlashModel, replicas: int | None = None, template: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The engine Deployment; `replicas` overrides the spec (the operator holds 0 after a preflight refusal).

    `template`: the model's render_pod_template where the caller has it already.
    """
    spec = fm.spec
    startup = spec.health.startup_timeout_seconds + (spec.prewarm.timeout_seconds if spec.prewarm.enabled else 0)
    serving = spec.replicas if replicas is None else replicas
    standby = standby_count(fm, serving)
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _metadata(fm, fm.name),
        "spec": {
            "replicas": serving + standby,
            "selector": {"matchLabels": selector_labels(fm)},
            # Surge one pod and keep every warm pod serving until its replacement is warm. A standby
            # is never Ready (its gate stays closed), so it counts as unavailable: without it in
            # maxUnavailable a rollout would wait for it forever.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": standby}},
            "progressDeadlineSeconds": startup + 120,
            "revisionHistoryLimit": 3,
            "template": render_pod_template(fm) if template is None else template,
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


def standby_count(fm: FlashModel, serving: int) -> int:
    """The standby pods the Deployment adds to `serving` pods: none for a model held or scaled to zero."""
    return fm.spec.standby_replicas if serving > 0 else 0


def needs_pdb(fm: FlashModel) -> bool:
    """Whether the model gets a PodDisruptionBudget: only where it can have two serving pods.

    With one serving pod the budget allows one pod (and every standby) unavailable, which is every pod:
    it would block no eviction and cost the API server and the disruption controller a write and a
    sync per model. The autoscaler's ceiling counts, so a model it scales between one and more pods
    keeps its budget instead of gaining and losing it with each scale.
    """
    ceiling = fm.spec.autoscaling.max_replicas if fm.spec.autoscaling is not None else 0
    return max(fm.spec.replicas, ceiling) >= 2


def render_pdb(fm: FlashModel) -> dict[str, Any]:
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": _metadata(fm, fm.name),
        "spec": {
            # One serving pod at a time; standby pods are unready on purpose and must not use up that one.
            "maxUnavailable": 1 + standby_count(fm, fm.spec.replicas),
            "selector": {"matchLabels": selector_labels(fm)},
            # A hung, unready pod must stay evictable, or remediation could never replace it.
            "unhealthyPodEvictionPolicy": "AlwaysAllow",
        },
    }


def render_autoscaler(fm: FlashModel, prometheus: str) -> dict[str, Any] | None:
    """The model's ScaledObject (KEDA) or HPA, named after the model; None without spec.autoscaling."""
    scaling = fm.spec.autoscaling
    if scaling is None:
        return None
    if scaling.scaler == "keda":
        return render_scaled_object(fm, _metadata(fm, fm.name), prometheus)
    return render_hpa(fm, _metadata(fm, fm.name))


def render_network_policy(fm: FlashModel) -> dict[str, Any] | None:
    """Who may reach the model's engine pods, where the cluster admin turns it on (network_policy.py)."""
    metadata = _metadata(fm, network_policy_name(fm.name))
    return network_policy.render(network_policy.current(), metadata, selector_labels(fm))


def network_policy_name(fm_name: str) -> str:
    return f"{fm_name}-engine"


def render_children(
    fm: FlashModel, replicas: int | None = None, prometheus: str = "", template: dict[str, Any] | None = None
) -> list[dict[str, Any]]:
    """Every child, in apply order (the ConfigMap before the pods that mount it); `template` as render_deployment's."""
    children = [render_configmap(fm), render_deployment(fm, replicas, template), render_service(fm)]
    if needs_pdb(fm):
        children.append(render_pdb(fm))
    policy = render_network_policy(fm)
    if policy is not None:
        children.append(policy)
    autoscaler = render_autoscaler(fm, prometheus)
    if autoscaler is not None:
        children.append(autoscaler)
    return children


class PatchError(ValueError):
    """A pod template patch that a strategic merge cannot apply."""


# Kubernetes' patch strategy per list of a pod template (the patchMergeKey tags of k8s.io/api core/v1):
# these lists merge item by item on their key; every other list (args, tolerations, readinessGates,
# envFrom, ...) is replaced whole, as a strategic merge patch does.
_CONTAINER_LISTS = {"env": "name", "volumeMounts": "mountPath", "volumeDevices": "devicePath",
                    "ports": "containerPort", "resizePolicy": "resourceName"}
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("spec", "volumes"): "name",
    ("spec", "imagePullSecrets"): "name",
    ("spec", "hostAliases"): "ip",
    ("spec", "schedulingGates"): "name",
    ("spec", "resourceClaims"): "name",
    ("spec", "topologySpreadConstraints"): "topologyKey",
    **{("spec", kind): "name" for kind in ("containers", "initContainers", "ephemeralContainers")},
    **{
        ("spec", kind, "*", field): key
        for kind in ("containers", "initContainers", "ephemeralContainers")
        for field, key in _CONTAINER_LISTS.items()
    },
}


def strategic_merge(base: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    """`patch` applied to the pod template `base` by Kubernetes' strategic-merge rules.

    Maps merge key by key and `null` removes a key; the lists in MERGE_KEYS merge on their key,
    where an item `{"<key>": ..., "$patch": "delete"}` removes one and `{"$patch": "replace"}` in
    the list replaces it whole; other lists are replaced. A map with `"$patch": "replace"` replaces
    what it patches.
    """
    merged = _merge_map(base, patch, ())
    return merged if merged is not None else {}


def _merge_map(base: dict[str, Any], patch: dict[str, Any], path: tuple[str, ...]) -> dict[str, Any] | None:
    directive = patch.get("$patch")
    if directive == "delete":
        return None
    if directive == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    if directive is not None:
        raise PatchError(f"{'.'.join(path) or 'the patch'}: $patch {directive!r} is not merge, replace or delete")
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if key.startswith("$"):
            raise PatchError(f"{'.'.join(path) or 'the patch'}: the directive {key} is not supported; "
                             "write the fields it would set instead")
        sub = (*path, key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            merged = _merge_map(out[key], value, sub)
            if merged is None:
                out.pop(key, None)
            else:
                out[key] = merged
        elif isinstance(value, list) and _wildcard(sub) in MERGE_KEYS:
            out[key] = _merge_list(out.get(key) or [], value, sub, MERGE_KEYS[_wildcard(sub)])
        elif isinstance(value, dict):
            out[key] = {k: copy.deepcopy(v) for k, v in value.items() if k != "$patch"}
        else:
            out[key] = copy.deepcopy(value)
    return out


def _wildcard(path: tuple[str, ...]) -> tuple[str, ...]:
    # The items of a keyed list share one strategy: spec.containers[engine].env is spec.containers.*.env.
    return tuple("*" if i > 0 and MERGE_KEYS.get(path[:i]) else part for i, part in enumerate(path))


def _merge_list(base: list[Any], patch: list[Any], path: tuple[str, ...], key: str) -> list[Any]:
    where = ".".join(path)
    if any(isinstance(item, dict) and item.get("$patch") == "replace" for item in patch):
        return [copy.deepcopy(item) for item in patch if not (isinstance(item, dict) and "$patch" in item)]
    out = [copy.deepcopy(item) for item in base]
    for item in patch:
        if not isinstance(item, dict) or key not in item:
            raise PatchError(f"{where}: every item needs its merge key {key!r} (Kubernetes merges this list on it)")
        index = next((i for i, old in enumerate(out) if isinstance(old, dict) and old.get(key) == item[key]), None)
        if item.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
        elif index is None:
            out.append({k: copy.deepcopy(v) for k, v in item.items() if k != "$patch"})
        else:
            merged = _merge_map(out[index], item, (*path, str(item[key])))
            if merged is None:
                out.pop(index)
            else:
                out[index] = merged
    return out
