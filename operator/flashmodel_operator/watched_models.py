"""Every FlashModel as the operator last saw it: its watch, its own reads and its status writes' answers."""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from flashmodel_operator.child_cache import resource_version

ModelKey = tuple[str, str]

TOMBSTONE_SECONDS = 300.0
"""How long a deletion's resourceVersion is kept: longer than any read in flight when it came."""


def _kept(body: Mapping[str, Any]) -> dict[str, Any]:
    """A private copy without managedFields (no reader looks at them; a third of a small body)."""
    kept = {k: copy.deepcopy(v) for k, v in body.items() if k != "metadata"}
    kept["metadata"] = {k: copy.deepcopy(v) for k, v in (body.get("metadata") or {}).items() if k != "managedFields"}
    return kept


class WatchedModels:
    """The newest body of every FlashModel the operator has seen, by resourceVersion.

    Fed by the FlashModel watch (`event`) and by every read and status write the operator sends for
    a model (`record`, from `Cluster`). A body only moves forward: so the body handed out is never
    older than one a pass already read or wrote. A pass that takes its model from here (under the
    model's lock) therefore cannot act on an older spec than any pass before it acted on, nor
    compare against an older status than the last one written; a spec change no watch event and no
    read has shown yet is as unknown to it as to a pass that had started a moment earlier, and the
    change's own watch event starts a full pass.

    `latest` vouches for a model only while its body was seen (an event or a read) since the
    watch's last listing: kopf lists at start-up and after its watch expired, and a model deleted
    in between sends no DELETED event. Thread-safe: the watch's handler runs on the event loop, the
    passes in kopf's pool. The bodies handed out are shared: read them, never change them.

    Not a kopf index: an index holds only what the watch delivered and is handed to handlers as an
    argument, while this also takes the answers of the operator's own reads and status writes (so
    no pass acts on a body older than one an earlier pass wrote from) and is read by the pod
    watches and the resync, which are not kopf handlers.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._bodies: dict[ModelKey, dict[str, Any]] = {}
        self._seen: dict[ModelKey, int] = {}
        """The watch's listing count when the body was last confirmed by an event or a read."""
        self._deleted: dict[ModelKey, tuple[int, float]] = {}
        """Model -> (resourceVersion of its deletion, when): a read served before it cannot bring it back."""
        self._listings = 0

    # -- what feeds it -----------------------------------------------------------------------------

    def event(self, event_type: str | None, body: Mapping[str, Any]) -> None:
        """A FlashModel watch event; kopf's type None is an object of a (re)listing."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        version = resource_version(body)
        with self._lock:
            if event_type is None:
                self._listings += 1
            if event_type == "DELETED":
                self._bodies.pop(key, None)
                self._seen.pop(key, None)
                self._deleted[key] = (version or 0, time.monotonic())
                self._prune_tombstones()
                return
            if version is None:
                self._bodies.pop(key, None)  # nothing to order it by: the next pass reads the API
                self._seen.pop(key, None)
                return
            self._keep(key, body, version)
            self._seen[key] = self._listings

    def record(self, body: Mapping[str, Any], listings: int) -> None:
        """An answer of the API server (a read, a status write); `listings`: the count before it was sent."""
        meta = body.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        version = resource_version(body)
        if version is None:
            return
        with self._lock:
            if version <= self._deleted.get(key, (-1, 0.0))[0]:
                return  # served before a deletion the watch has already reported
            self._keep(key, body, version)
            if listings == self._listings:
                self._seen[key] = listings

    # -- what it answers ---------------------------------------------------------------------------

    @property
    def listings(self) -> int:
        """Listings so far: taken before an API request, given back with its answer (`record`)."""
        with self._lock:
            return self._listings

    def get(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The newest body seen, vouched for or not: the pod polls' view, which a missing model only pauses."""
        with self._lock:
            return self._bodies.get((namespace, name))

    def latest(self, namespace: str, name: str) -> dict[str, Any] | None:
        """The newest body seen, where it is vouched for (see the class); None: read the API."""
        key = (namespace, name)
        with self._lock:
            if self._seen.get(key) != self._listings:
                return None
            return self._bodies.get(key)

    def __contains__(self, key: object) -> bool:
        with self._lock:
            return key in self._bodies

    def __iter__(self) -> Iterator[ModelKey]:
        with self._lock:
            return iter(list(self._bodies))

    def __len__(self) -> int:
        with self._lock:
            return len(self._bodies)

    def _keep(self, key: ModelKey, body: Mapping[str, Any], version: int) -> None:
        have = self._bodies.get(key)
        if have is None or (resource_version(have) or 0) < version:
            self._bodies[key] = _kept(body)

    def _prune_tombstones(self) -> None:
        cutoff = time.monotonic() - TOMBSTONE_SECONDS
        for key in [k for k, (_, at) in self._deleted.items() if at < cutoff]:
            del self._deleted[key]
