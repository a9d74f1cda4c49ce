"""reconcile() against the real API server: children, owner references, status, and zero writes when nothing changed."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from flashmodel_engine.contract import PREFLIGHT_EXIT_CODE
from flashmodel_operator import pod_policy
from flashmodel_operator.apply import Cluster
from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.pod_policy import PodPolicy
from flashmodel_operator.reconcile import SECRET_WAIT_REASONS, reconcile, referenced_secrets
from kubernetes.client.exceptions import ApiException

from e2e.harness.cluster import ControlPlane
from tests.operator.pod_attacks import ALLOWED_PRIORITY_CLASS, ATTACKS, CONTROLS
from tests.operator.specs import apply_model, get_model

ROOT = Path(__file__).resolve().parents[2]


SPEC = {"model": {"pvc": {"claimName": "models", "path": "qwen"}}, "replicas": 2}


CPU_SPEC = {
    "model": {"hub": {"id": "/models/tiny"}, "servedName": "tiny"},
    "accelerator": "cpu",
    "engine": {"blockSize": 32, "dtype": "float32", "maxModelLen": 512, "maxNumBatchedTokens": 512},
    "tolerations": [{"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}],
    "podTemplatePatch": {"spec": {"terminationGracePeriodSeconds": 20}},
    "replicas": 2,
}


@pytest.mark.parametrize("spec", [SPEC, CPU_SPEC], ids=["t4-pvc", "cpu-hub-patched"])
def test_first_pass_creates_children_second_pass_writes_nothing(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster, spec: dict[str, Any]
) -> None:
    body = apply_model(control_plane, k8s_namespace, "qwen", spec)
    first = reconcile(cluster, body)
    assert set(first.applied.values()) == {"created"}
    assert sorted(first.applied) == [
        "ConfigMap/qwen-engine",
        "Deployment/qwen",
        "PodDisruptionBudget/qwen",
        "Service/qwen",
    ]
    assert first.status_written

    for kind in ("deployment", "service", "configmap", "poddisruptionbudget"):
        name = "qwen-engine" if kind == "configmap" else "qwen"
        child = json.loads(
            control_plane.kubectl("get", kind, name, "-n", k8s_namespace, "-o", "json", "--show-managed-fields").stdout
        )
        owners = child["metadata"]["ownerReferences"]
        assert owners[0]["uid"] == body["metadata"]["uid"] and owners[0]["controller"] is True
        fields = {m["manager"] for m in child["metadata"]["managedFields"]}
        assert "flashmodel-operator" in fields

    # The API server has now defaulted and stored everything: a pass over unchanged input is free.
    settled = get_model(control_plane, k8s_namespace, "qwen")
    reconcile(cluster, settled)  # may record the Deployment controller's first status
    writes_before = cluster.writes
    again = reconcile(cluster, get_model(control_plane, k8s_namespace, "qwen"))
    assert set(again.applied.values()) == {"unchanged"}
    assert cluster.writes == writes_before, "a no-op reconcile must send no write to the API server"

    status = get_model(control_plane, k8s_namespace, "qwen")["status"]
    assert status["observedGeneration"] == 1
    block = "32" if spec is CPU_SPEC else "16"
    assert status["engineArgs"][status["engineArgs"].index("--block-size") + 1] == block
    assert status["selector"] == "app.kubernetes.io/instance=qwen,app.kubernetes.io/name=flashmodel-engine"
    assert {c["type"] for c in status["conditions"]} == {"Ready", "Available", "Progressing", "Degraded"}
    assert all(c["observedGeneration"] == 1 for c in status["conditions"])


def test_a_new_models_first_pass_writes_its_children_without_reading_them_first(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    # Every read before the Deployment's apply delays the model's first pod; a new model has no
    # children to compare with, so its first pass only writes them (the Deployment's status is in
    # the API server's answer to its apply).
    reads: list[str] = []

    class Counting(Cluster):
        def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
            reads.append(kind)
            return super().get(api_version, kind, namespace, name)

    counting = Counting(cluster.api)
    first = reconcile(counting, apply_model(control_plane, k8s_namespace, "fresh", SPEC))
    assert set(first.applied.values()) == {"created"}
    assert reads == []
    # The next pass compares: nothing to write.
    reads.clear()
    second = reconcile(counting, get_model(control_plane, k8s_namespace, "fresh"))
    assert set(second.applied.values()) == {"unchanged"}
    assert {"ConfigMap", "Service", "PodDisruptionBudget", "Secret"} <= set(reads)


def test_spec_change_updates_only_what_changed(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    body = apply_model(control_plane, k8s_namespace, "edit", SPEC)
    reconcile(cluster, body)
    edited = copy.deepcopy(SPEC)
    edited["engine"] = {"maxModelLen": 2048, "maxNumBatchedTokens": 2048}
    body = apply_model(control_plane, k8s_namespace, "edit", edited)
    assert body["metadata"]["generation"] == 2
    outcome = reconcile(cluster, body)
    assert outcome.applied["ConfigMap/edit-engine"] == "updated"
    assert outcome.applied["Deployment/edit"] == "updated"
    assert outcome.applied["Service/edit"] == "unchanged"
    config = control_plane.kubectl(
        "get", "configmap", "edit-engine", "-n", k8s_namespace, "-o", "jsonpath={.data.engine\\.yaml}"
    ).stdout
    assert yaml.safe_load(config)["engine"]["maxModelLen"] == 2048


def test_drift_in_a_child_is_corrected(control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster) -> None:
    body = apply_model(control_plane, k8s_namespace, "drift", SPEC)
    reconcile(cluster, body)
    control_plane.kubectl("scale", "deployment", "drift", "-n", k8s_namespace, "--replicas=5")
    outcome = reconcile(cluster, get_model(control_plane, k8s_namespace, "drift"))
    assert outcome.applied["Deployment/drift"] == "updated"
    replicas = control_plane.kubectl(
        "get", "deployment", "drift", "-n", k8s_namespace, "-o", "jsonpath={.spec.replicas}"
    ).stdout
    assert replicas == "2"


def test_a_budget_only_where_two_pods_can_serve(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    # One serving pod: a budget would allow every pod unavailable and protect nothing.
    single = reconcile(cluster, apply_model(control_plane, k8s_namespace, "one", {**SPEC, "replicas": 1}))
    assert "PodDisruptionBudget/one" not in single.applied
    assert cluster.get("policy/v1", "PodDisruptionBudget", k8s_namespace, "one") is None
    # An autoscaler that may add a second pod keeps it from the start, not from its first scale-up.
    scaled = {**SPEC, "replicas": 1, "autoscaling": {"minReplicas": 1, "maxReplicas": 2, "scaler": "hpa"}}
    outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, "scaled", scaled))
    assert outcome.applied["PodDisruptionBudget/scaled"] == "created"

    # 2 -> 1 -> 2: the budget goes with the second pod (with an event) and comes back with it.
    reconcile(cluster, apply_model(control_plane, k8s_namespace, "shrink", SPEC))
    assert cluster.get("policy/v1", "PodDisruptionBudget", k8s_namespace, "shrink") is not None
    reconcile(cluster, apply_model(control_plane, k8s_namespace, "shrink", {**SPEC, "replicas": 1}))
    assert cluster.get("policy/v1", "PodDisruptionBudget", k8s_namespace, "shrink") is None
    events = control_plane.kubectl(
        "get", "events", "-n", k8s_namespace, "--field-selector", "involvedObject.name=shrink,reason=Deleted",
        "-o", "jsonpath={.items[*].message}",
    ).stdout
    assert "deleted PodDisruptionBudget shrink" in events
    # The next pass finds none and deletes nothing.
    again = reconcile(cluster, get_model(control_plane, k8s_namespace, "shrink"))
    assert "PodDisruptionBudget/shrink" not in again.applied
    assert cluster.get("policy/v1", "PodDisruptionBudget", k8s_namespace, "shrink") is None
    outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, "shrink", SPEC))
    assert outcome.applied["PodDisruptionBudget/shrink"] == "created"

    # A budget of the same name that the model does not own is someone else's: left alone.
    theirs = {
        "apiVersion": "policy/v1", "kind": "PodDisruptionBudget",
        "metadata": {"name": "one", "namespace": k8s_namespace},
        "spec": {"minAvailable": 1, "selector": {"matchLabels": {"app": "theirs"}}},
    }
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(theirs))
    reconcile(cluster, get_model(control_plane, k8s_namespace, "one"))
    assert cluster.get("policy/v1", "PodDisruptionBudget", k8s_namespace, "one") is not None


def test_missing_auth_secret_is_degraded_with_what_to_do(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    spec = {**SPEC, "auth": {"apiKeySecretRef": {"name": "keys"}}}
    outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, "auth", spec))
    assert outcome.problem is not None and outcome.problem.reason == "AuthSecretNotFound"
    conditions = get_model(control_plane, k8s_namespace, "auth")["status"]["conditions"]
    degraded = {c["type"]: c for c in conditions}["Degraded"]
    assert degraded["status"] == "True"
    assert f"Secret {k8s_namespace}/keys" in degraded["message"] and "create it" in degraded["message"]
    events = control_plane.kubectl(
        "get",
        "events",
        "-n",
        k8s_namespace,
        "--field-selector",
        "involvedObject.name=auth,reason=AuthSecretNotFound",
        "-o",
        "name",
    ).stdout
    assert events.strip(), "a Degraded transition must be recorded as an event"
    # No pod may start without its key: it would crash on the missing mount, or serve unauthenticated.
    assert "Deployment/auth" not in outcome.applied
    assert cluster.get("apps/v1", "Deployment", k8s_namespace, "auth") is None

    control_plane.kubectl("create", "secret", "generic", "keys", "-n", k8s_namespace, "--from-literal=api-key=s3cret")
    outcome = reconcile(cluster, get_model(control_plane, k8s_namespace, "auth"))
    assert outcome.problem is None
    assert outcome.applied["Deployment/auth"] == "created"


def test_missing_hub_token_secret_holds_the_pods_and_says_what_to_do(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    spec = {"model": {"hub": {"id": "meta-llama/Llama-3.2-1B-Instruct", "tokenSecretRef": {"name": "hf"}}}}
    outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, "gated", spec))
    assert outcome.problem is not None and outcome.problem.reason == "HubTokenSecretNotFound"
    conditions = get_model(control_plane, k8s_namespace, "gated")["status"]["conditions"]
    degraded = {c["type"]: c for c in conditions}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "HubTokenSecretNotFound"
    assert f"spec.model.hub.tokenSecretRef: Secret {k8s_namespace}/hf with key 'token' not found" in degraded["message"]
    assert "create it" in degraded["message"]
    # A pod without its token would fail the gated download and crash-loop.
    assert cluster.get("apps/v1", "Deployment", k8s_namespace, "gated") is None

    control_plane.kubectl("create", "secret", "generic", "hf", "-n", k8s_namespace, "--from-literal=token=hf_x")
    outcome = reconcile(cluster, get_model(control_plane, k8s_namespace, "gated"))
    assert outcome.problem is None
    deployment = cluster.get("apps/v1", "Deployment", k8s_namespace, "gated") or {}
    env = deployment["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in env
    assert "hf_x" not in json.dumps(deployment)


@pytest.mark.parametrize(
    ("extra", "reason", "message"),
    [
        (
            {"podTemplatePatch": {"spec": {"containers": [{"name": "engine", "command": ["sleep", "inf"]}]}}},
            "PodTemplateRefused",
            "spec.podTemplatePatch changes the engine container's command",
        ),
        (
            {"podTemplatePatch": {"spec": {"readinessGates": []}}},
            "PodTemplateRefused",
            "spec.podTemplatePatch drops the readiness gate serving.flashmodel.io/prewarmed",
        ),
        (
            {"resources": {"limits": {"nvidia.com/gpu": 0}}},
            "PodTemplateRefused",
            "spec.resources.limits[nvidia.com/gpu] is 0; the t4 profile runs each engine on exactly 1",
        ),
        (
            # CEL cannot tell a flag's value from a stray positional; the operator resolves them as vLLM does.
            {"engine": {"extraArgs": ["--seed", "1", "/other/model"]}},
            "EngineConfigRefused",
            "engine.extraArgs[2] '/other/model' is not the value of a flag before it",
        ),
    ],
    ids=["command", "readiness-gate", "gpu-0", "stray-positional"],
)
def test_a_spec_that_undoes_the_enforced_pod_is_refused_and_no_pod_made(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster, extra: dict[str, Any], reason: str, message: str
) -> None:
    outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, "undo", {**SPEC, **extra}))
    assert outcome.problem is not None and outcome.problem.reason == reason, outcome.problem
    assert message in outcome.problem.message
    assert cluster.get("apps/v1", "Deployment", k8s_namespace, "undo") is None
    conditions = get_model(control_plane, k8s_namespace, "undo")["status"]["conditions"]
    degraded = {c["type"]: c for c in conditions}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == reason


@pytest.fixture
def priority_classes() -> Iterator[None]:
    pod_policy.use(PodPolicy(allowed_priority_classes=(ALLOWED_PRIORITY_CLASS,)))
    yield
    pod_policy.use(PodPolicy())


# One namespace for the whole table: a namespace per row costs the control plane seconds each.
@pytest.mark.usefixtures("priority_classes")
def test_every_pod_attack_is_degraded_with_the_reason_and_gets_no_deployment(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    wrong = {}
    for n, (row, (extra, says)) in enumerate(ATTACKS.items()):
        # The API server stores each of these FlashModels (the patch is free-form); the operator refuses them.
        name = f"attack-{n}"
        outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, name, {**SPEC, **extra}))
        conditions = get_model(control_plane, k8s_namespace, name)["status"]["conditions"]
        degraded = {c["type"]: c for c in conditions}["Degraded"]
        if not (outcome.problem is not None and outcome.problem.reason == "PodTemplateRefused"
                and degraded["status"] == "True" and degraded["reason"] == "PodTemplateRefused"
                and says in degraded["message"]
                and cluster.get("apps/v1", "Deployment", k8s_namespace, name) is None):
            wrong[row] = (outcome.problem, degraded)
    assert wrong == {}


@pytest.mark.usefixtures("priority_classes")
def test_an_ordinary_patch_gets_its_deployment_with_the_engine_intact(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    for n, (row, extra) in enumerate(CONTROLS.items()):
        name = f"control-{n}"
        outcome = reconcile(cluster, apply_model(control_plane, k8s_namespace, name, {**SPEC, **extra}))
        assert outcome.problem is None, (row, outcome.problem)
        assert outcome.applied[f"Deployment/{name}"] == "created", row
        deployment = cluster.get("apps/v1", "Deployment", k8s_namespace, name) or {}
        pod = deployment["spec"]["template"]["spec"]
        engine = next(c for c in pod["containers"] if c["name"] == "engine")
        assert engine["command"][:3] == ["python", "-m", "flashmodel_engine"], row
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1", row
        assert engine["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsNonRoot"], row


def test_a_child_the_api_server_refuses_is_degraded_not_silent(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    # A real refusal: a quota that allows no Service in this namespace.
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-services"},
        "spec": {"hard": {"services": "0"}},
    }
    control_plane.kubectl("apply", "-n", k8s_namespace, "-f", "-", input=yaml.safe_dump(quota))
    body = apply_model(control_plane, k8s_namespace, "refused", SPEC)
    with pytest.raises(ApiException) as refused:
        reconcile(cluster, body)
    assert refused.value.status == 403
    status = get_model(control_plane, k8s_namespace, "refused")["status"]
    conditions = {c["type"]: c for c in status["conditions"]}
    assert conditions["Degraded"]["status"] == "True" and conditions["Degraded"]["reason"] == "ApplyFailed"
    assert "Service refused" in conditions["Degraded"]["message"] and "quota" in conditions["Degraded"]["message"]
    assert conditions["Ready"]["status"] == "False"

    control_plane.kubectl("delete", "resourcequota", "no-services", "-n", k8s_namespace)
    outcome = reconcile(cluster, get_model(control_plane, k8s_namespace, "refused"))
    assert outcome.problem is None
    conditions = {c["type"]: c for c in get_model(control_plane, k8s_namespace, "refused")["status"]["conditions"]}
    assert conditions["Degraded"]["status"] == "False"


def test_preflight_refusal_holds_at_zero_instead_of_crash_looping(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    # kwok leaves the status of pods carrying this annotation to the test, which plays the
    # kubelet reporting the launcher's exit code and termination message.
    spec = {
        **SPEC,
        "replicas": 1,
        "podTemplatePatch": {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}},
    }
    reconcile(cluster, apply_model(control_plane, k8s_namespace, "refused", spec))
    pod = _wait_for_pod(control_plane, k8s_namespace, "refused")
    message = "preflight: head size 40 is not a multiple of 16 on t4; pick a model whose head size is"
    status = {
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "engine",
                    "image": "engine",
                    "imageID": "",
                    "ready": False,
                    "restartCount": 1,
                    "started": False,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {"exitCode": PREFLIGHT_EXIT_CODE, "reason": "Error", "message": message}
                    },
                }
            ],
        }
    }
    control_plane.kubectl(
        "patch", "pod", pod, "-n", k8s_namespace, "--subresource=status", "--type=merge", "-p", json.dumps(status)
    )
    outcome = reconcile(cluster, get_model(control_plane, k8s_namespace, "refused"))
    assert outcome.problem is not None and outcome.problem.reason == "PreflightFailed"
    assert message in outcome.problem.message
    replicas = control_plane.kubectl(
        "get", "deployment", "refused", "-n", k8s_namespace, "-o", "jsonpath={.spec.replicas}"
    ).stdout
    assert replicas == "0"
    # Held across passes (the pod is gone now) until the spec or the retry annotation changes.
    assert reconcile(cluster, get_model(control_plane, k8s_namespace, "refused")).problem is not None
    control_plane.kubectl("annotate", "flashmodel", "refused", "-n", k8s_namespace, "serving.flashmodel.io/retry=1")
    assert reconcile(cluster, get_model(control_plane, k8s_namespace, "refused")).problem is None
    replicas = control_plane.kubectl(
        "get", "deployment", "refused", "-n", k8s_namespace, "-o", "jsonpath={.spec.replicas}"
    ).stdout
    assert replicas == "1"


def _wait_for_pod(cp: ControlPlane, namespace: str, model: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        names = cp.kubectl(
            "get",
            "pods",
            "-n",
            namespace,
            "-l",
            f"serving.flashmodel.io/model={model}",
            "-o",
            "jsonpath={.items[*].metadata.name}",
        ).stdout.split()
        if names:
            return names[0]
        time.sleep(0.5)
    raise AssertionError(f"no pod of {namespace}/{model} appeared within {timeout}s")


def test_the_secret_wait_looks_for_every_secret_the_pods_read() -> None:
    # The 2 s timer (handlers.wait_for_secret) runs on these reasons and GETs exactly these Secrets.
    spec = FlashModelSpec.model_validate({"model": {"hub": {"id": "org/gated", "tokenSecretRef": {"name": "hf"}}},
                                          "auth": {"apiKeySecretRef": {"name": "keys", "key": "k"}}})
    refs = referenced_secrets(spec)
    assert sorted((r.name, r.key) for r in refs) == [("hf", "token"), ("keys", "k")]
    assert {r.reason for r in refs} == set(SECRET_WAIT_REASONS)
    assert referenced_secrets(FlashModelSpec.model_validate({"model": {"hub": {"id": "org/public"}}})) == []
