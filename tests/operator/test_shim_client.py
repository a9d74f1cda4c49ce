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
