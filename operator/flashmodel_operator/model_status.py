"""status.pods and status.remediations of a FlashModel as the pod watches keep them; reconcile writes them."""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from typing import Any

from flashmodel_operator.adapter_status import summary
from flashmodel_operator.apply import Cluster
from flashmodel_operator.pod_state import ModelState
from flashmodel_operator.reconcile import write_pod_records

log = logging.getLogger(__name__)

HISTORY = 10


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


async def write_pods(cluster: Cluster, namespace: str, model: str, state: ModelState) -> None:
    """status.pods from the watches' records, written (by reconcile's writer) only when they changed."""
    async with state.lock:
        pods = [record.to_status(name) for name, record in sorted(state.pods.items())]
        # status.adapters comes from the same records (adapters.summary); None clears it once LoRA is off.
        adapters = summary(state.adapters, state.pods) if state.adapters is not None else None
        if pods == state.written and adapters == state.written_adapters:
            return
        extra = {"adapters": adapters} if adapters is not None or state.written_adapters is not None else {}
        state.written, state.written_adapters = pods, adapters
    try:
        await asyncio.to_thread(write_pod_records, cluster, namespace, model, pods, extra)
    except Exception as exc:  # the model may be gone; the next change writes again
        log.info("event=pods-status-skipped model=%s/%s error=%s", namespace, model, exc)
