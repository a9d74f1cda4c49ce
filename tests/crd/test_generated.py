"""The CRD's spec schema is what the operator's models give, in the source CRD and the chart's copy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from flashmodel_operator.crd_schema import CHART_CRD, SOURCE_CRD, field_schema, render_crd, spec_schema, status_schema
from pydantic import BaseModel, Field

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", [SOURCE_CRD, CHART_CRD])
def test_the_checked_in_crd_is_what_the_models_give(path: str) -> None:
    checked_in = (ROOT / path).read_text()
    assert checked_in == render_crd((ROOT / SOURCE_CRD).read_text()), (
        f"{path} differs from what flashmodel_operator.model gives: run python scripts/gen_crd.py"
    )


def test_the_check_command_names_the_stale_file_and_the_fix(tmp_path: Path) -> None:
    # The script resolves the repository from its own place, so a copy of the tree it reads is enough.
    for rel in ("scripts/gen_crd.py", SOURCE_CRD, CHART_CRD):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text((ROOT / rel).read_text())
    for package in ("operator", "engine"):
        (tmp_path / package).symlink_to(ROOT / package)
    crd = tmp_path / SOURCE_CRD
    crd.write_text(crd.read_text().replace("default: 0.85", "default: 0.9", 1))
    check = subprocess.run(
        [sys.executable, str(tmp_path / "scripts/gen_crd.py"), "--check"], capture_output=True, text=True
    )
    assert check.returncode == 1
    assert f"{SOURCE_CRD} is not what flashmodel_operator.model gives: run python scripts/gen_crd.py" in check.stderr
    assert CHART_CRD not in check.stderr
    write = subprocess.run([sys.executable, str(tmp_path / "scripts/gen_crd.py")], capture_output=True, text=True)
    assert write.returncode == 0, write.stderr
    assert crd.read_text() == (ROOT / SOURCE_CRD).read_text()


def _spec(doc: dict[str, Any]) -> dict[str, Any]:
    node: dict[str, Any] = doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    return node


def test_only_the_spec_and_status_schemas_are_generated() -> None:
    source = (ROOT / SOURCE_CRD).read_text()
    doc = yaml.safe_load(render_crd(source))
    assert _spec(doc) == spec_schema()
    assert doc["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"] == status_schema()
    # Everything else (names, printer columns, subresources) passes through as written.
    original = yaml.safe_load(source)
    for d in (doc, original):
        del d["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
        del d["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["status"]
    assert doc == original


def test_the_status_schema_takes_what_the_operator_writes() -> None:
    from flashmodel_operator.status_model import FlashModelStatus

    written = {
        "observedGeneration": 3, "replicas": 2, "readyReplicas": 1, "servedName": "qwen",
        "conditions": [{"type": "Ready", "status": "False", "reason": "Prewarming", "message": "1 of 2",
                        "observedGeneration": 3, "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        "pods": [{"name": "p-0", "prewarmed": True, "coldTTFTMs": 812.5, "warmTTFTMs": 40.1}],
        "remediations": [{"pod": "p-1", "reason": "MemoryDivergence", "divergenceRatio": 0.2}],
        "autoscaler": None, "preflightRefusal": {"configHash": "abc", "retry": "", "pod": "p-1", "message": "m"},
    }
    assert FlashModelStatus.model_validate(written).model_dump(by_alias=True, exclude_unset=True) == written
    node = status_schema()
    assert node["properties"]["conditions"]["x-kubernetes-list-map-keys"] == ["type"]
    assert node["properties"]["conditions"]["items"]["required"] == ["type", "status"]
    assert node["properties"]["autoscaler"]["nullable"] is True
    # A status is written in parts: no field is required and none gets a default from the API server.
    assert "required" not in node and not any("default" in p for p in node["properties"].values())


def test_a_model_field_becomes_its_schema() -> None:
    from typing import Literal

    class Example(BaseModel):
        size: int = Field(default=16, ge=1, le=256, description="Block size in tokens. Default 16.")
        kind: Literal["a", "b"] | None = Field(default=None, description="Which kind.")
        names: list[str] = Field(default_factory=list, max_length=8, description="Names.")

    assert field_schema(Example.model_fields["size"], "x.size") == {
        "type": "integer",
        "description": "Block size in tokens. Default 16.",
        "default": 16,
        "minimum": 1,
        "maximum": 256,
    }
    assert field_schema(Example.model_fields["kind"], "x.kind") == {
        "type": "string",
        "description": "Which kind.",
        "enum": ["a", "b"],
    }
    assert field_schema(Example.model_fields["names"], "x.names") == {
        "type": "array",
        "description": "Names.",
        "default": [],
        "maxItems": 8,
        "items": {"type": "string"},
    }


def test_a_field_without_a_description_is_refused() -> None:
    class Undocumented(BaseModel):
        size: int = 16

    with pytest.raises(TypeError, match=r"x.size has no description: kubectl explain shows it"):
        field_schema(Undocumented.model_fields["size"], "x.size")
