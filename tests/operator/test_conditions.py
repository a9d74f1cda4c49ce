"""Ready means ready and prewarmed as the operator saw it, not as any writer of the gate says."""

from __future__ import annotations

from typing import Any

from flashmodel_operator.conditions import Observation, build_conditions
from flashmodel_operator.pod_state import gate_is_true
from flashmodel_operator.render import PREWARM_GATE


def _pod(reason: str | None) -> dict[str, Any]:
    condition = {"type": PREWARM_GATE, "status": "True"}
    if reason is not None:
        condition["reason"] = reason
    return {"status": {"conditions": [condition]}}


def test_only_a_gate_the_operator_opened_counts_as_prewarmed() -> None:
    # kwok sets every readiness gate of the pods it runs True: seen as "1/1 pods ready and prewarmed"
    # with no engine anywhere.
    assert not gate_is_true(_pod(None))
    assert not gate_is_true(_pod("PodReady"))
    assert gate_is_true(_pod("PrewarmSucceeded"))
    assert gate_is_true(_pod("PrewarmDisabled"))


def _ready(obs: Observation) -> dict[str, Any]:
    return next(c for c in build_conditions(obs, [], "2026-01-01T00:00:00Z") if c["type"] == "Ready")


def test_pods_ready_but_not_seen_prewarmed_are_not_ready() -> None:
    common = {"generation": 1, "desired_replicas": 1, "replicas": 1, "ready_replicas": 1, "updated_replicas": 1,
              "deployment_generation_observed": True}
    ready = _ready(Observation(**common, prewarmed_replicas=0))  # type: ignore[arg-type]
    assert (ready["status"], ready["reason"]) == ("False", "NotPrewarmed")
    assert "0 prewarmed by the operator" in ready["message"]
    ready = _ready(Observation(**common, prewarmed_replicas=1))  # type: ignore[arg-type]
    assert (ready["status"], ready["reason"]) == ("True", "AllReplicasReady")


def _available(obs: Observation) -> dict[str, Any]:
    return next(c for c in build_conditions(obs, [], "2026-01-01T00:00:00Z") if c["type"] == "Available")


def test_a_scale_up_turns_ready_false_and_leaves_available_true() -> None:
    scaling_up = Observation(generation=2, desired_replicas=3, replicas=3, ready_replicas=2, updated_replicas=3,
                             prewarmed_replicas=2, deployment_generation_observed=True)
    ready = _ready(scaling_up)
    assert (ready["status"], ready["reason"]) == ("False", "ReplicasNotReady")
    available = _available(scaling_up)
    assert (available["status"], available["reason"], available["message"]) == (
        "True", "MinimumReplicasAvailable", "2 pods serving")


def test_no_serving_pod_is_not_available_and_says_why() -> None:
    starting = Observation(generation=1, desired_replicas=2, replicas=2, ready_replicas=1, prewarmed_replicas=0,
                           deployment_generation_observed=True, unschedulable="pod qwen-b: 0/4 nodes have a free T4")
    available = _available(starting)
    assert (available["status"], available["reason"]) == ("False", "NoServingPod")
    assert available["message"] == "no pod serves yet: 1 ready, 0 prewarmed; pod qwen-b: 0/4 nodes have a free T4"
    idle = _available(Observation(generation=1, desired_replicas=0))
    assert (idle["status"], idle["reason"]) == ("False", "ScaledToZero")


def test_a_remediation_held_by_the_budget_is_degraded_while_ready_still_counts_the_serving_pods() -> None:
    from flashmodel_operator.conditions import Problem

    held = Problem("RestartBudgetExhausted", "pod qwen-a: 2 remediations in the last hour reach ...")
    obs = Observation(generation=1, desired_replicas=2, replicas=2, ready_replicas=2, updated_replicas=2,
                      prewarmed_replicas=2, deployment_generation_observed=True, remediation_held=held)
    conditions = {c["type"]: c for c in build_conditions(obs, [], "2026-01-01T00:00:00Z")}
    assert (conditions["Degraded"]["status"], conditions["Degraded"]["reason"]) == ("True", "RestartBudgetExhausted")
    assert conditions["Degraded"]["message"] == held.message
    assert conditions["Ready"]["status"] == "True" and conditions["Available"]["status"] == "True"
    assert conditions["Progressing"]["reason"] == "RolloutComplete"


def test_only_a_hold_that_lasts_reaches_the_status() -> None:
    from flashmodel_operator import pod_state, reconcile

    state = pod_state.model_state("ml", "held")
    try:
        state.last_hold, state.last_hold_message = "BackingOff", "pod held-a: last remediation 20s ago"
        assert reconcile._remediation_held("ml", "held") is None
        state.last_hold, state.last_hold_message = "RestartBudgetExhausted", "pod held-a: 2 remediations ..."
        problem = reconcile._remediation_held("ml", "held")
        assert problem is not None and problem.reason == "RestartBudgetExhausted"
        assert problem.message.startswith("pod held-a: 2 remediations ...; the operator replaces no pod until")
        assert reconcile._remediation_held("ml", "never-seen") is None
        assert ("ml", "never-seen") not in pod_state.MODELS
    finally:
        pod_state.forget("ml", "held")
