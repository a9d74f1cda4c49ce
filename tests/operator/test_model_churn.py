"""Model churn leaves nothing behind: 1,000 models created and deleted, and every per-model table is empty again.

Through the operator's own entry points (the kopf handlers, the pod watches, the resync), against an
in-memory API server that fails one request in nine (a dropped connection), with the events a real
cluster sends after a model's deletion: the garbage collector's DELETED events of its Deployment and
pods, and the passes they queue. An operator whose memory grew with every model it ever saw would
run out of it under churn (CI namespaces, preview models) however small its fleet.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, cast

import kopf
import pytest
import yaml
from flashmodel_operator import handlers, pod_state, reconcile
from flashmodel_operator.apply import Cluster
from flashmodel_operator.child_cache import ChildCache
from flashmodel_operator.condition_metrics import MODEL_CONDITIONS
from flashmodel_operator.diffbase import HandledSpecs
from flashmodel_operator.pod_tasks import EnginePodTasks
from flashmodel_operator.render import MODEL_LABEL
from flashmodel_operator.watched_models import WatchedModels

from e2e.harness.cluster import ControlPlane
from tests.operator.specs import MINIMAL_T4
from tests.operator.test_child_cache import InMemoryAPI

ROOT = Path(__file__).resolve().parents[2]

MODELS = 1000
NAMESPACE = "churn"
FM_PATH = "/apis/serving.flashmodel.io/v1alpha1/namespaces/{ns}/flashmodels/{name}"


class DroppingAPI(InMemoryAPI):
    """The in-memory API server, dropping every ninth request's connection (fault injection)."""

    def __init__(self) -> None:
        super().__init__()
        self.sent = 0
        self.dropped = 0

    def _send(self, method: str, path: str, **kwargs: Any) -> tuple[int, Any]:
        self.sent += 1
        if self.sent % 9 == 0:
            self.dropped += 1
            raise ConnectionResetError("the API server dropped the connection")
        if method == "DELETE":
            raise AssertionError(f"the operator sent DELETE {path}")
        return super()._send(method, path, **kwargs)

    def delete_object(self, path: str) -> dict[str, Any]:
        """A deletion by another client (the user, the garbage collector): the DELETED event's body."""
        self.version += 1
        gone = self.objects.pop(path)
        gone["metadata"]["resourceVersion"] = str(self.version)
        return gone


def _body(raw: dict[str, Any]) -> kopf.Body:
    return kopf.Body(cast(kopf.RawBody, copy.deepcopy(raw)))


def _pod(model: str, uid: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{model}-7d9f-abcde",
            "namespace": NAMESPACE,
            "uid": f"pod-{uid}",
            "resourceVersion": "1",
            "labels": {"app.kubernetes.io/managed-by": "flashmodel-operator", MODEL_LABEL: model},
        },
        "spec": {"containers": [{"name": "engine"}]},
        # Waiting for a node: its watch waits on the live body and asks the API nothing.
        "status": {"phase": "Pending"},
    }


async def _create(api: DroppingAPI, name: str, index: int) -> None:
    """The API server stores the model; kopf delivers its event and calls the create handler (and retries it)."""
    raw = copy.deepcopy(MINIMAL_T4)
    raw["metadata"].update(name=name, namespace=NAMESPACE, uid=f"uid-{index}")
    created = api.store(FM_PATH.format(ns=NAMESPACE, name=name), raw)
    remember = cast(Callable[..., Coroutine[Any, Any, None]], handlers.remember_flashmodel)
    await remember(body=_body(created), namespace=NAMESPACE, name=name, type="ADDED")
    change = cast(Callable[..., None], handlers.on_flashmodel_change)
    for retry in range(5):
        try:
            await asyncio.to_thread(
                change, namespace=NAMESPACE, name=name, body=_body(created), reason="create", retry=retry
            )
            break
        except ConnectionResetError:
            continue  # kopf's back-off; the model may stay failing until it is deleted
    # kopf records the handled spec as its diff base once the handler is done.
    essence = handlers.HANDLED_SPECS.build(body=_body(created))
    handlers.HANDLED_SPECS.store(body=_body(created), patch=kopf.Patch(), essence=essence)


async def _children_appear(api: DroppingAPI, name: str, index: int) -> None:
    """The Deployment's and its pod's watch events, as the cluster sends them after the first pass."""
    deployment = api.objects.get(f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}")
    if deployment is not None:
        on_deployment = cast(Callable[..., None], handlers.on_deployment_event)
        on_deployment(body=_body(deployment), namespace=NAMESPACE, type="ADDED")
    pod = _pod(name, str(index))
    engine_pod = cast(Callable[..., Coroutine[Any, Any, None]], handlers.engine_pod)
    await engine_pod(body=_body(pod), type="ADDED")
    on_pod = cast(Callable[..., None], handlers.on_pod_event)
    on_pod(body=_body(pod), namespace=NAMESPACE, type="ADDED")


async def _delete(api: DroppingAPI, name: str, index: int) -> None:
    """The user deletes the model; the garbage collector then deletes its children, whose events come after."""
    gone = api.delete_object(FM_PATH.format(ns=NAMESPACE, name=name))
    remember = cast(Callable[..., Coroutine[Any, Any, None]], handlers.remember_flashmodel)
    await remember(body=_body(gone), namespace=NAMESPACE, name=name, type="DELETED")
    deployment_path = f"/apis/apps/v1/namespaces/{NAMESPACE}/deployments/{name}"
    if deployment_path in api.objects:
        on_deployment = cast(Callable[..., None], handlers.on_deployment_event)
        on_deployment(body=_body(api.delete_object(deployment_path)), namespace=NAMESPACE, type="DELETED")
    pod = _pod(name, str(index))
    pod["metadata"]["resourceVersion"] = "2"
    engine_pod = cast(Callable[..., Coroutine[Any, Any, None]], handlers.engine_pod)
    await engine_pod(body=_body(pod), type="DELETED")
    on_pod = cast(Callable[..., None], handlers.on_pod_event)
    on_pod(body=_body(pod), namespace=NAMESPACE, type="DELETED")  # queues a pass, which finds no model


async def test_a_thousand_models_created_and_deleted_leave_every_per_model_table_empty(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    api = DroppingAPI()
    api.models = WatchedModels()
    monkeypatch.setattr(handlers, "_cluster", api)
    monkeypatch.setattr(handlers, "FLASHMODELS", api.models)
    monkeypatch.setattr(handlers, "CHILDREN", ChildCache())
    monkeypatch.setattr(handlers, "HANDLED_SPECS", HandledSpecs(prefix="serving.flashmodel.io", key="handled"))
    monkeypatch.setattr(handlers, "ENGINE_PODS", EnginePodTasks(handlers.watch_engine_pod, backoff=0.05, grace=0.5))
    ours = {(NAMESPACE, f"m{i}") for i in range(MODELS)}
    assert not any(_held_of(ours).values()), "the test's namespace is in use"
    # The resync runs all along: passes of its own, and the clean-up of what events after a deletion left.
    resync = asyncio.create_task(handlers.resync_fleet(0.2))
    try:
        batch = 100
        for start in range(0, MODELS, batch):
            names = [(f"m{i}", i) for i in range(start, start + batch)]
            for name, i in names:
                await _create(api, name, i)
                await _children_appear(api, name, i)
            assert len(handlers.ENGINE_PODS) == batch
            assert {(NAMESPACE, n) for n, _ in names} <= set(pod_state.MODELS)  # the tables did fill
            assert len(handlers.HANDLED_SPECS) == batch
            assert _held_of(ours)["replica gauges"]
            assert _held_of(ours)["condition series"]  # passes wrote their conditions
            for name, i in names:
                await _delete(api, name, i)
        assert await asyncio.to_thread(handlers.drain_child_passes, 30.0)
        assert api.dropped > 100
        # The late events' leftovers go at the resync's next look at the fleet: 0.2 s once the fleet is
        # empty, after it has walked the list it took before the last deletions (0.2 s a model).
        left = await _emptied(ours, tries=400)
    finally:
        resync.cancel()
        await handlers.ENGINE_PODS.stop_all()
    assert not any(left.values()), left


API_MODELS = 20


def _kubectl_json(cp: ControlPlane, *args: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(cp.kubectl("get", *args, "-o", "json").stdout)["items"]
    return items


async def test_models_created_and_deleted_on_a_real_api_server_leave_every_per_model_table_empty(
    control_plane: ControlPlane, k8s_namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same churn against the real API server, whose garbage collector deletes the children."""
    ns, cp = k8s_namespace, control_plane
    cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "flashmodel.yaml"))
    cp.wait_established("flashmodels.serving.flashmodel.io")
    api = cp.api_client()
    models = WatchedModels()
    monkeypatch.setattr(handlers, "_cluster", Cluster(api, models=models))
    monkeypatch.setattr(handlers, "FLASHMODELS", models)
    monkeypatch.setattr(handlers, "CHILDREN", ChildCache())
    monkeypatch.setattr(handlers, "HANDLED_SPECS", HandledSpecs(prefix="serving.flashmodel.io", key="handled"))
    monkeypatch.setattr(handlers, "ENGINE_PODS", EnginePodTasks(handlers.watch_engine_pod, backoff=0.05, grace=0.5))
    names = {(ns, f"m{i}") for i in range(API_MODELS)}
    # No node has this label: the pods stay Pending, so their watches wait and ask nothing of a shim.
    spec = {**MINIMAL_T4["spec"], "nodeSelector": {"churn.example/pool": "none"}}
    docs = [
        {"apiVersion": MINIMAL_T4["apiVersion"], "kind": "FlashModel", "metadata": {"name": n}, "spec": spec}
        for _, n in sorted(names)
    ]
    resync = asyncio.create_task(handlers.resync_fleet(0.2))
    try:
        cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump_all(docs))
        remember = cast(Callable[..., Coroutine[Any, Any, None]], handlers.remember_flashmodel)
        change = cast(Callable[..., None], handlers.on_flashmodel_change)
        bodies = _kubectl_json(cp, "flashmodels", "-n", ns)
        for body in bodies:
            name = body["metadata"]["name"]
            await remember(body=_body(body), namespace=ns, name=name, type="ADDED")
            await asyncio.to_thread(change, namespace=ns, name=name, body=_body(body), reason="create", retry=0)
        for deployment in _kubectl_json(cp, "deployments", "-n", ns):
            on_deployment = cast(Callable[..., None], handlers.on_deployment_event)
            on_deployment(body=_body(deployment), namespace=ns, type="ADDED")
        for _ in range(100):  # the Deployment controller makes the pods
            pods = _kubectl_json(cp, "pods", "-n", ns)
            if len(pods) >= API_MODELS:
                break
            await asyncio.sleep(0.2)
        engine_pod = cast(Callable[..., Coroutine[Any, Any, None]], handlers.engine_pod)
        on_pod = cast(Callable[..., None], handlers.on_pod_event)
        for pod in pods:
            await engine_pod(body=_body(pod), type="ADDED")
            on_pod(body=_body(pod), namespace=ns, type="ADDED")
        assert len(handlers.ENGINE_PODS) >= API_MODELS
        assert names <= set(pod_state.MODELS) and names <= handlers.CHILDREN.models()

        deployments = _kubectl_json(cp, "deployments", "-n", ns)
        cp.kubectl("delete", "flashmodels", "--all", "-n", ns, "--wait=true")
        for body in bodies:
            await remember(body=_body(body), namespace=ns, name=body["metadata"]["name"], type="DELETED")
        for _ in range(150):  # the garbage collector deletes the children after their owner
            if not _kubectl_json(cp, "deployments", "-n", ns) and not _kubectl_json(cp, "pods", "-n", ns):
                break
            await asyncio.sleep(0.2)
        for deployment in deployments:
            on_deployment = cast(Callable[..., None], handlers.on_deployment_event)
            on_deployment(body=_body(deployment), namespace=ns, type="DELETED")
        for pod in pods:
            await engine_pod(body=_body(pod), type="DELETED")
            on_pod(body=_body(pod), namespace=ns, type="DELETED")
        assert await asyncio.to_thread(handlers.drain_child_passes, 30.0)
        left = await _emptied(names, tries=200)
    finally:
        resync.cancel()
        await handlers.ENGINE_PODS.stop_all()
        api.close()  # type: ignore[no-untyped-call]
    assert not any(left.values()), left


async def _emptied(names: set[tuple[str, str]], tries: int) -> dict[str, object]:
    """What the tables still hold of `names` once they are empty, or after `tries` looks 0.1 s apart."""
    left = _held_of(names)
    for _ in range(tries):
        if not any(left.values()):
            break
        await asyncio.sleep(0.1)
        left = _held_of(names)
    return left


def _held_of(names: set[tuple[str, str]]) -> dict[str, object]:
    """What the per-model tables still hold of `names` (the pass locks and pod watches: how many in all)."""
    with handlers._child_lock:
        queued = handlers._child_queued | handlers._child_running | handlers._child_again
        child = names & (queued | handlers._child_unsure)
    return {
        "pod_state.MODELS": names & set(pod_state.MODELS),
        "reconcile pass locks": len(reconcile._locks),
        "reconcile failure clocks": names & set(reconcile._failing_since),
        "condition series": names & MODEL_CONDITIONS.models(),
        "HANDLED_SPECS": len(handlers.HANDLED_SPECS),
        "CHILDREN": names & handlers.CHILDREN.models(),
        "FLASHMODELS": names & set(handlers.FLASHMODELS),
        "ENGINE_PODS": len(handlers.ENGINE_PODS),
        "child pass sets": child,
        "replica gauges": [
            s.labels
            for m in reconcile.MODEL_REPLICAS.collect()
            for s in m.samples
            if (s.labels.get("namespace"), s.labels.get("flashmodel")) in names
        ],
    }
