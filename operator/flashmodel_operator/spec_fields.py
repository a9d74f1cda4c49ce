"""Spec fields taken from the engine config's models, so a field's bounds and description have one source."""

from __future__ import annotations

from typing import Any

import annotated_types
from pydantic import BaseModel, Field
from pydantic_core import PydanticUndefined

# The constraints a CRD field can carry (crd_schema turns them into minimum, maximum, ...), by the
# attribute annotated_types keeps each in and the Field keyword that sets it.
_BOUNDS: dict[type[Any], str] = {
    annotated_types.Ge: "ge",
    annotated_types.Gt: "gt",
    annotated_types.Le: "le",
    annotated_types.Lt: "lt",
    annotated_types.MinLen: "min_length",
    annotated_types.MaxLen: "max_length",
}


def engine_field(
    section: type[BaseModel], name: str, *, default: Any = PydanticUndefined, **narrower: int | float
) -> Any:
    """The engine field `section.name` as a spec field: its bounds and description, and the CRD's default.

    Without `default` the engine's own applies (None: the accelerator profile decides). A number's
    default is said at the end of its description, since `kubectl explain` shows no defaults.
    `narrower` bounds (ge, le, ...) replace the engine's where the spec allows less than the engine
    accepts (the engine's tests run with windows of seconds a FlashModel must not set); each must be
    at least as strict as the engine's, so every spec value stays a value the engine reads.
    """
    source = section.model_fields[name]
    bounds: dict[str, Any] = {}
    for constraint in source.metadata:
        keyword = _BOUNDS.get(type(constraint))
        if keyword is None:
            raise TypeError(f"{section.__name__}.{name}: constraint {constraint!r} has no CRD form")
        bounds[keyword] = getattr(constraint, keyword)
    for keyword, value in narrower.items():
        if not _at_least_as_strict(keyword, value, bounds):
            raise ValueError(f"{section.__name__}.{name}: {keyword}={value} allows what the engine refuses ({bounds})")
        bounds.pop({"ge": "gt", "gt": "ge", "le": "lt", "lt": "le"}.get(keyword, ""), None)
        bounds[keyword] = value
    if source.alias is not None:
        bounds["alias"] = source.alias
    description = source.description
    if description is None:
        raise TypeError(f"{section.__name__}.{name} has no description; the CRD shows it")
    if default is PydanticUndefined:
        if source.default_factory is not None:
            return Field(default_factory=source.default_factory, description=description, **bounds)
        default = source.default
    if isinstance(default, (int, float)) and not isinstance(default, bool):
        description = f"{description} Default {default:g}."
    return Field(default=default, description=description, **bounds)


def _at_least_as_strict(keyword: str, value: float, bounds: dict[str, Any]) -> bool:
    """Whether the spec bound `keyword=value` admits only values the engine's `bounds` admit too."""
    if keyword in ("ge", "gt"):
        floor = [(bounds[k], k) for k in ("ge", "gt") if k in bounds]
        return all(value > f or (value == f and (k == "ge" or keyword == "gt")) for f, k in floor)
    if keyword in ("le", "lt"):
        ceiling = [(bounds[k], k) for k in ("le", "lt") if k in bounds]
        return all(value < c or (value == c and (k == "le" or keyword == "lt")) for c, k in ceiling)
    raise ValueError(f"{keyword}: only numeric bounds can be narrowed")
