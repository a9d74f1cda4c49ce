"""What the engine pod and the operator both rely on, defined once and imported by both sides.

Only names both sides use belong here; docs/design.md ("The pod contract") lists each with who
writes it and who reads it. The config file's keys are not repeated: the operator renders the
engine config and checks it against the engine's own model (`flashmodel_engine.config`).
"""

from __future__ import annotations

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
HEALTH_POLL_PATH = "/health/poll"
"""The operator's poll in one small JSON answer: /readyz's result and the few /metrics values it reads.

A fleet's pods are polled every few seconds each; /readyz and a 33 kB /metrics page scanned for six
series were most of the operator's idle CPU. An engine from before this path answers 404, and the
operator then polls it the two-request way."""

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
