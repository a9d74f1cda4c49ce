"""Fixtures of the operator's tests against the real API server: the FlashModel CRD and a Cluster on it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flashmodel_operator.apply import Cluster

from e2e.harness.cluster import ControlPlane

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane) -> None:
    control_plane.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "flashmodel.yaml"))
    control_plane.wait_established("flashmodels.serving.flashmodel.io")


@pytest.fixture
def cluster(control_plane: ControlPlane, crd: None) -> Iterator[Cluster]:
    api = control_plane.api_client()
    yield Cluster(api)
    api.close()  # type: ignore[no-untyped-call]
