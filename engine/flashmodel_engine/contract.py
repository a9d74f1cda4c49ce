"""What the engine pod and the operator both rely on, defined once and imported by both sides.

Only names both sides use belong here; docs/design.md ("The pod contract") lists each with who
writes it and who reads it. The config file's keys are not repeated: the operator renders the
engine config and checks it against the engine's own model (`flashmodel_engine.config`).
"""

from __future__ import annotations

from collections.abc import Mapping

ENGINE_PORT = 8000
"""vLLM's OpenAI server in the pod: the Service's target and the status endpoint."""
SHIM_PORT = 8081
"""The health shim: the kubelet's probes and the operator's prewarm and metrics scrapes."""

CONFIG_DIR = "/etc/flashmodel"
CONFIG_KEY = "engine.yaml"
"""The ConfigMap key the operator writes and the file name the launcher reads."""
CONFIG_FILE = f"{CONFIG_DIR}/{CONFIG_KEY}"

# The launcher exits with EX_CONFIG (sysexits.h) when the preflight or the profile refuses the
# model or its settings; the operator reads it from the container's last state and holds the
# model at zero replicas, since restarting such a pod cannot succeed until the spec changes.
PREFLIGHT_EXIT_CODE = 78

# The shim's endpoints: the probes the operator renders and the calls it makes.
STARTUP_PATH = "/startupz"
LIVENESS_PATH = "/livez"
READINESS_PATH = "/readyz"
PREWARM_PATH = "/prewarm"
METRICS_PATH = "/metrics"
ADAPTERS_PATH = "/adapters"
"""LoRA adapters at run time. PUT (the operator's control token, like POST /prewarm) with the whole desired
set, `{"adapters": [ADAPTER, ...]}`, where ADAPTER is `{"name": N, "path": "/in/the/pod"}` or
`{"name": N, "hub": "org/repo", "revision": "<40 hex>"}`: the shim loads what is new or changed, unloads
what is gone, and answers 200 with the state of each, `{"adapters": [{"name": N, "state": "loaded" |
"failed", "reason": R}], "set": "<hash of the desired set>"}`; a malformed body gets 400 with a reason.
GET answers the same without changing anything. One adapter failing never unloads the base model or
the other adapters. The operator PUTs the set on every pod whenever it changes, and on a new pod before
its prewarm, which then covers every loaded adapter."""
ADAPTER_LOADED = "flashmodel_adapter_loaded"
"""A gauge per adapter (label `adapter`): 1 loaded, 0 failed."""
HEALTH_POLL_PATH = "/health/poll"
"""The operator's poll in one small JSON answer: /readyz's result and the few /metrics values it reads.

A fleet's pods are polled every few seconds each; /readyz and a 33 kB /metrics page scanned for six
series were most of the operator's idle CPU."""
HEALTH_POLL_MAX_WAIT_SECONDS = 300.0
"""The longest a health poll may wait for a change (`?wait=<seconds>&unless=<state>`).

A steady pod's answer rarely changes, so the operator asks the shim to hold the poll until it
would answer something else (readiness, the engine's generation, prewarm, the divergence
recommendation) or the wait is over: a fleet's polls come every half minute instead of every few
seconds, and a change is answered as the shim sees it, not at the next poll."""
HEALTH_POLL_STARTUP = "startupSeconds"
"""The health poll answer's start-up of the engine, `{phase: seconds}`: the phases of
flashmodel_startup_seconds known so far (STARTUP_PHASES), which the operator writes into status.pods.
Not part of the answer's `state`: the phases are all known before the pod's prewarm ends, and the
operator's first poll after the prewarm is never held."""
STARTUP_PHASES = (
    "launcher", "engine_load", "weights", "model_load", "compile", "graph_capture", "engine_init",
    "engine_init_other", "prewarm",
)
"""The `phase` values of flashmodel_startup_seconds. The shim's: launcher (process start to the shim
listening: the preflight), engine_load (vLLM's process start to its /health) and prewarm. vLLM's own,
from its log lines, all inside engine_load: weights (within model_load), compile and graph_capture
(within engine_init), and engine_init_other (engine_init less those two: memory profiling, the KV
cache, warm-up)."""


def health_poll_state(ready: bool, generation: float, prewarm_succeeded: bool, divergence_recommended: bool) -> str:
    """The `state` of a health poll's answer: the values the operator decides on, as one token.

    Not the request counts or the divergence ratio, which move with traffic: a waiting poll
    answers when this changes.
    """
    return f"r{int(ready)}g{generation:g}p{int(prewarm_succeeded)}d{int(divergence_recommended)}"


def parse_health_poll_wait(query: Mapping[str, str]) -> tuple[float, str | None]:
    """(seconds to wait, the state it waits to change from) of a health poll's query; ValueError says what to fix."""
    raw, unless = query.get("wait"), query.get("unless")
    if raw is None:
        if unless is not None:
            raise ValueError("unless= needs wait=<seconds>: how long to wait for the state to change")
        return 0.0, None
    try:
        wait = float(raw)
    except ValueError:
        raise ValueError(f"wait={raw[:40]!r} is not a number of seconds") from None
    if not 0 <= wait <= HEALTH_POLL_MAX_WAIT_SECONDS:  # NaN fails this too
        raise ValueError(f"wait={raw[:40]!r} is outside 0-{HEALTH_POLL_MAX_WAIT_SECONDS:g} seconds")
    if wait > 0 and not unless:
        raise ValueError("wait=<seconds> needs unless=<state>: the `state` of the answer the caller holds")
    return wait, unless

# Series the shim exports and the operator (or the autoscaler it renders) decides on.
ENGINE_GENERATION = "flashmodel_engine_generation"
MEMORY_DIVERGENCE_RATIO = "flashmodel_memory_divergence_ratio"
REMEDIATION_RECOMMENDED = "flashmodel_remediation_recommended"
REMEDIATION_REASON_LABEL = "reason"
MEMORY_DIVERGENCE_REASON = "memory_divergence"
"""The value of REMEDIATION_REASON_LABEL on which the operator drains and evicts for memory."""
PREWARM_SUCCEEDED = "flashmodel_prewarm_succeeded"
REQUESTS_FINISHED = "flashmodel_requests_finished"
"""A counter: Prometheus exposes it as `<name>_total`; client requests only, not probes or prewarm."""
REQUESTS_PER_SECOND = "flashmodel_requests_per_second"
REQUESTS_WAITING = "flashmodel_requests_waiting"
KV_CACHE_USAGE = "flashmodel_kv_cache_usage_ratio"
