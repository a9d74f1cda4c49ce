"""What the operator knows of each model's engine pods (in memory), and what it reads off a pod object."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flashmodel_operator.conditions import READY
from flashmodel_operator.remediation import PodHealth
from flashmodel_operator.render import PREWARM_GATE

STARTUP_PHASES = ("launcher", "engineOther", "weights", "compile", "graphCapture", "kvInit", "prewarm")
"""status.pods[].startupPhases' keys, in the order a start runs through them; they add up to startupSeconds."""


@dataclass(frozen=True)
class StartupTimes:
    """Where one start of a pod's engine spent its time, as status.pods[] shows it."""

    seconds: float
    """Process start to prewarmed: the sum of the phases."""
    phases: tuple[tuple[str, float], ...]
    """(phase, seconds) in STARTUP_PHASES order; a phase the engine did not report is left out."""

    @property
    def slowest(self) -> tuple[str, float]:
        return max(self.phases, key=lambda phase: phase[1])


def startup_times(engine: Mapping[str, float]) -> StartupTimes | None:
    """The engine's flashmodel_startup_seconds phases (its health poll's) in the status's terms.

    None until vLLM answered /health (engine_load), before which the start is not over. The
    engine's phases nest (weights inside model_load, compile and capture inside engine_init, all of
    those inside engine_load); the status's do not, so they add up: engineOther is what engine_load
    holds beyond vLLM's timed phases (its imports, the tokenizer, the API server), and weights is
    vLLM's model load (the weights' read and the model's construction) where it reports one.
    """
    load = engine.get("engine_load")
    if load is None:
        return None
    timed: dict[str, float | None] = {
        "weights": engine.get("model_load", engine.get("weights")),
        "compile": engine.get("compile"),
        "graphCapture": engine.get("graph_capture"),
        "kvInit": engine.get("engine_init_other"),
    }
    inside = sum(v for v in timed.values() if v is not None)
    found: dict[str, float | None] = {
        "launcher": engine.get("launcher"),
        "engineOther": max(0.0, load - inside),
        **timed,
        "prewarm": engine.get("prewarm"),
    }
    phases = tuple((name, round(found[name] or 0.0, 1)) for name in STARTUP_PHASES if found[name] is not None)
    return StartupTimes(seconds=round(sum(v for _, v in phases), 1), phases=phases)


@dataclass(frozen=True)
class DesiredAdapters:
    """The adapter set a model's spec asks for, as the shim's PUT body carries it (flashmodel_operator.adapters)."""

    key: tuple[str, int]
    """(uid, generation) of the spec it comes from."""
    on: bool
    """LoRA is on (spec.adapters or spec.lora): without it the pods have no /adapters to PUT to."""
    entries: tuple[dict[str, str], ...]
    set_hash: str
    entry_hashes: dict[str, str]
    """By adapter name, the hash of its entry: what AdapterOnPod.entry is compared with."""


@dataclass(frozen=True)
class AdapterOnPod:
    """One adapter as one pod's shim last answered for it."""

    entry: str
    """The hash of the adapter's entry in the PUT (its source): a changed adapter must be loaded again."""
    loaded: bool
    reason: str | None = None


@dataclass
class PodRecord:
    """status.pods[] of one pod: what its prewarm did."""

    prewarmed: bool = False
    cold_ttft_ms: float | None = None
    warm_ttft_ms: float | None = None
    last_prewarm_time: str | None = None
    prewarm_failures: int = 0
    reason: str | None = None
    standby: bool = False
    """Prewarmed, and held out of the Service (gate closed) until it is needed."""
    template: str = ""
    """The pod's config hash: which spec it runs."""
    startup: StartupTimes | None = None
    """The engine's last start, by phase, once its health poll reported it."""
    adapter_set: str = ""
    """The hash of the adapter set the pod's shim last answered a PUT for ("" before the first, and after
    its engine restarted): the pod has the spec's set when this is the model's current one."""
    adapters: dict[str, AdapterOnPod] = field(default_factory=dict)
    """What the pod's shim answered for each adapter, by name."""
    adapter_failures: int = 0
    """PUTs in a row that got no answer (the shim unreachable, a timeout, a 5xx)."""
    adapter_retry_at: float = 0.0
    """time.monotonic() before which the next PUT waits (a back-off after a failed one)."""

    @property
    def serving(self) -> bool:
        return self.prewarmed and not self.standby

    def to_status(self, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {"name": name, "prewarmed": self.prewarmed, "prewarmFailures": self.prewarm_failures}
        if self.standby:
            out["standby"] = True
        for key, value in (
            ("coldTTFTMs", self.cold_ttft_ms),
            ("warmTTFTMs", self.warm_ttft_ms),
            ("lastPrewarmTime", self.last_prewarm_time),
            ("reason", self.reason),
        ):
            if value is not None:
                out[key] = value
        if self.startup is not None:
            out["startupSeconds"] = self.startup.seconds
            out["startupPhases"] = dict(self.startup.phases)
        return out


@dataclass
class ModelState:
    """The operator's memory of one model's pods; the API server holds what must survive a restart."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    pods: dict[str, PodRecord] = field(default_factory=dict)
    health: dict[str, PodHealth] = field(default_factory=dict)
    in_flight: str | None = None
    last_remediation: float | None = None
    last_hold: str | None = None
    """The reason the model's remediation is held now (RestartBudgetExhausted, BackingOff, ...), if it is."""
    last_hold_message: str = ""
    latest_startup: tuple[str, str, StartupTimes] | None = None
    """(creationTimestamp, name, start-up) of the newest pod whose start-up was read, gone or not: status.startup."""
    written: tuple[list[dict[str, Any]], dict[str, Any] | None] | None = None
    """status.pods and status.startup as last written: a write that changes neither is skipped."""
    written_adapters: list[dict[str, Any]] | None = None
    """status.adapters as last written (None: never, or cleared)."""
    control_token: str | None = None
    """The model's `<name>-shim` token, which the shims require on POST /prewarm."""
    template: tuple[tuple[str, int], str] | None = None
    """((uid, generation), config hash) of the pods the model's spec renders now: a poll must not render it."""
    adapters: DesiredAdapters | None = None
    """The model's desired adapter set, computed once per generation."""
    adapter_seen: str | None = None
    """The spec's adapters and lora as the model's watch last delivered them: a change wakes held polls."""
    wakers: set[asyncio.Event] = field(default_factory=set)
    """The held health polls of the model's pods, each woken when the adapter set changes."""

    @property
    def idle(self) -> bool:
        """No pod watch holds anything here: nothing is lost when a deleted model's entry goes."""
        return (not self.pods and not self.health and self.in_flight is None and not self.lock.locked()
                and not self.wakers)


MODELS: dict[tuple[str, str], ModelState] = {}
"""The one table of every model's pod memory: made on a model's first use, dropped with the model (forget)."""


def model_state(namespace: str, model: str) -> ModelState:
    return MODELS.setdefault((namespace, model), ModelState())


def forget(namespace: str, model: str) -> None:
    """The model is deleted. Its pods' watches that still run keep their reference until they end."""
    MODELS.pop((namespace, model), None)


def retain(models: set[tuple[str, str]]) -> None:
    """Drop the idle entries of models not in `models`: one a late pod watch made after its model's deletion.

    Only idle ones: a model's pods can be watched before the model's own watch lists it (start-up),
    and two entries for one model would split its one-eviction-at-a-time budget.
    """
    # A snapshot: the passes' threads add entries (model_state) while the event loop runs this.
    for key, state in list(MODELS.items()):
        if key not in models and state.idle:
            MODELS.pop(key, None)


PROMOTED = "Promoted"
"""The gate reason of a standby that now serves."""
STANDBY = "Standby"
"""The gate reason of a prewarmed pod held out of the Service as a standby."""
PREWARMED_REASONS = frozenset({"PrewarmSucceeded", "PrewarmDisabled", PROMOTED})
"""The gate reasons this operator writes when it opens the gate; anything else did not see our prewarm."""


def gate_is_true(pod: Mapping[str, Any]) -> bool:
    """The pod's readiness gate is open, and by this operator after a prewarm it saw succeed.

    A gate set True by anyone else (kwok sets every readiness gate of the pods it runs) is no prewarm.
    """
    return any(
        c.get("type") == PREWARM_GATE and c.get("status") == "True" and c.get("reason") in PREWARMED_REASONS
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def gate_is_standby(pod: Mapping[str, Any]) -> bool:
    """The pod's gate is closed by this operator because the pod waits, prewarmed, as a standby."""
    return any(
        c.get("type") == PREWARM_GATE and c.get("status") == "False" and c.get("reason") == STANDBY
        for c in (pod.get("status") or {}).get("conditions") or []
    )


def pod_is_ready(pod: dict[str, Any]) -> bool:
    """The pod's Ready condition: its containers' probes and all its readiness gates pass."""
    return any(
        c.get("type") == READY and c.get("status") == "True" for c in (pod.get("status") or {}).get("conditions") or []
    )


def container_restarts(pod: dict[str, Any]) -> int:
    return sum(int(c.get("restartCount", 0)) for c in (pod.get("status") or {}).get("containerStatuses") or [])
