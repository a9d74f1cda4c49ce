"""Root pytest fixtures: the real Kubernetes control plane from e2e/cluster.py, for tests marked e2e."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from e2e.cluster import ControlPlane, testbin_dir

E2E_FIXTURES = frozenset({"control_plane", "k8s_namespace"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # Marking by fixture use means `-m "not e2e"` can never start a control plane by accident.
    for item in items:
        if E2E_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="session")
def control_plane() -> Iterator[ControlPlane]:
    """A started control plane with FLASHMODEL_E2E_T4_NODES (default 3) fake one-GPU T4 nodes."""
    if os.environ.get("FLASHMODEL_SKIP_E2E") == "1":
        pytest.skip("FLASHMODEL_SKIP_E2E=1 is set: the real control plane is not started")
    with ControlPlane(testbin_dir(build=True)) as cp:
        cp.add_t4_nodes(int(os.environ.get("FLASHMODEL_E2E_T4_NODES", "3")))
        yield cp


@pytest.fixture
def k8s_namespace(control_plane: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh namespace named after the test; deleted afterwards, waiting until its pods are gone."""
    name = control_plane.create_namespace(request.node.name)
    yield name
    # Waiting keeps tests independent: pods of a dying namespace still hold fake GPU nodes.
    control_plane.delete_namespace(name)
