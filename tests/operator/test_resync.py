"""When passes run: the resync spread over its period, and child events folded into as few passes as they need."""

from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any

import pytest


async def test_every_model_is_reconciled_once_per_period_spread_over_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashmodel_operator import handlers

    passes: list[tuple[tuple[str, str], float]] = []

    def reconcile(namespace: str, name: str, fresh: dict[str, Any] | None = None, child_event: bool = False) -> None:
        passes.append(((namespace, name), time.monotonic()))

    models = {("ns", f"m{i}"): {"metadata": {"namespace": "ns", "name": f"m{i}"}} for i in range(10)}
    monkeypatch.setattr(handlers, "_reconcile_latest", reconcile)
    monkeypatch.setattr(handlers, "FLASHMODELS", models)
    start = time.monotonic()
    loop = asyncio.create_task(handlers.resync_fleet(2.0))
    while len(passes) < 10 and time.monotonic() - start < 6:
        await asyncio.sleep(0.05)
    loop.cancel()
    first = passes[:10]
    assert sorted(key for key, _ in first) == sorted(models), "each model once in one period"
    # A timer per model would start them all together: 1,000 passes in one burst every period.
    times = [t - start for _, t in first]
    assert times[0] >= 0.15 and times[-1] >= 1.7, times
    assert max(b - a for a, b in itertools.pairwise(times)) < 0.6, times


async def test_a_failing_pass_does_not_stop_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashmodel_operator import handlers

    seen: list[str] = []

    def reconcile(namespace: str, name: str, fresh: dict[str, Any] | None = None, child_event: bool = False) -> None:
        seen.append(name)
        if name == "m0":
            raise ConnectionError("the API server went away")

    monkeypatch.setattr(handlers, "_reconcile_latest", reconcile)
    monkeypatch.setattr(handlers, "FLASHMODELS", {("ns", "m0"): {}, ("ns", "m1"): {}})
    loop = asyncio.create_task(handlers.resync_fleet(0.4))
    await asyncio.sleep(0.5)
    loop.cancel()
    assert seen[:2] == ["m0", "m1"]


def test_child_events_during_a_pass_fold_into_one_more_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    # A pass reads the latest of everything: ten pod events while one runs need one pass after it.
    from flashmodel_operator import handlers

    started, release = threading.Event(), threading.Event()
    passes: list[str] = []

    def reconcile(namespace: str, name: str, fresh: dict[str, Any] | None = None, child_event: bool = False) -> None:
        passes.append(name)
        if len(passes) == 1:
            started.set()
            release.wait(5)

    monkeypatch.setattr(handlers, "_reconcile_latest", reconcile)
    handlers.reconcile_for_child("ns", "qwen")  # queued: the handler's thread is not held
    assert started.wait(5)
    for _ in range(10):
        handlers.reconcile_for_child("ns", "qwen")  # the running pass will go again
    handlers.reconcile_for_child("ns", "other")  # another model is not held up
    deadline = time.monotonic() + 5
    while len(passes) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert passes == ["qwen", "other"]
    release.set()
    assert handlers.drain_child_passes(5)
    assert passes == ["qwen", "other", "qwen"]


def test_child_events_while_a_pass_waits_for_a_thread_fold_into_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # In a burst every child-pass thread is busy: a model's events that arrive while its pass waits
    # for one need no pass of their own, since the pass has read nothing yet.
    from flashmodel_operator import handlers

    release = threading.Event()
    passes: list[str] = []
    lock = threading.Lock()

    def reconcile(namespace: str, name: str, fresh: dict[str, Any] | None = None, child_event: bool = False) -> None:
        with lock:
            passes.append(name)
        if name.startswith("busy"):
            release.wait(5)

    monkeypatch.setattr(handlers, "_reconcile_latest", reconcile)
    for i in range(handlers.CHILD_PASS_WORKERS):
        handlers.reconcile_for_child("ns", f"busy-{i}")
    deadline = time.monotonic() + 5
    while len(passes) < handlers.CHILD_PASS_WORKERS and time.monotonic() < deadline:
        time.sleep(0.01)
    for _ in range(10):
        handlers.reconcile_for_child("ns", "qwen")
    assert "qwen" not in passes
    release.set()
    assert handlers.drain_child_passes(5)
    assert passes.count("qwen") == 1
    assert sorted(p for p in passes if p != "qwen") == sorted(f"busy-{i}" for i in range(handlers.CHILD_PASS_WORKERS))
