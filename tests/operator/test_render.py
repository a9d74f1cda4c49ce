"""Golden-file tests of the pure renderer: what the operator would apply, byte for byte."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from flashmodel_operator.model import FlashModel
from flashmodel_operator.reconcile import engine_args
from flashmodel_operator.render import (
    CONFIG_HASH_ANNOTATION,
    PREWARM_GATE,
    engine_config,
    merge_patch,
    render_children,
)

from tests.operator.specs import ALL, CPU_HUB, FULL_T4, MINIMAL_T4

GOLDEN = Path(__file__).parent.parent / "data" / "render"


def _children(body: dict[str, Any]) -> list[dict[str, Any]]:
    return render_children(FlashModel.from_body(body))


@pytest.mark.parametrize("case", sorted(ALL))
def test_render_matches_golden(case: str) -> None:
    rendered = yaml.safe_dump_all(_children(ALL[case]), sort_keys=True, allow_unicode=True)
    golden = GOLDEN / f"{case}.yaml"
    if os.environ.get("UPDATE_GOLDEN") == "1":
        golden.write_text(rendered)
    assert rendered == golden.read_text(), f"render changed; review and rerun with UPDATE_GOLDEN=1: {golden}"


def _by_kind(children: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["kind"]: c for c in children}


def test_t4_pod_requests_one_gpu_on_t4_nodes_with_prewarm_gate() -> None:
    pod = _by_kind(_children(MINIMAL_T4))["Deployment"]["spec"]["template"]["spec"]
    engine = pod["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert engine["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "Tesla-T4"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    assert pod["readinessGates"] == [{"conditionType": PREWARM_GATE}]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert engine["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "health"}
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"])


def test_cpu_profile_requests_no_gpu() -> None:
    pod = _by_kind(_children(CPU_HUB))["Deployment"]["spec"]["template"]["spec"]
    assert "nvidia.com/gpu" not in str(pod)
    assert "nodeSelector" not in pod


def test_user_overrides_merge_over_profile() -> None:
    kinds = _by_kind(_children(FULL_T4))
    pod = kinds["Deployment"]["spec"]["template"]
    assert pod["spec"]["nodeSelector"] == {"nvidia.com/gpu.product": "Tesla-T4", "cloud.example/pool": "t4-spot"}
    assert pod["spec"]["priorityClassName"] == "inference"
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert {"EXTRA", "POD_IP", "HF_HOME"} <= env
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert CONFIG_HASH_ANNOTATION in pod["metadata"]["annotations"]
    assert kinds["HorizontalPodAutoscaler"]["spec"]["scaleTargetRef"]["kind"] == "FlashModel"
    metrics = kinds["HorizontalPodAutoscaler"]["spec"]["metrics"]
    assert [m["pods"]["target"]["averageValue"] for m in metrics] == ["8", "800m"]


def test_no_hpa_without_autoscaling() -> None:
    assert "HorizontalPodAutoscaler" not in _by_kind(_children(MINIMAL_T4))


def test_spec_change_changes_pod_template_hash_and_scale_does_not() -> None:
    def template_hash(body: dict[str, Any]) -> str:
        dep = _by_kind(_children(body))["Deployment"]
        return str(dep["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])

    base = template_hash(MINIMAL_T4)
    edited = {**MINIMAL_T4, "spec": {**MINIMAL_T4["spec"], "engine": {"maxModelLen": 2048}}}
    scaled = {**MINIMAL_T4, "spec": {**MINIMAL_T4["spec"], "replicas": 3}}
    assert template_hash(edited) != base
    assert template_hash(scaled) == base


def test_engine_config_carries_auth_file_and_model_path() -> None:
    config = engine_config(FlashModel.from_body(FULL_T4))
    assert config["model"] == {"path": "/model-image/weights", "servedName": "qwen"}
    assert config["auth"] == {"apiKeyFile": "/etc/flashmodel/auth/api-key"}
    # The profile, not the spec, decides the block size: the launcher's own function says 16.
    assert "blockSize" not in config["engine"]
    args = engine_args(config)
    assert args[args.index("--block-size") + 1] == "16" and args[args.index("--dtype") + 1] == "float16"


def test_merge_patch_merges_named_lists_and_deletes_nulls() -> None:
    base = {"a": {"b": 1, "c": 2}, "containers": [{"name": "x", "image": "1"}], "args": ["p"]}
    patch = {"a": {"c": None}, "containers": [{"name": "x", "image": "2"}, {"name": "y"}], "args": ["q"]}
    assert merge_patch(base, patch) == {
        "a": {"b": 1},
        "containers": [{"name": "x", "image": "2"}, {"name": "y"}],
        "args": ["q"],
    }


def test_two_sources_are_refused() -> None:
    bad = {**MINIMAL_T4, "spec": {"model": {"pvc": {"claimName": "m"}, "hub": {"id": "x"}}}}
    with pytest.raises(ValueError, match="exactly one of pvc, image, hub"):
        FlashModel.from_body(bad)


def test_compile_caches_live_on_the_pods_empty_dir() -> None:
    """A restarted container must find vLLM's torch.compile, Inductor's and Triton's caches: they
    are on the `cache` emptyDir, which lives as long as the pod, not in the container's filesystem."""
    pod = _by_kind(_children(MINIMAL_T4))["Deployment"]["spec"]["template"]["spec"]
    env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
    mount = next(m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "cache")
    assert next(v for v in pod["volumes"] if v["name"] == "cache") == {"name": "cache", "emptyDir": {}}
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert str(env[name]).startswith(mount + "/"), name
