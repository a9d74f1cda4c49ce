"""The remediation decision: who is evicted, when, and when the budget says no."""

from __future__ import annotations

from flashmodel_operator.model import RemediationSpec
from flashmodel_operator.remediation import CONFIRM_SECONDS, ModelBudget, PodHealth, decide, serving_pods

SPEC = RemediationSpec(max_restarts_per_hour=2, hung_readiness_seconds=60)
NOW = 10_000.0


def pod(
    name: str,
    *,
    divergent_for: float | None = None,
    hung_for: float | None = None,
    live: bool = True,
    ratio: float = 0.0,
    prewarmed: bool = True,
    endpoint_ready: bool = True,
) -> PodHealth:
    return PodHealth(
        name=name,
        prewarmed=prewarmed,
        livez_ok=live,
        divergence_recommended=divergent_for is not None,
        divergence_ratio=ratio,
        divergent_since=None if divergent_for is None else NOW - divergent_for,
        readyz_failing_since=None if hung_for is None else NOW - hung_for,
        endpoint_ready=endpoint_ready,
    )


def budget(**kw: object) -> ModelBudget:
    base: dict[str, object] = {
        "restarts_last_hour": 0,
        "in_flight": None,
        "seconds_since_last": None,
        "ready_pods": 2,
        "desired_pods": 2,
    }
    base.update(kw)
    return ModelBudget(**base)  # type: ignore[arg-type]


def test_healthy_pods_need_nothing() -> None:
    assert decide([pod("a"), pod("b")], budget(), SPEC, NOW) is None


def test_sustained_divergence_evicts_that_pod() -> None:
    d = decide([pod("a"), pod("b", divergent_for=CONFIRM_SECONDS + 1, ratio=0.2)], budget(), SPEC, NOW)
    assert d is not None and (d.action, d.pod, d.reason) == ("evict", "b", "MemoryDivergence")
    assert "20.0%" in d.message


def test_a_fresh_divergence_signal_waits_for_confirmation() -> None:
    assert decide([pod("a", divergent_for=CONFIRM_SECONDS / 2, ratio=0.3)], budget(), SPEC, NOW) is None


def test_hung_generation_with_live_process_is_remediated_but_dead_process_is_the_kubelets() -> None:
    d = decide([pod("a", hung_for=61)], budget(ready_pods=1), SPEC, NOW)
    assert d is not None and (d.action, d.reason) == ("evict", "GenerationHung")
    assert decide([pod("a", hung_for=61, live=False)], budget(), SPEC, NOW) is None
    assert decide([pod("a", hung_for=59)], budget(), SPEC, NOW) is None


def test_one_at_a_time() -> None:
    d = decide([pod("a", divergent_for=99, ratio=0.2)], budget(in_flight="b"), SPEC, NOW)
    assert d is not None and (d.action, d.reason) == ("hold", "RemediationInProgress")


def test_the_hold_names_the_waiting_pod_not_the_one_being_drained() -> None:
    # "b" diverges more, but it is the one being drained: the hold is about "a".
    pods = [pod("a", divergent_for=99, ratio=0.1), pod("b", divergent_for=99, ratio=0.5)]
    d = decide(pods, budget(in_flight="b"), SPEC, NOW)
    assert d is not None and (d.action, d.pod, d.reason) == ("hold", "a", "RemediationInProgress")
    assert decide([pod("b", divergent_for=99, ratio=0.5)], budget(in_flight="b"), SPEC, NOW) is None


def test_restart_budget_holds() -> None:
    d = decide([pod("a", divergent_for=99, ratio=0.2)], budget(restarts_last_hour=2), SPEC, NOW)
    assert d is not None and (d.action, d.reason) == ("hold", "RestartBudgetExhausted")
    assert "maxRestartsPerHour=2" in d.message


def test_back_off_after_a_remediation() -> None:
    d = decide([pod("a", divergent_for=99, ratio=0.2)], budget(seconds_since_last=10), SPEC, NOW)
    assert d is not None and (d.action, d.reason) == ("hold", "BackingOff")


def test_a_serving_pod_waits_while_another_is_not_ready() -> None:
    d = decide([pod("a", divergent_for=99, ratio=0.2), pod("b")], budget(ready_pods=1), SPEC, NOW)
    assert d is not None and (d.action, d.reason) == ("hold", "WaitingForReadyPods")


def test_hung_pod_goes_before_diverged_pod() -> None:
    d = decide([pod("a", divergent_for=99, ratio=0.5), pod("b", hung_for=120)], budget(), SPEC, NOW)
    assert d is not None and d.pod == "b"


def test_disabled_remediation_never_acts() -> None:
    spec = RemediationSpec(enabled=False)
    assert decide([pod("a", hung_for=9999)], budget(), spec, NOW) is None


def _unprewarmed(name: str) -> PodHealth:
    return PodHealth(name=name, prewarmed=False, livez_ok=False, divergence_recommended=False, divergence_ratio=0.0,
                     divergent_since=None, readyz_failing_since=None, prewarm_failure="3 prewarms failed: 502")


def test_a_pod_whose_prewarm_keeps_failing_takes_the_same_budget() -> None:
    # Seen: such pods evicted 10 times in 3 minutes with maxRestartsPerHour 1, two at a time.
    one = RemediationSpec(max_restarts_per_hour=1)
    first = decide([_unprewarmed("a"), _unprewarmed("b")], budget(), one, NOW)
    assert first is not None and (first.action, first.reason) == ("evict", "PrewarmFailed")
    spent = decide([_unprewarmed("b")], budget(restarts_last_hour=1), one, NOW)
    assert spent is not None and (spent.action, spent.reason) == ("hold", "RestartBudgetExhausted")
    busy = decide([_unprewarmed("a"), _unprewarmed("b")], budget(in_flight="a"), one, NOW)
    assert busy is not None and (busy.action, busy.reason) == ("hold", "RemediationInProgress")
    soon = decide([_unprewarmed("b")], budget(seconds_since_last=1.0), SPEC, NOW)
    assert soon is not None and (soon.action, soon.reason) == ("hold", "BackingOff")


def test_a_replacement_whose_gate_opened_before_its_probe_passed_does_not_carry_the_model() -> None:
    # Its gate is open but the kubelet has not yet marked the pod Ready, so it is no endpoint:
    # draining the diverging pod now would leave the Service with none.
    pods = [pod("a", divergent_for=CONFIRM_SECONDS + 1, ratio=0.2), pod("b-new", endpoint_ready=False)]
    assert serving_pods(pods) == 1
    d = decide(pods, budget(ready_pods=serving_pods(pods)), SPEC, NOW)
    assert d is not None and (d.action, d.reason) == ("hold", "WaitingForReadyPods")
    pods[1] = pod("b-new")
    d = decide(pods, budget(ready_pods=serving_pods(pods)), SPEC, NOW)
    assert d is not None and (d.action, d.pod) == ("evict", "a")
