"""The operator's timings from its environment, read once when it starts (`python -m flashmodel_operator`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class OperatorSettings:
    """Each field has an environment variable: FLASHMODEL_ and the field's name in upper case."""

    monitor_seconds: float = 5.0
    """How often each engine pod's watch looks at it while anything about it is in question."""
    health_poll_wait_seconds: float = 30.0
    """How long the shim may hold a steady pod's health poll, answering at once when what the operator decides
    on changes: 1,000 steady pods cost 33 polls a second instead of 200 (docs/benchmarks/operator.md, "Held
    health polls, side by side"), and a fault is answered as the shim sees it instead of at the next poll. 0
    polls every monitor_seconds."""
    endpoint_propagation_seconds: float = 5.0
    """After a drained pod's address left the EndpointSlices, time for proxies and clients to stop using it."""
    remediation_backoff_seconds: float = 60.0
    """After one remediation of a model, the next waits at least this long."""
    transient_grace_seconds: float = 30.0
    """How long transient API failures (after the client's own retries) may last before a model shows Degraded."""
    resync_seconds: float = 600.0
    """The period in which every model is reconciled once, spread evenly over it: the safety net for drift no
    watch event announces (an edited ConfigMap, Service or PDB); changes to the model, its Deployment, pods
    and HPA are reconciled as their events arrive. Each pass is about eight API reads, so 1,000 models at
    60 s cost 130 reads/s and a fifth of a core for nothing; 0 turns it off."""
    handler_backoff_seconds: float = 2.0
    """How soon kopf runs a failed handler again (its default is 60 s: one dropped request cost a minute)."""
    handler_threads: int = 32
    """kopf's threads for the model passes its events start (a model's first pass among them). A pass waits on
    the API server for most of its time, so in a burst of new models the threads, not the cores, set how many
    first passes are under way at once: 32 finished a burst of 300 sooner than 16 in each of three pairs of
    runs (docs/benchmarks/operator.md, "Where a burst's time goes")."""
    metrics_port: int = 8090
    """The operator's own /metrics; 0 turns it off."""
    heap_trim_seconds: float = 30.0
    """How often the operator frees what a busy period left (a full collection after churn) and hands freed heap
    pages back to the system (flashmodel_operator.heap); 0 turns it off."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> OperatorSettings:
        values: dict[str, float | int] = {}
        for f in dataclasses.fields(cls):
            name = f"FLASHMODEL_{f.name.upper()}"
            raw = environ.get(name)
            if raw is None or raw.strip() == "":
                continue
            kind = int if f.type in (int, "int") else float
            try:
                value = kind(raw)
            except ValueError:
                raise ValueError(
                    f"{name}={raw!r} is not {'an integer' if kind is int else 'a number'}; "
                    f"unset it for the default {f.default}"
                ) from None
            if value < 0:
                raise ValueError(f"{name}={raw!r} is negative; give 0 or more, or unset it for {f.default}")
            values[f.name] = value
        return cls(**values)  # type: ignore[arg-type]


_current = OperatorSettings()


def current() -> OperatorSettings:
    """The settings the operator started with (the defaults where it was not started by `load`)."""
    return _current


def load(environ: Mapping[str, str] | None = None) -> OperatorSettings:
    """Read the environment once, at start-up, before the handlers module is imported."""
    global _current
    _current = OperatorSettings.from_environ(os.environ if environ is None else environ)
    return _current


def use(settings: OperatorSettings) -> None:
    """Install settings directly (tests that need shorter timings)."""
    global _current
    _current = settings
