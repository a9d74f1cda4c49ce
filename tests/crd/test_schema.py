"""The FlashModel CRD as a file: names, subresources, documentation, CEL-cost bounds, and the examples."""

from __future__ import annotations

import re
from collections.abc import Iterator
from copy import deepcopy
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from flashmodel_engine.profiles import (
    ALIASES,
    CODE_FLAGS,
    CONFIG_FLAG,
    ENFORCED_FLAGS,
    MEMORY_PLAN_FLAGS,
    SOURCE_FLAGS,
)

ROOT = Path(__file__).resolve().parents[2]
CRD_PATH = ROOT / "crds" / "flashmodel.yaml"
EXAMPLES = sorted((ROOT / "examples").glob("*.yaml"))


def crd() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(CRD_PATH.read_text())
    return doc


def version() -> dict[str, Any]:
    versions = crd()["spec"]["versions"]
    assert [v["name"] for v in versions] == ["v1alpha1"]
    v: dict[str, Any] = versions[0]
    return v


def schema() -> dict[str, Any]:
    s: dict[str, Any] = version()["schema"]["openAPIV3Schema"]
    return s


def walk(node: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any]]]:
    yield path, node
    for key, child in node.get("properties", {}).items():
        yield from walk(child, f"{path}.{key}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


def test_names_scope_and_served_version() -> None:
    doc = crd()
    assert doc["metadata"]["name"] == "flashmodels.serving.flashmodel.io"
    assert doc["spec"]["group"] == "serving.flashmodel.io"
    assert doc["spec"]["scope"] == "Namespaced"
    assert doc["spec"]["names"]["kind"] == "FlashModel"
    assert doc["spec"]["names"]["plural"] == "flashmodels"
    assert doc["spec"]["names"]["shortNames"] == ["fm"]
    assert version()["served"] is True and version()["storage"] is True


def test_status_and_scale_subresources() -> None:
    assert version()["subresources"] == {
        "status": {},
        "scale": {
            "specReplicasPath": ".spec.replicas",
            "statusReplicasPath": ".status.replicas",
            "labelSelectorPath": ".status.selector",
        },
    }


def test_printer_columns() -> None:
    columns = [(c["name"], c["jsonPath"]) for c in version()["additionalPrinterColumns"]]
    assert columns == [
        ("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        ("Available", '.status.conditions[?(@.type=="Available")].status'),
        ("Replicas", ".status.replicasSummary"),
        ("Accelerator", ".spec.accelerator"),
        ("Model", ".status.servedName"),
        ("Routing", '.status.conditions[?(@.type=="Routing")].status'),
        ("Age", ".metadata.creationTimestamp"),
    ]


def test_every_field_has_a_description() -> None:
    missing = [p for p, node in walk(schema(), "") if p and p != ".metadata" and not node.get("description")]
    # Items of string lists and map values are described by their parent.
    missing = [p for p in missing if not p.endswith(("[]", "{}"))]
    assert missing == []


def test_spec_lists_and_strings_are_bounded_for_the_cel_cost_estimator() -> None:
    unbounded = []
    for path, node in walk(schema()["properties"]["spec"], "spec"):
        if node.get("type") == "array" and "maxItems" not in node:
            unbounded.append(path)
        if node.get("type") == "string" and "enum" not in node and "maxLength" not in node:
            unbounded.append(path)
        if node.get("type") == "object" and "additionalProperties" in node and "maxProperties" not in node:
            unbounded.append(path)
    assert unbounded == []


def _extra_args_rules() -> list[dict[str, str]]:
    engine = schema()["properties"]["spec"]["properties"]["engine"]
    rules: list[dict[str, str]] = engine["properties"]["extraArgs"]["x-kubernetes-validations"]
    return rules


@pytest.mark.parametrize(
    "flag", [*sorted(ENFORCED_FLAGS), *sorted(MEMORY_PLAN_FLAGS), *sorted(ALIASES), CONFIG_FLAG, *sorted(SOURCE_FLAGS),
             *sorted(CODE_FLAGS)]
)
def test_every_enforced_engine_flag_has_a_cel_rule(flag: str) -> None:
    # The engine refuses these at launch; the API server must refuse them first (and every prefix of
    # them, as vLLM's parser reads one), with a message that names the flag.
    rules = [r for r in _extra_args_rules() if f"'{flag}'" in r["rule"] and ".startsWith(a.split('=')" in r["rule"]]
    assert len(rules) == 1, f"no CEL rule for {flag}"
    message = " ".join(rules[0]["message"].split())
    assert message.startswith("extraArgs must not set") and (flag in message or flag in MEMORY_PLAN_FLAGS
                                                             or flag in CODE_FLAGS)


def _closed(node: dict[str, Any]) -> dict[str, Any]:
    """The schema as JSON Schema with unknown fields refused (the API server's strict field validation)."""
    out = deepcopy(node)
    for _, sub in walk(out, ""):
        if "properties" in sub and not sub.get("x-kubernetes-preserve-unknown-fields"):
            sub.setdefault("additionalProperties", False)
        sub.pop("x-kubernetes-validations", None)
    return out


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_fits_the_schema(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
    assert [d["kind"] for d in docs] == ["FlashModel"]
    assert docs[0]["apiVersion"] == "serving.flashmodel.io/v1alpha1"
    jsonschema.Draft4Validator(_closed(schema())).validate(docs[0])


def test_examples_cover_t4_with_autoscaling_and_auth_minimal_t4_and_cpu() -> None:
    specs = [yaml.safe_load(p.read_text())["spec"] for p in EXAMPLES]
    assert any(s.get("accelerator", "t4") == "t4" and "autoscaling" in s and "auth" in s for s in specs)
    assert any(set(s) == {"model"} for s in specs)
    assert any(s.get("accelerator") == "cpu" for s in specs)


def test_closed_schema_refuses_a_misspelt_field() -> None:
    # Guards the example check above: it must catch a typo, not pass everything.
    doc = {
        "apiVersion": "v",
        "kind": "FlashModel",
        "spec": {"model": {"hub": {"id": "x"}}, "engine": {"blocksize": 16}},
    }
    with pytest.raises(jsonschema.ValidationError, match="blocksize"):
        jsonschema.Draft4Validator(_closed(schema())).validate(doc)


def test_quantization_values_agree_in_the_crd_the_operator_and_the_engine() -> None:
    from typing import get_args

    from flashmodel_engine.config import ModelSource
    from flashmodel_engine.quantization import QUANTIZATION_VALUES, TABLE
    from flashmodel_operator.model import ModelSpec, Quantization

    field = schema()["properties"]["spec"]["properties"]["model"]["properties"]["quantization"]
    assert field["default"] == "auto"
    assert list(field["enum"]) == list(QUANTIZATION_VALUES) == list(get_args(Quantization))
    assert set(TABLE) == set(QUANTIZATION_VALUES) - {"auto", "none"}
    assert ModelSpec.model_validate({"hub": {"id": "a/b"}}).quantization == "auto"
    assert ModelSource.model_validate({"path": "/m", "servedName": "m"}).quantization == "auto"


def test_every_method_the_t4_refuses_has_a_cel_rule_and_no_other_does() -> None:
    from flashmodel_engine.quantization import TABLE

    rules = schema()["properties"]["spec"]["x-kubernetes-validations"]
    t4_rules = [r["rule"] for r in rules if r.get("fieldPath") == ".model.quantization" and "'t4'" in r["rule"]]
    named = {m for m in TABLE for rule in t4_rules if f"'{m}'" in rule}
    assert named == {m for m, entry in TABLE.items() if entry.t4 is not None}


# What a cluster user cannot open: files of this repository, named in what `kubectl explain` shows.
_REPO_PATH = re.compile(
    r"(?<![\w.:/-])(docs|engine|operator|kernels|charts|crds|tests|e2e|examples|scripts|bench)/"
    r"|\bflashmodel_(engine|operator|kernels)/|\w\.(py|md|ipynb)\b"
)
# A number means something only with its unit (or what it counts).
_UNIT = re.compile(
    r"\b(seconds?|milliseconds?|minutes?|hours?|bytes|KiB|MiB|GiB|fraction|ratio|percent|requests?|tokens|"
    r"replicas|pods?|sequences|restarts|evictions|attempts|GPUs?|blocks?|relative weight)\b",
    re.IGNORECASE,
)

# A field named for its unit says that unit in words (kubectl explain shows the description, not the name's suffix).
_NAMED_UNITS = {"Milliseconds": "milliseconds", "Seconds": "seconds", "Ms": "milliseconds", "GiB": "GiB",
                "PerHour": "hour", "Ratio": "fraction"}


def _described(node: dict[str, Any]) -> str:
    return " ".join(str(node.get("description", "")).split())


def test_no_description_or_rule_message_names_a_repository_file() -> None:
    found = []
    for path, node in walk(schema(), ""):
        texts = [_described(node)] + [" ".join(r.get("message", "").split())
                                      for r in node.get("x-kubernetes-validations") or []]
        found += [f"{path}: {m.group(0)!r} in {t!r}" for t in texts for m in [_REPO_PATH.search(t)] if m]
    assert found == []


def test_the_repository_path_check_catches_a_path() -> None:
    assert _REPO_PATH.search("refused (docs/quantization.md)")
    assert _REPO_PATH.search("see flashmodel_engine/profiles.py")
    assert not _REPO_PATH.search("e.g. registry.example.com/models/qwen:1.5b, or http://otel:4317/v1/traces")


# Numbers whose descriptions get units and defaults in the autoscaling rework on its own branch.
def test_every_spec_number_says_its_unit_and_default() -> None:
    missing = []
    for path, node in walk(schema()["properties"]["spec"], "spec"):
        if node.get("type") not in ("integer", "number"):
            continue
        text = _described(node)
        named = next((u for suffix, u in _NAMED_UNITS.items() if path.endswith(suffix)), None)
        if named is not None:
            if not re.search(rf"\b{named}\b", text, re.IGNORECASE):
                missing.append(f"{path}: its name says {named}, its description does not: {text!r}")
        elif not _UNIT.search(text):
            missing.append(f"{path}: no unit in {text!r}")
        if "default" in node and not re.search(rf"\b[Dd]efault:? {re.escape(str(node['default']))}\b", text):
            missing.append(f"{path}: default {node['default']} not in {text!r}")
    assert missing == []
