"""The operator chart: helm lint/template, rendered RBAC and Deployment, the strict values schema."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "flashmodel-operator"
KUBE_VERSION = "1.34.3"

# helm lint and template need the testbin's helm, so these run in the control-plane tier.
pytestmark = pytest.mark.usefixtures("testbin")


def _find_helm() -> str | None:
    """The control-plane build's helm (FLASHMODEL_TESTBIN, then the cache), else one on PATH."""
    override = os.environ.get("FLASHMODEL_TESTBIN")
    if override and os.access(Path(override) / "helm", os.X_OK):
        return str(Path(override) / "helm")
    cache = Path(os.environ.get("FLASHMODEL_CACHE", "~/.cache/flashmodel")).expanduser()
    for candidate in sorted(cache.glob("testbin/*/helm"), reverse=True):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return shutil.which("helm")


@functools.cache
def helm_binary() -> str:
    found = _find_helm()
    if found is not None:
        return found
    if os.environ.get("FLASHMODEL_SKIP_E2E") == "1":
        pytest.skip("no helm binary and FLASHMODEL_SKIP_E2E=1: the testbin is not built")
    # A fresh machine: build the testbin (helm comes with it), as the control-plane fixture would.
    from e2e.harness.cluster import testbin_dir

    return str(testbin_dir(build=True) / "helm")


def helm(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # Keep helm's cache and config out of the user's home.
    env = {
        **os.environ,
        "HELM_CACHE_HOME": "/tmp/flashmodel-helm/cache",
        "HELM_CONFIG_HOME": "/tmp/flashmodel-helm/cfg",
    }
    proc = subprocess.run([helm_binary(), *args], capture_output=True, text=True, env=env, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"helm {' '.join(args)} failed rc={proc.returncode}\n{proc.stderr}")
    return proc


def render(*sets: str, namespace: str = "flashmodel-system") -> list[dict[str, Any]]:
    args = ["template", "fm", str(CHART), "--namespace", namespace, "--kube-version", KUBE_VERSION]
    for s in sets:
        args += ["--set", s]
    return [d for d in yaml.safe_load_all(helm(*args).stdout) if d]


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in by_kind(docs, kind) if name is None or d["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def grants(role: dict[str, Any]) -> dict[tuple[str, str], set[str]]:
    """(apiGroup, resource) -> verbs, over every rule of a (Cluster)Role."""
    out: dict[tuple[str, str], set[str]] = {}
    for rule in role["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out.setdefault((group, resource), set()).update(rule["verbs"])
    return out


def container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    assert [c["name"] for c in pod["containers"]] == ["operator"]
    c: dict[str, Any] = pod["containers"][0]
    return c


CHILD_VERBS = {"get", "list", "watch", "create", "patch", "delete"}
# What the operator (operator/flashmodel_operator) and kopf call, per namespace.
NAMESPACED_GRANTS: dict[tuple[str, str], set[str]] = {
    ("serving.flashmodel.io", "flashmodels"): {"get", "list", "watch", "patch", "update"},
    ("serving.flashmodel.io", "flashmodels/status"): {"get", "list", "watch", "patch", "update"},
    ("", "configmaps"): CHILD_VERBS,
    ("", "services"): CHILD_VERBS,
    ("apps", "deployments"): CHILD_VERBS,
    ("policy", "poddisruptionbudgets"): CHILD_VERBS,
    # networkPolicy.enabled: applied and, once turned off, read and deleted; never listed or watched.
    ("networking.k8s.io", "networkpolicies"): {"get", "create", "patch", "delete"},
    # spec.routing: the pool (the picker's Role grants its reads, which the operator must hold), the
    # route, the picker's account and RBAC; GIE's optional kinds are only granted on.
    ("inference.networking.k8s.io", "inferencepools"): CHILD_VERBS,
    ("inference.networking.x-k8s.io", "inferenceobjectives"): {"get", "list", "watch"},
    ("inference.networking.x-k8s.io", "inferencemodelrewrites"): {"get", "list", "watch"},
    ("gateway.networking.k8s.io", "httproutes"): {"get", "create", "patch", "delete"},
    ("", "serviceaccounts"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "roles"): {"get", "create", "patch", "delete"},
    ("rbac.authorization.k8s.io", "rolebindings"): {"get", "create", "patch", "delete"},
    ("autoscaling", "horizontalpodautoscalers"): CHILD_VERBS,
    ("keda.sh", "scaledobjects"): CHILD_VERBS,
    ("", "pods"): {"get", "list", "watch"},
    ("", "pods/status"): {"patch"},
    ("", "pods/eviction"): {"create"},
    ("discovery.k8s.io", "endpointslices"): {"list"},
    ("", "secrets"): {"get", "create"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
}
CRD_GRANT = {("apiextensions.k8s.io", "customresourcedefinitions"): {"get", "list", "watch"}}


# --- files, no helm needed ----------------------------------------------------------------


def test_chart_crd_is_byte_identical_to_the_source_crd() -> None:
    # templates/crd.yaml reads this copy: a chart package cannot reach files outside itself.
    source = (ROOT / "crds" / "flashmodel.yaml").read_bytes()
    copy = (CHART / "files" / "crds" / "flashmodel.yaml").read_bytes()
    assert copy == source, (
        "charts/flashmodel-operator/files/crds/flashmodel.yaml differs from crds/flashmodel.yaml: "
        "run python scripts/gen_crd.py"
    )


def test_the_flashmodel_crd_is_not_in_the_charts_crds_folder() -> None:
    # Helm installs crds/ once and never upgrades it; the CRD must come from templates/ only,
    # or a fresh install would create it twice and fail.
    assert not (CHART / "crds" / "flashmodel.yaml").exists()


def _schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def _values() -> dict[str, Any]:
    values: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    return values


def test_values_yaml_satisfies_the_strict_schema() -> None:
    jsonschema.Draft7Validator(_schema()).validate(_values())


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda v: v.update(replicas=2), id="unknown-top-level-key"),
        pytest.param(lambda v: v["image"].update(tags="x"), id="unknown-nested-key"),
        pytest.param(lambda v: v["rbac"].update(scope="everything"), id="bad-enum"),
        pytest.param(lambda v: v.update(replicaCount=0), id="below-minimum"),
        # Kubernetes' own types ($defs, from scripts/values_schema_k8s.py): what the API server refuses.
        pytest.param(lambda v: v["resources"]["limits"].update(memory="lots"), id="quantity-not-a-quantity"),
        pytest.param(lambda v: v["resources"]["requests"].update(cpu="1 core"), id="quantity-with-a-space"),
        pytest.param(lambda v: v["resources"].update(limit={"memory": "1Gi"}), id="resources-typo"),
        pytest.param(lambda v: v["resources"]["requests"].update(memory="-1Gi"), id="negative-request"),
        pytest.param(lambda v: v["resources"]["limits"].update(cpu=-1), id="negative-number-limit"),
        pytest.param(lambda v: v["podSecurityContext"].update(runAsUser=-5), id="negative-uid"),
        pytest.param(lambda v: v["podSecurityContext"].update(supplementalGroups=[-1]), id="negative-gid"),
        pytest.param(lambda v: v["securityContext"].update(runAsGroup=2**31), id="gid-above-int32"),
        pytest.param(lambda v: v["securityContext"]["capabilities"].update(drop="ALL"), id="capabilities-not-a-list"),
        pytest.param(lambda v: v["podSecurityContext"]["seccompProfile"].update(type="Strict"), id="seccomp-enum"),
        pytest.param(lambda v: v.update(tolerations=[{"key": "gpu", "effect": "Bogus"}]), id="toleration-effect"),
        pytest.param(lambda v: v.update(tolerations=[{"key": "gpu", "operator": "In"}]), id="toleration-operator"),
        pytest.param(
            lambda v: v.update(affinity={"nodeAffinity": {"requiredDuringScheduling": {}}}), id="affinity-typo"
        ),
        pytest.param(lambda v: v.update(extraEnv=[{"value": "x"}]), id="env-without-name"),
        pytest.param(
            lambda v: v.update(extraEnv=[{"name": "X", "valueFrom": {"secretRef": {"name": "s"}}}]),
            id="env-source-typo",
        ),
    ],
)
def test_values_schema_rejects_bad_values(mutate: Any) -> None:
    values = _values()
    mutate(values)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_schema()).validate(values)


@pytest.mark.parametrize(
    "mutate",
    [
        pytest.param(lambda v: v["resources"].update(limits={"memory": "1.5Gi", "cpu": "500m"}), id="quantities"),
        pytest.param(lambda v: v["resources"].update(requests={"cpu": 2, "memory": "1e9"}), id="number-quantities"),
        pytest.param(lambda v: v["podSecurityContext"].update(runAsUser=0, runAsNonRoot=False), id="root-uid"),
        pytest.param(
            lambda v: v.update(tolerations=[{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]),
            id="toleration",
        ),
        pytest.param(
            lambda v: v.update(
                affinity={
                    "nodeAffinity": {
                        "requiredDuringSchedulingIgnoredDuringExecution": {
                            "nodeSelectorTerms": [
                                {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["system"]}]}
                            ]
                        }
                    },
                    "podAntiAffinity": {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {
                                "weight": 100,
                                "podAffinityTerm": {
                                    "topologyKey": "kubernetes.io/hostname",
                                    "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "flashmodel-operator"}},
                                },
                            }
                        ]
                    },
                }
            ),
            id="affinity",
        ),
        pytest.param(
            lambda v: v.update(
                extraEnv=[
                    {"name": "A", "value": "1"},
                    {"name": "B", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": True}}},
                    {"name": "C", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
                ]
            ),
            id="env",
        ),
    ],
)
def test_values_schema_accepts_good_kubernetes_values(mutate: Any) -> None:
    values = _values()
    mutate(values)
    jsonschema.Draft7Validator(_schema()).validate(values)


def test_values_schema_defs_are_kubernetes_types_by_openapi_name() -> None:
    defs = _schema()["$defs"]
    assert defs["io.k8s.api.core.v1.Toleration"]["properties"]["effect"]["enum"] == [
        "NoExecute",
        "NoSchedule",
        "PreferNoSchedule",
    ]
    # Every $ref resolves inside the file: helm has no network access to fetch others.
    refs = set(re.findall(r'"\$ref": "#/\$defs/([^"]+)"', (CHART / "values.schema.json").read_text()))
    assert refs and refs <= set(defs)


def _closed_objects(node: dict[str, Any], path: str = "") -> Iterator[str]:
    """Paths of objects that declare properties but still accept unknown keys."""
    if "properties" in node:
        if node.get("additionalProperties") is not False:
            yield path or "<root>"
        for key, child in node["properties"].items():
            yield from _closed_objects(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from _closed_objects(node["items"], f"{path}[]")


def test_values_schema_closes_every_declared_object() -> None:
    assert list(_closed_objects(_schema())) == []


def _declared_paths(values: dict[str, Any], schema: dict[str, Any], prefix: str = "") -> Iterator[str]:
    """Dotted paths of the keys the schema declares (inside free-form objects nothing is declared)."""
    for key, value in values.items():
        node = schema["properties"][key]
        path = f"{prefix}{key}"
        yield path
        if isinstance(value, dict) and "properties" in node:
            yield from _declared_paths(value, node, path + ".")


def _documented_paths(text: str) -> set[str]:
    """Dotted paths of the keys in values.yaml whose line above is a comment."""
    documented: set[str] = set()
    stack: list[tuple[int, str]] = []
    previous = ""
    for line in text.splitlines():
        match = re.match(r"^( *)([A-Za-z][A-Za-z0-9]*):", line)
        if match:
            indent, key = len(match.group(1)), match.group(2)
            while stack and stack[-1][0] >= indent:
                stack.pop()
            path = ".".join([k for _, k in stack] + [key])
            if previous.lstrip().startswith("#"):
                documented.add(path)
            stack.append((indent, key))
        if line.strip():
            previous = line
    return documented


def test_every_value_is_documented_on_the_line_above() -> None:
    declared = set(_declared_paths(_values(), _schema()))
    undocumented = declared - _documented_paths((CHART / "values.yaml").read_text())
    assert not undocumented, f"values without a comment on the line above: {sorted(undocumented)}"


def test_every_value_in_the_schema_is_in_values_yaml() -> None:
    # A schema key missing from values.yaml is a value nobody can discover.
    declared = set(_schema()["properties"]) - {"global"}
    assert declared == set(_values())


# --- helm -------------------------------------------------------------------------------


def test_helm_lint_strict_passes() -> None:
    out = helm("lint", "--strict", str(CHART), "--kube-version", KUBE_VERSION).stdout
    assert "0 chart(s) failed" in out


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("resources.limits.memory=lots", "at '/resources/limits/memory': 'lots' does not match pattern"),
        ("podSecurityContext.runAsUser=-5", "at '/podSecurityContext/runAsUser': minimum: got -5, want 0"),
        ("tolerations[0].effect=Bogus", "at '/tolerations/0/effect': value must be one of 'NoExecute'"),
    ],
)
def test_helm_refuses_what_the_api_server_would(value: str, message: str) -> None:
    proc = helm("template", "fm", str(CHART), "--set", value, check=False)
    assert proc.returncode != 0
    assert message in proc.stderr


def test_helm_rejects_an_unknown_value() -> None:
    proc = helm("template", "fm", str(CHART), "--kube-version", KUBE_VERSION, "--set", "replicas=2", check=False)
    assert proc.returncode != 0
    assert "additional properties 'replicas' not allowed" in proc.stderr


def test_default_render_objects() -> None:
    docs = render()
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in docs)
    assert kinds == [
        "ClusterRole/fm-flashmodel-operator",
        "ClusterRole/fm-flashmodel-operator-edit",
        "ClusterRole/fm-flashmodel-operator-view",
        "ClusterRoleBinding/fm-flashmodel-operator",
        "CustomResourceDefinition/flashmodels.serving.flashmodel.io",
        "Deployment/fm-flashmodel-operator",
        "ServiceAccount/fm-flashmodel-operator",
    ]
    for d in docs:
        if d["kind"] in ("ServiceAccount", "Deployment"):
            assert d["metadata"]["namespace"] == "flashmodel-system"


def test_include_crds_renders_the_flashmodel_crd_and_kopf_peering_crds() -> None:
    out = helm("template", "fm", str(CHART), "--kube-version", KUBE_VERSION, "--include-crds").stdout
    crds = {d["metadata"]["name"]: d for d in yaml.safe_load_all(out) if d and d["kind"] == "CustomResourceDefinition"}
    assert set(crds) == {"flashmodels.serving.flashmodel.io", "clusterkopfpeerings.kopf.dev", "kopfpeerings.kopf.dev"}


def test_the_rendered_crd_is_the_source_crd_plus_helm_metadata() -> None:
    rendered = one(render(), "CustomResourceDefinition")
    source = yaml.safe_load((ROOT / "crds" / "flashmodel.yaml").read_text())
    metadata = rendered.pop("metadata")
    assert rendered == {k: v for k, v in source.items() if k != "metadata"}
    assert metadata["name"] == source["metadata"]["name"]
    # The source's own labels survive; Helm's ownership label and the keep policy are added.
    assert source["metadata"]["labels"].items() <= metadata["labels"].items()
    assert metadata["labels"]["app.kubernetes.io/managed-by"] == "Helm"
    assert metadata["annotations"] == {"helm.sh/resource-policy": "keep"}


def test_crds_keep_false_lets_uninstall_delete_the_crd() -> None:
    rendered = one(render("crds.keep=false"), "CustomResourceDefinition")
    assert "helm.sh/resource-policy" not in rendered["metadata"].get("annotations", {})


def test_crds_enabled_false_renders_no_crd() -> None:
    assert by_kind(render("crds.enabled=false"), "CustomResourceDefinition") == []


def test_helm_template_and_lint_need_no_kube_version_flag() -> None:
    docs = [d for d in yaml.safe_load_all(helm("template", "fm", str(CHART)).stdout) if d]
    assert len(by_kind(docs, "CustomResourceDefinition")) == 1
    assert "0 chart(s) failed" in helm("lint", "--strict", str(CHART)).stdout


@pytest.mark.parametrize("version", ["1.30.0", "v1.30.2-gke.1000", "1.35.0"])
def test_a_supported_kubernetes_version_renders(version: str) -> None:
    helm("template", "fm", str(CHART), "--kube-version", version)


@pytest.mark.parametrize("version", ["1.29.9", "v1.28.0-eks-1", "1.20.1"])
def test_a_too_old_kubernetes_is_refused_with_the_minimum(version: str) -> None:
    proc = helm("template", "fm", str(CHART), "--kube-version", version, check=False)
    assert proc.returncode != 0
    assert "flashmodel-operator needs Kubernetes >= 1.30" in proc.stderr
    major_minor = ".".join(version.removeprefix("v").split(".")[:2])
    assert f"this cluster is v{major_minor}." in proc.stderr


@pytest.mark.parametrize(
    "sets",
    [(), ("replicaCount=2",), ("watchNamespaces={a,b}", "rbac.scope=namespaced", "replicaCount=3")],
    ids=["default", "peered", "namespaced-peered"],
)
def test_rbac_has_no_wildcards(sets: tuple[str, ...]) -> None:
    for role in by_kind(render(*sets), "ClusterRole") + by_kind(render(*sets), "Role"):
        for rule in role["rules"]:
            for field in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[field], f"{role['metadata']['name']}: {rule}"


def test_cluster_scope_grants_exactly_what_the_operator_uses() -> None:
    docs = render()
    role = one(docs, "ClusterRole", "fm-flashmodel-operator")
    assert grants(role) == {**CRD_GRANT, **NAMESPACED_GRANTS}
    binding = one(docs, "ClusterRoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "fm-flashmodel-operator", "namespace": "flashmodel-system"}
    ]


def test_peered_cluster_scope_adds_cluster_peering() -> None:
    role = one(render("replicaCount=2"), "ClusterRole", "fm-flashmodel-operator")
    expected = {
        **CRD_GRANT,
        **NAMESPACED_GRANTS,
        ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"},
    }
    assert grants(role) == expected


def test_namespaced_scope_puts_the_rules_in_a_role_per_watched_namespace() -> None:
    docs = render("watchNamespaces={team-a,team-b}", "rbac.scope=namespaced", "replicaCount=2")
    cluster_role = one(docs, "ClusterRole", "fm-flashmodel-operator")
    assert grants(cluster_role) == {**CRD_GRANT, ("", "namespaces"): {"list", "watch"}}
    roles = by_kind(docs, "Role")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["team-a", "team-b"]
    for role in roles:
        assert grants(role) == {**NAMESPACED_GRANTS, ("kopf.dev", "kopfpeerings"): {"get", "list", "watch", "patch"}}
    bindings = by_kind(docs, "RoleBinding")
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["team-a", "team-b"]
    for b in bindings:
        assert b["subjects"][0]["namespace"] == "flashmodel-system"
    peerings = by_kind(docs, "KopfPeering")
    assert sorted(p["metadata"]["namespace"] for p in peerings) == ["team-a", "team-b"]
    assert not by_kind(docs, "ClusterKopfPeering")


def test_namespaced_scope_without_namespaces_fails_with_a_reason() -> None:
    proc = helm(
        "template", "fm", str(CHART), "--kube-version", KUBE_VERSION, "--set", "rbac.scope=namespaced", check=False
    )
    assert proc.returncode != 0
    assert "rbac.scope=namespaced needs watchNamespaces" in proc.stderr


def test_selector_labels_are_free_of_versions_and_match_the_pod() -> None:
    docs = render()
    deployment = one(docs, "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector == {"app.kubernetes.io/name": "flashmodel-operator", "app.kubernetes.io/instance": "fm"}
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= pod_labels.items()
    for d in docs:
        labels = d["metadata"]["labels"]
        assert labels["helm.sh/chart"] == "flashmodel-operator-0.1.0"
        assert labels["app.kubernetes.io/managed-by"] == "Helm"
        assert labels["app.kubernetes.io/version"] == "0.1.0"


def test_one_replica_runs_standalone_cluster_wide_with_recreate() -> None:
    docs = render()
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    c = container(docs)
    assert c["command"] == ["python", "-m", "flashmodel_operator"]
    assert c["args"] == [
        "--all-namespaces",
        "--liveness=http://0.0.0.0:8080/healthz",
        "--standalone",
        "--log-format=full",
    ]
    assert c["image"] == "ghcr.io/flashmodel/operator:0.1.0"
    assert not by_kind(docs, "ClusterKopfPeering")


def test_more_replicas_peer_with_distinct_priorities() -> None:
    docs = render("replicaCount=2")
    deployment = one(docs, "Deployment")
    assert deployment["spec"]["strategy"] == {"type": "RollingUpdate"}
    c = container(docs)
    assert c["command"][:2] == ["/bin/sh", "-c"]
    assert "exec python -m flashmodel_operator --priority=" in c["command"][2]
    assert "--peering=fm-flashmodel-operator" in c["args"]
    assert "--standalone" not in c["args"]
    assert one(docs, "ClusterKopfPeering")["metadata"]["name"] == "fm-flashmodel-operator"


def test_watch_namespaces_become_kopf_namespace_flags() -> None:
    c = container(render("watchNamespaces={team-a,team-b}"))
    assert "--all-namespaces" not in c["args"]
    assert [a for a in c["args"] if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]


def test_probes_security_and_resources() -> None:
    docs = render()
    pod = one(docs, "Deployment")["spec"]["template"]["spec"]
    c = container(docs)
    for probe in ("startupProbe", "livenessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "healthz"}
    assert {"name": "healthz", "containerPort": 8080, "protocol": "TCP"} in c["ports"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] != 0
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert c["resources"]["limits"]["memory"] == "256Mi"
    assert pod["serviceAccountName"] == "fm-flashmodel-operator"


def test_service_monitor_is_off_by_default_and_needs_metrics() -> None:
    assert not by_kind(render(), "ServiceMonitor")
    assert not by_kind(render(), "Service")
    docs = render(
        "metrics.enabled=true", "metrics.serviceMonitor.enabled=true", "metrics.serviceMonitor.labels.release=prom"
    )
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "prom"
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "interval": "30s", "honorLabels": True}]
    service = one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    c = container(docs)
    assert {"name": "FLASHMODEL_METRICS_PORT", "value": "8090"} in c["env"]
    proc = helm(
        "template",
        "fm",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        "--set",
        "metrics.serviceMonitor.enabled=true",
        check=False,
    )
    assert proc.returncode != 0 and "needs metrics.enabled" in proc.stderr


def test_rbac_create_false_renders_no_roles() -> None:
    docs = render("rbac.create=false")
    assert not [d for d in docs if d["kind"] in ("ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")]


def test_pod_monitors_only_where_served_and_relabel_like_the_documented_scrape_jobs() -> None:
    assert not by_kind(render(), "PodMonitor")  # no prometheus-operator: nothing to install
    served = ["--api-versions", "monitoring.coreos.com/v1/PodMonitor"]
    labels = ["--set", "engineMetrics.podMonitor.labels.release=p"]
    args = ["template", "fm", str(CHART), "--kube-version", KUBE_VERSION, *served, *labels]
    docs = [d for d in yaml.safe_load_all(helm(*args).stdout) if d]
    monitors = {d["metadata"]["name"]: d for d in docs if d["kind"] == "PodMonitor"}
    jobs = {j["job_name"]: j for j in yaml.safe_load((CHART / "files" / "prometheus-scrape-config.yaml").read_text())}
    # Each monitor is its plain-Prometheus job: the same pods, port and target labels (the autoscaler's
    # queries, the wake from zero and the dashboard need them).
    pairs = [
        ("fm-flashmodel-operator-engines", "flashmodel-engines", "health", "serving.flashmodel.io/model"),
        ("fm-flashmodel-operator-pickers", "flashmodel-pickers", "metrics", "serving.flashmodel.io/picker-for"),
    ]
    assert sorted(monitors) == sorted(m for m, _, _, _ in pairs) and sorted(jobs) == sorted(j for _, j, _, _ in pairs)
    for name, job_name, port, selector_label in pairs:
        monitor, job = monitors[name], jobs[job_name]
        assert monitor["metadata"]["labels"]["release"] == "p"
        assert monitor["spec"]["namespaceSelector"] == {"any": True}
        [endpoint] = monitor["spec"]["podMetricsEndpoints"]
        assert (endpoint["port"], endpoint["path"]) == (port, "/metrics")
        relabel = job["relabel_configs"]
        documented = {(tuple(r["source_labels"]), r["target_label"]) for r in relabel if "target_label" in r}
        assert {(tuple(r["sourceLabels"]), r["targetLabel"]) for r in endpoint["relabelings"]} == documented
        assert monitor["spec"]["selector"]["matchExpressions"] == [{"key": selector_label, "operator": "Exists"}]
        kept = {r["source_labels"][0]: r["regex"] for r in relabel if r.get("action") == "keep"}
        assert kept["__meta_kubernetes_pod_container_port_name"] == port
        meta_label = "__meta_kubernetes_pod_label_" + re.sub(r"[./-]", "_", selector_label)
        assert kept[meta_label] == ".+"


def test_dashboard_config_map_carries_the_dashboard_json_for_the_grafana_sidecar() -> None:
    assert not by_kind(render(), "ConfigMap")
    cm = one(render("dashboards.enabled=true"), "ConfigMap")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["flashmodel-fleet.json"])
    assert dashboard["uid"] == "flashmodel-fleet" and len(dashboard["panels"]) >= 8


def test_operator_gets_the_prometheus_address_and_the_t4_node_selector() -> None:
    env = container(render("autoscaling.prometheusAddress=http://prom.monitoring.svc:9090"))["env"]
    assert {"name": "FLASHMODEL_PROMETHEUS_URL", "value": "http://prom.monitoring.svc:9090"} in env
    selector = next(e["value"] for e in env if e["name"] == "FLASHMODEL_T4_NODE_SELECTOR")
    assert json.loads(selector) == {"nvidia.com/gpu.product": "Tesla-T4"}
    # Helm merges maps: a cluster replaces the GFD label by setting it to null beside its own.
    gke = container(
        render(
            "accelerators.t4.nodeSelector.nvidia\\.com/gpu\\.product=null",
            "accelerators.t4.nodeSelector.cloud\\.google\\.com/gke-accelerator=nvidia-tesla-t4",
        )
    )["env"]
    selector = next(e["value"] for e in gke if e["name"] == "FLASHMODEL_T4_NODE_SELECTOR")
    assert json.loads(selector) == {"cloud.google.com/gke-accelerator": "nvidia-tesla-t4"}


def test_operator_tracing_env_comes_from_the_tracing_values() -> None:
    assert not [e for e in container(render())["env"] if e["name"].startswith("OTEL_")]
    url = "http://otel-collector.monitoring:4318/v1/traces"
    env = container(render(f"tracing.otlpTracesEndpoint={url}", "tracing.otlpTracesProtocol=http/protobuf"))["env"]
    assert {"name": "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "value": url} in env
    assert {"name": "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "value": "http/protobuf"} in env
    args = ["template", "fm", str(CHART), "--kube-version", KUBE_VERSION]
    for bad in ("tracing.otlpTracesProtocol=http/json", "tracing.otlpTracesEndpoint=otel-collector:4317",
                "tracing.otlpTracesEndpoint=http://user:pw@otel-collector:4317"):
        proc = helm(*args, "--set", "tracing.otlpTracesEndpoint=http://otel-collector:4317", "--set", bad, check=False)
        assert proc.returncode != 0 and "tracing" in proc.stderr, bad
