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


def engine_field(section: type[BaseModel], name: str, *, default: Any = PydanticUndefined) -> Any:
    """The engine field `section.name` as a spec field: its bounds and description, and the CRD's default.

    Without `default` the engine's own applies (None: the accelerator profile decides). A number's
    default is said at the end of its description, since `kubectl explain` shows no defaults.
    """
    source = section.model_fields[name]
    bounds: dict[str, Any] = {}
    for constraint in source.metadata:
        keyword = _BOUNDS.get(type(constraint))
        if keyword is None:
            raise TypeError(f"{section.__name__}.{name}: constraint {constraint!r} has no CRD form")
        bounds[keyword] = getattr(constraint, keyword)
    description = source.description
    if description is None:
        raise TypeError(f"{section.__name__}.{name} has no description; the CRD shows it")
    if default is PydanticUndefined:
        if source.default_factory is not None:
            return Field(default_factory=source.default_factory, description=description, **bounds)
        default = source.default
    elif isinstance(default, (int, float)) and not isinstance(default, bool):
        description = f"{description} Default {default}."
    return Field(default=default, description=description, **bounds)
