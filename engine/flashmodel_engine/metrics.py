"""Engine metrics: vLLM's passed through, plus flashmodel_* (rates, memory, divergence, prewarm, probes)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from flashmodel_engine.config import RemediationSettings
from flashmodel_engine.contract import (
    ADAPTER_LOADED,
    ENGINE_GENERATION,
    KV_CACHE_USAGE,
    MEMORY_DIVERGENCE_RATIO,
    MEMORY_DIVERGENCE_REASON,
    PREWARM_SUCCEEDED,
    REMEDIATION_REASON_LABEL,
    REMEDIATION_RECOMMENDED,
    REQUESTS_FINISHED,
    REQUESTS_PER_SECOND,
    REQUESTS_WAITING,
)
from flashmodel_engine.startup_phases import PHASES as VLLM_PHASES
from flashmodel_engine.startup_phases import StartupPhases

ENGINE_INIT_OTHER = "engine_init_other"
"""vLLM's engine_init less its compile and graph capture (memory profiling, the KV cache, warm-up)."""
log = logging.getLogger("flashmodel.metrics")

# vLLM renamed its KV-cache gauge (>= 0.10: kv_cache_usage_perc); both are fractions 0..1.
KV_CACHE_METRICS = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
RATE_WINDOW_SECONDS = 30.0


@dataclass(frozen=True)
class EngineSample:
    """What vLLM's /metrics said at one moment (sums over label sets)."""

    kv_cache_usage: float | None
    running: float
    waiting: float
    request_success_total: float
    generation_tokens_total: float


def parse_vllm_metrics(text: str) -> EngineSample:
    """Pull the few numbers we act on out of vLLM's Prometheus text."""
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + float(s.value)
    kv = next((values[n] for n in KV_CACHE_METRICS if n in values), None)
    return EngineSample(
        kv_cache_usage=kv,
        running=values.get("vllm:num_requests_running", 0.0),
        waiting=values.get("vllm:num_requests_waiting", 0.0),
        request_success_total=values.get("vllm:request_success_total", 0.0),
        generation_tokens_total=values.get("vllm:generation_tokens_total", 0.0),
    )


@dataclass(frozen=True)
class MemorySample:
    """Memory of the engine's process tree: GPU memory from NVML, or host RSS on the CPU."""

    used_bytes: int
    total_bytes: int
    pinned_bytes: int
    source: str  # "nvml" | "host_rss"


def process_tree(root: int) -> list[int]:
    """`root` and all its descendants, from /proc (vLLM's engine core and workers are children)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def _status_kib(pid: int, key: str) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def host_memory_total() -> int:
    """The cgroup's memory limit when there is one (a pod's limit), else the host's MemTotal."""
    total = 0
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            total = int(line.split()[1]) * 1024
    try:
        raw = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if raw.isdigit() and 0 < int(raw) < total:
            return int(raw)
    except OSError:
        pass
    return total


class MemoryReader:
    """Reads the engine's memory: NVML when a GPU is present, host RSS of the process tree otherwise."""

    def __init__(self) -> None:
        self._nvml: Any = None
        try:
            import pynvml

            pynvml.nvmlInit()
            if pynvml.nvmlDeviceGetCount() > 0:
                self._nvml = pynvml
        except Exception:  # no library, no driver or no device: the CPU path is the answer
            self._nvml = None
        self._host_total = host_memory_total()

    @property
    def source(self) -> str:
        return "nvml" if self._nvml is not None else "host_rss"

    def read(self, root_pid: int) -> MemorySample:
        pids = process_tree(root_pid)
        if self._nvml is not None:
            return self._read_nvml(pids)
        rss = sum(_status_kib(p, "VmRSS") for p in pids) * 1024
        pinned = sum(_status_kib(p, "VmPin") + _status_kib(p, "VmLck") for p in pids) * 1024
        return MemorySample(used_bytes=rss, total_bytes=self._host_total, pinned_bytes=pinned,
                            source="host_rss")

    def _read_nvml(self, pids: list[int]) -> MemorySample:
        nv = self._nvml
        h = nv.nvmlDeviceGetHandleByIndex(0)
        info = nv.nvmlDeviceGetMemoryInfo(h)
        wanted = set(pids)
        used = sum(int(p.usedGpuMemory or 0) for p in nv.nvmlDeviceGetComputeRunningProcesses(h)
                   if p.pid in wanted)
        if used == 0:
            # In a container NVML reports host pids, which never match ours: the pod owns the card,
            # so the device's used memory is the engine's.
            used = int(info.used)
        return MemorySample(used_bytes=used, total_bytes=int(info.total), pinned_bytes=0, source="nvml")


class DivergenceTracker:
    """Memory above the post-prewarm baseline while the engine is nearly idle, sustained over a window.

    Under real load memory rises with the KV cache and activations; that is not divergence, so
    the clock only runs while KV-cache usage is below lowKVCacheUsage and at most one request
    (a readiness probe) is running or waiting.
    """

    def __init__(self, settings: RemediationSettings) -> None:
        self.settings = settings
        self.baseline_bytes: int | None = None
        self.ratio = 0.0
        self.since: float | None = None
        self.recommended = False

    def set_baseline(self, used_bytes: int) -> None:
        self.baseline_bytes = used_bytes
        self.since, self.recommended = None, False

    def observe(self, now: float, memory: MemorySample, engine: EngineSample | None) -> bool:
        """Feed one sample; returns whether remediation is recommended for memory divergence."""
        if self.baseline_bytes is None or memory.total_bytes <= 0:
            self.ratio = 0.0
            return False
        self.ratio = max(0.0, (memory.used_bytes - self.baseline_bytes) / memory.total_bytes)
        idle = engine is not None and (engine.kv_cache_usage or 0.0) < self.settings.low_kv_cache_usage and (
            engine.running + engine.waiting <= 1)
        if self.ratio > self.settings.divergence_ratio and idle:
            if self.since is None:
                self.since = now
            sustained = now - self.since >= self.settings.divergence_window_seconds
        else:
            self.since, sustained = None, False
        was = self.recommended
        self.recommended = sustained and self.settings.enabled
        if self.recommended and not was:
            log.warning("event=memory-divergence ratio=%.4f used_bytes=%d baseline_bytes=%d total_bytes=%d",
                        self.ratio, memory.used_bytes, self.baseline_bytes, memory.total_bytes)
        return self.recommended


class EngineMetrics:
    """The flashmodel_* metrics in their own registry; vLLM's text is prepended at scrape time."""

    def __init__(self, settings: RemediationSettings) -> None:
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.requests_per_second = Gauge(REQUESTS_PER_SECOND,
                                         "Client requests finished per second (30 s window).", registry=r)
        # A counter for PromQL's rate() (what the autoscaler's queries use); the gauge above is the
        # same rate over the shim's own window, for an HPA on Pods metrics through an adapter.
        self.requests_finished = Counter(REQUESTS_FINISHED,
                                         "Client requests vLLM finished (the shim's probes and prewarm excluded).",
                                         registry=r)
        self.requests_waiting = Gauge(REQUESTS_WAITING, "Requests waiting in vLLM's queue.",
                                      registry=r)
        self.kv_cache_usage = Gauge(KV_CACHE_USAGE,
                                    "vLLM KV-cache usage, 0..1 (either vLLM metric name).", registry=r)
        self.divergence_ratio = Gauge(MEMORY_DIVERGENCE_RATIO,
                                      "Memory above the post-prewarm baseline, as a fraction of total.",
                                      registry=r)
        self.remediation = Gauge(REMEDIATION_RECOMMENDED,
                                 "1 when the pod should be drained and replaced, by reason.",
                                 [REMEDIATION_REASON_LABEL], registry=r)
        self.prewarm_succeeded = Gauge(PREWARM_SUCCEEDED, "1 after a successful prewarm.",
                                       registry=r)
        self.prewarm_duration = Gauge("flashmodel_prewarm_duration_seconds", "Last prewarm's duration.",
                                      registry=r)
        self.prewarm_ttft = Gauge("flashmodel_prewarm_ttft_seconds", "Last prewarm's TTFT, cold and warm.",
                                  ["phase"], registry=r)
        self.generation = Gauge(ENGINE_GENERATION,
                                "Starts of the vLLM process in this pod (re-arm readiness when it moves).",
                                registry=r)
        self.engine_up = Gauge("flashmodel_engine_up", "1 while vLLM's /health answers 200.", registry=r)
        self.memory_used = Gauge("flashmodel_memory_used_bytes", "Engine process-tree memory in use.",
                                 ["source"], registry=r)
        self.memory_total = Gauge("flashmodel_memory_total_bytes", "Memory of the card (or host/cgroup).",
                                  ["source"], registry=r)
        self.memory_pinned = Gauge("flashmodel_memory_pinned_bytes", "Pinned/locked host memory of the "
                                   "engine's processes.", registry=r)
        self.memory_baseline = Gauge("flashmodel_memory_baseline_bytes", "Memory in use right after prewarm.",
                                     registry=r)
        self.probe_latency = Histogram(
            "flashmodel_probe_generation_latency_seconds", "Readiness one-token generation latency.",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10), registry=r)
        self.startup_seconds = Gauge(
            "flashmodel_startup_seconds",
            "Start-up time by phase: the shim's launcher, engine_load (process start to /health) and prewarm; "
            "vLLM's own weights, model_load, compile, graph_capture and engine_init (which holds compile and "
            "capture), and engine_init_other (engine_init less those two: memory profiling, KV cache, warm-up).",
            ["phase"], registry=r)
        self.startup_graph_memory = Gauge("flashmodel_startup_graph_memory_bytes",
                                          "The CUDA graph pool vLLM captured at start-up (0: eager or not yet).",
                                          registry=r)
        self.adapter_loaded = Gauge(ADAPTER_LOADED, "Per LoRA adapter of the set: 1 loaded, 0 failed.",
                                    ["adapter"], registry=r)
        for reason in (MEMORY_DIVERGENCE_REASON, "hung_readiness"):
            self.remediation.labels(reason).set(0)
        self.prewarm_succeeded.set(0)
        self.divergence = DivergenceTracker(settings)
        self._success: deque[tuple[float, float]] = deque()
        self._success_seen: float | None = None
        self._client_high = 0.0

    def observe_engine(
        self, now: float, sample: EngineSample, own_requests: float, own_in_flight: bool = False
    ) -> None:
        """`own_in_flight`: a prewarm is running, whose requests the shim counts as its own only once it ends."""
        if sample.kv_cache_usage is not None:
            self.kv_cache_usage.set(sample.kv_cache_usage)
        self.requests_waiting.set(sample.waiting)
        # Our own probes and warm-ups are not client traffic.
        client = sample.request_success_total - own_requests
        if self._success_seen is None or sample.request_success_total < self._success_seen:
            # The first sample, or a restarted vLLM counting from zero: the counter goes on from here.
            self._client_high = client
        elif client > self._client_high and not own_in_flight:
            # A probe counts in own_requests when it starts and in vLLM's total when it ends, so the
            # client count dips while one runs; only a new high is client traffic.
            self.requests_finished.inc(client - self._client_high)
            self._client_high = client
        self._success_seen = sample.request_success_total
        self._success.append((now, client))
        while self._success and now - self._success[0][0] > RATE_WINDOW_SECONDS:
            self._success.popleft()
        (t0, c0), (t1, c1) = self._success[0], self._success[-1]
        self.requests_per_second.set(max(0.0, (c1 - c0) / (t1 - t0)) if t1 > t0 else 0.0)

    def observe_memory(self, now: float, memory: MemorySample, engine: EngineSample | None) -> None:
        self.memory_used.labels(source=memory.source).set(memory.used_bytes)
        self.memory_total.labels(source=memory.source).set(memory.total_bytes)
        self.memory_pinned.set(memory.pinned_bytes)
        recommended = self.divergence.observe(now, memory, engine)
        self.divergence_ratio.set(self.divergence.ratio)
        self.remediation.labels(MEMORY_DIVERGENCE_REASON).set(1 if recommended else 0)

    def set_adapter(self, name: str, value: float | None) -> None:
        """An adapter's gauge; None removes its series (unloaded: it is not part of the set any more)."""
        if value is None:
            with contextlib.suppress(KeyError):
                self.adapter_loaded.remove(name)
        else:
            self.adapter_loaded.labels(adapter=name).set(value)

    def set_baseline(self, used_bytes: int) -> None:
        self.divergence.set_baseline(used_bytes)
        self.memory_baseline.set(used_bytes)

    def record_startup_phases(self, phases: StartupPhases) -> None:
        """vLLM's start-up phases as flashmodel_startup_seconds{phase} (a restart first clears them)."""
        for phase, seconds in phases.seconds.items():
            self.startup_seconds.labels(phase=phase).set(seconds)
        rest = phases.rest_of_engine_init()
        if rest is not None:
            self.startup_seconds.labels(phase=ENGINE_INIT_OTHER).set(rest)
        self.startup_graph_memory.set(phases.graph_memory_bytes or 0.0)

    def startup_by_phase(self) -> dict[str, float]:
        """flashmodel_startup_seconds as {phase: seconds}, the phases known so far."""
        return {
            sample.labels["phase"]: sample.value
            for family in self.startup_seconds.collect()
            for sample in family.samples
        }

    def clear_startup_phases(self) -> None:
        for phase in (*VLLM_PHASES, ENGINE_INIT_OTHER):
            with contextlib.suppress(KeyError):
                self.startup_seconds.remove(phase)
        self.startup_graph_memory.set(0.0)

    def render(self, vllm_text: str | None) -> bytes:
        ours = generate_latest(self.registry)
        if not vllm_text:
            return ours
        return vllm_text.rstrip("\n").encode() + b"\n" + ours


def now() -> float:
    return time.monotonic()
