"""Per engine pod: open the gate or hold the pod as a standby, promote a standby, step a surplus pod back.

standby.py decides from a list of pods; this module feeds it. The operator's memory of its pods
(ModelState.pods) answers the common case, "nothing to do", without an API request; every change
is decided again on a fresh pod list under the model's lock, because memory lags behind a restart
of the operator and behind other pods' watches.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from flashmodel_operator.model import FlashModel, FlashModelSpec
from flashmodel_operator.pod_context import PodContext
from flashmodel_operator.pod_state import PROMOTED, STANDBY, ModelState, PodRecord, gate_is_standby, gate_is_true
from flashmodel_operator.render import CONFIG_HASH_ANNOTATION, MODEL_LABEL, PREWARM_GATE, render_pod_template
from flashmodel_operator.standby import GateView, pick_standby, should_serve, should_stand_by, surplus

log = logging.getLogger(__name__)


def current_template(state: ModelState, fm: dict[str, Any]) -> str:
    """The config hash of the pods the model's spec renders now (what reconcile calls current).

    Kept in the model's state, once per generation: standbys ask on every poll.
    """
    meta = fm.get("metadata") or {}
    key = (str(meta.get("uid", "")), int(meta.get("generation", 0)))
    if state.template is None or state.template[0] != key:
        state.template = (key, template_hash(fm))
    return state.template[1]


def template_hash(fm: dict[str, Any]) -> str:
    """The config hash of the pods the model's spec renders."""
    return str(render_pod_template(FlashModel.from_body(fm))["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])


def template_of(pod: dict[str, Any]) -> str:
    return str((pod["metadata"].get("annotations") or {}).get(CONFIG_HASH_ANNOTATION, ""))


def memory_views(state: ModelState) -> list[GateView]:
    return [GateView(name, r.template, r.serving, r.prewarmed and r.standby) for name, r in state.pods.items()]


def api_views(pods: list[dict[str, Any]], state: ModelState) -> list[GateView]:
    """The live pods, each leaving where its last health poll calls for remediation or a live pod's gate
    says it was promoted in that pod's place (which outlives a restart of the operator)."""
    live = [p for p in pods if not p["metadata"].get("deletionTimestamp")]
    replaced = {replaced_pod(p) for p in live}
    views = []
    for pod in live:
        name = pod["metadata"]["name"]
        leaving = name in replaced or _unhealthy(state, name)
        views.append(GateView(name, template_of(pod), gate_is_true(pod), gate_is_standby(pod), leaving=leaving))
    return views


def _unhealthy(state: ModelState, name: str) -> bool:
    health = state.health.get(name)
    return health is not None and (health.readyz_failing_since is not None or health.divergence_recommended)


def promoted_message(replaced: str, why: str) -> str:
    """The promoted standby's gate message; `replaced_pod` reads the replaced pod's name back from it."""
    return f"standby promoted in place of pod {replaced}: {why}"


_PROMOTED_IN_PLACE = re.compile(r"^standby promoted in place of pod ([a-z0-9.-]+): ")


def replaced_pod(pod: dict[str, Any]) -> str | None:
    """The pod this pod was promoted in place of, from its gate condition; None when it was not."""
    for c in (pod.get("status") or {}).get("conditions") or []:
        if c.get("type") == PREWARM_GATE and c.get("status") == "True" and c.get("reason") == PROMOTED:
            found = _PROMOTED_IN_PLACE.match(str(c.get("message", "")))
            return found.group(1) if found else None
    return None


async def _live_pods(ctx: PodContext) -> list[dict[str, Any]]:
    return await ctx.api(ctx.cluster.list, "v1", "Pod", ctx.namespace, f"{MODEL_LABEL}={ctx.model}")


async def open_or_hold(
    ctx: PodContext, fm: dict[str, Any], spec: FlashModelSpec, record: PodRecord, reason: str, message: str
) -> bool:
    """After a prewarm: open the pod's gate, or hold it as a standby. True when it serves."""
    if spec.standby_replicas == 0:
        await ctx.set_gate(True, reason, message)
        record.standby = False
        return True
    template = current_template(ctx.state, fm)
    async with ctx.state.lock:
        views = api_views(await _live_pods(ctx), ctx.state)
        me = GateView(ctx.name, record.template, serving=False)
        serve = should_serve(me, views, template, spec.replicas, spec.standby_replicas, ctx.state.in_flight)
        if serve:
            await ctx.set_gate(True, reason, message)
        else:
            await ctx.set_gate(
                False, STANDBY, f"{message}; held as a standby: spec.replicas={spec.replicas} pods of this spec serve"
            )
        record.standby = not serve
    return serve


async def serve_if_needed(ctx: PodContext, fm: dict[str, Any], spec: FlashModelSpec, record: PodRecord) -> bool:
    """A standby's poll: open its gate when fewer pods of the current spec serve than replicas."""
    if not record.standby:
        return False
    template = current_template(ctx.state, fm)
    me = GateView(ctx.name, record.template, serving=False, standby=True)
    args = (template, spec.replicas, spec.standby_replicas, ctx.state.in_flight)
    if not should_serve(me, memory_views(ctx.state), *args):
        return False
    async with ctx.state.lock:
        if not record.standby:
            return False  # promoted meanwhile, by a drain
        views = api_views(await _live_pods(ctx), ctx.state)
        if not should_serve(me, views, template, spec.replicas, spec.standby_replicas, ctx.state.in_flight):
            return False
        serving = sum(1 for v in views if v.serving and v.template == template)
        message = f"standby promoted: {serving} of spec.replicas={spec.replicas} pods of this spec served"
        await ctx.set_gate(True, PROMOTED, message)
        record.standby = False
    await _promoted_event(ctx, fm, ctx.name, message)
    return True


async def stand_by_if_surplus(ctx: PodContext, fm: dict[str, Any], spec: FlashModelSpec, record: PodRecord) -> bool:
    """A serving pod's poll: close its gate and wait as a standby when more pods serve than replicas.

    Its engine keeps running, so the requests it has accepted finish; only new ones go elsewhere.
    """
    if spec.standby_replicas == 0 or not record.serving:
        return False
    template = current_template(ctx.state, fm)
    me = GateView(ctx.name, record.template, serving=True)
    args = (template, spec.replicas, spec.standby_replicas, ctx.state.in_flight)
    # Memory answers "no surplus" without a request; which pod steps back is decided on the API's list,
    # whose gates say which pod a promoted standby replaces.
    if not surplus(memory_views(ctx.state), template, spec.replicas, ctx.state.in_flight):
        return False
    async with ctx.state.lock:
        views = api_views(await _live_pods(ctx), ctx.state)
        if not should_stand_by(me, views, *args):
            return False
        serving = sum(1 for v in views if v.serving and v.template == template)
        message = f"stepped back to standby: {serving} pods of this spec served, spec.replicas={spec.replicas}"
        await ctx.set_gate(False, STANDBY, message)
        record.standby = True
    await ctx.api(ctx.cluster.event, fm, "Normal", "StandingBy", f"pod {ctx.name}: {message}")
    log.info("event=standing-by model=%s/%s pod=%s", ctx.namespace, ctx.model, ctx.name)
    await ctx.write_pods_status()
    return True


async def promote_for(ctx: PodContext, fm: dict[str, Any], spec: FlashModelSpec, why: str) -> tuple[str, str] | None:
    """Before this watch's pod is drained: open a healthy standby's gate in its place.

    (name, pod IP) of the promoted standby, or None when there is none.
    """
    record = ctx.state.pods.get(ctx.name)
    if spec.standby_replicas == 0 or record is None or not record.serving:
        return None  # a standby being replaced carries no traffic to hand over
    template = current_template(ctx.state, fm)
    healthy = frozenset(n for n in ctx.state.health if not _unhealthy(ctx.state, n))
    async with ctx.state.lock:
        pods = await _live_pods(ctx)
        name = pick_standby(api_views(pods, ctx.state), template, healthy)
        if name is None:
            return None
        message = promoted_message(ctx.name, why)
        await ctx.api(ctx.cluster.set_pod_condition, ctx.namespace, name, PREWARM_GATE, True, PROMOTED, message)
        promoted = ctx.state.pods.get(name)
        if promoted is not None:
            promoted.standby = False
    ip = next(str((p.get("status") or {}).get("podIP", "")) for p in pods if p["metadata"]["name"] == name)
    await _promoted_event(ctx, fm, name, message)
    return name, ip


async def _promoted_event(ctx: PodContext, fm: dict[str, Any], name: str, message: str) -> None:
    # On the model, beside its Remediated events: `kubectl describe fm` tells the whole replacement.
    await ctx.api(ctx.cluster.event, fm, "Normal", "Promoted", f"pod {name}: {message}")
    log.info("event=promoted model=%s/%s pod=%s", ctx.namespace, ctx.model, name)
    await ctx.write_pods_status()
