"""EnginePodTasks: one watch task per engine pod, driven by the pod's watch events, and no finalizer."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from flashmodel_operator.apply import Cluster
from flashmodel_operator.pod_tasks import KOPF_FINALIZER, EnginePodTasks, StopRequest


def _pod(name: str = "qwen-abc", uid: str = "u1", phase: str = "Pending", **meta: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "uid": uid, **meta},
        "status": {"phase": phase},
    }


class Watches:
    """A pod watch that records what it saw; `mode` injects its behaviour (fault injection)."""

    def __init__(self, mode: str = "honours-stop") -> None:
        self.mode = mode
        self.started: list[tuple[str, str]] = []
        self.phases_seen: list[str] = []
        self.ended: list[str] = []
        self.crashes_left = 0

    async def __call__(self, namespace: str, name: str, body: dict[str, Any], stopped: StopRequest) -> None:
        uid = body["metadata"]["uid"]
        self.started.append((name, uid))
        try:
            if self.crashes_left > 0:
                self.crashes_left -= 1
                raise RuntimeError("the engine's answer did not parse")
            while not stopped or self.mode == "ignores-stop":
                self.phases_seen.append(body["status"]["phase"])
                await asyncio.sleep(0.01)
        finally:
            self.ended.append(uid)


class NoRelease:
    def __init__(self) -> None:
        self.calls: list[tuple[str, str, str, int]] = []

    async def __call__(self, namespace: str, name: str, finalizer: str, index: int) -> bool:
        self.calls.append((namespace, name, finalizer, index))
        return True


async def test_one_task_per_pod_however_many_events_and_the_watch_sees_the_newest_body() -> None:
    watches = Watches()
    pods = EnginePodTasks(watches, NoRelease(), backoff=0.05, grace=0.5)
    await pods.event(None, _pod())  # kopf's first listing
    for _ in range(20):
        await pods.event("MODIFIED", _pod())
    await pods.event("MODIFIED", _pod(phase="Running"))
    await asyncio.sleep(0.05)
    assert watches.started == [("qwen-abc", "u1")]
    assert len(pods) == 1
    assert watches.phases_seen[-1] == "Running"  # the same dict, updated in place
    await pods.stop_all()
    assert watches.ended == ["u1"]


async def test_a_new_pod_under_the_same_name_replaces_the_old_ones_task() -> None:
    watches = Watches()
    pods = EnginePodTasks(watches, NoRelease(), backoff=0.05, grace=0.5)
    await pods.event("ADDED", _pod(uid="u1"))
    first = pods.get("ns", "qwen-abc")
    await asyncio.sleep(0.05)
    await pods.event("ADDED", _pod(uid="u2"))
    second = pods.get("ns", "qwen-abc")
    assert first is not None and second is not None and first is not second
    assert first.stop and not second.stop
    await asyncio.sleep(0.05)
    assert watches.started == [("qwen-abc", "u1"), ("qwen-abc", "u2")]
    assert watches.ended == ["u1"]
    await pods.stop_all()


async def test_deleted_stops_the_watch_and_cancels_one_that_does_not_end_within_the_grace() -> None:
    watches = Watches(mode="ignores-stop")
    pods = EnginePodTasks(watches, NoRelease(), backoff=0.05, grace=0.2)
    await pods.event("ADDED", _pod())
    await asyncio.sleep(0.02)  # the watch runs
    entry = pods.get("ns", "qwen-abc")
    assert entry is not None and entry.task is not None
    await pods.event("DELETED", _pod())
    assert entry.stop and len(pods) == 0
    await asyncio.sleep(0.1)
    assert not entry.task.done(), "cancelled before its grace"
    await asyncio.sleep(0.3)
    assert entry.task.cancelled()
    assert watches.ended == ["u1"]  # its `finally` ran


async def test_a_deletion_timestamp_stops_a_watch_that_ends_by_itself() -> None:
    watches = Watches()
    pods = EnginePodTasks(watches, NoRelease(), backoff=0.05, grace=5.0)
    await pods.event("ADDED", _pod())
    await asyncio.sleep(0.02)  # the watch runs
    entry = pods.get("ns", "qwen-abc")
    assert entry is not None and entry.task is not None
    await pods.event("MODIFIED", _pod(deletionTimestamp="2026-12-06T12:00:00Z"))
    await asyncio.wait_for(entry.task, 1.0)
    assert not entry.task.cancelled()
    assert entry.body["metadata"]["deletionTimestamp"]  # the watch saw why
    await pods.event("MODIFIED", _pod(deletionTimestamp="2026-12-06T12:00:00Z"))
    assert watches.started == [("qwen-abc", "u1")], "a pod being deleted got a new watch"


async def test_a_failed_watch_starts_again_after_the_backoff_while_the_pod_lives() -> None:
    watches = Watches()
    watches.crashes_left = 2
    pods = EnginePodTasks(watches, NoRelease(), backoff=0.2, grace=0.5)
    await pods.event("ADDED", _pod())
    await asyncio.sleep(0.1)
    assert len(watches.started) == 1, "started again before the back-off"
    await asyncio.sleep(0.4)
    assert len(watches.started) == 3
    entry = pods.get("ns", "qwen-abc")
    assert entry is not None and entry.task is not None and not entry.task.done()
    await pods.event("DELETED", _pod())
    await asyncio.wait_for(entry.task, 1.0)


async def test_a_stop_during_the_backoff_ends_it_without_another_start() -> None:
    watches = Watches()
    watches.crashes_left = 1
    pods = EnginePodTasks(watches, NoRelease(), backoff=30.0, grace=5.0)
    await pods.event("ADDED", _pod())
    entry = pods.get("ns", "qwen-abc")
    assert entry is not None and entry.task is not None
    await asyncio.sleep(0.05)
    await pods.event("DELETED", _pod())
    await asyncio.wait_for(entry.task, 1.0)
    assert len(watches.started) == 1


class FinalizerCluster(Cluster):
    """The real Cluster class with its transport replaced: records the PATCHes it would send."""

    def __init__(self) -> None:
        self.patches: list[tuple[str, list[dict[str, Any]]]] = []
        self.writes = 0

    def _call(self, method: str, path: str, **kwargs: Any) -> Any:
        assert kwargs["content_type"] == "application/json-patch+json"
        self.patches.append((path, kwargs["body"]))
        return {}


async def test_an_older_operators_finalizer_is_removed_once_and_the_others_are_kept() -> None:
    cluster = FinalizerCluster()

    async def release(namespace: str, name: str, finalizer: str, index: int) -> bool:
        return await asyncio.to_thread(cluster.remove_finalizer, "v1", "Pod", namespace, name, finalizer, index)

    pods = EnginePodTasks(Watches(), release, backoff=0.05, grace=0.5)
    held = _pod(finalizers=["example.com/keep", KOPF_FINALIZER])
    await pods.event(None, held)
    for _ in range(3):  # events sent before the patch's own
        await pods.event("MODIFIED", held)
    await pods.event("MODIFIED", _pod(finalizers=["example.com/keep"]))
    path = "/metadata/finalizers/1"
    assert cluster.patches == [
        (
            "/api/v1/namespaces/ns/pods/qwen-abc",
            [{"op": "test", "path": path, "value": KOPF_FINALIZER}, {"op": "remove", "path": path}],
        )
    ]
    # A pod already being deleted (its old watch gone with the old operator) is released too.
    await pods.event(
        "MODIFIED",
        _pod(name="qwen-def", uid="u9", deletionTimestamp="2026-12-06T12:00:00Z", finalizers=[KOPF_FINALIZER]),
    )
    assert len(cluster.patches) == 2
    assert pods.get("ns", "qwen-def") is None
    await pods.stop_all()


async def test_a_failed_finalizer_release_is_tried_again_on_the_next_event() -> None:
    calls = 0

    async def release(namespace: str, name: str, finalizer: str, index: int) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise ConnectionResetError("the API server went away")
        return True

    pods = EnginePodTasks(Watches(), release, backoff=0.05, grace=0.5)
    held = _pod(finalizers=[KOPF_FINALIZER])
    await pods.event("ADDED", held)
    await pods.event("MODIFIED", held)
    await pods.event("MODIFIED", held)
    assert calls == 2
    await pods.stop_all()


@pytest.mark.parametrize("event_type", [None, "ADDED", "MODIFIED"])
async def test_a_pod_without_our_finalizer_costs_no_write(event_type: str | None) -> None:
    release = NoRelease()
    pods = EnginePodTasks(Watches(), release, backoff=0.05, grace=0.5)
    await pods.event(event_type, _pod(finalizers=["example.com/keep"]))
    assert release.calls == []
    await pods.stop_all()


async def test_the_watch_keeps_the_pod_without_managed_fields_and_sees_every_other_field() -> None:
    watches = Watches()
    pods = EnginePodTasks(watches, NoRelease(), backoff=0.05, grace=0.5)
    fields = [{"manager": "kubelet", "operation": "Update", "fieldsV1": {"f:status": {}}}]
    await pods.event("ADDED", _pod(managedFields=fields, labels={"serving.flashmodel.io/model": "qwen"}))
    await pods.event("MODIFIED", _pod(phase="Running", managedFields=fields, labels={"a": "b"}))
    entry = pods.get("ns", "qwen-abc")
    assert entry is not None
    assert "managedFields" not in entry.body["metadata"]
    assert entry.body["metadata"]["labels"] == {"a": "b"}
    assert entry.body["status"] == {"phase": "Running"}
    await pods.stop_all()


async def test_a_watch_runs_in_a_context_of_its_own_not_the_handler_that_started_it() -> None:
    import contextvars

    cause: contextvars.ContextVar[str] = contextvars.ContextVar("cause", default="none")
    seen: list[str] = []

    async def watch(namespace: str, name: str, body: dict[str, Any], stopped: StopRequest) -> None:
        seen.append(cause.get())

    pods = EnginePodTasks(watch, NoRelease(), backoff=0.05, grace=0.5)
    cause.set("kopf's cause of the first event, with its whole body")
    await pods.event("ADDED", _pod())
    await asyncio.sleep(0.02)
    assert seen == ["none"]
    await pods.stop_all()
