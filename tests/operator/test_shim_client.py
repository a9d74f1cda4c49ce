"""Parsing the shim's real metric text into what the operator decides on."""

from __future__ import annotations

from flashmodel_operator.shim_client import parse_metrics

TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
# TYPE flashmodel_memory_divergence_ratio gauge
flashmodel_memory_divergence_ratio 0.23
# TYPE flashmodel_remediation_recommended gauge
flashmodel_remediation_recommended{reason="memory_divergence"} 1.0
flashmodel_remediation_recommended{reason="hung_readiness"} 0.0
# TYPE flashmodel_engine_generation gauge
flashmodel_engine_generation 2.0
# TYPE flashmodel_prewarm_succeeded gauge
flashmodel_prewarm_succeeded 1.0
"""


def test_parse_metrics_reads_divergence_generation_and_load() -> None:
    m = parse_metrics(TEXT)
    assert m.divergence_recommended and m.divergence_ratio == 0.23
    assert (m.generation, m.requests_running, m.requests_waiting) == (2.0, 3.0, 1.0)
    assert m.prewarm_succeeded


def test_only_memory_divergence_counts_as_divergence() -> None:
    text = TEXT.replace('{reason="memory_divergence"} 1.0', '{reason="memory_divergence"} 0.0').replace(
        '{reason="hung_readiness"} 0.0', '{reason="hung_readiness"} 1.0'
    )
    assert not parse_metrics(text).divergence_recommended


def test_the_operator_reads_the_series_the_engine_writes() -> None:
    # Both sides name these series through flashmodel_engine.contract; a rename on one side only
    # would leave the operator reading zeros (no prewarm seen, no divergence, no restart).
    from flashmodel_engine.config import RemediationSettings
    from flashmodel_engine.metrics import EngineMetrics

    engine = EngineMetrics(RemediationSettings())
    engine.prewarm_succeeded.set(1)
    engine.generation.set(3)
    engine.divergence_ratio.set(0.4)
    engine.remediation.labels("memory_divergence").set(1)
    m = parse_metrics(engine.render(None).decode())
    assert (m.prewarm_succeeded, m.generation, m.divergence_ratio, m.divergence_recommended) == (True, 3.0, 0.4, True)
