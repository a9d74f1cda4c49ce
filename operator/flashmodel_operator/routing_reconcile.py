"""One reconcile pass's routing step: apply the model's GIE children (routing.py), report the Routing condition.

Applied after the engine's children, as the autoscaler is: the InferencePool and HTTPRoute kinds
may not be served by the cluster, and a missing CRD must leave the model serving through its
Service with a condition that says what to install, not fail the pass.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from kubernetes.client.exceptions import ApiException

from flashmodel_operator.apply import Cluster
from flashmodel_operator.model import FlashModel
from flashmodel_operator.render import common_labels, selector_labels
from flashmodel_operator.routing import POOL_API, ROUTE_API, picker_name, render_routing, route_key, route_winner

log = logging.getLogger(__name__)

RoutingState = tuple[bool, str, str]
"""(active, reason, message) of the Routing condition."""

_MISSING = {
    "InferencePool": (
        "InferencePoolCRDMissing",
        f"InferencePool ({POOL_API}) is not served by this cluster: install the Gateway API Inference Extension's "
        "CRDs (the chart's gateway.installInferencePoolCRD: true), or remove spec.routing",
    ),
    "HTTPRoute": (
        "GatewayAPIMissing",
        f"HTTPRoute ({ROUTE_API}) is not served by this cluster: install the Gateway API CRDs and a Gateway "
        "controller that supports InferencePool backends, or remove spec.routing.gateway",
    ),
}


def reconcile_routing(
    cluster: Cluster, body: dict[str, Any], fm: FlashModel, new_status: dict[str, Any], outcome_applied: dict[str, str],
    peers: Iterable[Mapping[str, Any]] = (),
) -> RoutingState | None:
    """Apply or remove the model's routing children; the Routing condition's state (None without spec.routing).

    `peers`: the other FlashModels as the operator last saw them, for route conflicts.
    """
    before = (body.get("status") or {}).get("routing")
    if fm.spec.routing is None:
        if before:
            remove_routing(cluster, body, fm)
        new_status["routing"] = None
        return None
    winner = route_winner(fm, str(body["metadata"].get("creationTimestamp", "")), peers)
    children = render_routing(fm, common_labels(fm), selector_labels(fm))
    if winner is not None:
        children = [c for c in children if c["kind"] != "HTTPRoute"]
        _remove(cluster, body, fm, [(ROUTE_API, "HTTPRoute", fm.name)], f"the FlashModel {winner} claims its matches")
    changed: list[str] = []
    for child in children:
        kind, name = child["kind"], child["metadata"]["name"]
        try:
            result = cluster.apply(child)
        except ApiException as exc:
            if exc.status != 404 or kind not in _MISSING:
                raise
            reason, message = _MISSING[kind]
            new_status["routing"] = {"pool": fm.name, "endpointPicker": picker_name(fm), "pickerReady": False}
            return False, reason, message
        outcome_applied[f"{kind}/{name}"] = result
        if result != "unchanged":
            changed.append(f"{result} {kind} {name}")
    if changed:
        cluster.event(body, "Normal", "Applied", ", ".join(changed))
    if winner is not None:
        key = route_key(fm)
        assert key is not None
        matches = ", ".join(f"{h}: {v}" for h, v in key[2])
        message = (
            f"no HTTPRoute: the older FlashModel {winner} already routes the same requests ({matches}) on the "
            f"Gateway {key[0]}; change spec.routing.headers or the served name, or remove spec.routing.gateway"
        )
        if not (body.get("status") or {}).get("routing", {}).get("conflict"):
            cluster.event(body, "Warning", "RouteConflict", message)
        _observe(cluster, fm, new_status)
        new_status["routing"]["conflict"] = winner
        return False, "RouteConflict", message
    return _observe(cluster, fm, new_status)


def _observe(cluster: Cluster, fm: FlashModel, new_status: dict[str, Any]) -> RoutingState:
    routing = fm.spec.routing
    assert routing is not None
    picker = cluster.get("apps/v1", "Deployment", fm.namespace, picker_name(fm)) or {}
    ready = int((picker.get("status") or {}).get("availableReplicas") or 0) >= 1
    status: dict[str, Any] = {"pool": fm.name, "endpointPicker": picker_name(fm), "pickerReady": ready}
    if routing.gateway is not None:
        status["gateway"] = f"{routing.gateway.namespace or fm.namespace}/{routing.gateway.name}"
    new_status["routing"] = status
    if not ready:
        return False, "PickerNotReady", (
            f"the endpoint picker {picker_name(fm)} has no available pod: the Gateway "
            + ("refuses this model's requests (failureMode FailClose)" if routing.failure_mode == "FailClose"
               else "sends them to pods of the pool without it (failureMode FailOpen)")
        )
    if routing.gateway is None:
        return True, "PickerReady", f"the endpoint picker {picker_name(fm)} serves the InferencePool {fm.name}"
    accepted = _accepted_by(cluster.get(POOL_API, "InferencePool", fm.namespace, fm.name) or {})
    if accepted is None:
        return False, "NotAccepted", (
            f"no Gateway has accepted the InferencePool {fm.name} yet: check that the Gateway {status['gateway']} "
            "exists, allows routes from this namespace, and that its controller supports InferencePool backends"
        )
    return True, "Accepted", f"the InferencePool {fm.name} is accepted by {accepted}; its picker serves"


def _accepted_by(pool: dict[str, Any]) -> str | None:
    """The first parent whose Accepted condition is True in the pool's status (written by the Gateway's controller)."""
    for parent in (pool.get("status") or {}).get("parents") or []:
        if any(c.get("type") == "Accepted" and c.get("status") == "True" for c in parent.get("conditions") or []):
            ref = parent.get("parentRef") or {}
            return f"{ref.get('kind', 'Gateway')} {ref.get('namespace', '')}/{ref.get('name', '')}".replace(" /", " ")
    return None


def remove_routing(cluster: Cluster, body: dict[str, Any], fm: FlashModel) -> None:
    """Delete the routing children the model owns, once spec.routing is gone (the route first: no request is
    sent to a pool whose picker is already gone)."""
    name, picker = fm.name, picker_name(fm)
    kinds = [
        (ROUTE_API, "HTTPRoute", name), (POOL_API, "InferencePool", name),
        ("v1", "Service", picker), ("apps/v1", "Deployment", picker), ("v1", "ConfigMap", picker),
        ("rbac.authorization.k8s.io/v1", "RoleBinding", picker), ("rbac.authorization.k8s.io/v1", "Role", picker),
        ("v1", "ServiceAccount", picker),
    ]
    _remove(cluster, body, fm, kinds, "spec.routing removed")


def _remove(
    cluster: Cluster, body: dict[str, Any], fm: FlashModel, kinds: list[tuple[str, str, str]], why: str
) -> None:
    """Delete those of `kinds` (api, kind, name) that exist and the model owns; one event for them."""
    deleted = []
    for api, kind, child in kinds:
        try:
            found = cluster.get(api, kind, fm.namespace, child)
        except ApiException as exc:
            if exc.status != 404:
                raise
            found = None
        owners = (found or {}).get("metadata", {}).get("ownerReferences") or []
        if found is None or not any(o.get("uid") == fm.uid and o.get("controller") for o in owners):
            continue
        if cluster.delete(api, kind, fm.namespace, child):
            deleted.append(f"{kind} {child}")
    if deleted:
        cluster.event(body, "Normal", "Deleted", f"deleted {', '.join(deleted)}: {why}")
        log.info("event=routing-children-deleted model=%s/%s why=%r", fm.namespace, fm.name, why)


def warn_no_ready_endpoint(
    cluster: Cluster, body: dict[str, Any], fm: FlashModel, ready_before: int | None, ready_now: int, desired: int
) -> bool:
    """A Warning `NoReadyEndpoint` when a routed model's pool loses its last ready pod; whether one was sent.

    Once, when it happens (the pass that sees the ready count fall to zero from above it): the
    picker then answers every request for the model with 503. Not while a new model's first pods
    load (nothing was lost), nor for a model scaled to zero on purpose.
    """
    if fm.spec.routing is None or desired == 0 or ready_now > 0 or not ready_before:
        return False
    if fm.spec.scales_to_zero:
        # Its picker runs flow control: requests wait instead of failing at once.
        answer = f"holds this model's requests for up to {fm.spec.routing.hold_seconds}s each, then answers 503,"
    else:
        answer = "answers this model's requests through the Gateway with 503"
    cluster.event(
        body, "Warning", "NoReadyEndpoint",
        f"the InferencePool {fm.name} has no ready pod (it had {ready_before}): the endpoint picker "
        f"{picker_name(fm)} {answer} until a pod is ready again",
    )
    log.warning("event=no-ready-endpoint model=%s/%s ready_before=%d", fm.namespace, fm.name, ready_before)
    return True
