"""extraArgs off the allow-list against the real API server: the CRD admits them, the operator holds them Degraded."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from flashmodel_operator import extra_args_policy
from flashmodel_operator.apply import Cluster
from flashmodel_operator.reconcile import reconcile

from e2e.harness.cluster import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
SPEC: dict[str, Any] = {"model": {"pvc": {"claimName": "models", "path": "qwen"}}}


@pytest.fixture
def extension() -> Iterator[None]:
    extra_args_policy.use(("--generation-config",))
    yield
    extra_args_policy.use(())


def _create(cp: ControlPlane, namespace: str, name: str, extra_args: list[str]) -> dict[str, Any]:
    doc = {
        "apiVersion": "serving.flashmodel.io/v1alpha1",
        "kind": "FlashModel",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {**SPEC, "engine": {"extraArgs": extra_args}},
    }
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    body: dict[str, Any] = json.loads(cp.kubectl("get", "flashmodel", name, "-n", namespace, "-o", "json").stdout)
    return body


def _degraded(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    body = json.loads(cp.kubectl("get", "flashmodel", name, "-n", namespace, "-o", "json").stdout)
    degraded: dict[str, Any] = {c["type"]: c for c in body["status"]["conditions"]}["Degraded"]
    return degraded


def test_a_flag_off_the_allow_list_is_degraded_with_how_to_ask_and_no_deployment(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster
) -> None:
    # The CRD cannot know the cluster's extension, so it admits the flag; the operator refuses it.
    body = _create(control_plane, k8s_namespace, "gen", ["--seed", "1", "--generation-config", "vllm"])
    outcome = reconcile(cluster, body)
    assert outcome.problem is not None and outcome.problem.reason == "EngineConfigRefused", outcome.problem
    assert cluster.get("apps/v1", "Deployment", k8s_namespace, "gen") is None
    degraded = _degraded(control_plane, k8s_namespace, "gen")
    assert degraded["status"] == "True" and degraded["reason"] == "EngineConfigRefused"
    assert "--generation-config is not on the allow-list of vLLM flags known to be safe" in degraded["message"]
    assert "ask the cluster admin to add it to the chart's engineExtraArgs.allowed" in degraded["message"]


def test_the_admins_extension_lets_the_model_run_and_the_engine_hears_of_it(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster, extension: None
) -> None:
    body = _create(control_plane, k8s_namespace, "gen-ok", ["--generation-config=vllm", "--seed", "1"])
    outcome = reconcile(cluster, body)
    assert outcome.problem is None, outcome.problem
    assert cluster.get("apps/v1", "Deployment", k8s_namespace, "gen-ok") is not None
    configmap = cluster.get("v1", "ConfigMap", k8s_namespace, "gen-ok-engine")
    assert configmap is not None
    assert yaml.safe_load(configmap["data"]["engine.yaml"])["engine"]["extraArgsAllowed"] == ["--generation-config"]


@pytest.mark.parametrize("extra_args", [["--model-impl", "transformers"], ["--enable-sleep-mode"]],
                         ids=["model-impl", "sleep-mode"])
def test_a_flag_the_extension_does_not_name_stays_refused(
    control_plane: ControlPlane, k8s_namespace: str, cluster: Cluster, extension: None, extra_args: list[str]
) -> None:
    outcome = reconcile(cluster, _create(control_plane, k8s_namespace, "other", extra_args))
    assert outcome.problem is not None and outcome.problem.reason == "EngineConfigRefused"
    assert f"{extra_args[0]} is not on the allow-list" in outcome.problem.message
    assert cluster.get("apps/v1", "Deployment", k8s_namespace, "other") is None
