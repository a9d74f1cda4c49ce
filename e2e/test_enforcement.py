"""End to end: what the operator refuses to run, and what it waits for, with the real operator and API server."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import yaml
from flashmodel_operator.render import PREWARM_GATE

from e2e.harness.cluster import ControlPlane
from e2e.harness.operator_run import create_model_volume, get_json, wait_for


def _fm(name: str, spec: dict[str, Any]) -> str:
    return yaml.safe_dump(
        {"apiVersion": "serving.flashmodel.io/v1alpha1", "kind": "FlashModel", "metadata": {"name": name}, "spec": spec}
    )


def _deployment(cp: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    try:
        found: dict[str, Any] = get_json(cp, "deployment", name, "-n", ns)
    except subprocess.CalledProcessError:
        return None
    return found


def _degraded(cp: ControlPlane, ns: str, name: str) -> dict[str, Any] | None:
    status = get_json(cp, "flashmodel", name, "-n", ns).get("status") or {}
    return next((c for c in status.get("conditions", []) if c["type"] == "Degraded"), None)


def test_no_deployment_until_the_auth_secret_exists_and_its_arrival_proceeds_at_once(
    control_plane: ControlPlane, operator: Path, k8s_namespace: str
) -> None:
    ns, name = k8s_namespace, "keyed"
    create_model_volume(control_plane, ns, "models")
    spec = {
        "model": {"pvc": {"claimName": "models", "path": "qwen"}},
        "auth": {"apiKeySecretRef": {"name": "keyed-keys"}},
        "podTemplatePatch": {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}},
    }
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=_fm(name, spec))
    degraded = wait_for(
        "AuthSecretNotFound", lambda: (c := _degraded(control_plane, ns, name)) and c["reason"] == "AuthSecretNotFound"
    )
    assert degraded
    # The Service and ConfigMap may exist; a pod must not (it would crash on the missing mount).
    wait_for("the Service", lambda: get_json(control_plane, "service", name, "-n", ns))
    time.sleep(2)
    assert _deployment(control_plane, ns, name) is None, "a Deployment was made before its auth Secret existed"

    created = time.monotonic()
    control_plane.kubectl("create", "secret", "generic", "keyed-keys", "-n", ns, "--from-literal=api-key=k3y")
    wait_for("the Deployment after the Secret", lambda: _deployment(control_plane, ns, name), timeout=30)
    took = time.monotonic() - created
    # The held model's own short timer found it, not the next resync.
    log = operator.read_text()
    assert f"event=secrets-arrived model={ns}/{name} secrets=keyed-keys" in log, log[-3000:]
    assert took < 10, f"the Deployment came {took:.1f}s after the Secret"
    wait_for("Degraded cleared", lambda: (c := _degraded(control_plane, ns, name)) and c["status"] == "False")


REFUSED_PODS: dict[str, tuple[dict[str, Any], str]] = {
    "command": (
        {"podTemplatePatch": {"spec": {"containers": [{"name": "engine", "command": ["vllm", "serve", "/models"]}]}}},
        "changes the engine container's command",
    ),
    "no-gate": ({"podTemplatePatch": {"spec": {"readinessGates": []}}}, "drops the readiness gate"),
    "gpu-0": ({"resources": {"limits": {"nvidia.com/gpu": 0}}}, "spec.resources.limits[nvidia.com/gpu] is 0"),
    "other-gpu": (
        {"podTemplatePatch": {"spec": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-40GB"}}}},
        "changes nodeSelector[nvidia.com/gpu.product]",
    ),
    "second-mount-at-models": (
        {
            "podTemplatePatch": {
                "spec": {
                    "containers": [{"name": "engine", "volumeMounts": [{"name": "mine", "mountPath": "/models"}]}],
                    "volumes": [{"name": "mine", "emptyDir": {}}],
                }
            }
        },
        "changes the engine container's mount at /models",
    ),
    # issue 40: a second GPU through a sidecar, the hub's code path through the loader, the node's network
    "sidecar-gpu": (
        {"podTemplatePatch": {"spec": {"containers": [
            {"name": "thief", "image": "busybox", "resources": {"limits": {"nvidia.com/gpu": 1}}}]}}},
        "the container thief's resources.limits[nvidia.com/gpu] asks for",
    ),
    "ld-preload": (
        {"podTemplatePatch": {"spec": {"containers": [
            {"name": "engine", "env": [{"name": "LD_PRELOAD", "value": "/cache/evil.so"}]}]}}},
        "changes the engine container's env LD_PRELOAD",
    ),
    "host-network": ({"podTemplatePatch": {"spec": {"hostNetwork": True}}}, "sets hostNetwork"),
    "memory-1mi": (
        {"resources": {"limits": {"memory": "1Mi"}}},
        "memory limit 1Mi is below the 4 GiB the t4 profile's host side holds",
    ),
}


def test_a_spec_that_undoes_the_enforced_pod_gets_no_deployment_and_says_why(
    control_plane: ControlPlane, operator: Path, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    create_model_volume(control_plane, ns, "models")
    base = {"model": {"pvc": {"claimName": "models", "path": "qwen"}}, "replicas": 1}
    docs = [_fm(name, {**base, **extra}) for name, (extra, _) in REFUSED_PODS.items()]
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input="---\n".join(docs))
    for name, (_, says) in REFUSED_PODS.items():
        degraded = wait_for(
            f"{name} refused", lambda n=name: (c := _degraded(control_plane, ns, n)) and c["status"] == "True" and c
        )
        assert degraded["reason"] == "PodTemplateRefused" and says in degraded["message"], (name, degraded)
    # The pass that wrote Degraded stopped before the children: above all, no Deployment.
    for name in REFUSED_PODS:
        assert _deployment(control_plane, ns, name) is None, f"{name}: a Deployment was made from a refused pod"


def test_a_patch_beside_the_enforced_pod_runs_with_the_engine_intact(
    control_plane: ControlPlane, operator: Path, k8s_namespace: str
) -> None:
    ns, name = k8s_namespace, "patched"
    create_model_volume(control_plane, ns, "models")
    patch = {
        "spec": {
            "containers": [
                {
                    "name": "engine",
                    "env": [{"name": "EXTRA", "value": "1"}],
                    # Merged on mountPath as Kubernetes does: the engine's own mount at /models stays the only one.
                    "volumeMounts": [
                        {"name": "model", "mountPath": "/models", "readOnly": True},
                        {"name": "extra", "mountPath": "/extra"},
                    ],
                }
            ],
            "volumes": [{"name": "extra", "emptyDir": {}}],
        }
    }
    spec = {"model": {"pvc": {"claimName": "models", "path": "qwen"}}, "replicas": 1, "podTemplatePatch": patch}
    control_plane.kubectl("apply", "-n", ns, "-f", "-", input=_fm(name, spec))

    def scheduled() -> dict[str, Any] | None:
        pods = get_json(control_plane, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={name}")["items"]
        return next((p for p in pods if p["spec"].get("nodeName")), None)

    # The API server admitted the pod (two mounts at one path it would refuse) and the scheduler placed it.
    pod = wait_for("the patched pod scheduled", scheduled, timeout=90)
    engine = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    assert engine["command"][:3] == ["python", "-m", "flashmodel_engine"], engine["command"]
    assert {"name": "EXTRA", "value": "1"} in engine["env"]
    paths = [m["mountPath"] for m in engine["volumeMounts"]]
    assert paths.count("/models") == 1 and "/extra" in paths, paths
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"conditionType": PREWARM_GATE} in pod["spec"]["readinessGates"]
    node = get_json(control_plane, "node", pod["spec"]["nodeName"])
    assert node["metadata"]["labels"]["nvidia.com/gpu.product"] == "Tesla-T4"


def test_a_gate_opened_by_someone_else_is_no_prewarm(
    control_plane: ControlPlane, operator: Path, k8s_namespace: str
) -> None:
    ns, name = k8s_namespace, "kwokgated"
    create_model_volume(control_plane, ns, "models")
    # No custom-status annotation: kwok runs these pods and sets every condition True, the prewarm
    # gate included, with no engine anywhere.
    control_plane.kubectl(
        "apply", "-n", ns, "-f", "-", input=_fm(name, {"model": {"pvc": {"claimName": "models", "path": "qwen"}}})
    )

    def kubelet_ready() -> dict[str, Any]:
        status = get_json(control_plane, "flashmodel", name, "-n", ns).get("status") or {}
        return status if status.get("readyReplicas") == 1 else {}

    status = wait_for("the kwok pod counted ready by its Deployment", kubelet_ready, timeout=90)
    pod = get_json(control_plane, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={name}")["items"][0]
    gate = next(c for c in pod["status"]["conditions"] if c["type"] == PREWARM_GATE)
    assert gate["status"] == "True" and gate.get("reason") != "PrewarmSucceeded", gate
    assert status["prewarmedReplicas"] == 0
    ready = next(c for c in status["conditions"] if c["type"] == "Ready")
    assert ready["status"] == "False" and ready["reason"] == "NotPrewarmed", ready
    assert not [p for p in status.get("pods") or [] if p.get("prewarmed")]
