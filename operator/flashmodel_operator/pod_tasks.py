"""Per engine pod: the asyncio task that watches it, started and stopped by the pod's watch events.

kopf's daemons would do this, but kopf puts a finalizer on every object that has a daemon: two pod
PATCHes per engine pod (on and off), each one more watch event and reconcile pass, and kopf's
per-daemon memory. The pod's watch needs no finalizer (nothing has to happen before a pod may go),
so the operator keeps its tasks itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)

PodKey = tuple[str, str]
"""(namespace, pod name)."""


def live_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """The pod as its watch keeps it: the event's body without metadata.managedFields.

    No reader looks at managedFields, and they are a third to a half of a pod's body, kept for as
    long as the pod lives. Shallow: the rest is shared with the event, which nothing else keeps.
    """
    meta = body.get("metadata") or {}
    return {**body, "metadata": {k: v for k, v in meta.items() if k != "managedFields"}}


class StopRequest:
    """Truthy once the pod's watch is asked to end (PodWatch.run loops `while not stopped`)."""

    def __init__(self) -> None:
        self._event = asyncio.Event()

    def __bool__(self) -> bool:
        return self._event.is_set()

    def set(self) -> None:
        self._event.set()

    async def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds, woken early by a stop; True when stopped."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._event.wait(), timeout)
        return bool(self)


WatchPod = Callable[[str, str, dict[str, Any], StopRequest], Awaitable[None]]
"""(namespace, pod name, live body, stop request) -> the watch of one pod, returning when it is over."""

@dataclass
class PodTask:
    """One pod's watch: its uid, its task, the live body the watch reads, and the stop it tests."""

    uid: str
    body: dict[str, Any]
    """Updated in place on every event, so the watch sees the pod's newest status without API reads."""
    stop: StopRequest = field(default_factory=StopRequest)
    task: asyncio.Task[None] | None = None


class EnginePodTasks:
    """Every engine pod's watch task, keyed by (namespace, name), one per pod uid."""

    def __init__(
        self,
        watch: WatchPod,
        *,
        backoff: float,
        grace: float = 5.0,
    ) -> None:
        self.watch = watch
        self.backoff = backoff
        """Seconds before a watch that failed is started again (while its pod lives)."""
        self.grace = grace
        """Seconds a stopped watch has to end on its own (it finishes a step, writes status) before it is cancelled."""
        self._pods: dict[PodKey, PodTask] = {}
        self._stopping: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._pods)

    def get(self, namespace: str, name: str) -> PodTask | None:
        return self._pods.get((namespace, name))

    async def event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """One pod watch event: None (kopf's first listing), ADDED, MODIFIED or DELETED."""
        meta = body.get("metadata") or {}
        namespace, name, uid = meta.get("namespace"), meta.get("name"), str(meta.get("uid", ""))
        if not namespace or not name:
            return
        key = (namespace, name)
        entry = self._pods.get(key)
        if entry is not None and entry.uid == uid:
            # In place: the running watch holds this dict.
            entry.body.clear()
            entry.body.update(live_view(body))
        going = event_type == "DELETED" or bool(meta.get("deletionTimestamp"))
        if going:
            if entry is not None and entry.uid == uid:
                self._stop(key)
            return
        if entry is not None and entry.uid == uid:
            return  # its watch runs (or ended for good: a pod it evicted, a model gone)
        if entry is not None:
            # Same name, new pod (a StatefulSet-style re-creation): the old pod's watch is over.
            self._stop(key)
        self._start(key, uid, live_view(body))

    def _start(self, key: PodKey, uid: str, body: dict[str, Any]) -> None:
        entry = PodTask(uid=uid, body=body)
        # A context of its own: the task would otherwise keep a copy of the context it was started
        # in, which is kopf's handler context, holding the first event's cause and its whole body
        # for the pod's life.
        entry.task = asyncio.create_task(
            self._supervise(key, entry), name=f"pod-watch:{key[0]}/{key[1]}", context=contextvars.Context()
        )
        self._pods[key] = entry

    def _stop(self, key: PodKey) -> None:
        """Ask the pod's watch to end; cancel it after the grace if it has not."""
        entry = self._pods.pop(key)
        entry.stop.set()
        task = entry.task
        if task is None or task.done():
            return
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)
        timer = asyncio.get_running_loop().call_later(self.grace, task.cancel)
        task.add_done_callback(lambda _: timer.cancel())

    async def _supervise(self, key: PodKey, entry: PodTask) -> None:
        """The pod's watch, started again after a back-off when it fails, until it ends or is stopped."""
        namespace, name = key
        while not entry.stop:
            try:
                await self.watch(namespace, name, entry.body, entry.stop)
                return
            except Exception as exc:
                # PodWatch retries transient API failures itself: what reaches here is a bug or a
                # rejected request, which the same watch would hit again at once.
                log.exception(
                    "event=pod-watch-failed pod=%s/%s error=%s retry_in_s=%s",
                    namespace,
                    name,
                    type(exc).__name__,
                    self.backoff,
                )
            if await entry.stop.wait(self.backoff):
                return

    async def stop_all(self) -> None:
        """Operator shutdown: every watch cancelled (each still runs its `finally`) and awaited."""
        tasks = [e.task for e in self._pods.values() if e.task is not None] + list(self._stopping)
        for entry in self._pods.values():
            entry.stop.set()
        self._pods.clear()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


__all__ = ["EnginePodTasks", "PodTask", "StopRequest", "live_view"]
