"""status.adapters and the AdaptersReady condition: pure functions of what the pods' shims answered.

Apart from flashmodel_operator.adapters (the PUTs) so that the status writer and the reconcile read it
without importing the pod watches' modules.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flashmodel_operator.pod_state import DesiredAdapters, PodRecord


def summary(wanted: DesiredAdapters, pods: Mapping[str, PodRecord]) -> list[dict[str, Any]] | None:
    """status.adapters: per adapter, on how many serving and standby pods it is loaded, and why not.

    None when LoRA is off (the key is cleared). A pod counts once it is prewarmed, serving or standby;
    an adapter counts as loaded on it only as the spec has it now (its entry's hash), so a changed
    source is not reported loaded from the old one.
    """
    if not wanted.on:
        return None
    counted = sorted((name, r) for name, r in pods.items() if r.prewarmed)
    out = []
    for item in wanted.entries:
        name, want = item["name"], wanted.entry_hashes[item["name"]]
        on_pods = [(pod, r.adapters.get(name)) for pod, r in counted]
        loaded = sum(1 for _, seen in on_pods if seen is not None and seen.entry == want and seen.loaded)
        row: dict[str, Any] = {"name": name, "loadedPods": loaded, "pods": len(counted)}
        failed = next(
            (f"{pod}: {seen.reason or 'failed'}" for pod, seen in on_pods
             if seen is not None and seen.entry == want and not seen.loaded),
            None,
        )
        if failed is not None:
            row["reason"] = failed[:1024]
        out.append(row)
    return out


def condition(spec_on: bool, adapters: list[dict[str, Any]] | None, names: list[str]) -> tuple[bool, str, str] | None:
    """(status, reason, message) of the AdaptersReady condition from status.adapters; None when LoRA is off."""
    if not spec_on:
        return None
    if not names:
        return True, "NoAdapters", "LoRA is on and spec.adapters is empty"
    rows = {r.get("name"): r for r in adapters or [] if isinstance(r, dict)}
    nowhere = [f"{n} ({rows[n].get('reason')})" for n in names
               if n in rows and rows[n].get("reason") and not rows[n].get("loadedPods")]
    if nowhere:
        return False, "AdapterFailed", "loaded on no pod: " + "; ".join(nowhere)
    partly = [f"{n} ({rows[n].get('reason')})" for n in names if n in rows and rows[n].get("reason")]
    if partly:
        return False, "AdapterFailedOnSomePods", "failed on some pods: " + "; ".join(partly)
    waiting = [n for n in names if n not in rows or not rows[n].get("pods")
               or rows[n].get("loadedPods", 0) < rows[n].get("pods", 0)]
    if waiting:
        return False, "AdaptersLoading", "not yet loaded on every pod: " + ", ".join(waiting)
    return True, "AdaptersLoaded", f"{len(names)} adapters loaded on every serving and standby pod"
