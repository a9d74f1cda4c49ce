"""kopf handlers: parse the event, call reconcile, nothing else."""

from __future__ import annotations

import asyncio
import copy
import functools
import logging
import resource
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import aiohttp
import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from prometheus_client import start_http_server
from pydantic import ValidationError

from flashmodel_operator import FIELD_MANAGER, GROUP, PLURAL, VERSION, adapters, heap, pod_state
from flashmodel_operator.apply import Cluster, namespace_terminating, transient
from flashmodel_operator.child_cache import ChildCache
from flashmodel_operator.diffbase import HandledSpecs, UnmarkedProgressStorage
from flashmodel_operator.gating import PodWatch, model_of
from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.pod_tasks import EnginePodTasks, StopRequest
from flashmodel_operator.reconcile import (
    SECRET_WAIT_REASONS,
    forget_model,
    model_lock,
    reconcile,
    referenced_secrets,
    retain_models,
)
from flashmodel_operator.routing import PICKER_LABEL
from flashmodel_operator.settings import current
from flashmodel_operator.tracing import traced
from flashmodel_operator.watched_models import WatchedModels

log = logging.getLogger(__name__)

# kopf takes these when it imports this module, which `python -m flashmodel_operator` does after it
# read the environment (settings.load).
HANDLER_BACKOFF_SECONDS = current().handler_backoff_seconds
_OWNED = {"app.kubernetes.io/managed-by": FIELD_MANAGER}

_cluster: Cluster | None = None
_shim_session: aiohttp.ClientSession | None = None
_resync_task: asyncio.Task[None] | None = None
_trim_task: asyncio.Task[None] | None = None

FLASHMODELS = WatchedModels()
"""Every FlashModel as the operator last saw it (its watch, its reads, its status writes): what a child
event's pass, the pod watches and the resync read, instead of the API server."""

CHILDREN = ChildCache()
"""Every model's Deployment and pods as their watches last delivered them: what a child event's pass reads."""


async def watch_engine_pod(namespace: str, name: str, body: dict[str, Any], stopped: StopRequest) -> None:
    """Prewarm the pod, flip its readiness gate, then watch it until it goes away."""
    model = model_of(dict((body.get("metadata") or {}).get("labels") or {}))
    if model is None:
        return
    watch = PodWatch(
        cluster(),
        shim_session(),
        namespace,
        name,
        model,
        live_body=body,
        flashmodels=cached_flashmodel,
        request_pass=reconcile_for_child,
    )
    await watch.run(stopped)


ENGINE_PODS = EnginePodTasks(watch_engine_pod, backoff=HANDLER_BACKOFF_SECONDS, grace=5.0)
"""Every engine pod's watch task, started and stopped by the pods' watch events (no kopf daemon: no finalizer)."""


def cluster() -> Cluster:
    """The one API client of this process, made on first use (after kopf has logged in)."""
    global _cluster
    if _cluster is None:
        try:
            k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()  # type: ignore[no-untyped-call]
        configuration = k8s.Configuration.get_default_copy()
        # A pooled connection for each thread that calls the API: kopf's handlers, the child passes and the
        # pod watches' calls (asyncio's default pool).
        configuration.connection_pool_maxsize = current().handler_threads + CHILD_PASS_WORKERS + 8
        _cluster = Cluster(k8s.ApiClient(configuration), models=FLASHMODELS)
    return _cluster


HANDLED_SPECS = HandledSpecs(prefix=GROUP, key="last-handled-spec")
"""kopf's diff base: which spec of each model was last handled, in memory (diffbase.HandledSpecs)."""


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # The operator writes its own events, once per change; kopf's per-handler events would
    # turn every resync into API writes.
    settings.posting.enabled = False
    settings.execution.max_workers = max(1, current().handler_threads)
    settings.watching.server_timeout = 300
    # kopf's own requests (its progress annotations, the watch streams) retry sooner than its defaults.
    settings.networking.error_backoffs = [0.5, 1, 2, 4, 8]
    settings.watching.reconnect_backoff = 0.5
    # kopf logs "Handler ... succeeded" for every handled watch event (ten lines a new model, the
    # log's bulk and a few percent of a burst's CPU); the operator logs what changed itself.
    # kopf's warnings and errors (a failed handler, a retry) still show, and --verbose shows all.
    kopf_objects = logging.getLogger("kopf.objects")
    if kopf_objects.getEffectiveLevel() == logging.INFO:
        kopf_objects.setLevel(logging.WARNING)
    settings.persistence.diffbase_storage = HANDLED_SPECS
    settings.persistence.progress_storage = UnmarkedProgressStorage(prefix=GROUP)
    # A socket per engine pod's kept-alive shim connection: a 1,000-pod fleet must not hit the
    # usual soft limit of 1,024 open files (the hard limit is the node's to set).
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else max(soft, 65536), hard))
    port = current().metrics_port
    if port:
        start_http_server(port)  # flashmodel_operator_* for Prometheus


@kopf.on.startup()
async def start_resync(**_: Any) -> None:
    global _resync_task, _trim_task
    if current().resync_seconds > 0:
        _resync_task = asyncio.create_task(resync_fleet(current().resync_seconds))
    if current().heap_trim_seconds > 0:
        _trim_task = asyncio.create_task(heap.trim_periodically(current().heap_trim_seconds))


@kopf.on.cleanup()
async def stop(**_: Any) -> None:
    global _shim_session
    for task in (_resync_task, _trim_task):
        if task is not None:
            task.cancel()
    # Before the shim session closes: a watch's last step may still use it.
    await ENGINE_PODS.stop_all()
    # The passes already queued for children's events end before the API client goes.
    await asyncio.to_thread(drain_child_passes, 10.0)
    if _shim_session is not None:
        await _shim_session.close()
        _shim_session = None


def shim_session() -> aiohttp.ClientSession:
    """One aiohttp pool for every engine pod's shim: the prewarm POSTs (the polls have their own streams).

    A session per pod would be a connection pool and a set of buffers per pod, for a request or
    two in the pod's life.
    """
    global _shim_session
    if _shim_session is None or _shim_session.closed:
        # No total limit: a prewarm may take its whole timeout (minutes on a slow engine) and must not
        # hold up the other pods' prewarms; a shim never needs more than a few connections at once.
        connector = aiohttp.TCPConnector(limit=0, limit_per_host=4, keepalive_timeout=30)
        _shim_session = aiohttp.ClientSession(connector=connector)
    return _shim_session


def _reconcile_latest(
    namespace: str | None, name: str, fresh: dict[str, Any] | None = None, child_event: bool = False
) -> None:
    if namespace is None:  # FlashModel is namespaced; kopf types allow None for cluster objects
        return
    # The model is taken under its lock, so it is no older than what the pass before this one read
    # and wrote (the status this pass compares against must be the latest written).
    with model_lock(namespace, name):
        body = fresh
        unsure = child_event and _model_unsure(namespace, name)
        if body is None and child_event and not unsure:
            # The newest body the operator has seen (its watch, its reads, its status writes): a pass
            # after a child's event needs no read of its own. A spec change goes through the model's
            # own events, whose passes read the API.
            body = FLASHMODELS.latest(namespace, name)
        if body is None:
            # `fresh`: the caller holds a body no pass has written to yet (a create event), as good as a read.
            body = cluster().get_flashmodel(namespace, name)
            if unsure:
                with _child_lock:
                    _child_unsure.discard((namespace, name))
        if body is None or body["metadata"].get("deletionTimestamp"):
            return
        try:
            one_pass = functools.partial(reconcile, watched=CHILDREN, child_event=child_event)
            outcome = traced(one_pass)(cluster(), body)
        except ApiException as exc:
            if namespace_terminating(exc):
                # The namespace is being deleted with the model in it; retrying would only repeat the 403.
                log.info("event=skipped model=%s/%s reason=NamespaceTerminating", namespace, name)
                return
            raise
    changed = {k: v for k, v in outcome.applied.items() if v != "unchanged"}
    if changed or outcome.status_written:
        log.info(
            "event=reconciled model=%s/%s applied=%s status_written=%s problem=%s",
            namespace,
            name,
            changed,
            outcome.status_written,
            outcome.problem.reason if outcome.problem else None,
        )


_child_lock = threading.Lock()
_child_queued: set[tuple[str, str]] = set()
_child_running: set[tuple[str, str]] = set()
_child_again: set[tuple[str, str]] = set()
_child_unsure: set[tuple[str, str]] = set()
"""Models whose next child pass reads the model from the API: one of their children is going away."""

CHILD_PASS_WORKERS = 8
_child_passes = ThreadPoolExecutor(max_workers=CHILD_PASS_WORKERS, thread_name_prefix="child-pass")
"""The passes for children's events, apart from kopf's handler threads: a burst of new models' events (their
Deployments' and pods' every change) queues here, and their first passes, in kopf's threads, do not wait
behind it. The fewer threads, the more of a model's events fold into one pass while it waits its turn."""


def _model_unsure(namespace: str, name: str) -> bool:
    """True after a child's deletion, until a pass has read the model: its own deletion may be the cause.

    The garbage collector deletes a deleted model's children, and their events may come before the
    model's own DELETED event: a pass on the watched body would apply the Deployment of a model
    that is gone. A child going away is rare otherwise (a rollout, an eviction), so its pass reads.
    """
    with _child_lock:
        return (namespace, name) in _child_unsure


def _child_going(namespace: str, name: str, event_type: str | None, body: kopf.Body) -> None:
    if event_type == "DELETED" or body.get("metadata", {}).get("deletionTimestamp"):
        with _child_lock:
            _child_unsure.add((namespace, name))


def reconcile_for_child(namespace: str | None, name: str) -> None:
    """Queue a pass for a child's event (its Deployment, pods, HPA); events that find one queued or running fold in.

    A new model's pods and Deployment change a dozen times in its first seconds (scheduled, running,
    gated, ready; the ReplicaSet's counts), each a watch event. A pass reads the latest of everything
    (the caller has put the event's object in CHILDREN), so events that arrive while one waits need
    no pass of their own, and those that arrive while one runs need one more after it: in a burst of
    300 new models that is most of the passes, and each pass that writes is a FlashModel status write.
    """
    if namespace is None:
        return
    key = (namespace, name)
    with _child_lock:
        if key in _child_queued:
            return  # the queued pass has not read anything yet
        if key in _child_running:
            _child_again.add(key)  # the running pass goes once more when it is done
            return
        _child_queued.add(key)
    _child_passes.submit(_child_pass, key)


def _child_pass(key: tuple[str, str]) -> None:
    namespace, name = key
    with _child_lock:
        _child_queued.discard(key)
        _child_running.add(key)
    try:
        while True:
            try:
                _reconcile_latest(namespace, name, child_event=True)
            except Exception as exc:
                with _child_lock:
                    again = key in _child_again
                # An event came during the failed pass: its own pass runs now. Otherwise the model's next
                # event, or the resync, tries again.
                if not again and transient(exc):
                    error = f"{type(exc).__name__}: {exc}"
                    log.warning("event=child-pass-failed model=%s/%s error=%s", namespace, name, error)
                elif not again:
                    log.exception("event=child-pass-failed model=%s/%s", namespace, name)
            with _child_lock:
                if key not in _child_again:
                    break
                _child_again.discard(key)
    finally:
        with _child_lock:
            _child_running.discard(key)
            _child_again.discard(key)


def drain_child_passes(timeout: float) -> bool:
    """Wait until no child pass is queued or running (False if some still are after `timeout` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with _child_lock:
            if not _child_queued and not _child_running:
                return True
        time.sleep(0.02)
    return False


@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
@kopf.on.create(GROUP, VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
@kopf.on.update(GROUP, VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
def on_flashmodel_change(namespace: str | None, name: str, body: kopf.Body, reason: str, retry: int, **_: Any) -> None:
    # A model just created, on its first try, has no status for the pass to compare against: the
    # event's body is the latest, and reading it again would only delay its first pod.
    first = reason == "create" and retry == 0 and not body.get("status")
    _reconcile_latest(namespace, name, copy.deepcopy(dict(body)) if first else None)


@kopf.on.event(GROUP, VERSION, PLURAL)
async def remember_flashmodel(body: kopf.Body, namespace: str | None, name: str, type: str | None, **_: Any) -> None:
    if namespace is None:
        return
    FLASHMODELS.event(type, body)
    # A changed adapter set ends the model's held health polls, so its pods get it within seconds.
    adapters.model_event(namespace, name, body)
    if type == "DELETED":
        forget_deleted_model(namespace, name, body.metadata.uid or "")


def forget_deleted_model(namespace: str, name: str, uid: str) -> None:
    """Everything the operator keeps of a deleted model, dropped: no finalizer is needed, since the
    children go with their owner reference and only the operator's memory and metrics stay."""
    HANDLED_SPECS.forget(uid)
    CHILDREN.forget(namespace, name)
    pod_state.forget(namespace, name)
    forget_model(namespace, name)
    with _child_lock:
        _child_unsure.discard((namespace, name))


def _retain(models: set[tuple[str, str]]) -> None:
    """Drop what events that came after their model's deletion left behind (a child's DELETED, a late pass)."""
    CHILDREN.retain(models)
    pod_state.retain(models)
    retain_models(models)
    with _child_lock:
        _child_unsure.intersection_update(models)


def cached_flashmodel(namespace: str, name: str) -> dict[str, Any] | None:
    return FLASHMODELS.get(namespace, name)


async def resync_fleet(period: float) -> None:
    """The safety net for drift and missed events: every model reconciled once per period, spread evenly.

    Changes are handled as their watch events arrive (the model, its Deployment, its pods, its HPA);
    this catches what no event announces (an edited ConfigMap, Service or PDB). One loop paces the
    fleet: a timer per model would start all of them together at start-up and fire in a burst of
    1,000 reconciles every period.
    """
    while True:
        models = sorted(FLASHMODELS)
        # Also when the fleet is empty (all its models deleted): what is dropped is read again if needed.
        _retain(set(models))
        if not models:
            # At start-up the watch has not listed the models yet: look again soon, not a period later.
            await asyncio.sleep(min(period, 5.0))
            continue
        for namespace, name in models:
            # The pace follows the fleet as it is now: models added during a pass come in the next.
            await asyncio.sleep(period / max(1, len(FLASHMODELS)))
            if (namespace, name) not in FLASHMODELS:
                continue
            try:
                await asyncio.to_thread(_reconcile_latest, namespace, name)
            except Exception as exc:  # the next event or the next period tries again
                log.warning("event=resync-failed model=%s/%s error=%s: %s", namespace, name, type(exc).__name__, exc)


SECRET_WAIT_SECONDS = 2.0
"""How often a model held for a missing Secret (its API key, its hub token) looks for it."""


def _waiting_for_secret(status: kopf.Status, **_: Any) -> bool:
    return any(
        c.get("type") == "Degraded" and c.get("status") == "True" and c.get("reason") in SECRET_WAIT_REASONS
        for c in status.get("conditions") or []
    )


@kopf.timer(
    GROUP, VERSION, PLURAL, interval=SECRET_WAIT_SECONDS, when=_waiting_for_secret, backoff=HANDLER_BACKOFF_SECONDS
)
def wait_for_secret(namespace: str | None, name: str, spec: kopf.Spec, **_: Any) -> None:
    # A model waiting for a Secret (no Deployment until it exists) goes on within seconds of its
    # creation, not at the next resync. One GET by name while it waits: a watch would need list and
    # watch on every Secret of the cluster, and would hold all their contents in this process.
    if namespace is None:
        return
    try:
        refs = referenced_secrets(FlashModelSpec.model_validate(dict(spec)))
    except ValidationError:
        return  # the reconcile reports SpecInvalid; nothing to wait for
    for use in refs:
        secret = cluster().get("v1", "Secret", namespace, use.name)
        if secret is None or use.key not in (secret.get("data") or {}):
            return
    log.info("event=secrets-arrived model=%s/%s secrets=%s", namespace, name, ",".join(u.name for u in refs))
    _reconcile_latest(namespace, name)


def _owner_name(body: kopf.Body) -> str | None:
    for ref in body.get("metadata", {}).get("ownerReferences") or []:
        if ref.get("kind") == "FlashModel" and ref.get("apiVersion", "").startswith(f"{GROUP}/"):
            return str(ref["name"])
    return None


@kopf.on.event("apps", "v1", "deployments", labels=_OWNED)
def on_deployment_event(body: kopf.Body, namespace: str | None, type: str | None, **_: Any) -> None:
    owner = _owner_name(body)
    if owner is None or namespace is None:
        return
    # Kept before the pass, so the pass (this one, or the running one it folds into) sees it.
    CHILDREN.deployment_event(namespace, owner, type, body)
    _child_going(namespace, owner, type, body)
    if type != "DELETED":
        reconcile_for_child(namespace, owner)


@kopf.on.event("apps", "v1", "deployments", labels={PICKER_LABEL: kopf.PRESENT})
def on_picker_event(body: kopf.Body, namespace: str | None, type: str | None, **_: Any) -> None:
    # The picker's availability is the Routing condition, which only a full pass observes (a child's
    # pass keeps it as it was): a pass when it differs from what the model's status says.
    owner = _owner_name(body)
    if owner is None or namespace is None or type == "DELETED":
        return
    available = int((body.get("status") or {}).get("availableReplicas") or 0) >= 1
    model = FLASHMODELS.latest(namespace, owner) or cluster().get_flashmodel(namespace, owner) or {}
    routing = (model.get("status") or {}).get("routing") or {}
    if routing and bool(routing.get("pickerReady")) != available:
        _reconcile_latest(namespace, owner)


# Registered before on_pod_event: kopf runs a pod's event handlers in this order, and a new pod's
# watch (its prewarm) must not wait for the model's reconcile pass.
@kopf.on.event("", "v1", "pods", labels=_OWNED)
async def engine_pod(body: kopf.Body, type: str | None, **_: Any) -> None:
    """Start the pod's watch on its first event (kopf's first listing included), stop it when the pod goes."""
    await ENGINE_PODS.event(type, body)


@kopf.on.event("", "v1", "pods", labels=_OWNED)
def on_pod_event(body: kopf.Body, namespace: str | None, type: str | None, **_: Any) -> None:
    # Pods belong to ReplicaSets; the model label names the FlashModel directly.
    model = (body.get("metadata", {}).get("labels") or {}).get(f"{GROUP}/model")
    if model and namespace is not None:
        CHILDREN.pod_event(namespace, model, type, body)
        _child_going(namespace, model, type, body)
        reconcile_for_child(namespace, model)


@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels={f"{GROUP}/model": kopf.PRESENT})
def on_hpa_event(body: kopf.Body, namespace: str | None, type: str, **_: Any) -> None:
    # The HPA's status (its metrics, the replica count it wants, why it cannot scale) goes into the
    # FlashModel's Autoscaling condition. KEDA's HPA carries the ScaledObject's labels, the model's included.
    model = (body.get("metadata", {}).get("labels") or {}).get(f"{GROUP}/model")
    if model and type != "DELETED":
        reconcile_for_child(namespace, model)
