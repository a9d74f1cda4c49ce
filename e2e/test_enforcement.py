"""End to end: what the operator refuses to run, and what it waits for, with the real operator and API server."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import yaml

from e2e.cluster import ControlPlane
from e2e.operator_run import create_model_volume, get_json, wait_for


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
    assert f"event=auth-secret-arrived model={ns}/{name} secret=keyed-keys" in log, log[-3000:]
    assert took < 10, f"the Deployment came {took:.1f}s after the Secret"
    wait_for("Degraded cleared", lambda: (c := _degraded(control_plane, ns, name)) and c["status"] == "False")
