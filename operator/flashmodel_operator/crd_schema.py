"""The FlashModel CRD's spec schema, built from the pydantic models in model.py (its one source).

`python scripts/gen_crd.py` writes it into crds/flashmodel.yaml and the chart's copy; the rest of
that file (names, printer columns, subresources) is written by hand. The status schema comes from
status_model.py the same way.
"""

from __future__ import annotations

import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

import annotated_types
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from flashmodel_operator.model import FlashModelSpec, Rule
from flashmodel_operator.status_model import FlashModelStatus

# The order keys appear in, so the YAML reads as `kubectl explain` does: what it is, then its rules.
_ORDER = (
    "type", "format", "nullable", "description", "required", "default", "enum", "minimum", "maximum",
    "minLength", "maxLength", "maxItems", "maxProperties", "x-kubernetes-preserve-unknown-fields",
    "x-kubernetes-list-type", "x-kubernetes-list-map-keys", "items", "additionalProperties",
    "x-kubernetes-validations", "properties",
)  # fmt: skip

_BOUNDS = {
    annotated_types.Ge: ("minimum", "ge"),
    annotated_types.Le: ("maximum", "le"),
    annotated_types.MinLen: ("minLength", "min_length"),
    annotated_types.MaxLen: ("maxLength", "max_length"),
}


def _ordered(node: dict[str, Any]) -> dict[str, Any]:
    unknown = set(node) - set(_ORDER)
    assert not unknown, f"schema keys without a place in the order: {sorted(unknown)}"
    return {key: node[key] for key in _ORDER if key in node}


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
        raise TypeError(f"{annotation}: a union of several types has no structural schema")
    return annotation


def _add_bounds(node: dict[str, Any], constraints: list[Any], where: str) -> None:
    for constraint in constraints:
        kind = _BOUNDS.get(type(constraint))
        if kind is None:
            raise TypeError(f"{where}: constraint {constraint!r} has no CRD form; use ge, le, min_length or max_length")
        key, attr = kind
        # pydantic's lengths are the item count of a list and the property count of a map.
        if node["type"] == "array":
            key = key.replace("Length", "Items")
        elif node["type"] == "object":
            key = key.replace("Length", "Properties")
        node[key] = getattr(constraint, attr)


def _type_node(annotation: Any, where: str) -> dict[str, Any]:
    """The schema of a Python type: type, enum, bounds of Annotated, items, properties."""
    annotation = _without_none(annotation)
    origin = get_origin(annotation)
    if origin is Annotated:
        inner, *extras = get_args(annotation)
        node = _type_node(inner, where)
        for extra in extras:
            if not isinstance(extra, FieldInfo):
                raise TypeError(f"{where}: only Field(...) constraints have a CRD form, not {extra!r}")
            _add_bounds(node, extra.metadata, where)
        return node
    if annotation is Any:
        # Core Kubernetes types pass through: the API server validates them where they land.
        return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return object_schema(annotation, where)
    if origin is Literal:
        values = list(get_args(annotation))
        if not all(isinstance(v, str) for v in values):
            raise TypeError(f"{where}: only string Literals have a CRD form")
        return {"type": "string", "enum": values}
    if origin is list:
        return {"type": "array", "items": _ordered(_type_node(get_args(annotation)[0], f"{where}[]"))}
    if origin is dict:
        key, value = get_args(annotation)
        if key is not str:
            raise TypeError(f"{where}: CRD maps have string keys, not {key}")
        if value is Any:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {"type": "object", "additionalProperties": _ordered(_type_node(value, f"{where}{{}}"))}
    simple = {bool: "boolean", int: "integer", float: "number", str: "string"}
    if annotation not in simple:
        raise TypeError(f"{where}: no CRD type for {annotation}")
    return {"type": simple[annotation]}


def _default(field: FieldInfo, node: dict[str, Any]) -> Any:
    """The schema default, or None for none."""
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        # `{}`: the API server creates the object and fills in its fields' own defaults.
        return {}
    if isinstance(value, list) and not value:
        # A list of strings reads the same empty or absent, but the default shows it in kubectl explain.
        return [] if node.get("items", {}).get("type") == "string" else None
    if isinstance(value, dict) and not value:
        # Maps and core Kubernetes objects: absent means empty; no default keeps them out of stored objects.
        return None
    return value


def field_schema(field: FieldInfo, where: str) -> dict[str, Any]:
    """The schema of one field: its type's, with the field's description, default, bounds and extras."""
    node = _type_node(field.annotation, where)
    _add_bounds(node, field.metadata, where)
    if field.description is None:
        raise TypeError(f"{where} has no description: kubectl explain shows it; add Field(description=...)")
    node["description"] = field.description
    if not field.is_required():
        default = _default(field, node)
        if default is not None:
            node["default"] = default
    extra = field.json_schema_extra
    if isinstance(extra, dict):
        node.update(extra)
    return _ordered(node)


def _rules(rules: tuple[Rule, ...]) -> list[dict[str, str]]:
    return [{**rule.crd(), "rule": _CEL(rule.rule)} for rule in rules]


def object_schema(model: type[BaseModel], where: str = "spec") -> dict[str, Any]:
    """The schema of a model: its fields as properties, required ones listed, its CEL rules."""
    properties: dict[str, Any] = {}
    required: list[str] = []
    field_rules: dict[str, tuple[Rule, ...]] = getattr(model, "field_rules", {})
    for name, field in model.model_fields.items():
        alias = field.alias or name
        properties[alias] = field_schema(field, f"{where}.{alias}")
        if name in field_rules:
            properties[alias]["x-kubernetes-validations"] = _rules(field_rules[name])
        if field.is_required():
            required.append(alias)
    unknown = set(field_rules) - set(model.model_fields)
    if unknown:
        raise TypeError(f"{model.__name__}.field_rules names fields it does not have: {sorted(unknown)}")
    node: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        node["required"] = required
    rules: tuple[Rule, ...] = getattr(model, "rules", ())
    if rules:
        node["x-kubernetes-validations"] = _rules(rules)
    return _ordered(node)


def _described_schema(model: type[BaseModel], where: str) -> dict[str, Any]:
    node = object_schema(model, where)
    node["description"] = " ".join((model.__doc__ or "").split())
    return _ordered(node)


def spec_schema() -> dict[str, Any]:
    """The openAPIV3Schema of `spec`, described by FlashModelSpec's docstring."""
    return _described_schema(FlashModelSpec, "spec")


def status_schema() -> dict[str, Any]:
    """The openAPIV3Schema of `status`, described by FlashModelStatus's docstring."""
    return _described_schema(FlashModelStatus, "status")


SOURCE_CRD = "crds/flashmodel.yaml"
CHART_CRD = "charts/flashmodel-operator/files/crds/flashmodel.yaml"
# Where the generated block sits in the CRD file: the `spec:` property of openAPIV3Schema.
_SPEC_INDENT = 12
# PyYAML breaks a folded line at the first space past the width, so lines run one word beyond it.
_WIDTH = 100
# Texts longer than this go on their own lines: at the schema's deeper levels a longer one would run
# past _WIDTH beside its key.
_FOLD_AT = 76


class _Dumper(yaml.SafeDumper):
    """Block YAML that reads like the hand-written rest of the file."""

    def increase_indent(self, flow: bool = False, indentless: bool = False) -> None:
        # Entries of a list indented under their key, as in the rest of the file.
        super().increase_indent(flow, False)


class _CEL(str):
    """A CEL expression: kept on one line, since a fold at the width would split it mid-expression."""


def _cel(dumper: yaml.SafeDumper, value: _CEL) -> yaml.ScalarNode:
    return dumper.represent_scalar("tag:yaml.org,2002:str", str(value), style="|" if len(value) > _FOLD_AT else None)


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    # Long texts fold over lines (kubectl explain joins them again); short ones stay on their key's line.
    style = ">" if len(value) > _FOLD_AT and "\n" not in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


def _list(dumper: yaml.SafeDumper, value: list[Any]) -> yaml.SequenceNode:
    # Lists of names (required, enum) on one line, as `[a, b]`; lists of rules one per entry.
    flow = all(isinstance(v, str) and len(v) < 40 for v in value)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", value, flow_style=flow)


_Dumper.add_representer(str, _str)
_Dumper.add_representer(list, _list)
_Dumper.add_representer(_CEL, _cel)


def _block_yaml(key: str, schema: dict[str, Any]) -> str:
    """A `key:` block, indented to its place in the CRD file."""
    text = yaml.dump({key: schema}, Dumper=_Dumper, sort_keys=False, width=_WIDTH - _SPEC_INDENT, allow_unicode=True)
    pad = " " * _SPEC_INDENT
    return "".join(pad + line if line.strip() else line for line in text.splitlines(keepends=True))


def spec_yaml() -> str:
    """The `spec:` block, indented to its place in the CRD file."""
    return _block_yaml("spec", spec_schema())


def status_yaml() -> str:
    """The `status:` block, indented to its place in the CRD file."""
    return _block_yaml("status", status_schema())


def _replace_block(lines: list[str], key: str, text: str) -> list[str]:
    """`lines` with the property `key` of openAPIV3Schema (its line and every deeper one) replaced by text."""
    pad = " " * _SPEC_INDENT
    starts = [i for i, line in enumerate(lines) if line == f"{pad}{key}:\n"]
    if len(starts) != 1:
        raise ValueError(f"expected one line {pad}{key}: (openAPIV3Schema.properties.{key}), found {len(starts)}")
    start = starts[0]
    end = next(
        (
            i for i in range(start + 1, len(lines))
            if lines[i].strip() and (len(lines[i]) - len(lines[i].lstrip(" ")) <= _SPEC_INDENT)
            and not lines[i].lstrip(" ").startswith("#")
        ),
        len(lines),
    )
    return [*lines[:start], *text.splitlines(keepends=True), *lines[end:]]


def render_crd(text: str) -> str:
    """The CRD file `text` with its spec and status schemas replaced by the ones the models give."""
    lines = text.splitlines(keepends=True)
    lines = _replace_block(lines, "spec", spec_yaml())
    lines = _replace_block(lines, "status", status_yaml())
    return "".join(lines)
