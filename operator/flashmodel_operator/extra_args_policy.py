"""The cluster admin's additions to the extraArgs allow-list (the chart's engineExtraArgs.allowed).

The allow-list itself is the engine's (flashmodel_engine.extra_args_allowed); a cluster may add
vLLM flags to it, never one the profile, the memory plan, the model's source or the engine's code
depends on (flashmodel_engine.profiles.NEVER_ALLOWED): such a setting stops the operator at start.
The CRD cannot see this setting, so the operator refuses what is off the list (EngineConfigRefused),
and passes the entries a model uses to its engine in the engine config (render.engine_config).
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from flashmodel_engine.profiles import extension_problems

ENV = "FLASHMODEL_EXTRA_ARGS_ALLOWED"
"""Comma-separated vLLM flags in full (--generation-config,--model-impl)."""

_current: tuple[str, ...] = ()


def from_environ(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The flags the environment adds; ValueError naming each entry that cannot be allowed."""
    flags = tuple(item.strip() for item in environ.get(ENV, "").split(",") if item.strip())
    problems = extension_problems(flags)
    if problems:
        raise ValueError(f"{ENV} (the chart's engineExtraArgs.allowed): " + "; ".join(problems))
    return flags


def current() -> tuple[str, ...]:
    return _current


def load(environ: Mapping[str, str] | None = None) -> tuple[str, ...]:
    """Read the environment once, at start-up, beside the operator's settings."""
    global _current
    _current = from_environ(os.environ if environ is None else environ)
    return _current


def use(flags: tuple[str, ...]) -> None:
    """Install an extension directly (tests)."""
    global _current
    _current = flags
