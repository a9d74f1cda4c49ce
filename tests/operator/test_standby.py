"""Standby pods (spec.standbyReplicas): which prewarmed pods serve, and what the Deployment and PDB allow."""

from __future__ import annotations

from typing import Any

from flashmodel_operator.model import FlashModel, RemediationSpec
from flashmodel_operator.pod_state import PROMOTED, ModelState
from flashmodel_operator.remediation import CONFIRM_SECONDS, ModelBudget, PodHealth, decide
from flashmodel_operator.render import PREWARM_GATE, render_deployment, render_pdb
from flashmodel_operator.standby import GateView, pick_standby, should_serve, should_stand_by
from flashmodel_operator.standby_gate import api_views, promoted_message, replaced_pod

from tests.operator.specs import MINIMAL_T4

NEW, OLD = "hash-new", "hash-old"


def serving(name: str, template: str = NEW) -> GateView:
    return GateView(name, template, serving=True)


def standby(name: str, template: str = NEW) -> GateView:
    return GateView(name, template, serving=False, standby=True)


def fresh(name: str, template: str = NEW) -> GateView:
    return GateView(name, template, serving=False)


def test_without_standbys_every_prewarmed_pod_serves() -> None:
    pods = [serving("a"), serving("b"), fresh("c")]
    assert should_serve(fresh("c"), pods, NEW, replicas=2, standby_replicas=0, draining=None)
    assert not should_stand_by(serving("b"), pods, NEW, replicas=1, standby_replicas=0, draining=None)


def test_a_new_pod_waits_as_standby_once_replicas_pods_of_the_spec_serve() -> None:
    pods = [serving("a"), serving("b"), fresh("c")]
    assert not should_serve(fresh("c"), pods, NEW, replicas=2, standby_replicas=1, draining=None)
    assert should_serve(fresh("c"), pods[:1] + pods[2:], NEW, replicas=2, standby_replicas=1, draining=None)


def test_a_standby_serves_in_place_of_a_draining_pod() -> None:
    pods = [serving("a"), standby("s")]
    assert not should_serve(standby("s"), pods, NEW, replicas=1, standby_replicas=1, draining=None)
    assert should_serve(standby("s"), pods, NEW, replicas=1, standby_replicas=1, draining="a")


def test_in_a_rollout_a_new_pod_serves_whatever_old_pods_still_serve() -> None:
    # The Deployment removes old pods only once new ones are available: holding the new one back
    # as a standby would stop the rollout for ever.
    pods = [serving("old-1", OLD), serving("old-2", OLD), fresh("new-1")]
    assert should_serve(fresh("new-1"), pods, NEW, replicas=2, standby_replicas=1, draining=None)
    # ...until replicas pods of the new spec serve: the last new pod is the standby.
    pods = [serving("old-1", OLD), serving("new-1"), serving("new-2"), fresh("new-3")]
    assert not should_serve(fresh("new-3"), pods, NEW, replicas=2, standby_replicas=1, draining=None)


def test_an_old_spec_pod_serves_only_where_too_few_pods_serve_at_all() -> None:
    assert not should_serve(fresh("old-2", OLD), [serving("new-1"), serving("old-1", OLD)], NEW, 2, 1, None)
    assert should_serve(fresh("old-2", OLD), [serving("new-1")], NEW, 2, 1, None)


def test_after_a_scale_down_exactly_one_surplus_pod_steps_back() -> None:
    pods = [serving("a"), serving("b"), serving("c")]
    stepping = [p.name for p in pods if should_stand_by(p, pods, NEW, replicas=2, standby_replicas=1, draining=None)]
    assert stepping == ["c"]
    assert not any(should_stand_by(p, pods, NEW, replicas=3, standby_replicas=1, draining=None) for p in pods)
    # Pods of an old spec are the rollout's to remove, and the draining pod is on its way out.
    assert not should_stand_by(serving("c", OLD), pods, NEW, replicas=1, standby_replicas=1, draining=None)
    assert not should_stand_by(serving("c"), pods, NEW, replicas=1, standby_replicas=1, draining="c")


def test_the_pod_about_to_be_replaced_steps_back_not_the_healthy_one() -> None:
    """The operator restarted between promoting a standby ("a") and draining the pod it replaces ("b"):
    both serve, one too many. "b" steps back, though the rule without it would bench "b" only by name."""
    promoted, victim = serving("a"), GateView("b", NEW, serving=True, leaving=True)
    pods = [promoted, victim]
    assert [p.name for p in pods if should_stand_by(p, pods, NEW, 1, 1, None)] == ["b"]
    # Named the other way round: still the leaving pod, where the name rule alone would pick the healthy one.
    pods = [GateView("a", NEW, serving=True, leaving=True), serving("b")]
    assert [p.name for p in pods if should_stand_by(p, pods, NEW, 1, 1, None)] == ["a"]
    # Two leaving pods and one surplus: one steps back.
    pods = [GateView("a", NEW, True, leaving=True), GateView("b", NEW, True, leaving=True), serving("c")]
    assert [p.name for p in pods if should_stand_by(p, pods, NEW, 2, 1, None)] == ["a"]


def test_the_replaced_pod_is_read_back_from_the_promoted_pods_gate() -> None:
    def pod(name: str, reason: str, message: str) -> dict[str, Any]:
        gate = {"type": PREWARM_GATE, "status": "True", "reason": reason, "message": message}
        return {"metadata": {"name": name, "annotations": {}}, "status": {"conditions": [gate]}}

    promoted = pod("m-a", PROMOTED, promoted_message("m-b", "memory diverges"))
    victim = pod("m-b", "PrewarmSucceeded", "prewarm ok")
    assert replaced_pod(promoted) == "m-b" and replaced_pod(victim) is None
    views = {v.name: v for v in api_views([promoted, victim], ModelState())}
    assert views["m-b"].leaving and not views["m-a"].leaving
    # A poll that calls for remediation makes a pod leaving too, before any promotion.
    state = ModelState()
    state.health["m-a"] = PodHealth("m-a", True, True, True, 0.2, 1.0, None)
    assert {v.name for v in api_views([promoted, victim], state) if v.leaving} == {"m-a", "m-b"}


def test_the_standby_promoted_is_healthy_and_of_the_current_spec() -> None:
    pods = [serving("a"), standby("s-old", OLD), standby("s-sick"), standby("s-ok"), standby("s-ok2")]
    assert pick_standby(pods, NEW, healthy=frozenset({"s-old", "s-ok", "s-ok2"})) == "s-ok"
    assert pick_standby(pods, NEW, healthy=frozenset({"s-old", "s-sick"}) - {"s-sick"}) is None


def _health(name: str, *, standby: bool, endpoint_ready: bool) -> PodHealth:
    return PodHealth(name=name, prewarmed=True, livez_ok=True, divergence_recommended=True, divergence_ratio=0.2,
                     divergent_since=0.0, readyz_failing_since=None, endpoint_ready=endpoint_ready, standby=standby)


def test_a_diverging_standby_is_replaced_even_while_serving_pods_are_short() -> None:
    budget = ModelBudget(restarts_last_hour=0, in_flight=None, seconds_since_last=None, ready_pods=1, desired_pods=2)
    now = CONFIRM_SECONDS + 1
    spec = RemediationSpec()
    held = decide([_health("a", standby=False, endpoint_ready=True)], budget, spec, now)
    assert held is not None and held.action == "hold" and held.reason == "WaitingForReadyPods"
    evicted = decide([_health("s", standby=True, endpoint_ready=False)], budget, spec, now)
    assert evicted is not None and evicted.action == "evict" and evicted.pod == "s"


def _model(**spec: Any) -> FlashModel:
    return FlashModel.from_body({**MINIMAL_T4, "spec": {**MINIMAL_T4["spec"], **spec}})


def test_the_deployment_and_pdb_make_room_for_standbys() -> None:
    plain, spare = _model(replicas=2), _model(replicas=2, standbyReplicas=1)
    assert render_deployment(plain)["spec"]["replicas"] == 2
    assert render_deployment(plain)["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert render_pdb(plain)["spec"]["maxUnavailable"] == 1
    deployment = render_deployment(spare)["spec"]
    assert deployment["replicas"] == 3
    # The standby is never available: a rollout that counted it would never finish, a PDB that
    # counted it would block every voluntary eviction of a serving pod.
    assert deployment["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 1}
    assert render_pdb(spare)["spec"]["maxUnavailable"] == 2
    # A model held at 0 (preflight refusal) or scaled to 0 keeps no standby either.
    assert render_deployment(spare, replicas=0)["spec"]["replicas"] == 0
    assert render_deployment(_model(replicas=0, standbyReplicas=2))["spec"]["replicas"] == 0
