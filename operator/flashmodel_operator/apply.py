"""The only module that talks to the API server: reads, server-side apply, status, events."""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import os
import random
import threading
import time
from collections.abc import Callable
from typing import Any, Literal, Protocol

import urllib3
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException
from prometheus_client import Counter

from flashmodel_operator import FIELD_MANAGER, GROUP, KIND, PLURAL, VERSION
from flashmodel_operator.render import APPLIED_HASH_ANNOTATION, content_hash

log = logging.getLogger(__name__)

API_WRITES = Counter(
    "flashmodel_operator_api_writes_total", "Writes the operator sent to the API server", ["verb", "kind"]
)

API_RETRIES = Counter(
    "flashmodel_operator_api_retries_total",
    "API requests the operator sent again after a transient failure",
    ["reason"],
)

ApplyResult = Literal["created", "updated", "unchanged"]

# Answers that say "not now" rather than "no": throttling, an API server restarting or overloaded,
# an aggregated API or a proxy in between failing. The request is sent again after a short pause.
RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
RETRY_DELAYS: tuple[float, ...] = tuple(
    float(d) for d in os.environ.get("FLASHMODEL_API_RETRY_DELAYS", "0.1,0.25,0.5,1,2").split(",") if d
)
"""Pauses before each resend (jittered down by up to half). Five resends: at a 10 % fault rate one call
in 10^6 still fails; a throttled 429's Retry-After is honoured up to the same longest pause."""
REQUEST_TIMEOUT = (5.0, 30.0)
"""(connect, read) seconds: a request the network swallowed is sent again instead of waited on for ever."""


def transient(exc: BaseException) -> bool:
    """An error another try may not see: a retryable status, a dropped or refused connection, a timeout."""
    if isinstance(exc, ApiException):
        return exc.status in RETRY_STATUSES or not exc.status
    return isinstance(exc, urllib3.exceptions.HTTPError | OSError)


# Where each child kind lives in the REST API (the operator writes no other kinds).
_PATHS: dict[tuple[str, str], str] = {
    ("v1", "ConfigMap"): "/api/v1/namespaces/{ns}/configmaps",
    ("v1", "Service"): "/api/v1/namespaces/{ns}/services",
    ("v1", "Secret"): "/api/v1/namespaces/{ns}/secrets",
    ("v1", "Pod"): "/api/v1/namespaces/{ns}/pods",
    ("v1", "Event"): "/api/v1/namespaces/{ns}/events",
    ("discovery.k8s.io/v1", "EndpointSlice"): "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices",
    ("apps/v1", "Deployment"): "/apis/apps/v1/namespaces/{ns}/deployments",
    ("policy/v1", "PodDisruptionBudget"): "/apis/policy/v1/namespaces/{ns}/poddisruptionbudgets",
    ("networking.k8s.io/v1", "NetworkPolicy"): "/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies",
    ("v1", "ServiceAccount"): "/api/v1/namespaces/{ns}/serviceaccounts",
    ("rbac.authorization.k8s.io/v1", "Role"): "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles",
    ("rbac.authorization.k8s.io/v1", "RoleBinding"): "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings",
    ("inference.networking.k8s.io/v1", "InferencePool"): (
        "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools"
    ),
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "/apis/gateway.networking.k8s.io/v1/namespaces/{ns}/httproutes",
    ("autoscaling/v2", "HorizontalPodAutoscaler"): "/apis/autoscaling/v2/namespaces/{ns}/horizontalpodautoscalers",
    ("keda.sh/v1alpha1", "ScaledObject"): "/apis/keda.sh/v1alpha1/namespaces/{ns}/scaledobjects",
    (f"{GROUP}/{VERSION}", KIND): f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}",
}


def namespace_terminating(exc: ApiException) -> bool:
    """True for the 403 the API server sends when a write lands in a namespace being deleted.

    Not an RBAC denial: the namespace controller is removing everything, the FlashModel included,
    so there is nothing left to reconcile.
    """
    return exc.status == 403 and "NamespaceTerminating" in str(exc.body or "")


def api_message(exc: ApiException) -> str:
    """The API server's own message from an error response (its Status object), else the raw body."""
    raw = str(exc.body or exc.reason or "")
    try:
        return str(json.loads(raw).get("message") or raw)[:500]
    except (ValueError, AttributeError):
        return raw[:500]


def collection_path(api_version: str, kind: str, namespace: str) -> str:
    return _PATHS[(api_version, kind)].format(ns=namespace)


def contains(live: Any, desired: Any) -> bool:
    """True when every field of `desired` is present in `live` with the same value.

    The API server adds defaults (so live has more) and may render scalars differently
    (a port as int or string), so scalars compare by their text.
    """
    if isinstance(desired, dict):
        # The API server drops empty maps and lists, so an empty desired value matches an absent one.
        return isinstance(live, dict) and all(
            contains(live[k], v) if k in live else v in ({}, []) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return isinstance(live, list) and len(live) == len(desired) and all(map(contains, live, desired))
    if isinstance(desired, bool) or isinstance(live, bool):
        return live is desired
    return str(live) == str(desired)


class ModelRecorder(Protocol):
    """Where the FlashModels the operator reads and writes go (watched_models.WatchedModels)."""

    @property
    def listings(self) -> int: ...

    def record(self, body: dict[str, Any], listings: int) -> None: ...


class Cluster:
    """A thin typed front to the API server; counts every write it sends.

    `models`: every FlashModel it reads and every status it writes (the server's answer) is given to
    it, so a pass that takes its model from there sees what any earlier pass saw.
    """

    def __init__(self, api: k8s.ApiClient, models: ModelRecorder | None = None) -> None:
        self.api = api
        self.models = models
        self.writes = 0
        self._lock = threading.Lock()

    def _call(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, Any]] | None = None,
        content_type: str | None = None,
        kind: str = "",
        retry_throttled: bool = True,
    ) -> Any:
        """The response body of one API request (see _send)."""
        return self._send(
            method,
            path,
            body=body,
            query=query,
            content_type=content_type,
            kind=kind,
            retry_throttled=retry_throttled,
        )[1]

    def _send(
        self,
        method: str,
        path: str,
        *,
        body: Any = None,
        query: list[tuple[str, Any]] | None = None,
        content_type: str | None = None,
        kind: str = "",
        retry_throttled: bool = True,
    ) -> tuple[int, Any]:
        """One API request, sent again after a pause on a transient failure (see RETRY_STATUSES).

        The pauses are short and bounded, like client-go's own retries, so one dropped connection
        costs a fraction of a second instead of a failed handler and its back-off.
        `retry_throttled=False` returns a 429 at once: for an eviction it means a budget said no.
        """
        headers = {"Accept": "application/json"}
        if content_type or body is not None:
            headers["Content-Type"] = content_type or "application/json"
        if method != "GET":
            with self._lock:
                self.writes += 1
            API_WRITES.labels(verb=method, kind=kind).inc()
        method_, url, headers_, body_, _ = self.api.param_serialize(
            method, path, query_params=query or [], header_params=headers, body=body, auth_settings=["BearerToken"]
        )
        for delay in (*RETRY_DELAYS, None):
            try:
                response = self.api.call_api(
                    method_, url, header_params=headers_, body=body_, _request_timeout=REQUEST_TIMEOUT
                )
                data: bytes = response.read()  # type: ignore[no-untyped-call]
            except (urllib3.exceptions.HTTPError, OSError, ApiException) as exc:
                # The client reports some transport failures (TLS) as an ApiException with status 0.
                if delay is None or not transient(exc):
                    raise
                reason, pause = type(exc).__name__, delay
            else:
                if 200 <= response.status < 300:
                    return response.status, json.loads(data) if data else None
                error = ApiException(status=response.status, reason=response.reason, body=data.decode(errors="replace"))
                if delay is None or not transient(error) or (response.status == 429 and not retry_throttled):
                    raise error
                reason, pause = str(response.status), delay
                after = (response.headers or {}).get("Retry-After") if response.status == 429 else None
                if after and after.isdigit():
                    pause = min(float(after), max(RETRY_DELAYS))
            API_RETRIES.labels(reason=reason).inc()
            log.debug("event=api-retry method=%s path=%s reason=%s pause_s=%.2f", method, path, reason, pause)
            time.sleep(pause * random.uniform(0.5, 1.0))
        raise AssertionError("unreachable: the last attempt returns or raises")

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            result: dict[str, Any] = self._call("GET", f"{collection_path(api_version, kind, namespace)}/{name}")
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return result

    def list_with_version(
        self, api_version: str, kind: str, namespace: str, selector: str
    ) -> tuple[list[dict[str, Any]], str]:
        """The matching objects and the list's resourceVersion (the point in time it shows)."""
        result = self._call("GET", collection_path(api_version, kind, namespace), query=[("labelSelector", selector)])
        items: list[dict[str, Any]] = result.get("items", [])
        return items, str((result.get("metadata") or {}).get("resourceVersion", ""))

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        return self.list_with_version(api_version, kind, namespace, selector)[0]

    def apply(
        self,
        desired: dict[str, Any],
        known_absent: bool = False,
        live: dict[str, Any] | None = None,
        spec_matched: bool = False,
        matched: Callable[[dict[str, Any], str], None] | None = None,
        digest: str | None = None,
    ) -> ApplyResult:
        """Server-side apply `desired` unless the live object already matches it; force only on our children.

        `known_absent`: the caller has reason to think the object does not exist yet (a model's first
        pass), so the read that would show it unchanged is skipped; the apply is correct either way.
        `live`: the caller already holds the live object (from a watch), compared instead of read.
        `spec_matched`: the caller vouches that live's spec, which it may leave out, holds desired's (a
        whole compare matched it at live's generation). `matched`: told of each whole live object found
        to hold `desired` (compared, or the server's answer to the apply), with desired's digest.
        `digest`: content_hash(desired) where the caller has it already (a Deployment's hash is the
        pass's costliest step after its requests).
        """
        meta = desired["metadata"]
        digest = digest or content_hash(desired)
        if live is None and not known_absent:
            live = self.get(desired["apiVersion"], desired["kind"], meta["namespace"], meta["name"])
        if live is not None:
            applied = (live.get("metadata", {}).get("annotations") or {}).get(APPLIED_HASH_ANNOTATION)
            compared = {k: v for k, v in desired.items() if k != "spec"} if spec_matched else desired
            if applied == digest and contains(live, compared):
                if matched is not None and not spec_matched:
                    matched(live, digest)
                return "unchanged"
        body = {
            **desired,
            "metadata": {**meta, "annotations": {**meta.get("annotations", {}), APPLIED_HASH_ANNOTATION: digest}},
        }
        path = f"{collection_path(desired['apiVersion'], desired['kind'], meta['namespace'])}/{meta['name']}"
        status, answer = self._send(
            "PATCH",
            path,
            body=body,
            kind=desired["kind"],
            query=[("fieldManager", FIELD_MANAGER), ("force", "true")],
            content_type="application/apply-patch+yaml",
        )
        if matched is not None and isinstance(answer, dict) and contains(answer, desired):
            matched(answer, digest)  # a mutating webhook may have changed it: only what holds desired counts
        # The API server answers an apply that made the object with 201 Created.
        return "created" if status == 201 else "updated"

    def create(self, desired: dict[str, Any]) -> bool:
        """Create `desired` unless an object of its name exists (then False): for what must be made only once."""
        meta = desired["metadata"]
        try:
            self._call(
                "POST",
                collection_path(desired["apiVersion"], desired["kind"], meta["namespace"]),
                body=desired,
                kind=desired["kind"],
                query=[("fieldManager", FIELD_MANAGER)],
                content_type="application/json",
            )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        return True

    def secret_value(self, namespace: str, name: str, key: str) -> str | None:
        """One key of a Secret, decoded; None when the Secret or the key is missing."""
        secret = self.get("v1", "Secret", namespace, name)
        raw = ((secret or {}).get("data") or {}).get(key)
        return base64.b64decode(raw).decode() if raw is not None else None

    def delete(self, api_version: str, kind: str, namespace: str, name: str) -> bool:
        try:
            self._call("DELETE", f"{collection_path(api_version, kind, namespace)}/{name}", kind=kind)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def serving_addresses(self, namespace: str, service: str) -> set[str]:
        """Addresses the Service routes to now: ready endpoints of its EndpointSlices."""
        slices = self.list("discovery.k8s.io/v1", "EndpointSlice", namespace, f"kubernetes.io/service-name={service}")
        return {
            address
            for s in slices
            for endpoint in s.get("endpoints") or []
            if (endpoint.get("conditions") or {}).get("ready")
            for address in endpoint.get("addresses") or []
        }

    def set_pod_condition(self, namespace: str, name: str, kind: str, value: bool, reason: str, message: str) -> None:
        """Set one pod condition (the readiness gate); a strategic merge keeps the kubelet's conditions."""
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        condition = {
            "type": kind,
            "status": "True" if value else "False",
            "reason": reason,
            "message": message[:1024],
            "lastTransitionTime": now,
            "lastProbeTime": None,
        }
        self._call(
            "PATCH",
            f"{collection_path('v1', 'Pod', namespace)}/{name}/status",
            body={"status": {"conditions": [condition]}},
            kind="Pod",
            content_type="application/strategic-merge-patch+json",
        )

    def evict(self, namespace: str, name: str) -> Literal["evicted", "blocked", "gone"]:
        """Evict through the Eviction API, so PodDisruptionBudgets hold; 'blocked' when a budget says no."""
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
        try:
            self._call(
                "POST",
                f"{collection_path('v1', 'Pod', namespace)}/{name}/eviction",
                body=body,
                kind="Eviction",
                retry_throttled=False,
            )
        except ApiException as exc:
            if exc.status == 404:
                return "gone"
            if exc.status == 429:
                return "blocked"
            raise
        return "evicted"

    def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any] | None:
        listings = self.models.listings if self.models is not None else 0
        body = self.get(f"{GROUP}/{VERSION}", KIND, namespace, name)
        if body is not None and self.models is not None:
            self.models.record(body, listings)
        return body

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> dict[str, Any] | None:
        """Merge `status` into the model's; the model as the server stored it."""
        listings = self.models.listings if self.models is not None else 0
        path = f"{collection_path(f'{GROUP}/{VERSION}', KIND, namespace)}/{name}/status"
        body: dict[str, Any] | None = self._call(
            "PATCH", path, body={"status": status}, content_type="application/merge-patch+json", kind=KIND
        )
        if body is not None and self.models is not None:
            self.models.record(body, listings)
        return body

    def event(self, involved: dict[str, Any], type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        """Record a core/v1 Event on `involved` (a FlashModel or a Pod)."""
        meta = involved["metadata"]
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"generateName": f"{meta['name']}.", "namespace": meta["namespace"]},
            "involvedObject": {
                "apiVersion": involved.get("apiVersion", f"{GROUP}/{VERSION}"),
                "kind": involved.get("kind", KIND),
                "name": meta["name"],
                "namespace": meta["namespace"],
                "uid": meta.get("uid"),
            },
            "type": type_,
            "reason": reason,
            "message": message[:1024],
            "source": {"component": FIELD_MANAGER},
            "reportingComponent": FIELD_MANAGER,
            "firstTimestamp": now,
            "lastTimestamp": now,
            "eventTime": now,
            "action": reason,
            "reportingInstance": FIELD_MANAGER,
            "count": 1,
        }
        try:
            self._call("POST", collection_path("v1", "Event", meta["namespace"]), body=body, kind="Event")
        except ApiException as exc:
            # An event that cannot be written must not fail the reconcile that caused it.
            log.warning(
                "event=dropped object=%s/%s reason=%s status=%s", meta["namespace"], meta["name"], reason, exc.status
            )
