"""EnginePodTasks: one watch task per engine pod, driven by the pod's watch events, and no finalizer."""

from __future__ import annotations

import asyncio
from typing import Any

from flashmodel_operator.pod_tasks import EnginePodTasks, StopRequest


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


async def test_one_task_per_pod_however_many_events_and_the_watch_sees_the_newest_body() -> None:
    watches = Watches()
    pods = EnginePodTasks(watches, backoff=0.05, grace=0.5)
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
    pods = EnginePodTasks(watches, backoff=0.05, grace=0.5)
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
    pods = EnginePodTasks(watches, backoff=0.05, grace=0.2)
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
    pods = EnginePodTasks(watches, backoff=0.05, grace=5.0)
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
    pods = EnginePodTasks(watches, backoff=0.2, grace=0.5)
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
    pods = EnginePodTasks(watches, backoff=30.0, grace=5.0)
    await pods.event("ADDED", _pod())
    entry = pods.get("ns", "qwen-abc")
    assert entry is not None and entry.task is not None
    await asyncio.sleep(0.05)
    await pods.event("DELETED", _pod())
    await asyncio.wait_for(entry.task, 1.0)
    assert len(watches.started) == 1


async def test_the_watch_keeps_the_pod_without_managed_fields_and_sees_every_other_field() -> None:
    watches = Watches()
    pods = EnginePodTasks(watches, backoff=0.05, grace=0.5)
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

    pods = EnginePodTasks(watch, backoff=0.05, grace=0.5)
    cause.set("kopf's cause of the first event, with its whole body")
    await pods.event("ADDED", _pod())
    await asyncio.sleep(0.02)
    assert seen == ["none"]
    await pods.stop_all()
