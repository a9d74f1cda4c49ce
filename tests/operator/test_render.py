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
    pod_template_problems,
    render_children,
    render_pod_template,
    strategic_merge,
)

from tests.operator.specs import ALL, CPU_HUB, FULL_T4, GATED_HUB_T4, MINIMAL_T4

GOLDEN = Path(__file__).parent.parent / "data" / "render"


PROMETHEUS = "http://prometheus-operated.monitoring.svc:9090"


def _children(body: dict[str, Any]) -> list[dict[str, Any]]:
    return render_children(FlashModel.from_body(body), prometheus=PROMETHEUS)


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
    env = {e["name"] for e in pod["spec"]["containers"][0]["env"]}
    assert {"EXTRA", "POD_IP", "HF_HOME"} <= env
    assert pod["metadata"]["annotations"]["prometheus.io/scrape"] == "true"
    assert CONFIG_HASH_ANNOTATION in pod["metadata"]["annotations"]
    assert kinds["ScaledObject"]["spec"]["scaleTargetRef"]["kind"] == "FlashModel"
    assert [t["metadata"]["threshold"] for t in kinds["ScaledObject"]["spec"]["triggers"]] == ["8", "0.8"]


def test_no_autoscaler_without_autoscaling() -> None:
    kinds = _by_kind(_children(MINIMAL_T4))
    assert "HorizontalPodAutoscaler" not in kinds and "ScaledObject" not in kinds


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
    assert config["model"] == {"path": "/model-image/weights", "servedName": "qwen", "quantization": "awq"}
    assert config["auth"] == {"apiKeyFile": "/etc/flashmodel/auth/api-key"}
    # The profile, not the spec, decides the block size: the launcher's own function says 16.
    assert "blockSize" not in config["engine"]
    args = engine_args(config)
    assert args[args.index("--block-size") + 1] == "16" and args[args.index("--dtype") + 1] == "float16"
    # An explicit method is an enforced flag, after the extra args (status.engineArgs shows it).
    assert args[0] == "--enable-prefix-caching" and args[-2:] == ["--quantization", "awq"]


def test_quantization_auto_is_left_out_of_the_engine_config() -> None:
    # auto is the engine's default: writing it would change every existing model's config hash and
    # restart its pods when the operator is upgraded.
    config = engine_config(FlashModel.from_body(MINIMAL_T4))
    assert "quantization" not in config["model"]
    assert "--quantization" not in engine_args(config)


def test_strategic_merge_follows_each_lists_merge_key() -> None:
    base = {
        "metadata": {"labels": {"a": "1"}},
        "spec": {
            "containers": [{"name": "engine", "image": "1", "args": ["p"],
                            "env": [{"name": "A", "value": "1"}],
                            "volumeMounts": [{"name": "model", "mountPath": "/models"}],
                            "ports": [{"name": "http", "containerPort": 8000}]}],
            "tolerations": [{"key": "gpu"}],
        },
    }
    patch = {
        "metadata": {"labels": {"a": None}},
        "spec": {
            "containers": [{"name": "engine", "image": "2", "args": ["q"],
                            "env": [{"name": "B", "value": "2"}, {"name": "A", "$patch": "delete"}],
                            # volumeMounts merge on mountPath, not name: this one replaces the mount at /models
                            "volumeMounts": [{"name": "other", "mountPath": "/models"},
                                             {"name": "model", "mountPath": "/extra"}],
                            "ports": [{"name": "metrics", "containerPort": 9000}]},
                           {"name": "sidecar"}],
            "tolerations": [{"key": "spot"}],
        },
    }
    assert strategic_merge(base, patch) == {
        "metadata": {"labels": {}},
        "spec": {
            "containers": [{"name": "engine", "image": "2", "args": ["q"],
                            "env": [{"name": "B", "value": "2"}],
                            "volumeMounts": [{"name": "other", "mountPath": "/models"},
                                             {"name": "model", "mountPath": "/extra"}],
                            "ports": [{"name": "http", "containerPort": 8000},
                                      {"name": "metrics", "containerPort": 9000}]},
                           {"name": "sidecar"}],
            # tolerations have no merge key in Kubernetes: the patch's list replaces the old one
            "tolerations": [{"key": "spot"}],
        },
    }
    replaced = strategic_merge({"spec": {"volumes": [{"name": "a"}]}},
                               {"spec": {"volumes": [{"$patch": "replace"}, {"name": "b"}]}})
    assert replaced == {"spec": {"volumes": [{"name": "b"}]}}


def _with_patch(patch: dict[str, Any], **spec: Any) -> FlashModel:
    return FlashModel.from_body({**FULL_T4, "spec": {**FULL_T4["spec"], "podTemplatePatch": patch, **spec}})


def _engine(template: dict[str, Any]) -> dict[str, Any]:
    engine: dict[str, Any] = next(c for c in template["spec"]["containers"] if c["name"] == "engine")
    return engine


# (patch, what the refusal names): each seen, or possible, with the home-made merge.
ENFORCED_PATCHES: list[tuple[dict[str, Any], str]] = [
    ({"spec": {"containers": [{"name": "engine", "command": ["sh", "-c", "vllm serve --max-model-len 9999"]}]}},
     "changes the engine container's command"),
    ({"spec": {"containers": [{"name": "engine", "args": ["--max-model-len", "9999"]}]}},
     "changes the engine container's args"),
    ({"spec": {"readinessGates": []}}, "drops the readiness gate serving.flashmodel.io/prewarmed"),
    ({"spec": {"readinessGates": None}}, "drops the readiness gate serving.flashmodel.io/prewarmed"),
    ({"spec": {"containers": [{"name": "engine", "ports": [{"name": "health", "containerPort": 9999}]}]}},
     "changes the engine container's port health (8081)"),
    ({"spec": {"containers": [{"name": "engine", "ports": [{"$patch": "replace"}]}]}},
     "changes the engine container's port http (8000)"),
    ({"spec": {"containers": [{"name": "engine", "volumeMounts": [{"name": "mine", "mountPath": "/model-image"}]}]}},
     "changes the engine container's mount at /model-image"),
    ({"spec": {"containers": [{"name": "engine", "readinessProbe": {"tcpSocket": {"port": 8000}}}]}},
     "changes the engine container's readinessProbe"),
    ({"spec": {"containers": [{"name": "engine", "$patch": "delete"}]}}, "removes the engine container"),
    # A preStop that kills at once would drop a scale-down's in-flight requests.
    ({"spec": {"containers": [{"name": "engine", "lifecycle": {"preStop": {"exec": {"command": ["kill", "1"]}}}}]}},
     "changes the engine container's lifecycle"),
    ({"spec": {"containers": [{"name": "engine", "resources": {"limits": {"nvidia.com/gpu": 0}}}]}},
     "changes the engine container's limits[nvidia.com/gpu]"),
    ({"spec": {"nodeSelector": {"nvidia.com/gpu.product": "A100"}}}, "changes nodeSelector[nvidia.com/gpu.product]"),
    ({"spec": {"volumes": [{"name": "config", "emptyDir": {}}]}}, "changes the volume config"),
    ({"metadata": {"labels": {"app.kubernetes.io/instance": "x"}}}, "changes the pod label app.kubernetes.io/instance"),
    ({"spec": {"$retainKeys": ["containers"]}}, "the directive $retainKeys is not supported"),
    ({"spec": {"containers": [{"name": "engine", "env": [{"name": "HF_TOKEN", "value": "hf_mine"}]}]}},
     "changes the engine container's env HF_TOKEN"),
    ({"spec": {"containers": [{"name": "engine", "env": [{"name": "HF_HOME", "value": "/tmp/hf"}]}]}},
     "changes the engine container's env HF_HOME"),
    ({"spec": {"containers": [{"name": "engine", "env": [{"name": "HF_HOME", "$patch": "delete"}]}]}},
     "changes the engine container's env HF_HOME"),
    ({"spec": {"containers": [{"name": "engine", "env": [{"name": "HF_HUB_CACHE", "value": "/tmp/hub"}]}]}},
     "set spec.model.hub.cache instead"),
    ({"spec": {"automountServiceAccountToken": True}}, "mounts a service-account token"),
    ({"spec": {"automountServiceAccountToken": None}}, "mounts a service-account token"),
    ({"spec": {"serviceAccountName": "cluster-admin-sa"}}, "sets serviceAccountName"),
    ({"spec": {"serviceAccount": "cluster-admin-sa"}}, "sets serviceAccount"),
]


@pytest.mark.parametrize(("patch", "problem"), ENFORCED_PATCHES, ids=[p[1] for p in ENFORCED_PATCHES])
def test_a_patch_cannot_change_the_enforced_pod(patch: dict[str, Any], problem: str) -> None:
    fm = _with_patch(patch)
    problems = pod_template_problems(fm)
    assert any(problem in p for p in problems), problems
    # Whatever the patch said, the rendered pod holds what the operator and the engine rely on.
    template, clean = render_pod_template(fm), render_pod_template(_with_patch({}))
    engine, want = _engine(template), _engine(clean)
    for field in ("command", "startupProbe", "livenessProbe", "readinessProbe"):
        assert engine[field] == want[field]
    assert "args" not in engine
    assert [p for p in engine["ports"] if p in want["ports"]] == want["ports"]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert {"conditionType": PREWARM_GATE} in template["spec"]["readinessGates"]
    assert template["spec"]["nodeSelector"]["nvidia.com/gpu.product"] == "Tesla-T4"
    assert template["spec"]["automountServiceAccountToken"] is False
    assert "serviceAccountName" not in template["spec"] and "serviceAccount" not in template["spec"]
    paths = [m["mountPath"] for m in engine["volumeMounts"]]
    assert len(paths) == len(set(paths))
    assert all(m in engine["volumeMounts"] for m in want["volumeMounts"])


def test_a_patch_that_adds_beside_the_enforced_pod_is_accepted() -> None:
    # No priority class (none is allowed by default) and no extra engine port (the engine listens on its
    # two): tests/operator/test_pod_policy.py holds the whole allow-list.
    patch = {"spec": {"tolerations": [{"key": "spot", "operator": "Exists"}],
                      "containers": [{"name": "engine", "env": [{"name": "EXTRA", "value": "1"}],
                                      "volumeMounts": [{"name": "extra", "mountPath": "/extra"}]},
                                     {"name": "sidecar", "image": "busybox"}],
                      "volumes": [{"name": "extra", "emptyDir": {}}]}}
    fm = _with_patch(patch)
    assert pod_template_problems(fm) == []
    template = render_pod_template(fm)
    engine = _engine(template)
    assert [p["containerPort"] for p in engine["ports"]] == [8000, 8081]
    assert [m["mountPath"] for m in engine["volumeMounts"]].count("/extra") == 1
    # tolerations are replaced by the patch, and the profile's GPU toleration is put back
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in template["spec"]["tolerations"]
    assert {"key": "spot", "operator": "Exists"} in template["spec"]["tolerations"]


def test_resources_and_node_selector_cannot_undo_the_t4_profile() -> None:
    fm = _with_patch({}, resources={"limits": {"nvidia.com/gpu": 0}},
                     nodeSelector={"nvidia.com/gpu.product": "NVIDIA-A100", "pool": "x"})
    problems = pod_template_problems(fm)
    assert any("spec.resources.limits[nvidia.com/gpu] is 0; the t4 profile runs each engine on exactly 1" in p
               for p in problems), problems
    assert any("spec.nodeSelector[nvidia.com/gpu.product] is 'NVIDIA-A100'" in p for p in problems), problems
    pod = render_pod_template(fm)["spec"]
    assert _engine({"spec": pod})["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "Tesla-T4", "pool": "x"}


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


def _gated_pod() -> dict[str, Any]:
    pod: dict[str, Any] = _by_kind(_children(GATED_HUB_T4))["Deployment"]["spec"]["template"]["spec"]
    return pod


def test_hub_revision_pins_weights_and_code_on_the_command_line() -> None:
    fm = FlashModel.from_body(GATED_HUB_T4)
    args = engine_args(engine_config(fm))
    revision = "9213176726f574b556790deb65791e0c5aa438b6"
    assert args[args.index("--revision") + 1] == revision
    assert args[args.index("--code-revision") + 1] == revision
    # main is what vLLM fetches without the flag: no flag, and no change to existing models' config hash.
    assert "--revision" not in engine_args(engine_config(FlashModel.from_body(CPU_HUB)))
    assert "revision" not in engine_config(FlashModel.from_body(CPU_HUB))["model"]


def test_hub_token_comes_from_the_secret_and_nowhere_else() -> None:
    pod = _gated_pod()
    env = {e["name"]: e for e in pod["containers"][0]["env"]}
    assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}
    configmap = _by_kind(_children(GATED_HUB_T4))["ConfigMap"]
    assert "hf-token" not in str(configmap) and "token" not in yaml.safe_load(configmap["data"]["engine.yaml"])["model"]
    assert "HF_TOKEN" not in {e["name"] for e in _by_kind(_children(CPU_HUB))["Deployment"]["spec"]["template"]
                              ["spec"]["containers"][0]["env"]}


def test_a_patch_cannot_point_the_hub_token_elsewhere() -> None:
    patch = {"spec": {"containers": [{"name": "engine", "env": [
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "someone-elses", "key": "token"}}}]}]}}
    fm = FlashModel.from_body({**GATED_HUB_T4, "spec": {**GATED_HUB_T4["spec"], "podTemplatePatch": patch}})
    assert any("env HF_TOKEN" in p and "spec.model.hub.tokenSecretRef" in p for p in pod_template_problems(fm))
    env = [e for e in _engine(render_pod_template(fm))["env"] if e["name"] == "HF_TOKEN"]
    assert env == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]


def test_hub_cache_claim_is_mounted_at_hf_home_and_compile_caches_stay_in_the_pod() -> None:
    pod = _gated_pod()
    engine = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in engine["env"]}
    assert {"name": "hub-cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]
    assert {"name": "hub-cache", "mountPath": env["HF_HOME"]} in engine["volumeMounts"]
    assert next(v for v in pod["volumes"] if v["name"] == "cache") == {"name": "cache", "emptyDir": {}}
    for name in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
        assert not str(env[name]).startswith(str(env["HF_HOME"])), name
    # Without spec.model.hub.cache, nothing changes: the emptyDir holds the downloads.
    cpu = _by_kind(_children(CPU_HUB))["Deployment"]["spec"]["template"]["spec"]
    assert "hub-cache" not in {v["name"] for v in cpu["volumes"]}
    patch = {"spec": {"volumes": [{"name": "hub-cache", "emptyDir": {}}]}}
    fm = FlashModel.from_body({**GATED_HUB_T4, "spec": {**GATED_HUB_T4["spec"], "podTemplatePatch": patch}})
    assert any("changes the volume hub-cache" in p for p in pod_template_problems(fm))


def test_tracing_endpoint_reaches_the_engine_config_and_command_line() -> None:
    config = engine_config(FlashModel.from_body(GATED_HUB_T4))
    assert config["observability"] == {"otlpTracesEndpoint": "http://otel-collector.monitoring:4317",
                                       "otlpTracesProtocol": "grpc"}
    args = engine_args(config)
    assert args[args.index("--otlp-traces-endpoint") + 1] == "http://otel-collector.monitoring:4317"
    assert "observability" not in engine_config(FlashModel.from_body(MINIMAL_T4))


@pytest.mark.parametrize("section", ["engine", "prewarm", "health", "remediation"])
@pytest.mark.parametrize("case", sorted(ALL))
def test_a_spec_field_added_with_a_default_rolls_no_pod(case: str, section: str) -> None:
    """The operator's next version may add a defaulted field; existing pods must keep their template."""
    from pydantic import Field, create_model

    fm = FlashModel.from_body(ALL[case])
    current = getattr(fm.spec, section)
    grown_model = create_model(  # the section as a release with one more field would have it
        f"Grown{type(current).__name__}", __base__=type(current),
        new_setting=(int, Field(default=7, ge=0, description="A setting added after these pods started.")),
    )
    grown = grown_model.model_validate(current.model_dump(by_alias=True, exclude_unset=True))
    later = fm.model_copy(update={"spec": fm.spec.model_copy(update={section: grown})})
    assert render_pod_template(later) == render_pod_template(fm)
    assert engine_config(later) == engine_config(fm)

    # Set to anything but its default, the new field reaches the engine and rolls the pods.
    changed = fm.model_copy(update={"spec": fm.spec.model_copy(update={section: grown.model_copy(
        update={"new_setting": 8})})})
    assert engine_config(changed)[section]["newSetting"] == 8
    annotations = render_pod_template(changed)["metadata"]["annotations"]
    assert annotations[CONFIG_HASH_ANNOTATION] != render_pod_template(fm)["metadata"]["annotations"][
        CONFIG_HASH_ANNOTATION]


def test_prefix_caching_reaches_the_engine_config_and_command_line_only_when_set() -> None:
    fm = FlashModel.from_body({**MINIMAL_T4, "spec": {**MINIMAL_T4["spec"], "engine": {"enablePrefixCaching": False}}})
    config = engine_config(fm)
    assert config["engine"]["enablePrefixCaching"] is False
    assert "--no-enable-prefix-caching" in engine_args(config)
    assert "enablePrefixCaching" not in engine_config(FlashModel.from_body(MINIMAL_T4))["engine"]
