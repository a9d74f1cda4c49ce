"""PodWatch's waiting phase: a Pending pod is watched through kopf's live body, not by polling the API."""

from __future__ import annotations

from typing import Any

import aiohttp
from flashmodel_operator.apply import Cluster
from flashmodel_operator.gating import PodWatch


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
