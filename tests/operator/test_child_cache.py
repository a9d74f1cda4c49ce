"""A child event's pass reads the model's Deployment and pods from the watch, and falls back to the API where it must.

Against an in-memory API server under the real Cluster class (its transport replaced): every
request is counted, so the tests show which reads a pass makes, and that the cache never makes a
pass act on a child it has not seen or on an older one than a pass already wrote a status from.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, cast

import kopf
import pytest
from flashmodel_operator.apply import Cluster
from flashmodel_operator.child_cache import ChildCache
from flashmodel_operator.pod_state import model_state
from flashmodel_operator.render import CONFIG_HASH_ANNOTATION, CONTROL_TOKEN_KEY, MODEL_LABEL, PREWARM_GATE
from flashmodel_operator.standby_gate import template_hash
from flashmodel_operator.watched_models import WatchedModels
from kubernetes.client.exceptions import ApiException

from tests.operator.specs import MINIMAL_T4

_namespaces = itertools.count()
_FM_PATH = "/apis/serving.flashmodel.io/v1alpha1/namespaces/{ns}/flashmodels/{name}"


def _merge(target: dict[str, Any], patch: dict[str, Any]) -> None:
    """JSON merge patch (RFC 7386), as the API server applies a status patch."""
    for key, value in patch.items():
        if value is None:
            target.pop(key, None)
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            _merge(target[key], value)
        else:
            target[key] = copy.deepcopy(value)


class InMemoryAPI(Cluster):
    """The real Cluster class over an in-memory API server: objects by path, a resourceVersion per write."""

    def __init__(self) -> None:
        super().__init__(api=None)  # type: ignore[arg-type]  # _send below is the whole transport
        self.objects: dict[str, dict[str, Any]] = {}
        self.version = 1000
        self.requests: list[str] = []
        """'GET deployments', 'LIST pods', 'PATCH flashmodels/status', ... in the order sent."""

    def store(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Write an object as another client would (the Deployment controller, the kubelet): a new version."""
        self.version += 1
        body["metadata"]["resourceVersion"] = str(self.version)
        self.objects[path] = body
        return copy.deepcopy(body)

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
        parts = path.split("/")
        at = parts.index("namespaces") + 2  # .../namespaces/<ns>/<plural>[/<name>[/status]]
        plural, rest = parts[at], parts[at + 1 :]
        if method == "GET" and not rest:
            self.requests.append(f"LIST {plural}")
            wanted = dict(pair.split("=") for pair in dict(query or [])["labelSelector"].split(","))
            prefix = path + "/"
            items = [
                copy.deepcopy(o)
                for p, o in self.objects.items()
                if p.startswith(prefix) and wanted.items() <= (o["metadata"].get("labels") or {}).items()
            ]
            return 200, {"items": items, "metadata": {"resourceVersion": str(self.version)}}
        self.requests.append(f"{method} {plural}{'/status' if rest[1:] == ['status'] else ''}")
        if plural == "events":
            return 201, None
        if method == "POST":
            target = f"{path}/{body['metadata']['name']}"
            if target in self.objects:
                raise ApiException(status=409, reason="Conflict")
            return 201, self.store(target, copy.deepcopy(body))
        target = path.removesuffix("/status")
        if method == "GET":
            if target not in self.objects:
                raise ApiException(status=404, reason="Not Found")
            return 200, copy.deepcopy(self.objects[target])
        if method == "PATCH" and rest[1:] == ["status"]:
            _merge(self.objects[target].setdefault("status", {}), body["status"])
            return 200, self.store(target, self.objects[target])
        if method == "PATCH":  # server-side apply: the operator owns every field it sends
            existed = target in self.objects
            applied = copy.deepcopy(body)
            generation = 1
            if existed:
                before = self.objects[target]
                generation = int(before["metadata"].get("generation", 1)) + (before.get("spec") != applied.get("spec"))
                if "status" in before:
                    applied["status"] = before["status"]
            applied["metadata"]["generation"] = generation
            return (200 if existed else 201), self.store(target, applied)
        raise AssertionError(f"the operator sent {method} {path}")


@pytest.fixture
def api(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemoryAPI]:
    from flashmodel_operator import handlers

    server = InMemoryAPI()
    server.models = WatchedModels()  # as handlers.cluster() makes it: every read and status write goes in
    monkeypatch.setattr(handlers, "_cluster", server)
    monkeypatch.setattr(handlers, "CHILDREN", ChildCache())
    monkeypatch.setattr(handlers, "FLASHMODELS", server.models)
    yield server


def _new_model(api: InMemoryAPI) -> tuple[str, str]:
    """A model created and given its first pass (what the create event does)."""
    from flashmodel_operator import handlers

    ns, name = f"cache-{next(_namespaces)}", str(MINIMAL_T4["metadata"]["name"])
    body = copy.deepcopy(MINIMAL_T4)
    body["metadata"]["namespace"] = ns
    created = api.store(_FM_PATH.format(ns=ns, name=name), body)
    handlers._reconcile_latest(ns, name, fresh=created)
    return ns, name


def test_a_pass_renders_the_engine_pod_once(api: InMemoryAPI, monkeypatch: pytest.MonkeyPatch) -> None:
    # The pass wants the pod's config hash, its problems and the Deployment's template: one render.
    from flashmodel_operator import render

    rendered: list[str] = []
    base = render._base_pod_template

    def counted(fm: Any) -> dict[str, Any]:
        rendered.append(fm.name)
        return base(fm)

    monkeypatch.setattr(render, "_base_pod_template", counted)
    _, name = _new_model(api)
    assert "PATCH deployments" in api.requests
    assert rendered == [name]


def _deployment_path(ns: str, name: str) -> str:
    return f"/apis/apps/v1/namespaces/{ns}/deployments/{name}"


def _controller_writes_status(api: InMemoryAPI, ns: str, name: str, ready: int) -> dict[str, Any]:
    deployment = api.objects[_deployment_path(ns, name)]
    deployment["metadata"]["generation"] = 1
    deployment["status"] = {"observedGeneration": 1, "replicas": 1, "readyReplicas": ready, "updatedReplicas": 1}
    return api.store(_deployment_path(ns, name), deployment)


def _kubelet_writes_pod(api: InMemoryAPI, ns: str, name: str, pod: str, prewarmed: bool) -> dict[str, Any]:
    fm = api.objects[_FM_PATH.format(ns=ns, name=name)]
    conditions = [{"type": PREWARM_GATE, "status": "True", "reason": "PrewarmSucceeded"}] if prewarmed else []
    body = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": pod,
            "namespace": ns,
            "labels": {
                "app.kubernetes.io/name": "flashmodel-engine",
                "app.kubernetes.io/instance": name,
                "app.kubernetes.io/managed-by": "flashmodel-operator",
                MODEL_LABEL: name,
            },
            "annotations": {CONFIG_HASH_ANNOTATION: template_hash(fm)},
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"containers": [{"name": "engine"}]},
        "status": {"phase": "Running", "conditions": conditions},
    }
    return api.store(f"/api/v1/namespaces/{ns}/pods/{pod}", body)


def _pod_event(event_type: str | None, body: dict[str, Any]) -> None:
    """kopf delivering a pod's watch event to the operator's handler, and the pass it queued."""
    from flashmodel_operator import handlers

    handler = cast(Callable[..., None], handlers.on_pod_event)
    handler(body=kopf.Body(cast(kopf.RawBody, body)), namespace=body["metadata"]["namespace"], type=event_type)
    assert handlers.drain_child_passes(10)  # the pass the event queued


def _deployment_event(event_type: str | None, body: dict[str, Any]) -> None:
    from flashmodel_operator import handlers

    handler = cast(Callable[..., None], handlers.on_deployment_event)
    handler(body=kopf.Body(cast(kopf.RawBody, body)), namespace=body["metadata"]["namespace"], type=event_type)
    assert handlers.drain_child_passes(10)  # the pass the event queued


def _model_event(event_type: str | None, body: dict[str, Any]) -> None:
    """kopf delivering a FlashModel's watch event to the operator's handler."""
    from flashmodel_operator import handlers

    handler = cast(Callable[..., Coroutine[Any, Any, None]], handlers.remember_flashmodel)
    meta = body["metadata"]
    asyncio.run(
        handler(
            body=kopf.Body(cast(kopf.RawBody, copy.deepcopy(body))),
            namespace=meta["namespace"],
            name=meta["name"],
            type=event_type,
        )
    )


def _status(api: InMemoryAPI, ns: str, name: str) -> dict[str, Any]:
    status: dict[str, Any] = api.objects[_FM_PATH.format(ns=ns, name=name)]["status"]
    return status


def _reads(requests: list[str]) -> list[str]:
    return [r for r in requests if r.startswith(("GET", "LIST"))]


def test_a_child_event_pass_reads_nothing_once_the_operator_has_seen_the_model_and_its_children(
    api: InMemoryAPI,
) -> None:
    from flashmodel_operator import handlers

    ns, name = _new_model(api)
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=0))
    _pod_event("ADDED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=False))

    # The model's own update pass (and the resync) read everything: 7 requests (the Deployment the
    # apply compared is the one its status reads; the PodDisruptionBudget a single-replica model must
    # not have is looked for, as the apply would have read it).
    api.requests.clear()
    handlers._reconcile_latest(ns, name)
    assert sorted(_reads(api.requests)) == [
        "GET configmaps", "GET deployments", "GET flashmodels", "GET poddisruptionbudgets",
        "GET secrets", "GET services", "LIST pods",
    ]

    # A pod event: the model is the one the last pass read, its pods and Deployment come from the watch.
    api.requests.clear()
    pod = _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True)
    _pod_event("MODIFIED", pod)
    assert api.requests == ["PATCH flashmodels/status"]
    assert _status(api, ns, name)["prewarmedReplicas"] == 1

    # A Deployment event: the model as that status write left it, its status from the event's body.
    api.requests.clear()
    _deployment_event("MODIFIED", _controller_writes_status(api, ns, name, ready=1))
    assert api.requests == ["PATCH flashmodels/status"]
    assert _status(api, ns, name)["readyReplicas"] == 1

    # The pass compared against the status it wrote last, not an older one: nothing new, nothing sent.
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    assert api.requests == []


def test_a_new_models_first_pass_reads_nothing(api: InMemoryAPI) -> None:
    # Nothing of it exists yet; the Deployment's status comes from the server's answer to its apply.
    api.requests.clear()
    ns, name = _new_model(api)
    assert _reads(api.requests) == []
    assert sorted(r for r in api.requests if r != "POST events") == [
        "PATCH configmaps", "PATCH deployments", "PATCH flashmodels/status", "PATCH services", "POST secrets",
    ]
    assert _status(api, ns, name)["replicas"] == 0 and _status(api, ns, name)["observedGeneration"] == 1
    # One event says what the pass made; its pods' watches take the shim token from the pass, not the API.
    assert api.requests.count("POST events") == 1
    secret = api.objects[f"/api/v1/namespaces/{ns}/secrets/{name}-shim"]
    assert model_state(ns, name).control_token == secret["stringData"][CONTROL_TOKEN_KEY]


def test_a_new_models_pods_all_come_through_the_watch_so_its_child_passes_list_none(api: InMemoryAPI) -> None:
    # The first pass made the Deployment: every pod of the model is still to come, each as a watch
    # event, so the set the watch delivers is whole without an API list.
    ns, name = _new_model(api)
    api.requests.clear()
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=0))
    _pod_event("ADDED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=False))
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    assert _reads(api.requests) == []
    assert _status(api, ns, name)["prewarmedReplicas"] == 1

    # Unless the watch listed the pods again since: a pod deleted meanwhile would send no event.
    other_ns, other = _new_model(api)
    from flashmodel_operator import handlers

    handlers.CHILDREN.pod_event("elsewhere", "x", None, _pod("x", api.version + 1))
    api.requests.clear()
    _pod_event("ADDED", _kubelet_writes_pod(api, other_ns, other, "q1", prewarmed=True))
    assert _reads(api.requests) == ["LIST pods"]


def test_a_child_the_watch_has_not_shown_whole_is_read_from_the_api(
    api: InMemoryAPI, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The operator just started: kopf's listing delivers each object as an event of type None, so
    # the pods seen so far may not be all of them, and a Deployment not listed yet may be gone.
    from flashmodel_operator import handlers

    ns, name = _new_model(api)
    _controller_writes_status(api, ns, name, ready=1)
    monkeypatch.setattr(handlers, "CHILDREN", ChildCache())  # a new operator process
    api.models = WatchedModels()
    monkeypatch.setattr(handlers, "FLASHMODELS", api.models)
    api.requests.clear()
    _pod_event(None, _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    assert _reads(api.requests) == ["GET flashmodels", "LIST pods", "GET deployments"]
    assert _status(api, ns, name)["readyReplicas"] == 1

    # All three were read since the listing: the next event's pass reads none.
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=False))
    assert _reads(api.requests) == []
    assert _status(api, ns, name)["prewarmedReplicas"] == 0

    # kopf lists the Deployments again (its watch expired): a deletion in between sent no event,
    # so until this model's own Deployment is seen again, the pass reads it.
    other = {"metadata": {"name": "other", "resourceVersion": str(api.version + 1)}}
    handlers.CHILDREN.deployment_event("elsewhere", "other", None, other)
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    assert _reads(api.requests) == ["GET deployments"]

    # And the pods again: the next pass lists them.
    handlers.CHILDREN.pod_event("elsewhere", "other", None, _pod("x", api.version + 1))
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=False))
    assert _reads(api.requests) == ["LIST pods"]
    assert _status(api, ns, name)["prewarmedReplicas"] == 0

    # And the models: one deleted while the watch was away sent no DELETED event, so the next pass
    # reads the model, once.
    _model_event(None, {"metadata": {"namespace": "elsewhere", "name": "other", "resourceVersion": "1"}})
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    assert _reads(api.requests) == ["GET flashmodels"]
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=False))
    assert _reads(api.requests) == []


def test_a_deleted_deployment_is_recreated_not_taken_as_unchanged(api: InMemoryAPI) -> None:

    ns, name = _new_model(api)
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=1))
    _pod_event(None, _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    gone = api.objects.pop(_deployment_path(ns, name))
    gone["metadata"]["resourceVersion"] = str(api.version + 1)
    _deployment_event("DELETED", gone)
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=False))
    assert "GET deployments" in api.requests and "PATCH deployments" in api.requests
    assert _deployment_path(ns, name) in api.objects


def test_a_deployment_the_pass_corrected_is_read_back_for_its_status(api: InMemoryAPI) -> None:
    # Someone edited the pod template and the controller rolled it out; the watched body looks
    # settled. The pass puts the template back: the status must come from the Deployment as it is
    # now (a new generation, not yet rolled out), not from the body it replaced.

    ns, name = _new_model(api)
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=1))
    _pod_event(None, _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    progressing = next(c for c in _status(api, ns, name)["conditions"] if c["type"] == "Progressing")
    assert progressing["status"] == "False"
    edited = api.objects[_deployment_path(ns, name)]
    edited["spec"]["template"]["spec"]["containers"][0]["image"] = "someone/else:latest"
    edited["metadata"]["generation"] = 2
    edited["status"]["observedGeneration"] = 2
    api.requests.clear()
    _deployment_event("MODIFIED", api.store(_deployment_path(ns, name), edited))
    assert "PATCH deployments" in api.requests
    # The watched body keeps no spec, and its generation is not the one last compared whole: the
    # Deployment is read whole to compare; the server's answer to the apply is the status's.
    assert _reads(api.requests) == ["GET deployments"]
    progressing = next(c for c in _status(api, ns, name)["conditions"] if c["type"] == "Progressing")
    assert (progressing["status"], progressing["reason"]) == ("True", "RollingOut")


def test_a_late_watch_event_never_takes_the_status_back(api: InMemoryAPI) -> None:
    # The model's own pass read the Deployment from the API after the controller's second write;
    # the watch then delivers the first one, late. The status must not go back to 0 ready.
    from flashmodel_operator import handlers

    ns, name = _new_model(api)
    older = _controller_writes_status(api, ns, name, ready=0)
    _pod_event(None, _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    _controller_writes_status(api, ns, name, ready=1)
    handlers._reconcile_latest(ns, name)
    assert _status(api, ns, name)["readyReplicas"] == 1
    api.requests.clear()
    _deployment_event("MODIFIED", older)
    assert api.requests == [], "the cache kept the newer Deployment: nothing to write"
    assert _status(api, ns, name)["readyReplicas"] == 1


def _new_spec(api: InMemoryAPI, ns: str, name: str, max_model_len: int) -> dict[str, Any]:
    """A user's spec change: a new generation on the API server, not yet seen by the operator."""
    fm = copy.deepcopy(api.objects[_FM_PATH.format(ns=ns, name=name)])
    fm["spec"]["engine"] = {"maxModelLen": max_model_len}
    fm["metadata"]["generation"] = int(fm["metadata"].get("generation", 1)) + 1
    return api.store(_FM_PATH.format(ns=ns, name=name), fm)


def _engine_config(api: InMemoryAPI, ns: str, name: str) -> str:
    return json.dumps(api.objects[f"/api/v1/namespaces/{ns}/configmaps/{name}-engine"]["data"])


def _template_of_deployment(api: InMemoryAPI, ns: str, name: str) -> str:
    template = api.objects[_deployment_path(ns, name)]["spec"]["template"]
    return str(template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])


def test_a_spec_change_the_watch_delivered_is_applied_whole_by_a_child_event_pass(api: InMemoryAPI) -> None:
    # The engine config (ConfigMap) must change together with the pod template, even when a child's
    # event is the first to start a pass after the change.
    ns, name = _new_model(api)
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=1))
    _model_event("MODIFIED", _new_spec(api, ns, name, 1024))
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    assert "PATCH configmaps" in api.requests and "PATCH deployments" in api.requests
    assert "GET flashmodels" not in api.requests, "the watch's body is the newest the operator has seen"
    assert "1024" in _engine_config(api, ns, name)
    assert _status(api, ns, name)["observedGeneration"] == 2


def test_a_child_event_pass_never_takes_back_a_spec_another_pass_read(api: InMemoryAPI) -> None:
    # The model's update pass read generation 2 from the API and applied it; the watch's event of
    # generation 1 comes late. A pod event's pass must act on generation 2, not put 1 back.
    from flashmodel_operator import handlers

    ns, name = _new_model(api)
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=1))
    old = copy.deepcopy(api.objects[_FM_PATH.format(ns=ns, name=name)])
    new = _new_spec(api, ns, name, 1024)
    handlers._reconcile_latest(ns, name)
    applied = _template_of_deployment(api, ns, name)
    assert applied == template_hash(new) != template_hash(old)
    _model_event("MODIFIED", old)
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    assert "PATCH deployments" not in api.requests and "PATCH configmaps" not in api.requests
    assert _template_of_deployment(api, ns, name) == applied
    assert "1024" in _engine_config(api, ns, name)
    assert _status(api, ns, name)["observedGeneration"] == 2


def test_a_spec_change_is_not_missed_when_a_child_event_comes_before_its_own(api: InMemoryAPI) -> None:
    # A pod event's pass runs before the model's watch event of a new spec has arrived: it acts on
    # the spec the operator has seen (as if it had run a moment earlier), and the change's own event
    # then applies the new one, whole.
    from flashmodel_operator import handlers

    ns, name = _new_model(api)
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=1))
    before = _template_of_deployment(api, ns, name)
    changed = _new_spec(api, ns, name, 1024)
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    assert _template_of_deployment(api, ns, name) == before
    _model_event("MODIFIED", changed)
    update = cast(Callable[..., None], handlers.on_flashmodel_change)
    update(namespace=ns, name=name, body=kopf.Body(cast(kopf.RawBody, changed)), reason="update", retry=0)
    assert _template_of_deployment(api, ns, name) == template_hash(changed) != before
    assert "1024" in _engine_config(api, ns, name)
    assert _status(api, ns, name)["observedGeneration"] == 2


def test_a_child_going_away_makes_the_pass_read_the_model(api: InMemoryAPI) -> None:
    # The model was deleted; the garbage collector deletes its children, whose events may come
    # before the model's own DELETED event. The pass reads the model and finds it gone: no
    # Deployment made again for a model that no longer exists, no status written to it.
    ns, name = _new_model(api)
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=1))
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    pod = _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True)
    del api.objects[_FM_PATH.format(ns=ns, name=name)]
    deployment = api.objects.pop(_deployment_path(ns, name))
    deployment["metadata"]["resourceVersion"] = str(api.version + 1)
    _deployment_event("DELETED", deployment)
    pod["metadata"]["deletionTimestamp"] = "2026-12-06T00:00:00Z"
    pod["metadata"]["resourceVersion"] = str(api.version + 2)
    api.requests.clear()
    _pod_event("MODIFIED", pod)
    assert api.requests == ["GET flashmodels"]
    assert _deployment_path(ns, name) not in api.objects


# -- the cache on its own ---------------------------------------------------------------------------


def _pod(name: str, version: int, phase: str = "Running") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "resourceVersion": str(version), "managedFields": [{"manager": "kubelet"}]},
        "spec": {"containers": [{"name": "engine", "image": "x" * 1000}]},
        "status": {"phase": phase},
    }


def _names(cache: ChildCache) -> list[str] | None:
    pods = cache.pods("ns", "m")
    return None if pods is None else sorted(p["metadata"]["name"] for p in pods)


def test_a_pod_set_is_whole_only_after_an_api_list_and_until_the_next_listing() -> None:
    cache = ChildCache()
    cache.pod_event("ns", "m", "ADDED", _pod("a", 10))
    assert _names(cache) is None, "one event says nothing of the model's other pods"
    listings = cache.listings[1]
    cache.record_pods("ns", "m", [_pod("a", 10), _pod("b", 11)], "12", listings)
    assert _names(cache) == ["a", "b"]
    cache.pod_event("ns", "m", "ADDED", _pod("c", 13))
    cache.pod_event("ns", "m", "DELETED", _pod("a", 14))
    assert _names(cache) == ["b", "c"]
    cache.pod_event("ns", "other", None, _pod("x", 15))  # kopf lists again, whichever model's pod comes first
    assert _names(cache) is None


def test_a_list_that_overlapped_a_listing_is_not_trusted() -> None:
    cache = ChildCache()
    listings = cache.listings[1]
    cache.pod_event("ns", "m", None, _pod("a", 10))
    cache.record_pods("ns", "m", [_pod("a", 10)], "11", listings)
    assert _names(cache) is None


def test_an_api_list_or_a_late_event_never_brings_back_a_deleted_pod() -> None:
    cache = ChildCache()
    cache.record_pods("ns", "m", [_pod("a", 10), _pod("b", 11)], "12", cache.listings[1])
    cache.pod_event("ns", "m", "DELETED", _pod("a", 20))
    # A list served before the deletion, merged after its event (another pass's read).
    cache.record_pods("ns", "m", [_pod("a", 10), _pod("b", 11)], "15", cache.listings[1])
    assert _names(cache) == ["b"]
    # An event for a pod the newest list no longer had, older than that list: the pod is gone.
    cache.record_pods("ns", "m", [_pod("b", 11)], "30", cache.listings[1])
    cache.pod_event("ns", "m", "MODIFIED", _pod("z", 25))
    assert _names(cache) == ["b"]
    cache.pod_event("ns", "m", "ADDED", _pod("n", 31))
    assert _names(cache) == ["b", "n"]


def test_bodies_only_move_forward() -> None:
    cache = ChildCache()
    cache.record_pods("ns", "m", [_pod("a", 10)], "12", cache.listings[1])
    cache.pod_event("ns", "m", "MODIFIED", _pod("a", 20, phase="Failed"))
    cache.record_pods("ns", "m", [_pod("a", 10)], "13", cache.listings[1])  # served before the event
    pods = cache.pods("ns", "m")
    assert pods is not None and pods[0]["status"]["phase"] == "Failed"

    deployment = {"metadata": {"name": "m", "resourceVersion": "20"}, "spec": {"replicas": 2}, "status": {}}
    cache.deployment_event("ns", "m", "MODIFIED", deployment)
    cache.record_deployment("ns", "m", {**deployment, "metadata": {"resourceVersion": "15"}}, cache.listings[0])
    assert (cache.deployment("ns", "m") or {})["metadata"]["resourceVersion"] == "20"
    cache.deployment_event("ns", "m", "DELETED", {**deployment, "metadata": {"resourceVersion": "21"}})
    assert cache.deployment("ns", "m") is None
    cache.record_deployment("ns", "m", deployment, cache.listings[0])  # a read served before the deletion
    assert cache.deployment("ns", "m") is None


def test_the_cache_keeps_what_a_pass_reads_and_forgets_a_deleted_model() -> None:
    cache = ChildCache()
    cache.pod_event("ns", "m", "ADDED", _pod("a", 10))
    cache.record_pods("ns", "m", [_pod("a", 10)], "11", cache.listings[1])
    pods = cache.pods("ns", "m")
    assert pods is not None and set(pods[0]) == {"metadata", "status"}, "no spec: a pass reads none of it"
    assert "managedFields" not in pods[0]["metadata"]
    cache.deployment_event("ns", "m", "ADDED", {"metadata": {"name": "m", "resourceVersion": "12"}})
    cache.forget("ns", "m")
    assert cache.pods("ns", "m") is None and cache.deployment("ns", "m") is None
    assert not cache._pods and not cache._deployments
    # The garbage collector deletes the children after the model: their events come after `forget`.
    cache.deployment_event("ns", "m", "DELETED", {"metadata": {"name": "m", "resourceVersion": "13"}})
    cache.pod_event("ns", "m", "DELETED", _pod("a", 14))
    cache.pod_event("ns", "kept", "ADDED", _pod("k", 15))
    cache.retain({("ns", "kept")})
    assert list(cache._pods) == [("ns", "kept")] and not cache._deployment_deleted


def test_a_watched_deployment_spec_is_compared_whole_only_after_its_generation_moved(api: InMemoryAPI) -> None:
    # The cache keeps no Deployment spec. Its first apply's answer was compared whole; a new
    # generation (here the autoscaler's scale, which leaves the desired spec held) is read whole
    # once, found unchanged, and the next events of that generation need no read.
    ns, name = _new_model(api)
    _deployment_event("ADDED", _controller_writes_status(api, ns, name, ready=1))
    _pod_event(None, _kubelet_writes_pod(api, ns, name, "p1", prewarmed=True))
    scaled = api.objects[_deployment_path(ns, name)]
    scaled["metadata"]["generation"] = 2
    scaled["status"]["observedGeneration"] = 2
    api.requests.clear()
    _deployment_event("MODIFIED", api.store(_deployment_path(ns, name), scaled))
    assert _reads(api.requests) == ["GET deployments"] and "PATCH deployments" not in api.requests
    api.requests.clear()
    _pod_event("MODIFIED", _kubelet_writes_pod(api, ns, name, "p1", prewarmed=False))
    assert _reads(api.requests) == [] and "PATCH deployments" not in api.requests


def _kwok_pod(name: str, conditions: list[dict[str, Any]], **status: Any) -> dict[str, Any]:
    """A pod as the API server returns it: most of it is nothing a pass reads."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "ns",
            "uid": "3f6c",
            "resourceVersion": "10",
            "generateName": "m-5d8f-",
            "labels": {MODEL_LABEL: "m", "pod-template-hash": "5d8f"},
            "annotations": {CONFIG_HASH_ANNOTATION: "abc"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "m-5d8f", "uid": "1"}],
            "managedFields": [{"manager": "kubelet", "fieldsV1": {"f:status": {}}}],
            "creationTimestamp": "2026-12-06T00:00:00Z",
        },
        "spec": {"containers": [{"name": "engine", "image": "x" * 200}], "readinessGates": [{"conditionType": "g"}]},
        "status": {
            "hostIP": "10.0.0.1",
            "podIP": "127.16.0.9",
            "qosClass": "Burstable",
            "startTime": "2026-12-06T00:00:01Z",
            "conditions": [
                {**c, "lastProbeTime": None, "lastTransitionTime": "2026-12-06T00:00:02Z"} for c in conditions
            ],
            **status,
        },
    }


def test_a_kept_pod_answers_every_question_a_pass_asks_as_the_whole_pod_does() -> None:
    from flashmodel_engine.contract import PREFLIGHT_EXIT_CODE
    from flashmodel_operator.child_cache import pod_view
    from flashmodel_operator.pod_state import gate_is_standby, gate_is_true
    from flashmodel_operator.reconcile import preflight_refusal, unschedulable

    refused = {"terminated": {"exitCode": PREFLIGHT_EXIT_CODE, "message": "needs 16 GiB", "reason": "Error"}}
    pods = [
        _kwok_pod("prewarmed", [{"type": PREWARM_GATE, "status": "True", "reason": "PrewarmSucceeded"}],
                  phase="Running", containerStatuses=[{"name": "engine", "state": {"running": {"startedAt": "t"}},
                                                       "image": "x", "imageID": "y", "restartCount": 0}]),
        _kwok_pod("standby", [{"type": PREWARM_GATE, "status": "False", "reason": "Standby"}], phase="Running"),
        _kwok_pod("pending", [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                               "message": "0/3 nodes have a free T4"}], phase="Pending"),
        _kwok_pod("refused", [], phase="Running",
                  containerStatuses=[{"name": "engine", "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                      "lastState": refused, "restartCount": 3}]),
    ]
    pods[1]["metadata"]["deletionTimestamp"] = "2026-12-06T00:01:00Z"
    views = [pod_view(p) for p in pods]
    assert preflight_refusal(views, "abc") == preflight_refusal(pods, "abc") == ("refused", "needs 16 GiB")
    assert unschedulable(views) == unschedulable(pods) is not None
    assert [gate_is_true(v) for v in views] == [gate_is_true(p) for p in pods] == [True, False, False, False]
    assert [gate_is_standby(v) for v in views] == [gate_is_standby(p) for p in pods] == [False, True, False, False]
    for view, pod in zip(views, pods, strict=True):
        assert view["metadata"]["annotations"] == pod["metadata"]["annotations"]
        assert view["metadata"].get("deletionTimestamp") == pod["metadata"].get("deletionTimestamp")
    assert len(json.dumps(views)) < len(json.dumps(pods)) / 3
