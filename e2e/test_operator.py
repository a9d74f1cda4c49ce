"""End to end on the real control plane: helm install, the operator as a process, kubectl as a user."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.autoscaling import install_keda_crds
from e2e.harness.cluster import ControlPlane
from e2e.harness.operator_run import create_model_volume, get_json, wait_for

ROOT = Path(__file__).resolve().parents[1]


def _apply(cp: ControlPlane, namespace: str, doc: dict[str, Any]) -> None:
    cp.kubectl("apply", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc))


def _status(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = get_json(cp, "flashmodel", name, "-n", namespace).get("status") or {}
    return status


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next(c for c in status.get("conditions", []) if c["type"] == kind)


def _printer_row(cp: ControlPlane, namespace: str, name: str) -> dict[str, str]:
    out = cp.kubectl("get", "fm", name, "-n", namespace).stdout.splitlines()
    header, row = out[0].split(), out[1].split()
    return dict(zip(header, row, strict=False))


def _fm(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "serving.flashmodel.io/v1alpha1",
        "kind": "FlashModel",
        "metadata": {"name": name},
        "spec": spec,
    }


def test_chart_installed_what_it_promises(control_plane: ControlPlane, operator: Path) -> None:
    deployments = get_json(control_plane, "deployments", "-n", "flashmodel-system")["items"]
    assert len(deployments) == 1
    rules = [
        r
        for role in get_json(control_plane, "clusterroles", "-l", "app.kubernetes.io/instance=flashmodel")["items"]
        for r in role.get("rules", [])
    ]
    assert rules and all("*" not in r.get("verbs", []) and "*" not in r.get("resources", []) for r in rules)


def test_examples_reconcile_into_scheduled_t4_pods(
    control_plane: ControlPlane, operator: Path, k8s_namespace: str
) -> None:
    ns = k8s_namespace
    install_keda_crds(control_plane)  # the autoscaling example's ScaledObject needs the kind served, not KEDA
    docs = [d for f in sorted((ROOT / "examples").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    models = [d for d in docs if d["kind"] == "FlashModel"]
    assert models, "examples/ holds no FlashModel"
    for doc in docs:
        if doc["kind"] == "FlashModel" and doc["spec"].get("auth"):
            ref = doc["spec"]["auth"]["apiKeySecretRef"]
            control_plane.kubectl(
                "create",
                "secret",
                "generic",
                ref["name"],
                "-n",
                ns,
                f"--from-literal={ref.get('key', 'api-key')}=test-key",
            )
        hub = (doc["spec"]["model"].get("hub") or {}) if doc["kind"] == "FlashModel" else {}
        if hub.get("tokenSecretRef"):
            token = hub["tokenSecretRef"]
            literal = f"--from-literal={token.get('key', 'token')}=hf_test"
            control_plane.kubectl("create", "secret", "generic", token["name"], "-n", ns, literal)
        if doc["kind"] == "FlashModel" and doc["spec"]["model"].get("pvc"):
            create_model_volume(control_plane, ns, doc["spec"]["model"]["pvc"]["claimName"])
        if (hub.get("cache") or {}).get("pvc"):
            # Pods with an unbound claim are never scheduled: the hub cache gets a bound volume too.
            create_model_volume(control_plane, ns, hub["cache"]["pvc"]["claimName"])
        doc.setdefault("metadata", {}).pop("namespace", None)
        _apply(control_plane, ns, doc)

    for doc in models:
        name = doc["metadata"]["name"]
        dep = wait_for(f"Deployment {name}", lambda n=name: get_json(control_plane, "deployment", n, "-n", ns))
        for kind, child in (("service", name), ("configmap", f"{name}-engine")):
            obj = get_json(control_plane, kind, child, "-n", ns)
            assert obj["metadata"]["ownerReferences"][0]["name"] == name
        # A budget only where two pods can serve: with one it would block no eviction.
        spec = doc["spec"]
        two_pods = max(spec.get("replicas", 1), (spec.get("autoscaling") or {}).get("maxReplicas", 0)) >= 2
        budgets = get_json(control_plane, "poddisruptionbudget", "-n", ns, "--field-selector", f"metadata.name={name}")
        assert [b["metadata"]["ownerReferences"][0]["name"] for b in budgets["items"]] == ([name] if two_pods else [])
        if doc["spec"].get("autoscaling"):
            # The default scaler is KEDA: a ScaledObject on the FlashModel's scale subresource.
            so = wait_for(f"ScaledObject {name}", lambda n=name: get_json(control_plane, "scaledobject", n, "-n", ns))
            assert so["spec"]["maxReplicaCount"] == doc["spec"]["autoscaling"]["maxReplicas"]
            assert so["spec"]["scaleTargetRef"] == {
                "apiVersion": "serving.flashmodel.io/v1alpha1",
                "kind": "FlashModel",
                "name": name,
            }
        template = dep["spec"]["template"]["spec"]
        assert template["readinessGates"] == [{"conditionType": "serving.flashmodel.io/prewarmed"}]
        config = yaml.safe_load(get_json(control_plane, "configmap", f"{name}-engine", "-n", ns)["data"]["engine.yaml"])
        assert config["accelerator"] == doc["spec"].get("accelerator", "t4")

    t4_models = [d["metadata"]["name"] for d in models if d["spec"].get("accelerator", "t4") == "t4"]
    for name in t4_models:

        def scheduled(n: str = name) -> list[str]:
            pods = get_json(control_plane, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={n}")["items"]
            nodes = [p["spec"].get("nodeName", "") for p in pods]
            return nodes if nodes and all(nodes) else []

        nodes = wait_for(f"pods of {name} scheduled", scheduled, timeout=90)
        for node in nodes:
            labels = get_json(control_plane, "node", node)["metadata"]["labels"]
            assert labels["nvidia.com/gpu.product"] == "Tesla-T4"

    for doc in models:
        name = doc["metadata"]["name"]
        status = wait_for(
            f"status of {name}",
            lambda n=name: _status(control_plane, ns, n).get("engineArgs") and _status(control_plane, ns, n),
        )
        assert status["observedGeneration"] == 1
        # Handled at once, the model got nothing from kopf but its status: no diff-base annotation,
        # no marker, no progress left (diffbase.HandledSpecs, UnmarkedProgressStorage).
        body = get_json(control_plane, "flashmodel", name, "-n", ns, "--show-managed-fields")
        ours = [k for k in body["metadata"].get("annotations") or {} if k.startswith("serving.flashmodel.io/")]
        assert not ours, f"{name}: the operator annotated the model: {ours}"
        writers = {m["manager"] for m in body["metadata"]["managedFields"] if not m.get("subresource")}
        assert all(w.startswith("kubectl") for w in writers), f"{name}: metadata written by {writers}"
        row = _printer_row(control_plane, ns, name)
        assert row["ACCELERATOR"] == doc["spec"].get("accelerator", "t4")
        assert row["REPLICAS"] == status["replicasSummary"]


def test_scale_edit_delete_lifecycle(control_plane: ControlPlane, operator: Path, k8s_namespace: str) -> None:
    ns, name = k8s_namespace, "lifecycle"
    # No kubelet runs these pods (kwok is told to leave their status alone), so none gets
    # ready or prewarmed, and status must say exactly that.
    unattended = {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}}
    spec = {"model": {"pvc": {"claimName": "models", "path": "qwen"}}, "replicas": 1, "podTemplatePatch": unattended}
    create_model_volume(control_plane, ns, "models")
    _apply(control_plane, ns, _fm(name, spec))
    wait_for("Deployment", lambda: get_json(control_plane, "deployment", name, "-n", ns))

    # kubectl scale goes through the scale subresource, which the HPA uses too.
    control_plane.kubectl("scale", "fm", name, "-n", ns, "--replicas=3")
    wait_for("Deployment at 3", lambda: get_json(control_plane, "deployment", name, "-n", ns)["spec"]["replicas"] == 3)
    wait_for(
        "3 pods scheduled",
        lambda: (
            len(
                [
                    p
                    for p in get_json(control_plane, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={name}")[
                        "items"
                    ]
                    if p["spec"].get("nodeName")
                ]
            )
            == 3
        ),
        timeout=90,
    )
    scale = json.loads(
        control_plane.kubectl(
            "get", "--raw", f"/apis/serving.flashmodel.io/v1alpha1/namespaces/{ns}/flashmodels/{name}/scale"
        ).stdout
    )
    assert scale["spec"]["replicas"] == 3
    wait_for("status.replicas 3", lambda: _status(control_plane, ns, name).get("replicas") == 3)
    assert _printer_row(control_plane, ns, name)["REPLICAS"].endswith("/3")
    # No pod is prewarmed yet (the gate is the operator's to flip), so Ready says so.
    ready = _condition(_status(control_plane, ns, name), "Ready")
    assert ready["status"] == "False"

    # Editing the engine settings rolls the Deployment: a new pod template, a new ReplicaSet.
    before = get_json(control_plane, "deployment", name, "-n", ns)["spec"]["template"]["metadata"]["annotations"]
    control_plane.kubectl(
        "patch",
        "fm",
        name,
        "-n",
        ns,
        "--type=merge",
        "-p",
        json.dumps({"spec": {"engine": {"maxModelLen": 2048, "maxNumBatchedTokens": 2048}}}),
    )

    def rolled() -> bool:
        after = get_json(control_plane, "deployment", name, "-n", ns)["spec"]["template"]["metadata"]["annotations"]
        return bool(after["serving.flashmodel.io/config-hash"] != before["serving.flashmodel.io/config-hash"])

    wait_for("pod template changed", rolled)
    wait_for(
        "two ReplicaSets",
        lambda: (
            len(get_json(control_plane, "replicasets", "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"])
            == 2
        ),
    )
    status = wait_for(
        "observedGeneration 3", lambda: (s := _status(control_plane, ns, name)).get("observedGeneration") == 3 and s
    )
    assert "2048" in status["engineArgs"]
    assert all(c["observedGeneration"] == 3 for c in status["conditions"])
    events = get_json(control_plane, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "Applied" and "Deployment" in e["message"] for e in events)

    # Deleting the FlashModel leaves the rest to the garbage collector.
    control_plane.kubectl("delete", "fm", name, "-n", ns)
    for kind in ("deployment", "service", "configmap", "poddisruptionbudget"):
        wait_for(
            f"{kind} gone",
            lambda k=kind: (
                not get_json(control_plane, k, "-n", ns, "-l", f"app.kubernetes.io/instance={name}")["items"]
            ),
            timeout=60,
        )


def _force_delete_seconds(cp: ControlPlane, namespace: str, pod: str) -> float:
    """How long a forced deletion takes to remove the pod: only a finalizer can hold it."""
    started = time.monotonic()
    cp.kubectl("delete", "pod", pod, "-n", namespace, "--grace-period=0", "--force", "--wait", "--timeout=30s")
    return time.monotonic() - started


def test_engine_pods_carry_no_finalizer(
    control_plane: ControlPlane, operator: Path, k8s_namespace: str
) -> None:
    ns, name = k8s_namespace, "unheld"
    unattended = {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}}
    spec = {"model": {"pvc": {"claimName": "models", "path": "qwen"}}, "replicas": 1, "podTemplatePatch": unattended}
    create_model_volume(control_plane, ns, "models")
    _apply(control_plane, ns, _fm(name, spec))
    pods = wait_for(
        "the engine pod",
        lambda: get_json(control_plane, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={name}")["items"],
    )
    wait_for("status.replicas 1", lambda: _status(control_plane, ns, name).get("replicas") == 1)
    time.sleep(2)  # a daemon's finalizer came within a second of the pod's first event
    pod = get_json(control_plane, "pod", pods[0]["metadata"]["name"], "-n", ns)
    assert not pod["metadata"].get("finalizers"), pod["metadata"]["finalizers"]
    assert _force_delete_seconds(control_plane, ns, pod["metadata"]["name"]) < 10


def test_a_pod_pending_for_lack_of_a_t4_node_says_why_and_schedules_once_one_is_added(
    control_plane: ControlPlane, operator: Path, k8s_namespace: str
) -> None:
    # cluster-autoscaler cannot be built here (the module proxy refuses k8s.io/autoscaler), so the
    # test plays it: it adds the node a scale-up would add, and the pod must land on it.
    ns, name, pool = k8s_namespace, "burst", "t4-burst"
    unattended = {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}}
    # A hub source: no claim to bind, so the node selector is the one thing the scheduler waits on.
    spec = {
        "model": {"hub": {"id": "Qwen/Qwen2.5-1.5B-Instruct"}},
        "nodeSelector": {"cloud.example/pool": pool},
        "podTemplatePatch": unattended,
    }
    _apply(control_plane, ns, _fm(name, spec))

    def unschedulable() -> dict[str, Any]:
        conditions = _status(control_plane, ns, name).get("conditions") or []
        ready: dict[str, Any] = next((c for c in conditions if c["type"] == "Ready"), {})
        return ready if ready.get("reason") == "Unschedulable" else {}

    ready = wait_for("Ready=False Unschedulable", unschedulable, timeout=60)
    # The scheduler's own words: which nodes it tried and why none fits.
    assert "node affinity/selector" in ready["message"], ready
    events = get_json(control_plane, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
    assert any(e["reason"] == "Unschedulable" and e["type"] == "Warning" for e in events), events

    node = control_plane.add_t4_nodes(1, kwok_taint=False, gpu_taint=True, labels={"cloud.example/pool": pool})[0]

    def placed() -> list[str]:
        pods = get_json(control_plane, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={name}")["items"]
        return [p["spec"].get("nodeName", "") for p in pods if p["spec"].get("nodeName")]

    assert wait_for(f"pod scheduled on {node}", placed, timeout=60) == [node]
    wait_for("Ready no longer Unschedulable", lambda: not unschedulable(), timeout=60)
