"""The NoReadyEndpoint event: a routed model whose pool loses its last ready pod says so, once (real API server)."""

from __future__ import annotations

from pathlib import Path

from flashmodel_operator.apply import Cluster
from flashmodel_operator.reconcile import reconcile

from e2e.harness.cluster import ControlPlane
from tests.operator.specs import apply_model, get_model

ROOT = Path(__file__).resolve().parents[2]
CHART_CRDS = ROOT / "charts" / "flashmodel-operator" / "files" / "crds"
POOL_CRD = CHART_CRDS / "inference.networking.k8s.io_inferencepools.yaml"
PVC_MODEL = {"pvc": {"claimName": "models", "path": "qwen"}, "servedName": "qwen"}


def _events(cp: ControlPlane, ns: str, name: str) -> list[str]:
    out = cp.kubectl(
        "get", "events", "-n", ns, "--field-selector", f"involvedObject.name={name},reason=NoReadyEndpoint",
        "-o", "jsonpath={range .items[*]}{.type} {.message}{\"\\n\"}{end}",
    ).stdout
    return [line for line in out.splitlines() if line.strip()]


def _had_ready_pods(cp: ControlPlane, ns: str, name: str, ready: int) -> None:
    """What the pass before saw: `ready` ready pods (no kubelet runs them here, so the status says it)."""
    cp.kubectl("patch", "flashmodel", name, "-n", ns, "--subresource=status", "--type=merge",
               "-p", f'{{"status": {{"readyReplicas": {ready}}}}}')


def test_a_routed_model_that_loses_its_last_ready_pod_gets_one_warning(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    control_plane.kubectl("apply", "--server-side", "-f", str(POOL_CRD))
    control_plane.wait_established("inferencepools.inference.networking.k8s.io")
    ns = k8s_namespace
    routed = {"model": PVC_MODEL, "replicas": 1, "routing": {}}
    reconcile(cluster, apply_model(control_plane, ns, "routed", routed))
    # A new model's pods loading is not news: nothing was lost.
    assert _events(control_plane, ns, "routed") == []

    _had_ready_pods(control_plane, ns, "routed", 2)
    reconcile(cluster, get_model(control_plane, ns, "routed"))
    events = _events(control_plane, ns, "routed")
    assert len(events) == 1, events
    assert events[0].startswith("Warning ") and "InferencePool routed has no ready pod (it had 2)" in events[0]
    assert "503" in events[0]
    # The pass wrote readyReplicas 0: the next one, still without a ready pod, says nothing more.
    reconcile(cluster, get_model(control_plane, ns, "routed"))
    assert len(_events(control_plane, ns, "routed")) == 1

    # A model without routing has no pool to warn about; the Service says nothing of its own either.
    reconcile(cluster, apply_model(control_plane, ns, "plain", {"model": PVC_MODEL, "replicas": 1}))
    _had_ready_pods(control_plane, ns, "plain", 1)
    reconcile(cluster, get_model(control_plane, ns, "plain"))
    assert _events(control_plane, ns, "plain") == []
