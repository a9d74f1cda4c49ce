"""spec.adapters and spec.lora against the real API server: what the CRD accepts, and what it refuses and why."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.harness.cluster import ControlPlane
from tests.operator.specs import apply_model

SHA = "0123456789abcdef0123456789abcdef01234567"
MODEL = {"pvc": {"claimName": "models", "path": "qwen"}}
SUPPORT = {"name": "support", "pvc": {"claimName": "lora", "path": "support/v3"}}


@pytest.fixture(scope="module")
def namespace(control_plane: ControlPlane, crd: None) -> Iterator[str]:
    name = control_plane.create_namespace("adapters-api")
    yield name
    control_plane.delete_namespace(name)


def _create(cp: ControlPlane, namespace: str, spec: dict[str, Any]) -> tuple[int, str]:
    doc = {"apiVersion": "serving.flashmodel.io/v1alpha1", "kind": "FlashModel",
           "metadata": {"name": "bad"}, "spec": spec}
    proc = cp.kubectl("create", "-n", namespace, "-f", "-", input=yaml.safe_dump(doc), check=False)
    return proc.returncode, proc.stderr


def test_two_adapters_and_lora_are_stored_as_written(control_plane: ControlPlane, namespace: str) -> None:
    adapters = [
        SUPPORT,
        {"name": "triage", "hub": {"id": "acme/qwen-triage-lora", "revision": SHA}},
        {"name": "legal", "image": {"reference": "registry.example/adapters/legal:1"}},
    ]
    stored = apply_model(control_plane, namespace, "qwen", {
        "model": MODEL, "adapters": adapters, "lora": {"maxLoras": 4, "maxRank": 32}
    })
    got = stored["spec"]["adapters"]
    assert [a["name"] for a in got] == ["support", "triage", "legal"]
    assert got[2]["image"] == {"reference": "registry.example/adapters/legal:1", "path": "/"}  # the default
    assert stored["spec"]["lora"] == {"maxLoras": 4, "maxRank": 32}
    # Adding one to the stored list by a merge patch keeps the others (a list-map keyed by name).
    control_plane.kubectl(
        "patch", "fm", "qwen", "-n", namespace, "--type=json",
        "-p", '[{"op": "add", "path": "/spec/adapters/-", "value": {"name": "billing", "pvc": {"claimName": "lora"}}}]',
    )


REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("name-not-a-label", {"adapters": [{"name": "Support_V3", "pvc": {"claimName": "l"}}]},
     "an adapter's name is lower-case letters, digits and '-'"),
    ("two-sources", {"adapters": [{"name": "a", "pvc": {"claimName": "l"}, "hub": {"id": "a/b", "revision": SHA}}]},
     "each adapter needs exactly one source: set one of pvc, image or hub"),
    ("no-source", {"adapters": [{"name": "a"}]}, "each adapter needs exactly one source"),
    ("path-up", {"adapters": [{"name": "a", "pvc": {"claimName": "l", "path": "x/../../etc"}}]},
     "an adapter's path must not have a '..' segment"),
    ("image-path-up", {"adapters": [{"name": "a", "image": {"reference": "r/x:1", "path": "/.."}}]},
     "an adapter's path must not have a '..' segment"),
    ("hub-revision-branch", {"adapters": [{"name": "a", "hub": {"id": "a/b", "revision": "main"}}]},
     "an adapter's hub revision must be a full 40-hex commit id"),
    ("same-name-twice", {"adapters": [SUPPORT, dict(SUPPORT, pvc={"claimName": "other"})]}, "Duplicate value"),
    ("named-like-served-name", {"model": dict(MODEL, servedName="support"), "adapters": [SUPPORT]},
     "an adapter must not be named like spec.model.servedName"),
    ("more-than-default", {"adapters": [dict(SUPPORT, name=f"a{i}") for i in range(5)]},
     "spec.adapters lists more adapters than a pod holds (spec.lora.maxLoras, 4 by default on t4, at most 8)"),
    ("more-than-max-loras", {"lora": {"maxLoras": 1}, "adapters": [dict(SUPPORT, name=f"a{i}") for i in range(2)]},
     "spec.adapters lists more adapters than a pod holds"),
    ("max-loras-over-t4", {"lora": {"maxLoras": 9}}, "lora.maxLoras must be at most 8 on t4"),
    ("rank-not-vllms", {"lora": {"maxRank": 12}}, "maxRank must be one of vLLM's LoRA ranks 8, 16, 32, 64"),
    ("rank-over", {"lora": {"maxRank": 128}}, "maxRank must be one of vLLM's LoRA ranks"),
]


@pytest.mark.parametrize(("spec", "message"), [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_a_bad_adapter_spec_is_refused_with_what_to_change(
    control_plane: ControlPlane, namespace: str, spec: dict[str, Any], message: str
) -> None:
    rc, stderr = _create(control_plane, namespace, {"model": MODEL, **spec})
    assert rc != 0, "the API server accepted a spec it must refuse"
    assert message in stderr, stderr
