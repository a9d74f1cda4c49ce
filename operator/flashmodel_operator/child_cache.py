"""Each FlashModel's Deployment and engine pods as the operator's watches last delivered them: a child event's reads."""

from __future__ import annotations

import copy
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flashmodel_operator.apply import ApplyResult, Cluster
from flashmodel_operator.render import content_hash

ModelKey = tuple[str, str]


def resource_version(body: Mapping[str, Any]) -> int | None:
    """The object's resourceVersion as a number, None where the server sent something else.

    The API server's versions are etcd revisions, which only grow: the cache keeps the newer of two
    bodies by them. A version that is not a number makes the cache step aside (the API is read).
    """
    raw = (body.get("metadata") or {}).get("resourceVersion")
    try:
        return int(str(raw))
    except ValueError:
        return None


_POD_METADATA = ("name", "namespace", "resourceVersion", "annotations", "deletionTimestamp")
"""What a pass reads off a pod's metadata: its name, its config hash (an annotation), whether it is going."""
_POD_CONDITION = ("type", "status", "reason", "message")
"""Of each condition: the readiness gate's state and who set it, the scheduler's word on a Pending pod."""


def pod_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """A private copy of what a pass reads off a pod (reconcile: preflight_refusal, unschedulable, the gates).

    Not the spec, managedFields, owners, IPs, images, timestamps: a kept pod is about a tenth of the
    object. A container's state is kept only where it terminated (the preflight's exit code and message).
    """
    meta = body.get("metadata") or {}
    status = body.get("status") or {}
    view_status: dict[str, Any] = {}
    if "phase" in status:
        view_status["phase"] = status["phase"]
    if status.get("conditions"):
        view_status["conditions"] = [{k: c[k] for k in _POD_CONDITION if k in c} for c in status["conditions"]]
    containers = []
    for container in status.get("containerStatuses") or []:
        states = {
            when: {"terminated": copy.deepcopy(container[when]["terminated"])}
            for when in ("state", "lastState")
            if (container.get(when) or {}).get("terminated")
        }
        containers.append({"name": container.get("name"), **states})
    if containers:
        view_status["containerStatuses"] = containers
    view = {"metadata": {k: copy.deepcopy(meta[k]) for k in _POD_METADATA if k in meta}}
    if view_status:
        view["status"] = view_status
    return view


_DEPLOYMENT_METADATA = (
    "name", "namespace", "uid", "resourceVersion", "generation", "labels", "annotations", "ownerReferences"
)
"""What the apply compares besides the spec (labels, annotations with the applied digest, the owner),
and the generation and uid that say which spec the object has."""


def deployment_view(body: Mapping[str, Any]) -> dict[str, Any]:
    """A private copy of a Deployment without its spec (most of the object) and managedFields.

    The apply compares the spec only where a whole compare has not already matched it at this
    generation (ChildCache.spec_matched); the status gives the replica counts.
    """
    meta = body.get("metadata") or {}
    view = {k: body[k] for k in ("apiVersion", "kind") if k in body}
    view["metadata"] = {k: copy.deepcopy(meta[k]) for k in _DEPLOYMENT_METADATA if k in meta}
    if "status" in body:
        view["status"] = copy.deepcopy(body["status"])
    return view


@dataclass
class _ModelPods:
    bodies: dict[str, dict[str, Any]] = field(default_factory=dict)
    deleted: dict[str, int] = field(default_factory=dict)
    """Pod name -> resourceVersion of its deletion, so an API list served before it cannot bring it back."""
    listed_version: int | None = None
    """The resourceVersion of the last API list merged in: a pod older than it and not in it is gone."""
    listing: int = -1
    """The watch's listing count when that list was sent: the set is whole only while no listing came since."""


class ChildCache:
    """The latest Deployment and pods of every model, from the watch events the operator receives anyway.

    A pass started by one of these events reads them here instead of asking the API server (the
    Deployment twice, the pods once). What the cache has not seen whole is read from the API:

    - a model's pod set counts as whole only after one API list of its pods was merged with the
      watch's events, and only until the watch lists again (kopf lists at start-up and after a
      watch's resourceVersion expired: a pod deleted in between sends no DELETED event, so every
      model's set is read from the API once more);
    - a model's Deployment counts only once a watch event of it (or an API read) came after the
      watch's last listing, for the same reason; a DELETED event drops it (the next pass reads
      the API and sees it gone, not "unchanged").

    Bodies only ever move forward (a newer resourceVersion replaces an older one, never the other
    way), and the passes' own API reads go in too: a pass never sees an older Deployment or pod
    than one an earlier pass wrote a status from. Entries go with their model (`forget`, and
    `retain` for events that came after it), so the memory follows the fleet. The bodies handed
    out are shared: read them, never change them. Thread-safe: kopf's event handlers and the
    passes run in its pool.

    Not a kopf index, for WatchedModels' reasons: the passes' own reads go in too, and the passes
    that read it run in the operator's threads, not as kopf handlers.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._deployments: dict[ModelKey, dict[str, Any]] = {}
        self._deployment_seen: dict[ModelKey, int] = {}
        """The watch's listing count when the Deployment was last seen by an event or a read."""
        self._deployment_deleted: dict[ModelKey, int] = {}
        self._deployment_listings = 0
        self._pods: dict[ModelKey, _ModelPods] = {}
        self._pod_listings = 0
        self._spec_matched: dict[ModelKey, tuple[str, int, str]] = {}
        """(uid, generation, digest): the Deployment whose whole spec was last found to hold the desired one."""

    # -- the watch's events ------------------------------------------------------------------------

    def deployment_event(self, namespace: str, model: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Keep a Deployment watch event's body; kopf's type None is an object of a (re)listing."""
        key = (namespace, model)
        version = resource_version(body)
        with self._lock:
            if event_type is None:
                self._deployment_listings += 1
            if event_type == "DELETED" or version is None:
                self._deployments.pop(key, None)
                self._deployment_seen.pop(key, None)
                if version is not None:
                    self._deployment_deleted[key] = version
                return
            self._keep_deployment(key, body, version)
            self._deployment_seen[key] = self._deployment_listings

    def pod_event(self, namespace: str, model: str, event_type: str | None, body: Mapping[str, Any]) -> None:
        """Keep a pod watch event's body, or drop the pod on DELETED."""
        key = (namespace, model)
        name = str((body.get("metadata") or {}).get("name"))
        version = resource_version(body)
        with self._lock:
            if event_type is None:
                self._pod_listings += 1
            pods = self._pods.setdefault(key, _ModelPods())
            if version is None:
                pods.bodies.pop(name, None)
                pods.listing = -1
                return
            if event_type == "DELETED":
                pods.bodies.pop(name, None)
                pods.deleted[name] = version
                return
            have = pods.bodies.get(name)
            if have is not None and (resource_version(have) or 0) >= version:
                return
            if have is None and pods.listed_version is not None and version <= pods.listed_version:
                return  # an event older than a list that no longer had the pod: it is gone
            if pods.deleted.get(name, -1) >= version:
                return
            pods.bodies[name] = pod_view(body)

    def forget(self, namespace: str, model: str) -> None:
        """The model is deleted: its children go with it."""
        key = (namespace, model)
        with self._lock:
            self._deployments.pop(key, None)
            self._deployment_seen.pop(key, None)
            self._deployment_deleted.pop(key, None)
            self._pods.pop(key, None)
            self._spec_matched.pop(key, None)

    def retain(self, models: set[ModelKey]) -> None:
        """Drop every model but these: a child's DELETED event that came after its model's leaves an entry.

        Always safe: what the cache no longer holds, a pass reads from the API.
        """
        with self._lock:
            for entries in (
                self._deployments, self._deployment_seen, self._deployment_deleted, self._pods, self._spec_matched
            ):
                for key in [k for k in entries if k not in models]:
                    del entries[key]

    def models(self) -> set[ModelKey]:
        """Every model the cache holds anything of."""
        with self._lock:
            return {
                key
                for entries in (
                    self._deployments, self._deployment_seen, self._deployment_deleted, self._pods, self._spec_matched
                )
                for key in entries
            }

    # -- the passes' reads -------------------------------------------------------------------------

    @property
    def listings(self) -> tuple[int, int]:
        """(Deployment, pod) listings so far: taken before an API read, given back with its result."""
        with self._lock:
            return self._deployment_listings, self._pod_listings

    def deployment(self, namespace: str, model: str) -> dict[str, Any] | None:
        """The model's Deployment as last watched; None where the cache cannot vouch for it (read the API)."""
        key = (namespace, model)
        with self._lock:
            if self._deployment_seen.get(key) != self._deployment_listings:
                return None
            return self._deployments.get(key)

    def pods(self, namespace: str, model: str) -> list[dict[str, Any]] | None:
        """The model's pods as last watched; None where the set may not be whole (list them from the API)."""
        with self._lock:
            pods = self._pods.get((namespace, model))
            if pods is None or pods.listing != self._pod_listings:
                return None
            return list(pods.bodies.values())

    def spec_matched(self, namespace: str, model: str, body: Mapping[str, Any], digest: str) -> bool:
        """True where a whole compare found this Deployment's spec (its uid, its generation) holding `digest`'s.

        Anyone's change to a Deployment's spec makes a new generation, so a kept body of the same
        generation has the spec that was compared.
        """
        with self._lock:
            return self._spec_matched.get((namespace, model)) == (*_identity(body), digest)

    def record_spec_match(self, namespace: str, model: str, body: Mapping[str, Any], digest: str) -> None:
        """A whole Deployment (read, or the server's answer to an apply) was found to hold the desired one."""
        if (body.get("metadata") or {}).get("generation") is None:
            return
        with self._lock:
            self._spec_matched[(namespace, model)] = (*_identity(body), digest)

    def record_deployment(self, namespace: str, model: str, body: dict[str, Any] | None, listings: int) -> None:
        """A pass read the Deployment from the API (`listings`: the Deployment listings before it asked)."""
        key = (namespace, model)
        version = None if body is None else resource_version(body)
        with self._lock:
            if body is None or version is None:
                # Not found says nothing of when: a DELETED or ADDED event may be on its way. The next
                # pass reads the API again.
                self._deployment_seen.pop(key, None)
                return
            if version <= self._deployment_deleted.get(key, -1):
                return  # read before a deletion the watch has already reported
            self._keep_deployment(key, body, version)
            if listings == self._deployment_listings:
                self._deployment_seen[key] = listings

    def pods_to_come(self, namespace: str, model: str, created: int, listings: int) -> None:
        """The model's Deployment was just made (at resourceVersion `created`): every pod of it is yet to come.

        Its pods will each arrive as a watch event, so the set the watch delivers is whole from here
        on without an API list, as long as the watch does not list again (`listings`: the pod
        listings before the Deployment was applied). Pods already kept (a deleted model's of the
        same name, still going) stay.
        """
        with self._lock:
            pods = self._pods.setdefault((namespace, model), _ModelPods())
            pods.listed_version = max(created, pods.listed_version or 0)
            pods.listing = listings if listings == self._pod_listings else -1

    def record_pods(
        self, namespace: str, model: str, items: list[dict[str, Any]], list_version: str, listings: int
    ) -> None:
        """Merge an API list of the model's pods (`listings`: the pod listings before it was sent)."""
        listed = resource_version({"metadata": {"resourceVersion": list_version}})
        with self._lock:
            pods = self._pods.setdefault((namespace, model), _ModelPods())
            if listed is None:
                pods.listing = -1
                return
            merged: dict[str, dict[str, Any]] = {}
            for item in items:
                name = str(item["metadata"]["name"])
                version = resource_version(item) or 0
                if pods.deleted.get(name, -1) >= version:
                    continue  # deleted after the list was served
                have = pods.bodies.get(name)
                if have is not None and (resource_version(have) or 0) > version:
                    merged[name] = have  # an event newer than the list
                else:
                    merged[name] = pod_view(item)
            for name, have in pods.bodies.items():
                if name not in merged and (resource_version(have) or 0) > listed:
                    merged[name] = have  # created after the list was served
            pods.bodies = merged
            pods.deleted = {name: v for name, v in pods.deleted.items() if v > listed}
            pods.listed_version = max(listed, pods.listed_version or 0)
            pods.listing = listings if listings == self._pod_listings else -1

    def _keep_deployment(self, key: ModelKey, body: Mapping[str, Any], version: int) -> None:
        have = self._deployments.get(key)
        if have is None or (resource_version(have) or 0) < version:
            self._deployments[key] = deployment_view(body)
            self._deployment_deleted.pop(key, None)


def _identity(body: Mapping[str, Any]) -> tuple[str, int]:
    meta = body.get("metadata") or {}
    return str(meta.get("uid")), int(meta.get("generation") or 0)


@dataclass
class PassReads:
    """Where one pass reads its model's pods and Deployment.

    `from_watch`: the pass follows a child's event, so both come from the cache where it can vouch
    for them. Either way what the pass reads from the API goes into the cache.
    """

    cluster: Cluster
    cache: ChildCache | None
    namespace: str
    name: str
    from_watch: bool
    _deployment: dict[str, Any] | None = None
    _deployment_read: bool = False
    _deployment_now: dict[str, Any] | None = None

    def pods(self, selector: str) -> list[dict[str, Any]]:
        if self.from_watch and self.cache is not None:
            watched = self.cache.pods(self.namespace, self.name)
            if watched is not None:
                return watched
        listings = self.cache.listings[1] if self.cache is not None else 0
        items, version = self.cluster.list_with_version("v1", "Pod", self.namespace, selector)
        if self.cache is not None:
            self.cache.record_pods(self.namespace, self.name, items, version, listings)
        return items

    def apply_deployment(self, desired: dict[str, Any], known_absent: bool) -> ApplyResult:
        """Apply the Deployment, keeping the whole object the apply compared or wrote as the pass's view of it.

        From the watch the body has no spec: it counts as matching where a whole compare matched the
        desired digest at the body's uid and generation (anyone's spec change makes a new generation);
        otherwise the Deployment is read whole. A whole object found to hold the desired one (read,
        or the server's answer to the apply) is remembered as matched, and is the Deployment as it is
        now: the pass's status reads it (`deployment_now`) instead of reading it back.
        """
        listings, pod_listings = self.cache.listings if self.cache is not None else (0, 0)
        live, spec_matched = None, False
        digest = content_hash(desired)
        if self.from_watch:
            live = self.deployment()
            if live is not None and "spec" not in live:
                if self.cache is not None and self.cache.spec_matched(self.namespace, self.name, live, digest):
                    spec_matched = True
                else:
                    live = self.deployment(fresh=True)
            known_absent = live is None

        def matched(whole: dict[str, Any], digest: str) -> None:
            if self.cache is not None:
                self.cache.record_spec_match(self.namespace, self.name, whole, digest)
                self.cache.record_deployment(self.namespace, self.name, whole, listings)
            self._deployment_now = whole

        result = self.cluster.apply(
            desired, known_absent=known_absent, live=live, spec_matched=spec_matched, matched=matched, digest=digest
        )
        made = self._deployment_now if result == "created" else None
        created = None if made is None else resource_version(made)
        if self.cache is not None and created is not None:
            self.cache.pods_to_come(self.namespace, self.name, created, pod_listings)
        return result

    @property
    def deployment_now(self) -> dict[str, Any] | None:
        """The whole Deployment this pass's apply compared or wrote, where it held the desired one."""
        return self._deployment_now

    def deployment(self, fresh: bool = False) -> dict[str, Any] | None:
        """The Deployment; `fresh` reads the API (after this pass wrote it, or for a full pass's status)."""
        if self.from_watch and not fresh:
            if self._deployment_read:
                return self._deployment
            if self.cache is not None:
                watched = self.cache.deployment(self.namespace, self.name)
                if watched is not None:
                    return watched
        listings = self.cache.listings[0] if self.cache is not None else 0
        live = self.cluster.get("apps/v1", "Deployment", self.namespace, self.name)
        if self.cache is not None:
            self.cache.record_deployment(self.namespace, self.name, live, listings)
        self._deployment, self._deployment_read = live, True
        return live
