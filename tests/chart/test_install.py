"""helm install against the real API server: the objects are accepted and RBAC grants exactly what it should."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from e2e.harness.cluster import ControlPlane
from tests.chart.test_chart import CRD_GRANT, NAMESPACED_GRANTS

CHART = Path(__file__).resolve().parents[2] / "charts" / "flashmodel-operator"


def values_schema_script() -> Any:
    """scripts/values_schema_k8s.py as a module (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(
        "values_schema_k8s", CHART.parents[1] / "scripts" / "values_schema_k8s.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_values_schema_defs_match_this_api_servers_openapi(control_plane: ControlPlane) -> None:
    # Fails when values.schema.json's Kubernetes types drift from the API server the tests run,
    # e.g. after a testbin upgrade: rerun scripts/values_schema_k8s.py against it.
    script = values_schema_script()
    schema = json.loads((CHART / "values.schema.json").read_text())
    openapi = json.loads(control_plane.kubectl("get", "--raw", "/openapi/v3/api/v1").stdout)
    assert script.regenerate(json.loads(json.dumps(schema)), openapi) == schema


def can_i(cp: ControlPlane, account: str, verb: str, group: str, resource: str) -> bool:
    """The API server's own access review for `account`, in every namespace.

    A SubjectAccessReview, not `kubectl auth can-i`: kubectl first resolves the resource by
    discovery, and reads a kind that is not installed here (KEDA's scaledobjects.keda.sh) as
    resource.version.group, so it would ask about the wrong group.
    """
    resource, _, sub = resource.partition("/")
    review = {
        "apiVersion": "authorization.k8s.io/v1",
        "kind": "SubjectAccessReview",
        "spec": {
            "user": account,
            "resourceAttributes": {"verb": verb, "group": group, "resource": resource, "subresource": sub},
        },
    }
    proc = cp.kubectl("create", "-o", "json", "-f", "-", input=json.dumps(review))
    return bool(json.loads(proc.stdout)["status"].get("allowed"))


def test_install_peered_release_and_check_every_grant(control_plane: ControlPlane, k8s_namespace: str) -> None:
    release = "chart-e2e"
    # --take-ownership: other tests in this session may have applied the CRD with kubectl.
    control_plane.helm(
        "install",
        release,
        str(CHART),
        "-n",
        k8s_namespace,
        "--set",
        "replicaCount=2",
        "--wait=false",
        "--take-ownership",
    )
    try:
        account = f"system:serviceaccount:{k8s_namespace}:{release}-flashmodel-operator"
        grants = {
            **CRD_GRANT,
            **NAMESPACED_GRANTS,
            ("kopf.dev", "clusterkopfpeerings"): {"get", "list", "watch", "patch"},
        }
        missing = [
            f"{verb} {group}/{resource}"
            for (group, resource), verbs in grants.items()
            for verb in sorted(verbs)
            if not can_i(control_plane, account, verb, group, resource)
        ]
        assert missing == []
        # What the operator must not be able to do.
        refused = [
            ("delete", "serving.flashmodel.io", "flashmodels"),
            ("list", "", "secrets"),
            ("watch", "", "secrets"),
            ("create", "", "pods"),
            ("delete", "", "pods"),
            ("update", "apps", "deployments"),
            ("get", "", "nodes"),
            ("delete", "apiextensions.k8s.io", "customresourcedefinitions"),
            ("create", "rbac.authorization.k8s.io", "clusterroles"),
        ]
        allowed = [r for r in refused if can_i(control_plane, account, *r)]
        assert allowed == []

        deployment = json.loads(
            control_plane.kubectl(
                "get", "deployment", f"{release}-flashmodel-operator", "-n", k8s_namespace, "-o", "json"
            ).stdout
        )
        assert deployment["spec"]["replicas"] == 2
        # The peering object kopf requires with --peering was created after its CRD (crds/ installs first).
        peering = control_plane.kubectl("get", "clusterkopfpeering", f"{release}-flashmodel-operator", check=False)
        assert peering.returncode == 0, peering.stderr
    finally:
        control_plane.helm("uninstall", release, "-n", k8s_namespace, check=False)


def test_namespaced_release_confines_the_operator(control_plane: ControlPlane, k8s_namespace: str) -> None:
    watched = control_plane.create_namespace("chart-watched")
    release = "chart-ns"
    control_plane.helm(
        "install",
        release,
        str(CHART),
        "-n",
        k8s_namespace,
        "--set",
        f"watchNamespaces={{{watched}}}",
        "--set",
        "rbac.scope=namespaced",
        "--set",
        "rbac.aggregateToDefaultRoles=false",
        # A second release in a cluster: only one release can own the cluster-wide CRD.
        "--set",
        "crds.enabled=false",
        "--wait=false",
    )
    try:
        account = f"system:serviceaccount:{k8s_namespace}:{release}-flashmodel-operator"

        def can(verb: str, resource: str, namespace: str) -> bool:
            resource, _, sub = resource.partition("/")
            args = ["auth", "can-i", verb, resource, f"--as={account}", "-n", namespace]
            if sub:
                args.append(f"--subresource={sub}")
            return control_plane.kubectl(*args, check=False).returncode == 0

        assert can("patch", "deployments.apps", watched)
        assert can("patch", "pods/status", watched)
        assert not can("patch", "deployments.apps", k8s_namespace)
        assert not can("get", "flashmodels.serving.flashmodel.io", "default")
        assert can("list", "customresourcedefinitions.apiextensions.k8s.io", "default")
    finally:
        control_plane.helm("uninstall", release, "-n", k8s_namespace, check=False)
        control_plane.kubectl("delete", "namespace", watched, "--wait=false", check=False)
