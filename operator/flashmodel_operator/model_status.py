"""status.pods and status.remediations of a FlashModel as the pod watches keep them; reconcile writes them."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections.abc import Mapping
from typing import Any

from prometheus_client import Histogram

from flashmodel_operator.adapter_status import summary
from flashmodel_operator.apply import Cluster
from flashmodel_operator.pod_state import STARTUP_PHASES, ModelState, PodRecord, startup_times
from flashmodel_operator.reconcile import write_pod_records

log = logging.getLogger(__name__)

HISTORY = 10

POD_STARTUP = Histogram(
    "flashmodel_operator_pod_startup_seconds",
    "Engine pod start-ups by phase (status.pods[].startupPhases; phase=total: process start to prewarmed), "
    "observed once per engine start when its health poll first reports it.",
    ["phase"],
    buckets=(1, 2.5, 5, 10, 20, 30, 45, 60, 90, 120, 180, 300, 600, 1200),
)
for _phase in (*STARTUP_PHASES, "total"):
    POD_STARTUP.labels(phase=_phase)


def now_iso() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def history_length(fm: dict[str, Any]) -> int:
    """How many status.remediations to keep: at least HISTORY, and all an hour's budget can hold."""
    budget = ((fm.get("spec") or {}).get("remediation") or {}).get("maxRestartsPerHour", 0)
    return max(HISTORY, int(budget) if isinstance(budget, int) else 0)


def restarts_last_hour(fm: dict[str, Any], now: dt.datetime) -> int:
    count = 0
    for entry in (fm.get("status") or {}).get("remediations") or []:
        try:
            at = dt.datetime.strptime(entry["time"], "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC)
        except (KeyError, ValueError):
            continue
        if now - at < dt.timedelta(hours=1):
            count += 1
    return count


def note_startup(
    state: ModelState, fm: Mapping[str, Any], name: str, record: PodRecord, engine: Mapping[str, float], created: str
) -> bool:
    """Take a pod's start-up phases from its health poll; True when they are new (status.pods is to be written).

    They change once per engine start, so this writes once per start, not once per poll. The
    histogram counts each start once: a start the model's status already shows was counted by the
    operator that wrote it (before a restart of this one). `created`: the pod's creationTimestamp.
    """
    times = startup_times(engine)
    if times is None or times == record.startup:
        return False
    record.startup = times
    if state.latest_startup is None or (created, name) >= state.latest_startup[:2]:
        state.latest_startup = (created, name, times)
    shown = any(
        entry.get("name") == name and entry.get("startupSeconds") == times.seconds
        for entry in (fm.get("status") or {}).get("pods") or []
    )
    if not shown:
        for phase, seconds in times.phases:
            POD_STARTUP.labels(phase=phase).observe(seconds)
        POD_STARTUP.labels(phase="total").observe(times.seconds)
    return True


def startup_summary(state: ModelState) -> dict[str, Any] | None:
    """status.startup: the newest pod's start-up and its slowest phase; None while no pod reported one."""
    if state.latest_startup is None:
        return None
    _, name, times = state.latest_startup
    phase, seconds = times.slowest
    return {"lastPod": name, "lastPodSeconds": times.seconds, "slowestPhase": phase, "slowestPhaseSeconds": seconds}


async def write_pods(cluster: Cluster, namespace: str, model: str, state: ModelState) -> None:
    """status.pods (and status.startup) from the watches' records, written (by reconcile's writer) only when
    they changed."""
    async with state.lock:
        pods = [record.to_status(name) for name, record in sorted(state.pods.items())]
        startup = startup_summary(state)
        # status.adapters comes from the same records (adapters.summary); None clears it once LoRA is off.
        adapters = summary(state.adapters, state.pods) if state.adapters is not None else None
        if (pods, startup) == state.written and adapters == state.written_adapters:
            return
        extra: dict[str, Any] = {}
        if adapters is not None or state.written_adapters is not None:
            extra["adapters"] = adapters
        if startup is not None:
            extra["startup"] = startup
        state.written, state.written_adapters = (pods, startup), adapters
    try:
        await asyncio.to_thread(write_pod_records, cluster, namespace, model, pods, extra)
    except Exception as exc:  # the model may be gone; the next change writes again
        log.info("event=pods-status-skipped model=%s/%s error=%s", namespace, model, exc)
