"""PodWatch's waiting phase: a Pending pod is watched through kopf's live body, not by polling the API."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Literal

import aiohttp
from flashmodel_operator.apply import Cluster
from flashmodel_operator.gating import REMEDIATIONS, PodWatch
from flashmodel_operator.remediation import Decision


class CountingCluster(Cluster):
    """The real Cluster class with its transport replaced: counts reads, answers with a fixed pod."""

    def __init__(self, pod: dict[str, Any]) -> None:
        self.reads = 0
        self.pod = pod

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return self.pod

    def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any] | None:
        self.reads += 1
        return None  # the model is gone: the watch ends after its first real look


def _pod(phase: str, ip: str | None) -> dict[str, Any]:
    status: dict[str, Any] = {"phase": phase}
    if ip:
        status["podIP"] = ip
    return {"metadata": {"name": "qwen-abc", "namespace": "ns"}, "status": status}


async def test_pending_pod_costs_no_api_reads() -> None:
    pending = _pod("Pending", None)
    cluster = CountingCluster(pending)
    async with aiohttp.ClientSession() as session:
        watch = PodWatch(cluster, session, "ns", "qwen-abc", "qwen", live_body=pending)
        for _ in range(5):
            assert await watch.step() == 1.0
    assert cluster.reads == 0


async def test_running_pod_is_read_fresh_from_the_api() -> None:
    running = _pod("Running", "10.0.0.7")
    cluster = CountingCluster(running)
    async with aiohttp.ClientSession() as session:
        watch = PodWatch(cluster, session, "ns", "qwen-abc", "qwen", live_body=running)
        # Running: the pod and its model are read from the API; the model is gone, so the watch ends.
        assert await watch.step() is None
    assert cluster.reads == 2


class EvictingCluster(Cluster):
    """The real Cluster class with its transport replaced: an eviction, then the writes that record it."""

    def __init__(self) -> None:
        self.evicted = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        self.status_patches: list[dict[str, Any]] = []
        self.events: list[str] = []

    def evict(self, namespace: str, name: str) -> Literal["evicted", "blocked", "gone"]:
        self.loop.call_soon_threadsafe(self.evicted.set)
        time.sleep(0.2)  # the API server answers; meanwhile the pod's deletion reaches kopf
        return "evicted"

    def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any] | None:
        return {"metadata": {"name": name, "namespace": namespace}, "status": {}}

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.status_patches.append(status)

    def event(self, involved: dict[str, Any], type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append(reason)


async def test_an_eviction_is_recorded_even_when_the_pods_daemon_is_cancelled() -> None:
    # kopf cancels a pod's daemon once the pod is marked for deletion, which the eviction itself
    # causes: the status entry, the event and the metric must still be written.
    cluster = EvictingCluster()
    fm = {"metadata": {"name": "qwen", "namespace": "ns-cancel"}, "status": {}}
    decision = Decision("evict", "GenerationHung", "qwen-abc", "hung for 20s")
    before = REMEDIATIONS.labels(reason="GenerationHung")._value.get()
    async with aiohttp.ClientSession() as session:
        watch = PodWatch(cluster, session, "ns-cancel", "qwen-abc", "qwen")
        daemon = asyncio.create_task(watch.evict_and_record(fm, decision))
        await cluster.evicted.wait()
        daemon.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await daemon
        for _ in range(100):
            if cluster.events:
                break
            await asyncio.sleep(0.05)
    assert [p["remediations"][0]["pod"] for p in cluster.status_patches] == ["qwen-abc"]
    assert cluster.events == ["Remediated"]
    assert REMEDIATIONS.labels(reason="GenerationHung")._value.get() == before + 1
