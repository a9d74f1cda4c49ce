"""helm upgrade from the chart that shipped the CRD in crds/ to this one, against the real API server.

Each test gets its own control plane: the CRD is cluster-scoped, and the session's control
plane may already hold one applied by kubectl or owned by another test's release.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

# Aliased: pytest collects any module-level function whose name starts with "test".
from e2e.harness.cluster import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "flashmodel-operator"
# The last commit whose chart installed the FlashModel CRD from crds/ (which Helm never upgrades).
PREVIOUS_CHART_COMMIT = "c00768a"
CRD = "flashmodels.serving.flashmodel.io"
RELEASE = "fm-upgrade"
NAMESPACE = "flashmodel-system"


@pytest.fixture
def own_control_plane(testbin: Path) -> Iterator[ControlPlane]:
    with ControlPlane(testbin) as cp:
        yield cp


@pytest.fixture
def previous_chart(tmp_path: Path) -> Path:
    """charts/flashmodel-operator as of PREVIOUS_CHART_COMMIT, unpacked from git."""
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", PREVIOUS_CHART_COMMIT, "charts/flashmodel-operator"],
        capture_output=True,
        check=True,
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive, check=True)
    chart = tmp_path / "charts" / "flashmodel-operator"
    assert (chart / "crds" / "flashmodel.yaml").exists(), "the previous chart should ship its CRD in crds/"
    return chart


def crd_properties(cp: ControlPlane) -> dict[str, Any]:
    crd = json.loads(cp.kubectl("get", "crd", CRD, "-o", "json").stdout)
    spec_props: dict[str, Any] = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"][
        "properties"
    ]
    return spec_props


def flashmodel(name: str, **spec: Any) -> str:
    body = {
        "apiVersion": "serving.flashmodel.io/v1alpha1",
        "kind": "FlashModel",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {"model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}, **spec},
    }
    return yaml.safe_dump(body)


def create(cp: ControlPlane, manifest: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # Strict field validation: a field the CRD does not know is an error, not silently pruned.
    return cp.kubectl("create", "--validate=strict", "-f", "-", input=manifest, check=check)


def uid(cp: ControlPlane, name: str) -> str:
    return cp.kubectl("get", "flashmodel", name, "-n", "default", "-o", "jsonpath={.metadata.uid}").stdout


AUTOSCALED = {"autoscaling": {"scaler": "hpa", "minReplicas": 1, "maxReplicas": 2}}


@pytest.mark.parametrize("adoption", ["kubectl-annotate", "take-ownership"])
def test_upgrade_from_the_crds_folder_chart_upgrades_the_crd_and_uninstall_keeps_it(
    own_control_plane: ControlPlane, previous_chart: Path, adoption: str
) -> None:
    cp = own_control_plane
    cp.helm("install", RELEASE, str(previous_chart), "-n", NAMESPACE, "--create-namespace", "--wait=false")
    cp.wait_established(CRD)
    assert "scaler" not in crd_properties(cp)["autoscaling"]["properties"]
    create(cp, flashmodel("survivor"))
    survivor = uid(cp, "survivor")
    refused = create(cp, flashmodel("autoscaled", **AUTOSCALED), check=False)
    assert refused.returncode != 0 and 'unknown field "spec.autoscaling.scaler"' in refused.stderr

    upgrade = ["upgrade", RELEASE, str(CHART), "-n", NAMESPACE, "--wait=false"]
    if adoption == "kubectl-annotate":
        # Without adoption Helm refuses to take over the CRD that crds/ installed (README says so).
        proc = cp.helm(*upgrade, check=False)
        assert proc.returncode != 0 and "invalid ownership metadata" in proc.stderr, proc.stderr
        # The two commands README's "Install on a real cluster" gives.
        cp.kubectl(
            "annotate",
            "crd",
            CRD,
            f"meta.helm.sh/release-name={RELEASE}",
            f"meta.helm.sh/release-namespace={NAMESPACE}",
        )
        cp.kubectl("label", "crd", CRD, "app.kubernetes.io/managed-by=Helm")
        cp.helm(*upgrade)
    else:
        # --reuse-values keeps the old chart's defaults, which lack crds (README says so).
        proc = cp.helm(*upgrade, "--take-ownership", "--reuse-values", check=False)
        assert proc.returncode != 0 and "missing properties" in proc.stderr and "'crds'" in proc.stderr, proc.stderr
        cp.helm(*upgrade, "--take-ownership", "--reset-then-reuse-values")

    cp.wait_established(CRD)
    assert crd_properties(cp)["autoscaling"]["properties"]["scaler"]["enum"] == ["keda", "hpa"]
    create(cp, flashmodel("autoscaled", **AUTOSCALED))
    scaler = cp.kubectl(
        "get", "flashmodel", "autoscaled", "-n", "default", "-o", "jsonpath={.spec.autoscaling.scaler}"
    ).stdout
    assert scaler == "hpa"
    assert uid(cp, "survivor") == survivor
    # The new CRD's own CEL rules are live too.
    too_low = create(cp, flashmodel("too-low", autoscaling={"minReplicas": 0, "maxReplicas": 2}), check=False)
    assert too_low.returncode != 0 and "autoscaling.minReplicas: 0 needs spec.routing" in too_low.stderr

    uninstall = cp.helm("uninstall", RELEASE, "-n", NAMESPACE)
    assert f"kept due to the resource policy:\n[CustomResourceDefinition] {CRD}" in uninstall.stdout
    crd = json.loads(cp.kubectl("get", "crd", CRD, "-o", "json").stdout)
    assert crd["metadata"].get("deletionTimestamp") is None
    assert uid(cp, "survivor") == survivor
    assert cp.kubectl("get", "flashmodel", "autoscaled", "-n", "default", "-o", "name").stdout.strip()


def test_fresh_install_then_uninstall_keeps_the_crd_and_a_reinstall_adopts_it(
    own_control_plane: ControlPlane,
) -> None:
    cp = own_control_plane
    cp.helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", "--wait=false")
    cp.wait_established(CRD)
    create(cp, flashmodel("kept", **AUTOSCALED))
    kept = uid(cp, "kept")
    cp.helm("uninstall", RELEASE, "-n", NAMESPACE)
    assert uid(cp, "kept") == kept
    # The kept CRD still carries this release's ownership, so installing it again just works.
    cp.helm("install", RELEASE, str(CHART), "-n", NAMESPACE, "--wait=false")
    assert uid(cp, "kept") == kept
