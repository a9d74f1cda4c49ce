"""One reconcile pass: parse -> render -> apply -> observe -> status, writing only what changed."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import secrets
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from flashmodel_engine.contract import ENGINE_PORT, PREFLIGHT_EXIT_CODE
from kubernetes.client.exceptions import ApiException
from prometheus_client import Gauge
from pydantic import ValidationError

from flashmodel_operator import GROUP
from flashmodel_operator.adapter_status import condition as adapter_condition
from flashmodel_operator.apply import Cluster, api_message, namespace_terminating, transient
from flashmodel_operator.autoscaling import PROMETHEUS_URL_ENV, ScalerState, hpa_name, prometheus_url, scaler_state
from flashmodel_operator.child_cache import ChildCache, PassReads
from flashmodel_operator.condition_metrics import MODEL_CONDITIONS
from flashmodel_operator.conditions import Observation, Problem, build_conditions, same_conditions
from flashmodel_operator.model import FlashModel, FlashModelSpec
from flashmodel_operator.pod_state import MODELS as POD_MEMORY
from flashmodel_operator.pod_state import gate_is_standby, gate_is_true, model_state
from flashmodel_operator.render import (
    CONFIG_HASH_ANNOTATION,
    control_secret_name,
    engine_config,
    needs_pdb,
    network_policy_name,
    render_autoscaler,
    render_children,
    render_control_secret,
    render_network_policy,
    render_pod,
    selector_string,
    standby_count,
)
from flashmodel_operator.routing_reconcile import RoutingState, reconcile_routing, warn_no_ready_endpoint
from flashmodel_operator.settings import current
from flashmodel_operator.watched_models import WatchedModels

log = logging.getLogger(__name__)

RETRY_ANNOTATION = f"{GROUP}/retry"
"""Change this annotation's value to retry a model whose preflight was refused, without a spec change."""



class PassLocks:
    """One reentrant lock per model, held by its passes and its status writes; kept only while in use.

    One pass per FlashModel at a time: the resync, spec changes and child events all reconcile.
    Reentrant: the caller takes it to read the model it passes in (model_lock), reconcile again.
    An entry lives while someone holds or waits for it, so a deleted model leaves none behind and
    the table's size is the number of passes in flight, not the number of models ever seen.
    """

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[tuple[str, str], tuple[threading.RLock, int]] = {}

    @contextlib.contextmanager
    def hold(self, key: tuple[str, str]) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key) or (threading.RLock(), 0)
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                users = self._locks[key][1] - 1
                if users:
                    self._locks[key] = (lock, users)
                else:
                    del self._locks[key]

    def __len__(self) -> int:
        with self._guard:
            return len(self._locks)


_locks = PassLocks()
_failing_since: dict[tuple[str, str], float] = {}
"""Models whose passes fail transiently, since when: Degraded only once it lasts (_still_transient)."""
MODEL_REPLICAS = Gauge(
    "flashmodel_operator_model_replicas",
    "Pods of each FlashModel at the last pass: desired (spec.replicas, the autoscaler's count when it scales), "
    "ready, prewarmed, standby (prewarmed, held out of the Service)",
    ["namespace", "flashmodel", "state"],
)
REPLICA_STATES = ("desired", "ready", "prewarmed", "standby")


def model_lock(namespace: str, name: str) -> contextlib.AbstractContextManager[None]:
    """The lock of the model's passes: a body read while holding it is not older than the last pass's."""
    return _locks.hold((namespace, name))


def forget_model(namespace: str, name: str) -> None:
    """Drop a deleted model's series, so the fleet's dashboards show only models that exist, and its failure clock."""
    for state in REPLICA_STATES:
        with contextlib.suppress(KeyError):  # never set: the model never got a pass
            MODEL_REPLICAS.remove(namespace, name, state)
    MODEL_CONDITIONS.forget(namespace, name)
    _failing_since.pop((namespace, name), None)


def retain_models(models: set[tuple[str, str]]) -> None:
    """Drop the failure clocks of models not in `models`: a pass that failed after its model's deletion."""
    for key in [k for k in list(_failing_since) if k not in models]:
        _failing_since.pop(key, None)
    MODEL_CONDITIONS.retain(models)


@dataclass
class Outcome:
    """What a pass did, for logs and tests."""

    applied: dict[str, str] = field(default_factory=dict)
    status_written: bool = False
    problem: Problem | None = None


def engine_args(config: dict[str, Any]) -> list[str]:
    """The vLLM command line the pods will run, from the same function the launcher uses."""
    # Imported here: the engine package is optional at import time for tools that only render.
    from flashmodel_engine.config import EngineConfig
    from flashmodel_engine.profiles import vllm_args

    return vllm_args(EngineConfig.model_validate(config))


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _retry_token(body: dict[str, Any]) -> str:
    return str((body.get("metadata", {}).get("annotations") or {}).get(RETRY_ANNOTATION, ""))


def _pod_is_prewarmed(pod: dict[str, Any]) -> bool:
    # Only a gate this operator opened after a prewarm it saw succeed counts (kwok opens every gate).
    return gate_is_true(pod)


def preflight_refusal(
    pods: list[dict[str, Any]], config_hash: str, ignore: frozenset[str] = frozenset()
) -> tuple[str, str] | None:
    """(pod, message) of a live pod of the current template whose launcher refused to start."""
    for pod in pods:
        meta = pod.get("metadata", {})
        annotations = meta.get("annotations") or {}
        # A pod on its way out, or one whose refusal the user already chose to retry, says nothing new.
        if annotations.get(CONFIG_HASH_ANNOTATION) != config_hash or meta.get("deletionTimestamp"):
            continue
        if meta.get("name") in ignore:
            continue
        for status in pod.get("status", {}).get("containerStatuses") or []:
            for state in (status.get("state") or {}, status.get("lastState") or {}):
                terminated = state.get("terminated") or {}
                if terminated.get("exitCode") == PREFLIGHT_EXIT_CODE:
                    message = (terminated.get("message") or "preflight failed (no message)").strip()
                    return pod["metadata"]["name"], message
    return None


def reconcile(
    cluster: Cluster, body: dict[str, Any], watched: ChildCache | None = None, child_event: bool = False
) -> Outcome:
    """One pass over the model `body` (read fresh by the caller).

    `watched`: the Deployments and pods the operator's watches delivered; every pass adds what it
    reads from the API. `child_event`: the pass follows an event of the model's Deployment, pods or
    HPA, so it reads those two from `watched` where it can (see _reconcile).
    """
    meta = body["metadata"]
    key = (meta["namespace"], meta["name"])
    with _locks.hold(key):
        try:
            outcome = _reconcile(cluster, body, watched, child_event)
        except Exception as exc:
            if transient(exc):
                _failing_since.setdefault(key, time.monotonic())
            raise
        _failing_since.pop(key, None)
        return outcome


def _still_transient(exc: Exception, key: tuple[str, str]) -> bool:
    """A transient failure not yet lasting transient_grace_seconds: retried quietly, no Degraded."""
    if not transient(exc):
        return False
    since = _failing_since.setdefault(key, time.monotonic())
    return time.monotonic() - since < current().transient_grace_seconds


@dataclass(frozen=True)
class Parsed:
    """A spec the pass can act on: the model, its engine's command line and its pod, rendered once."""

    fm: FlashModel
    args: list[str]
    template: dict[str, Any]

    @property
    def template_hash(self) -> str:
        return str(self.template["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])


@dataclass
class Plan:
    """What one pass will write, decided from the model and what the pass read; nothing written yet."""

    parsed: Parsed
    reads: PassReads
    pods: list[dict[str, Any]]
    first_pass: bool
    """The model was never reconciled: no children and no pods of its own yet."""
    from_watch: bool
    """The pass reads the pods and the Deployment from the watch and applies only the Deployment."""
    held: bool
    """Held at 0 replicas for a refused preflight."""
    refusal: tuple[str, str] | None
    """(pod, message) of a preflight refusal this pass found: news, told once."""
    problem: Problem | None
    children: list[dict[str, Any]]
    control_token: str | None
    """The token of the control Secret to make, where it is missing."""
    new_status: dict[str, Any]


def _reconcile(cluster: Cluster, body: dict[str, Any], watched: ChildCache | None, child_event: bool) -> Outcome:
    outcome = Outcome()
    generation = int(body["metadata"].get("generation", 1))
    new_status: dict[str, Any] = {"observedGeneration": generation}
    parsed = _parse(body)
    if isinstance(parsed, Problem):
        outcome.problem = parsed
        _write_status(cluster, body, new_status, Observation(generation, 0, problem=parsed), outcome)
        return outcome
    plan = _plan(cluster, body, parsed, new_status, watched, child_event)
    _execute(cluster, body, plan, outcome)
    return outcome


def _parse(body: dict[str, Any]) -> Parsed | Problem:
    """The model, its engine's arguments and its pod; or the problem that stops the pass before any request."""
    try:
        fm = FlashModel.from_body(body)
    except ValidationError as exc:
        return Problem("SpecInvalid", f"the spec cannot be used: {exc.errors()[0]['msg']}")
    try:
        args = engine_args(engine_config(fm))
    except ValueError as exc:
        # The schema caught what it could; this is what only the profile logic sees.
        return Problem("EngineConfigRefused", str(exc))
    template, pod_problems = render_pod(fm)
    if pod_problems:
        # The render puts the enforced parts back anyway; refusing tells the user their patch is not what runs.
        return Problem("PodTemplateRefused", "; ".join(pod_problems))
    return Parsed(fm, args, template)


def _plan(
    cluster: Cluster,
    body: dict[str, Any],
    parsed: Parsed,
    new_status: dict[str, Any],
    watched: ChildCache | None,
    child_event: bool,
) -> Plan:
    """Read what the pass needs (pods, Secrets) and decide what it writes."""
    fm = parsed.fm
    ns, name = fm.namespace, fm.name
    status: dict[str, Any] = dict(body.get("status") or {})
    # A model never reconciled has no children and no pods of its own yet: its first pass writes
    # without reading first, which brings its Deployment (and so its first pod) several requests
    # sooner. Its children's events start the next passes, which read them.
    first_pass = "observedGeneration" not in status
    # A pass that follows a child's event, for a generation a full pass has already applied, reads
    # the pods and the Deployment from the watch (`watched`) and applies only the Deployment. The
    # children nobody watches (ConfigMap, Service, PDB) and the control Secret's existence are left
    # to the model's own events and to the resync, which read everything from the API, as do a new
    # generation's passes (its ConfigMap must change with its Deployment).
    from_watch = child_event and status.get("observedGeneration") == new_status["observedGeneration"]
    reads = PassReads(cluster, watched, ns, name, from_watch)
    pods = [] if first_pass else reads.pods(selector_string(fm))
    held, refusal, problem = _preflight_hold(body, status, pods, parsed.template_hash, new_status)
    secret_missing, secret_problem = _missing_secret(cluster, fm)
    # The token the shim requires on POST /prewarm; made once and random, so it is not in the render.
    control_missing = first_pass or (
        not from_watch and cluster.get("v1", "Secret", ns, control_secret_name(name)) is None
    )
    # The autoscaler is applied after the rest (_reconcile_autoscaler): its kind may not exist here.
    rendered = render_children(fm, replicas=0 if held else None, template=parsed.template)
    children = [c for c in rendered if c["kind"] not in _AUTOSCALER_API]
    if from_watch:
        children = [c for c in children if c["kind"] == "Deployment"]
    if secret_missing:
        # A pod without its key would serve without authentication or crash-loop on the missing mount,
        # and one without its hub token would fail its download; the Secret's arrival triggers a pass
        # within seconds (handlers.wait_for_secret).
        children = [c for c in children if c["kind"] != "Deployment"]
    return Plan(
        parsed=parsed,
        reads=reads,
        pods=pods,
        first_pass=first_pass,
        from_watch=from_watch,
        held=held,
        refusal=refusal,
        problem=problem or secret_problem,
        children=children,
        control_token=secrets.token_urlsafe(32) if control_missing else None,
        new_status=new_status,
    )


def _preflight_hold(
    body: dict[str, Any],
    status: dict[str, Any],
    pods: list[dict[str, Any]],
    template_hash: str,
    new_status: dict[str, Any],
) -> tuple[bool, tuple[str, str] | None, Problem | None]:
    """(held, a refusal found now, the problem): a refused preflight cannot succeed on retry.

    The Deployment is held at 0 for this spec with the reason in the status, instead of letting the
    pod crash-loop. A spec change or the retry annotation releases the hold.
    """
    hold = status.get("preflightRefusal") or {}
    retry = _retry_token(body)
    held = hold.get("configHash") == template_hash and hold.get("retry", "") == retry
    retried = frozenset({str(hold["pod"])}) if hold.get("pod") and not held else frozenset()
    refusal = None if held else preflight_refusal(pods, template_hash, ignore=retried)
    if refusal is not None:
        pod_name, message = refusal
        hold = {"configHash": template_hash, "retry": retry, "pod": pod_name, "message": message}
        held = True
    if not held:
        if status.get("preflightRefusal"):
            new_status["preflightRefusal"] = None
        return False, None, None
    new_status["preflightRefusal"] = hold
    problem = Problem(
        "PreflightFailed",
        f"pod {hold.get('pod')}: {hold.get('message')}; fix the model or "
        f"spec, or annotate {RETRY_ANNOTATION}=<new value> to retry",
    )
    return True, refusal, problem


def _missing_secret(cluster: Cluster, fm: FlashModel) -> tuple[bool, Problem | None]:
    """Whether a Secret key the pods read is missing, and the problem of the first one that is."""
    missing_any, problem = False, None
    for use in referenced_secrets(fm.spec):
        secret = cluster.get("v1", "Secret", fm.namespace, use.name)
        missing = secret is None or use.key not in (secret.get("data") or {})
        missing_any = missing_any or missing
        if missing and problem is None:
            problem = Problem(
                use.reason,
                f"{use.field}: Secret {fm.namespace}/{use.name} with key {use.key!r} not found; "
                f"create it, or {use.instead} (no pod starts until then)",
            )
    return missing_any, problem


def _execute(cluster: Cluster, body: dict[str, Any], plan: Plan, outcome: Outcome) -> None:
    """Write what the plan decided: the control Secret, the children, the autoscaler, then the status."""
    fm = plan.parsed.fm
    ns, name = fm.namespace, fm.name
    if plan.refusal is not None:
        pod_name, message = plan.refusal
        cluster.event(body, "Warning", "PreflightFailed", f"pod {pod_name}: {message}")
        log.warning("event=preflight-refused model=%s/%s pod=%s message=%r", ns, name, pod_name, message)
    if plan.control_token is not None and cluster.create(render_control_secret(fm, plan.control_token)):
        # The pod watches would read it back from the API, once per model; the pass that made it knows it.
        model_state(ns, name).control_token = plan.control_token
        log.info("event=control-secret-created model=%s/%s", ns, name)
    _apply_children(cluster, body, plan, outcome)
    if not plan.from_watch:
        plan.new_status["networkPolicy"] = True if render_network_policy(fm) is not None else None
    if not plan.first_pass and not plan.from_watch:
        _remove_unwanted_children(cluster, body, fm, plan.new_status)
    status: dict[str, Any] = dict(body.get("status") or {})
    scaler = _reconcile_autoscaler(cluster, body, fm, status, plan.new_status, outcome)
    routed = None if plan.from_watch else reconcile_routing(
        cluster, body, fm, plan.new_status, outcome.applied, _peers(cluster)
    )
    _observe(cluster, body, plan, scaler, outcome, routed)


def _apply_children(cluster: Cluster, body: dict[str, Any], plan: Plan, outcome: Outcome) -> None:
    fm = plan.parsed.fm
    # One event for the children a pass changed, after them: an event per child was four more writes
    # before a new model's status (most of a burst's events), and each would hold up the next child.
    applied_events: list[str] = []
    try:
        for child in plan.children:
            try:
                if child["kind"] == "Deployment":
                    result = plan.reads.apply_deployment(child, known_absent=plan.first_pass)
                else:
                    result = cluster.apply(child, known_absent=plan.first_pass)
            except Exception as exc:
                if (isinstance(exc, ApiException) and namespace_terminating(exc)) or _still_transient(
                    exc, (fm.namespace, fm.name)
                ):
                    # A dropped connection or a 5xx the client's retries did not outlast says nothing about
                    # the model: the handler's back-off retries it, and only a lasting failure is Degraded.
                    raise
                # Without this the model would show no status at all while kopf retries (seen when a
                # Service range was full): say which child the API server refused and why.
                kind, child_name = child["kind"], child["metadata"]["name"]
                code = exc.status if isinstance(exc, ApiException) else type(exc).__name__
                detail = api_message(exc) if isinstance(exc, ApiException) else str(exc)[:300]
                refused = Problem(
                    "ApplyFailed",
                    f"the API server refused {kind} {child_name} ({code}): {detail}; "
                    "the operator retries with back-off",
                )
                outcome.problem = refused
                generation = plan.new_status["observedGeneration"]
                observation = Observation(generation, fm.spec.replicas, problem=refused)
                _write_status(cluster, body, plan.new_status, observation, outcome)
                raise
            outcome.applied[f"{child['kind']}/{child['metadata']['name']}"] = result
            if result != "unchanged":
                applied_events.append(f"{result} {child['kind']} {child['metadata']['name']}")
    finally:
        if applied_events:
            cluster.event(body, "Normal", "Applied", ", ".join(applied_events))


HELD_FOR_GOOD = frozenset({"RestartBudgetExhausted"})
"""Remediation holds that last until an operator acts (the others end by themselves: a backoff, a pod starting)."""


def _remediation_held(namespace: str, name: str) -> Problem | None:
    state = POD_MEMORY.get((namespace, name))  # not model_state(): a pass must not make an entry
    if state is None or state.last_hold not in HELD_FOR_GOOD:
        return None
    return Problem(
        state.last_hold,
        f"{state.last_hold_message}; the operator replaces no pod until the oldest remediation in "
        "status.remediations is an hour old, or spec.remediation.maxRestartsPerHour is raised",
    )


def _observe(
    cluster: Cluster, body: dict[str, Any], plan: Plan, scaler: ScalerState | None, outcome: Outcome,
    routed: RoutingState | None,
) -> None:
    """The pass's view of the model's pods and Deployment after its writes, into the status and the gauges."""
    fm = plan.parsed.fm
    ns, name = fm.namespace, fm.name
    status: dict[str, Any] = dict(body.get("status") or {})
    # Its status after this pass's apply: the object the apply compared or wrote where it has it, else
    # read back when the apply wrote it (or for a full pass), else as watched.
    deployment_written = outcome.applied.get(f"Deployment/{name}", "unchanged") != "unchanged"
    reads = plan.reads
    deployment = reads.deployment_now or reads.deployment(fresh=deployment_written or not plan.from_watch) or {}
    dep_status = deployment.get("status") or {}
    template_hash = plan.parsed.template_hash
    current_pods = [
        p for p in plan.pods if (p["metadata"].get("annotations") or {}).get(CONFIG_HASH_ANNOTATION) == template_hash
    ]
    desired = 0 if plan.held else fm.spec.replicas
    # Standby pods are on top of replicas and never Ready: the scale subresource, the conditions and
    # an autoscaler count the serving pods.
    serving_pods = max(0, int(dep_status.get("replicas", 0)) - standby_count(fm, desired))
    obs = Observation(
        generation=plan.new_status["observedGeneration"],
        desired_replicas=desired,
        replicas=serving_pods,
        ready_replicas=int(dep_status.get("readyReplicas", 0)),
        updated_replicas=int(dep_status.get("updatedReplicas", 0)),
        prewarmed_replicas=sum(
            1 for p in current_pods if _pod_is_prewarmed(p) and not p["metadata"].get("deletionTimestamp")
        ),
        deployment_generation_observed=int(dep_status.get("observedGeneration", 0))
        >= int(deployment.get("metadata", {}).get("generation", 1)),
        problem=plan.problem,
        unschedulable=unschedulable(current_pods),
        autoscaling=None if scaler is None else (scaler.active, scaler.reason, scaler.message),
        routing=_routing_as_before(body) if plan.from_watch else routed,
        scales_to_zero=fm.spec.scales_to_zero,
        remediation_held=_remediation_held(ns, name),
        # From status.adapters, which the pod watches write as their PUTs are answered.
        adapters=adapter_condition(fm.spec.lora_on, status.get("adapters"), [a.name for a in fm.spec.adapters]),
    )
    was_unschedulable = any(
        c.get("type") == "Ready" and c.get("reason") == "Unschedulable" for c in status.get("conditions") or []
    )
    if obs.unschedulable is not None and not was_unschedulable:
        # News once, when it starts; the scheduler's own FailedScheduling events on the pod repeat.
        cluster.event(body, "Warning", "Unschedulable", obs.unschedulable)
    warn_no_ready_endpoint(cluster, body, fm, status.get("readyReplicas"), obs.ready_replicas, desired)
    standby = sum(1 for p in current_pods if gate_is_standby(p) and not p["metadata"].get("deletionTimestamp"))
    counts = (desired, obs.ready_replicas, obs.prewarmed_replicas, standby)
    for state, value in zip(REPLICA_STATES, counts, strict=True):
        MODEL_REPLICAS.labels(ns, name, state).set(value)
    plan.new_status.update(
        {
            "replicas": obs.replicas,
            "readyReplicas": obs.ready_replicas,
            "prewarmedReplicas": obs.prewarmed_replicas,
            "standbyReplicas": standby,
            "replicasSummary": f"{obs.ready_replicas}/{fm.spec.replicas}",
            "selector": selector_string(fm),
            "servedName": fm.served_name,
            "endpoint": f"http://{name}.{ns}.svc:{ENGINE_PORT}/v1",
            "engineArgs": plan.parsed.args,
        }
    )
    outcome.problem = plan.problem
    _write_status(cluster, body, plan.new_status, obs, outcome)


SECRET_WAIT_REASONS = ("AuthSecretNotFound", "HubTokenSecretNotFound")
"""The Degraded reasons of a model held until a Secret it references exists."""


@dataclass(frozen=True)
class SecretUse:
    """A Secret key the engine pods read, and what the status says while it is missing."""

    reason: str
    field: str
    name: str
    key: str
    instead: str
    """What else the user can do than create it."""


def referenced_secrets(spec: FlashModelSpec) -> list[SecretUse]:
    """Every Secret key the engine pods read: the API key, the hub token."""
    refs = []
    if spec.auth is not None:
        ref = spec.auth.api_key_secret_ref
        refs.append(SecretUse("AuthSecretNotFound", "spec.auth.apiKeySecretRef", ref.name, ref.key, "remove spec.auth"))
    hub = spec.model.hub
    if hub is not None and hub.token_secret_ref is not None:
        token = hub.token_secret_ref
        refs.append(SecretUse("HubTokenSecretNotFound", "spec.model.hub.tokenSecretRef", token.name, token.key,
                              "remove tokenSecretRef for a public model"))
    return refs


_AUTOSCALER_API = {"ScaledObject": "keda.sh/v1alpha1", "HorizontalPodAutoscaler": "autoscaling/v2"}


def unschedulable(pods: list[dict[str, Any]]) -> str | None:
    """The scheduler's word on the first Pending pod it could not place, for the Ready condition."""
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Pending" or pod["metadata"].get("deletionTimestamp"):
            continue
        for c in (pod.get("status") or {}).get("conditions") or []:
            if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason") == "Unschedulable":
                return f"pod {pod['metadata']['name']} unschedulable: {c.get('message') or 'no reason given'}"
    return None


def _peers(cluster: Cluster) -> list[Mapping[str, Any]]:
    """Every FlashModel the operator has seen (WatchedModels), for route conflicts; none without that memory."""
    models = cluster.models
    if not isinstance(models, WatchedModels):
        return []
    return [body for key in models if (body := models.get(*key)) is not None]


def _routing_as_before(body: dict[str, Any]) -> RoutingState | None:
    """The Routing condition as the last full pass left it: a pass from a child's watch does not look at routing."""
    for c in (body.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Routing":
            return c.get("status") == "True", str(c.get("reason", "")), str(c.get("message", ""))
    return None


def _remove_unwanted_children(
    cluster: Cluster, body: dict[str, Any], fm: FlashModel, new_status: dict[str, Any]
) -> None:
    """Delete the optional children the model no longer wants: the PodDisruptionBudget once it can have
    only one serving pod (render.needs_pdb), the NetworkPolicy once the cluster turned it off.

    Read first: the pass that applied a child read it for the apply, so a full pass's reads stay as
    many, and only a child this model owns is deleted, not one of the same name made by someone else.
    The NetworkPolicy is looked for only where the status says one was made: a fleet that never turned
    it on pays no read for it.
    """
    unwanted: list[tuple[str, str, str, str]] = []
    if not needs_pdb(fm):
        unwanted.append(("policy/v1", "PodDisruptionBudget", fm.name,
                         "at most one serving pod, which a budget would not protect"))
    if new_status.get("networkPolicy") is None and (body.get("status") or {}).get("networkPolicy"):
        unwanted.append(("networking.k8s.io/v1", "NetworkPolicy", network_policy_name(fm.name),
                         "the operator's networkPolicy is off"))
    for api, kind, child, why in unwanted:
        found = cluster.get(api, kind, fm.namespace, child)
        if found is None:
            continue
        owners = found["metadata"].get("ownerReferences") or []
        if not any(o.get("uid") == fm.uid and o.get("controller") for o in owners):
            continue
        if cluster.delete(api, kind, fm.namespace, child):
            cluster.event(body, "Normal", "Deleted", f"deleted {kind} {child}: {why}")
            log.info("event=child-deleted model=%s/%s kind=%s", fm.namespace, fm.name, kind)


def _reconcile_autoscaler(
    cluster: Cluster,
    body: dict[str, Any],
    fm: FlashModel,
    status: dict[str, Any],
    new_status: dict[str, Any],
    outcome: Outcome,
) -> ScalerState | None:
    """Apply the model's ScaledObject or HPA, remove the one it no longer wants, and read what its HPA says."""
    ns, name = fm.namespace, fm.name
    scaling = fm.spec.autoscaling
    wanted = None if scaling is None else ("ScaledObject" if scaling.scaler == "keda" else "HorizontalPodAutoscaler")
    before = status.get("autoscaler") or {}
    # status.autoscaling alone (no status.autoscaler) is what an HPA-only operator recorded.
    had = before.get("kind") or ("HorizontalPodAutoscaler" if status.get("autoscaling") else None)
    if had in _AUTOSCALER_API and had != wanted and cluster.delete(_AUTOSCALER_API[had], had, ns, name):
        why = "spec.autoscaling removed" if scaling is None else f"spec.autoscaling.scaler is now {scaling.scaler}"
        cluster.event(body, "Normal", "Deleted", f"deleted {had} {name}: {why}")
    new_status["autoscaling"] = scaling is not None
    if scaling is None:
        new_status["autoscaler"] = None
        return None

    missing: str | None = None
    server = prometheus_url()
    if scaling.scaler == "keda" and not server:
        missing = (
            f"no Prometheus address for KEDA's triggers: set the chart value autoscaling.prometheusAddress "
            f"(operator env {PROMETHEUS_URL_ENV}), or use spec.autoscaling.scaler: hpa with a metrics adapter"
        )
    child = None if missing else render_autoscaler(fm, server)
    if child is not None:
        try:
            result = cluster.apply(child)
        except ApiException as exc:
            if exc.status != 404:
                raise
            # The kind is not served: KEDA's CRDs are not installed. The model serves at its
            # current replica count; only the autoscaling condition says what is missing.
            missing = (
                f"{child['kind']} ({child['apiVersion']}) is not served by this cluster: install KEDA "
                "(v2.12 or newer), or use spec.autoscaling.scaler: hpa with a custom-metrics adapter"
            )
        else:
            outcome.applied[f"{child['kind']}/{name}"] = result
            if result != "unchanged":
                cluster.event(body, "Normal", "Applied", f"{result} {child['kind']} {name}")
    hpa = None if missing else cluster.get("autoscaling/v2", "HorizontalPodAutoscaler", ns, hpa_name(fm))
    scaled_object = (
        None if missing or wanted != "ScaledObject" else cluster.get("keda.sh/v1alpha1", "ScaledObject", ns, name)
    )
    state = scaler_state(fm, hpa, scaled_object, missing)
    previous = before.get("specReplicas")
    if previous is not None and int(previous) != fm.spec.replicas:
        # The HPA writes the scale before its own status, so its numbers may be a sync behind.
        seen = ", ".join(state.status.get("metrics") or []) or "none"
        by = f"HPA {hpa_name(fm)} last wanted {state.status.get('desiredReplicas', '?')}; metrics {seen}"
        cluster.event(body, "Normal", "Scaled", f"spec.replicas {previous} -> {fm.spec.replicas} ({by})")
        log.info("event=scaled model=%s/%s from=%s to=%d", ns, name, previous, fm.spec.replicas)
    state.status["specReplicas"] = fm.spec.replicas
    new_status["autoscaler"] = state.status
    return state


def write_pod_records(
    cluster: Cluster, namespace: str, name: str, pods: list[dict[str, Any]], extra: dict[str, Any] | None = None
) -> None:
    """status.pods (and `extra`: status.startup, status.adapters; what it leaves out is kept), for the pod
    watches: under the model's lock, so it never lands inside a pass."""
    with _locks.hold((namespace, name)):
        cluster.patch_status(namespace, name, {"pods": pods, **(extra or {})})


def record_remediation(
    cluster: Cluster,
    namespace: str,
    name: str,
    fm: dict[str, Any],
    entry: dict[str, Any],
    keep: Callable[[dict[str, Any]], int],
) -> None:
    """Add one eviction to status.remediations (the restart budget counts them), on the latest status.

    Under the model's lock: the read and the write of the history are one step, with no pass between.
    """
    with _locks.hold((namespace, name)):
        latest = cluster.get_flashmodel(namespace, name) or fm
        history = [*((latest.get("status") or {}).get("remediations") or []), entry][-keep(latest) :]
        cluster.patch_status(namespace, name, {"remediations": history})


def _write_status(
    cluster: Cluster, body: dict[str, Any], new_status: dict[str, Any], obs: Observation, outcome: Outcome
) -> None:
    meta = body["metadata"]
    current: dict[str, Any] = dict(body.get("status") or {})
    previous_conditions = current.get("conditions") or []
    conditions = build_conditions(obs, previous_conditions, _now())
    MODEL_CONDITIONS.record(meta["namespace"], meta["name"], conditions)
    changed = not same_conditions(conditions, previous_conditions) or any(
        current.get(k) != v for k, v in new_status.items() if not (v is None and k not in current)
    )
    if not changed:
        return
    was_degraded = any(c.get("type") == "Degraded" and c.get("status") == "True" for c in previous_conditions)
    if obs.problem is not None and not was_degraded:
        cluster.event(body, "Warning", obs.problem.reason, obs.problem.message)
    cluster.patch_status(meta["namespace"], meta["name"], {**new_status, "conditions": conditions})
    outcome.status_written = True
