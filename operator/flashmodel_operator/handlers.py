"""kopf handlers: parse the event, call reconcile, nothing else."""

from __future__ import annotations

import logging
from typing import Any

import aiohttp
import kopf
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes.client.exceptions import ApiException
from prometheus_client import start_http_server
from pydantic import ValidationError

from flashmodel_operator import FIELD_MANAGER, GROUP, PLURAL, VERSION
from flashmodel_operator.apply import Cluster, namespace_terminating
from flashmodel_operator.gating import PodWatch, model_of
from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.reconcile import SECRET_WAIT_REASONS, forget_model, reconcile, referenced_secrets
from flashmodel_operator.settings import current
from flashmodel_operator.tracing import traced

log = logging.getLogger(__name__)

# kopf takes these when it imports this module, which `python -m flashmodel_operator` does after it
# read the environment (settings.load).
RESYNC_SECONDS = current().resync_seconds
HANDLER_BACKOFF_SECONDS = current().handler_backoff_seconds
_OWNED = {"app.kubernetes.io/managed-by": FIELD_MANAGER}

_cluster: Cluster | None = None


def cluster() -> Cluster:
    """The one API client of this process, made on first use (after kopf has logged in)."""
    global _cluster
    if _cluster is None:
        try:
            k8s_config.load_incluster_config()  # type: ignore[no-untyped-call]
        except k8s_config.ConfigException:
            k8s_config.load_kube_config()  # type: ignore[no-untyped-call]
        configuration = k8s.Configuration.get_default_copy()
        # Sync handlers run in kopf's thread pool; give each worker a pooled connection.
        configuration.connection_pool_maxsize = 32
        _cluster = Cluster(k8s.ApiClient(configuration))
    return _cluster


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # The operator writes its own events, once per change; kopf's per-handler events would
    # turn every resync into API writes.
    settings.posting.enabled = False
    settings.execution.max_workers = 16
    settings.watching.server_timeout = 300
    # kopf's own requests (its progress annotations, the watch streams) retry sooner than its defaults.
    settings.networking.error_backoffs = [0.5, 1, 2, 4, 8]
    settings.watching.reconnect_backoff = 0.5
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-spec")
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    port = current().metrics_port
    if port:
        start_http_server(port)  # flashmodel_operator_* for Prometheus


def _reconcile_latest(namespace: str | None, name: str) -> None:
    if namespace is None:  # FlashModel is namespaced; kopf types allow None for cluster objects
        return
    # Read the object fresh: the status this pass compares against must be the latest written.
    body = cluster().get_flashmodel(namespace, name)
    if body is None or body["metadata"].get("deletionTimestamp"):
        return
    try:
        outcome = traced(reconcile)(cluster(), body)
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


@kopf.on.resume(GROUP, VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
@kopf.on.create(GROUP, VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
@kopf.on.update(GROUP, VERSION, PLURAL, backoff=HANDLER_BACKOFF_SECONDS)
def on_flashmodel_change(namespace: str | None, name: str, **_: Any) -> None:
    _reconcile_latest(namespace, name)


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_flashmodel_deleted(namespace: str | None, name: str, **_: Any) -> None:
    # optional: no finalizer; the children go with their owner reference, only our metrics stay.
    if namespace is not None:
        forget_model(namespace, name)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS,
            backoff=HANDLER_BACKOFF_SECONDS)
def resync(namespace: str | None, name: str, **_: Any) -> None:
    # Catches drift in children and anything a missed watch event would have told us.
    _reconcile_latest(namespace, name)


SECRET_WAIT_SECONDS = 2.0
"""How often a model held for a missing Secret (its API key, its hub token) looks for it."""


def _waiting_for_secret(status: kopf.Status, **_: Any) -> bool:
    return any(
        c.get("type") == "Degraded" and c.get("status") == "True" and c.get("reason") in SECRET_WAIT_REASONS
        for c in status.get("conditions") or []
    )


@kopf.timer(GROUP, VERSION, PLURAL, interval=SECRET_WAIT_SECONDS, when=_waiting_for_secret,
            backoff=HANDLER_BACKOFF_SECONDS)
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
def on_deployment_event(body: kopf.Body, namespace: str | None, type: str, **_: Any) -> None:
    owner = _owner_name(body)
    if owner is not None and type != "DELETED":
        _reconcile_latest(namespace, owner)


@kopf.on.event("", "v1", "pods", labels=_OWNED)
def on_pod_event(body: kopf.Body, namespace: str | None, type: str, **_: Any) -> None:
    # Pods belong to ReplicaSets; the model label names the FlashModel directly.
    model = (body.get("metadata", {}).get("labels") or {}).get(f"{GROUP}/model")
    if model:
        _reconcile_latest(namespace, model)


@kopf.on.event("autoscaling", "v2", "horizontalpodautoscalers", labels={f"{GROUP}/model": kopf.PRESENT})
def on_hpa_event(body: kopf.Body, namespace: str | None, type: str, **_: Any) -> None:
    # The HPA's status (its metrics, the replica count it wants, why it cannot scale) goes into the
    # FlashModel's Autoscaling condition. KEDA's HPA carries the ScaledObject's labels, the model's included.
    model = (body.get("metadata", {}).get("labels") or {}).get(f"{GROUP}/model")
    if model and type != "DELETED":
        _reconcile_latest(namespace, model)


@kopf.daemon("", "v1", "pods", labels=_OWNED, cancellation_timeout=5, backoff=HANDLER_BACKOFF_SECONDS)
async def engine_pod(
    namespace: str | None, name: str, labels: kopf.Labels, body: kopf.Body, stopped: kopf.DaemonStopped, **_: Any
) -> None:
    """Prewarm the pod, flip its readiness gate, then watch it until it goes away."""
    model = model_of(dict(labels))
    if namespace is None or model is None:
        return
    async with aiohttp.ClientSession() as session:
        await PodWatch(cluster(), session, namespace, name, model, live_body=body).run(stopped)
