"""The divergence rule, the client-request counter and vLLM metric parsing, as pure functions.

The real-engine tests are in test_engine_vllm.
"""

from __future__ import annotations

from flashmodel_engine.config import RemediationSettings
from flashmodel_engine.metrics import DivergenceTracker, EngineMetrics, EngineSample, MemorySample, parse_vllm_metrics

GIB = 1024**3
SETTINGS = RemediationSettings.model_validate(
    {"divergenceRatio": 0.10, "divergenceWindowSeconds": 300, "lowKVCacheUsage": 0.5})


def mem(used_gib: float) -> MemorySample:
    return MemorySample(used_bytes=int(used_gib * GIB), total_bytes=16 * GIB, pinned_bytes=0, source="nvml")


def engine(kv: float = 0.05, running: float = 0) -> EngineSample:
    return EngineSample(kv_cache_usage=kv, running=running, waiting=0, request_success_total=0,
                        generation_tokens_total=0)


def test_sustained_growth_while_idle_is_divergence() -> None:
    t = DivergenceTracker(SETTINGS)
    t.set_baseline(int(13.6 * GIB))
    assert not t.observe(0, mem(16.0), engine())  # 15% above baseline, but not for 300 s yet
    assert not t.observe(299, mem(16.0), engine())
    assert t.observe(300, mem(16.0), engine())
    assert round(t.ratio, 3) == 0.15


def test_growth_under_load_does_not_count_and_resets_the_clock() -> None:
    t = DivergenceTracker(SETTINGS)
    t.set_baseline(int(13.6 * GIB))
    t.observe(0, mem(16.0), engine())
    assert not t.observe(200, mem(16.0), engine(kv=0.8, running=40))  # busy: KV cache in use
    assert not t.observe(400, mem(16.0), engine())  # the window starts again after the load
    assert not t.observe(400, mem(16.0), engine(kv=0.1, running=5))  # many running requests
    assert not t.observe(600, mem(16.0), engine())
    assert t.observe(900, mem(16.0), engine())


def test_no_baseline_no_divergence_and_disabled_never_recommends() -> None:
    t = DivergenceTracker(SETTINGS)
    assert not t.observe(1000, mem(16.0), engine()) and t.ratio == 0
    off = DivergenceTracker(SETTINGS.model_copy(update={"enabled": False}, deep=True))
    off.set_baseline(GIB)
    off.observe(0, mem(16.0), engine())
    assert not off.observe(10_000, mem(16.0), engine())
    assert off.ratio > 0.9  # still measured and exported, just not acted on


def test_both_kv_cache_metric_names_are_read() -> None:
    new = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\nvllm:num_requests_running{model_name="m"} 3\n'
    old = ('# HELP vllm:gpu_cache_usage_perc GPU KV-cache usage.\n# TYPE vllm:gpu_cache_usage_perc gauge\n'
           'vllm:gpu_cache_usage_perc{model_name="m"} 0.5\n'
           'vllm:request_success_total{finished_reason="stop",model_name="m"} 4\n'
           'vllm:request_success_total{finished_reason="length",model_name="m"} 6\n')
    assert parse_vllm_metrics(new).kv_cache_usage == 0.25
    assert parse_vllm_metrics(new).running == 3
    assert parse_vllm_metrics(old).kv_cache_usage == 0.5
    assert parse_vllm_metrics(old).request_success_total == 10
    assert parse_vllm_metrics("").kv_cache_usage is None


def _finished(m: EngineMetrics) -> float:
    return float(m.requests_finished._value.get())


def test_client_request_counter_skips_probes_in_flight_and_survives_a_vllm_restart() -> None:
    m = EngineMetrics(SETTINGS)

    def seen(success: float, own: float) -> None:
        m.observe_engine(0.0, EngineSample(kv_cache_usage=0.0, running=0, waiting=2, request_success_total=success,
                                           generation_tokens_total=0), own)

    seen(10, 4)  # the first sample is the base: 6 client requests before the shim looked are not counted
    seen(12, 4)
    assert _finished(m) == 2
    seen(12, 5)  # a probe started (counted as ours) ...
    seen(13, 5)  # ... and finished: no client request
    assert _finished(m) == 2
    m.observe_engine(0.0, EngineSample(kv_cache_usage=0.0, running=0, waiting=2, request_success_total=16,
                                       generation_tokens_total=0), 5, own_in_flight=True)
    assert _finished(m) == 2  # a prewarm's requests, finished before the shim counts them as its own
    seen(16, 8)  # the prewarm ended: its 3 requests are the shim's
    assert _finished(m) == 2
    seen(1, 8)  # vLLM restarted and counts from zero: nothing counted, nothing taken back
    seen(3, 8)
    assert _finished(m) == 4
    assert m.requests_waiting._value.get() == 2
