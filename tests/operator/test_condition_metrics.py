"""The models' conditions as flashmodel_operator_model_condition series, as the chart's alerts read them."""

from __future__ import annotations

from flashmodel_operator.condition_metrics import ModelConditions
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def _series(conditions: ModelConditions) -> set[tuple[tuple[str, str], ...]]:
    registry = CollectorRegistry()
    registry.register(conditions)
    text = generate_latest(registry).decode()
    return {
        tuple(sorted(s.labels.items()))
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.value == 1
    }


def test_one_series_per_condition_with_its_status_and_reason_and_none_after_the_model_goes() -> None:
    conditions = ModelConditions()
    conditions.record(
        "ml",
        "qwen",
        [
            {"type": "Ready", "status": "False", "reason": "ReplicasNotReady", "message": "1/2 pods ready"},
            {"type": "Autoscaling", "status": "False", "reason": "ScalerUnavailable", "message": "no Prometheus"},
        ],
    )
    conditions.record("ml", "phi", [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}])
    assert _series(conditions) == {
        (
            ("flashmodel", "qwen"),
            ("namespace", "ml"),
            ("reason", "ReplicasNotReady"),
            ("status", "False"),
            ("type", "Ready"),
        ),
        (
            ("flashmodel", "qwen"),
            ("namespace", "ml"),
            ("reason", "ScalerUnavailable"),
            ("status", "False"),
            ("type", "Autoscaling"),
        ),
        (
            ("flashmodel", "phi"),
            ("namespace", "ml"),
            ("reason", "AllReplicasReady"),
            ("status", "True"),
            ("type", "Ready"),
        ),
    }
    # A new pass replaces the model's series: the old reason is gone, not left beside the new one.
    conditions.record("ml", "qwen", [{"type": "Ready", "status": "True", "reason": "AllReplicasReady"}])
    assert {dict(s)["reason"] for s in _series(conditions) if dict(s)["flashmodel"] == "qwen"} == {"AllReplicasReady"}
    conditions.forget("ml", "qwen")
    conditions.retain({("other", "x")})
    assert _series(conditions) == set()
