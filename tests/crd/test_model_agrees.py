"""The engine config reads every FlashModel spec the API server admits, and the examples parse.

The CRD's spec schema is generated from the operator's models (test_generated.py); the engine config
is written by hand beside them, so these tests walk the sections the operator copies into it and
name every field whose name, type, default, enum or bounds would refuse or change a spec value.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from tests.crd.test_schema import EXAMPLES, schema

# What a pydantic field says about the values it accepts, in the CRD's vocabulary.
Shape = dict[str, Any]


def _is_optional(annotation: Any) -> tuple[bool, Any]:
    """(True, T) for `T | None`, else (False, annotation)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) < len(get_args(annotation)):
            assert len(args) == 1, f"a union of several types has no CRD form: {annotation}"
            return True, args[0]
    return False, annotation


def _type_shape(annotation: Any) -> Shape:
    """The CRD schema node a Python type corresponds to, with its bounds, without a default."""
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extras = get_args(annotation)
        shape = _type_shape(inner)
        for extra in extras:
            assert isinstance(extra, FieldInfo), f"{annotation}: only Field(...) constraints have a CRD form here"
            _add_bounds(shape, extra.metadata)
        return shape
    if annotation is Any:
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return {"type": "object", "model": annotation}
    if origin is Literal:
        values = list(get_args(annotation))
        return {"type": "string", "enum": values}
    if origin is list:
        return {"type": "array", "items": _type_shape(get_args(annotation)[0])}
    if origin is dict:
        key, value = get_args(annotation)
        assert key is str, f"CRD maps have string keys, not {key}"
        if value is Any:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "object", "additionalProperties": _type_shape(value)}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    assert annotation in simple, f"no CRD type for {annotation}"
    return {"type": simple[annotation]}


_BOUNDS = {
    annotated_types.Ge: ("minimum", "ge"),
    annotated_types.Le: ("maximum", "le"),
    # Only the engine config uses `gt` (the CRD's schema has no exclusive bound of this form).
    annotated_types.Gt: ("exclusiveMinimum", "gt"),
    annotated_types.MinLen: ("minLength", "min_length"),
    annotated_types.MaxLen: ("maxLength", "max_length"),
}


def _add_bounds(shape: Shape, constraints: list[Any]) -> None:
    for constraint in constraints:
        kind = _BOUNDS.get(type(constraint))
        assert kind is not None, f"constraint {constraint!r} has no CRD counterpart here; add one to _BOUNDS"
        key, attr = kind
        # pydantic's length bounds are the CRD's item and property counts on lists and maps.
        if shape["type"] == "array":
            key = key.replace("Length", "Items")
        elif shape["type"] == "object":
            key = key.replace("Length", "Properties")
        shape[key] = getattr(constraint, attr)


def field_shape(field: FieldInfo) -> Shape:
    """The CRD schema node (type, enum, default, bounds, optional) a pydantic field stands for."""
    optional, annotation = _is_optional(field.annotation)
    shape = _type_shape(annotation)
    _add_bounds(shape, field.metadata)
    shape["required"] = field.is_required()
    if not field.is_required():
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            # The CRD says `default: {}` and the API server fills in the nested defaults, which
            # are compared field by field below.
            shape["default"] = {}
        elif default is not None:
            shape["default"] = default
        elif not optional:
            raise AssertionError(f"{field} defaults to None but its type {field.annotation} does not admit None")
    return shape


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_example_parses_as_the_operator_reads_it(path: Path) -> None:
    from flashmodel_operator.model import FlashModel

    doc = yaml.safe_load(path.read_text())
    body = {**doc, "metadata": {**doc["metadata"], "namespace": "default", "uid": "u"}}
    assert FlashModel.from_body(body).spec.model_dump(by_alias=True, exclude_unset=True) == doc["spec"]


def test_the_accelerators_agree_in_the_crd_the_operator_and_the_engine() -> None:
    from flashmodel_engine.config import Accelerator, EngineConfig
    from flashmodel_operator.model import FlashModelSpec

    crd = schema()["properties"]["spec"]["properties"]["accelerator"]
    ours = field_shape(FlashModelSpec.model_fields["accelerator"])
    assert list(get_args(Accelerator)) == ours["enum"] == crd["enum"]
    assert field_shape(EngineConfig.model_fields["accelerator"])["default"] == ours["default"] == crd["default"]


# The spec sections the operator copies into the engine config (render.engine_config), and the
# engine config's section that reads each. Fields only one side has are named with the reason.
_MIRRORED = {
    "engine": "EngineSettings",
    "prewarm": "PrewarmSettings",
    "health": "HealthSettings",
    "remediation": "RemediationSettings",
    "observability": "ObservabilitySettings",
}
# Only in the engine config: the cpu profile's KV-cache size, which no FlashModel field sets, and the
# cluster admin's extraArgs allow-list entries the model uses, which the operator's configuration sets.
_ENGINE_ONLY = {"engine": {"cpuKVCacheSpaceGiB", "extraArgsAllowed"}}


def _aliases(model: type[BaseModel]) -> dict[str, FieldInfo]:
    return {f.alias or name: f for name, f in model.model_fields.items()}


def _lower(field: FieldInfo) -> tuple[float, bool] | None:
    """The field's lower bound and whether the bound itself is admitted."""
    for c in field.metadata:
        if isinstance(c, annotated_types.Ge):
            return float(c.ge), True  # type: ignore[arg-type]
        if isinstance(c, annotated_types.Gt):
            return float(c.gt), False  # type: ignore[arg-type]
    return None


def _upper(field: FieldInfo) -> float | None:
    return next((float(c.le) for c in field.metadata if isinstance(c, annotated_types.Le)), None)  # type: ignore[arg-type]


@pytest.mark.parametrize("section", sorted(_MIRRORED))
def test_the_engine_config_reads_every_value_the_spec_admits(section: str) -> None:
    """A FlashModel the API server admits must not yield an engine config the engine refuses."""
    from flashmodel_engine import config
    from flashmodel_operator.model import FlashModelSpec

    spec_model = _section_model(FlashModelSpec.model_fields[section])
    engine_model: type[BaseModel] = getattr(config, _MIRRORED[section])
    spec_fields, engine_fields = _aliases(spec_model), _aliases(engine_model)
    problems = [
        f"{section}.{n}: in the spec, not in the engine config" for n in sorted(set(spec_fields) - set(engine_fields))
    ]
    problems += [
        f"{section}.{n}: in the engine config, not in the spec"
        for n in sorted(set(engine_fields) - set(spec_fields) - _ENGINE_ONLY.get(section, set()))
    ]
    for name in sorted(set(spec_fields) & set(engine_fields)):
        ours, theirs = spec_fields[name], engine_fields[name]
        mine, engine = field_shape(ours), field_shape(theirs)
        if mine["type"] != engine["type"] and (mine["type"], engine["type"]) != ("integer", "number"):
            problems.append(f"{section}.{name}: the spec's {mine['type']} is read as {engine['type']}")
        admitted: list[Any] = mine.get("enum", [])
        refused = set(admitted) - set(engine.get("enum", admitted))
        if refused:
            problems.append(f"{section}.{name}: the engine refuses {sorted(refused)}")
        low, high = _lower(theirs), _upper(theirs)
        spec_low, spec_high = _lower(ours), _upper(ours)
        if low is not None and (spec_low is None or spec_low[0] < low[0] or (spec_low[0] == low[0] and not low[1])):
            problems.append(f"{section}.{name}: the spec admits {spec_low}, the engine's lower bound is {low}")
        if high is not None and (spec_high is None or spec_high > high):
            problems.append(f"{section}.{name}: the spec admits {spec_high}, the engine's upper bound is {high}")
        # The engine's own default applies where the operator leaves the key out; None there means
        # "the accelerator profile decides", which the operator never leaves to it (checked below).
        if engine.get("default") is not None and engine.get("default") != mine.get("default"):
            problems.append(
                f"{section}.{name}: default {mine.get('default')!r} in the spec, "
                f"{engine.get('default')!r} in the engine config"
            )
    assert problems == []


def _section_model(field: FieldInfo) -> type[BaseModel]:
    _, annotation = _is_optional(field.annotation)
    assert isinstance(annotation, type) and issubclass(annotation, BaseModel)
    return annotation


@pytest.mark.parametrize("bound", ["default", "minimum", "maximum"])
def test_a_spec_at_the_crd_bounds_reaches_the_engine_unchanged(bound: str) -> None:
    """Every mirrored number at its CRD bound (or absent, for the defaults) arrives in the engine as set."""
    from flashmodel_engine.config import EngineConfig
    from flashmodel_operator.model import FlashModel
    from flashmodel_operator.render import engine_config

    spec_schema = schema()["properties"]["spec"]["properties"]
    spec: dict[str, Any] = {"model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}, "accelerator": "cpu"}
    for section in _MIRRORED:
        if bound != "default":
            numbers = {
                name: node[bound]
                for name, node in spec_schema[section]["properties"].items()
                if node.get("type") in ("integer", "number") and bound in node
            }
            spec[section] = numbers
    if bound != "default":
        spec["observability"] = {"otlpTracesEndpoint": "http://otel:4317"}
    body = {"metadata": {"name": "m", "namespace": "ns", "uid": "u"}, "spec": spec}
    fm = FlashModel.from_body(body)
    parsed = EngineConfig.model_validate(engine_config(fm))
    differences = []
    for section in _MIRRORED:
        ours = getattr(fm.spec, section)
        if ours is None:
            continue
        theirs = getattr(parsed, section)
        for name in type(ours).model_fields:
            if name == "image":  # the pod's image, not a setting the engine reads
                continue
            if getattr(ours, name) is not None and getattr(theirs, name) != getattr(ours, name):
                differences.append(f"{section}.{name}: {getattr(ours, name)!r} set, {getattr(theirs, name)!r} read")
    assert differences == []


def test_spec_engine_fields_are_the_engine_configs_with_the_crds_defaults() -> None:
    """One definition of each spec.engine field: the engine's type, bounds and description."""
    from flashmodel_engine.config import EngineSettings
    from flashmodel_engine.profiles import PROFILES
    from flashmodel_operator.model import EngineSpec, FlashModelSpec

    problems = []
    for name, ours in EngineSpec.model_fields.items():
        if name == "image":  # the pod's image: the engine only reads it as information
            continue
        theirs = EngineSettings.model_fields[name]
        if ours.metadata != theirs.metadata:
            problems.append(f"{name}: bounds {ours.metadata} in the spec, {theirs.metadata} in the engine")
        if not (ours.description or "").startswith(theirs.description or "-"):
            problems.append(f"{name}: the spec's description is not the engine's")
        _, annotation = _is_optional(theirs.annotation)
        if ours.annotation not in (theirs.annotation, annotation):
            problems.append(f"{name}: {ours.annotation} in the spec, {theirs.annotation} in the engine")
    assert problems == []
    # The CRD's defaults are the default accelerator's profile values, not numbers of their own.
    default = PROFILES[FlashModelSpec.model_fields["accelerator"].default]
    spec = EngineSpec()
    assert (spec.max_num_seqs, spec.max_model_len, spec.gpu_memory_utilization) == (
        default.max_num_seqs, default.max_model_len, default.default_gpu_memory_utilization)


def _side(constraint: Any) -> str:
    return {annotated_types.Ge: "floor", annotated_types.Gt: "floor", annotated_types.Le: "ceiling",
            annotated_types.Lt: "ceiling"}.get(type(constraint), repr(constraint))


@pytest.mark.parametrize("section", ["prewarm", "health", "remediation"])
def test_the_pod_watch_sections_are_the_engines_fields_narrowed_only(section: str) -> None:
    """prewarm, health and remediation: the engine's descriptions, and its bounds or stricter ones."""
    from flashmodel_engine import config
    from flashmodel_operator.model import FlashModelSpec

    spec_model = _section_model(FlashModelSpec.model_fields[section])
    engine_model = getattr(config, _MIRRORED[section])
    problems = []
    for name, ours in spec_model.model_fields.items():
        theirs = engine_model.model_fields[name]
        if not (ours.description or "").startswith(theirs.description or "-"):
            problems.append(f"{name}: the spec's description is not the engine's")
        if ours.alias != theirs.alias:
            problems.append(f"{name}: alias {ours.alias} in the spec, {theirs.alias} in the engine")
        # An engine bound may be missing from the spec only where a bound of the same side replaced it
        # (engine_field checks that the replacement is stricter).
        added_sides = {_side(c) for c in ours.metadata if c not in theirs.metadata}
        for constraint in theirs.metadata:
            if constraint not in ours.metadata and _side(constraint) not in added_sides:
                problems.append(f"{name}: the engine's {constraint!r} is not in the spec")
    assert problems == []


def test_a_spec_field_cannot_allow_what_the_engine_refuses() -> None:
    from flashmodel_engine.config import HealthSettings, RemediationSettings
    from flashmodel_operator.spec_fields import engine_field

    with pytest.raises(ValueError, match="allows what the engine refuses"):
        engine_field(RemediationSettings, "divergence_ratio", le=2)
    with pytest.raises(ValueError, match="allows what the engine refuses"):
        engine_field(HealthSettings, "readiness_deadline_seconds", ge=0)  # the engine says gt=0
    assert engine_field(HealthSettings, "readiness_deadline_seconds", ge=1).metadata


def _default_mismatches(
    spec_model: type[BaseModel], engine_model: type[BaseModel], written: frozenset[str]
) -> list[str]:
    """Fields the engine config leaves out at their spec default where the engine's default differs."""
    engine_fields = _aliases(engine_model)
    differing = []
    for name, field in spec_model.model_fields.items():
        if name in written or name == "image":  # the image is the pod's, never written
            continue
        ours = field.get_default(call_default_factory=True)
        theirs = engine_fields[field.alias or name].get_default(call_default_factory=True)
        if ours != theirs:
            differing.append(f"{name}: {ours!r} in the spec, {theirs!r} in the engine")
    return differing


@pytest.mark.parametrize("section", sorted(_MIRRORED))
def test_a_field_left_out_at_its_default_means_the_same_to_the_engine(section: str) -> None:
    """The engine config leaves out a newer field at its spec default, so the engine's default must be it."""
    from flashmodel_engine import config
    from flashmodel_operator.model import FlashModelSpec
    from flashmodel_operator.render import ALWAYS_WRITTEN

    spec_model = _section_model(FlashModelSpec.model_fields[section])
    assert _default_mismatches(spec_model, getattr(config, _MIRRORED[section]), ALWAYS_WRITTEN[section]) == []


def test_the_default_check_catches_a_spec_default_the_engine_does_not_share() -> None:
    from flashmodel_engine.config import EngineSettings
    from flashmodel_operator.model import EngineSpec
    from flashmodel_operator.render import ALWAYS_WRITTEN
    from pydantic import Field, create_model

    grown_engine = create_model("GrownEngine", __base__=EngineSettings, new_setting=(int | None, Field(default=None)))
    grown_spec = create_model("GrownSpec", __base__=EngineSpec, new_setting=(int, Field(default=5)))
    assert _default_mismatches(grown_spec, grown_engine, ALWAYS_WRITTEN["engine"]) == [
        "new_setting: 5 in the spec, None in the engine"
    ]
