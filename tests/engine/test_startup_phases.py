"""vLLM's start-up phases read from its log lines: the parser, and the wording of the vLLM installed."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from flashmodel_engine.metrics import ENGINE_INIT_OTHER
from flashmodel_engine.startup_phases import GIB, StartupPhases

# Lines as vLLM 0.26 prints them on a GPU: its logger's prefix, the engine core's process tag.
GPU_START = [
    "INFO 12-07 10:01:02 [gpu_model_runner.py:3400] Starting to load model /models/qwen...",
    "(EngineCore_DP0 pid=211) INFO 12-07 10:01:05 [default_loader.py:431] Loading weights took 2.41 seconds",
    "(EngineCore_DP0 pid=211) INFO 12-07 10:01:05 [gpu_model_runner.py:5348] Model loading took 2.9 GiB memory "
    "and 3.120000 seconds",
    "(EngineCore_DP0 pid=211) INFO 12-07 10:01:20 [monitor.py:34] torch.compile took 14.52 s in total",
    "(EngineCore_DP0 pid=211) INFO 12-07 10:01:44 [gpu_model_runner.py:6845] Graph capturing finished in 23 secs, "
    "took 1.47 GiB",
    "(EngineCore_DP0 pid=211) INFO 12-07 10:01:45 [core.py:348] init engine (profile, create kv cache, warmup "
    "model) took 42.80 s (compilation: 14.52 s)",
    "INFO 12-07 10:01:46 [api_server.py:1500] Starting vLLM API server 0 on http://0.0.0.0:8000",
]


def test_the_phases_of_a_gpu_start_and_what_is_left_of_engine_init() -> None:
    phases = StartupPhases()
    seen = [phases.observe(line) for line in GPU_START]
    assert seen == [None, "weights", "model_load", "compile", "graph_capture", "engine_init", None]
    assert phases.seconds == {
        "weights": 2.41, "model_load": 3.12, "compile": 14.52, "graph_capture": 23.0, "engine_init": 42.8,
    }
    assert phases.model_memory_bytes == pytest.approx(2.9 * GIB)
    assert phases.graph_memory_bytes == pytest.approx(1.47 * GIB)
    assert phases.rest_of_engine_init() == pytest.approx(42.8 - 14.52 - 23.0)


def test_an_eager_start_has_no_compile_or_capture_and_a_combined_compile_line_counts() -> None:
    phases = StartupPhases()
    phases.observe("init engine (profile, create kv cache, warmup model) took 3.10 s")
    assert phases.seconds == {"engine_init": 3.1} and phases.rest_of_engine_init() == 3.1
    assert phases.graph_memory_bytes is None
    phases.observe("torch.compile and initial profiling/warmup run together took 5.50 s in total")
    assert phases.seconds["compile"] == 5.5
    assert ENGINE_INIT_OTHER not in phases.seconds


def _vllm_source(relative: str) -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.fail("vLLM is not installed in this interpreter")
    return (Path(spec.origin).parent / relative).read_text()


# Where the installed vLLM logs each phase, and how the line starts: the format string is rendered
# with sample values and must match the pattern, so a change of wording in a new vLLM fails here,
# not silently in pods.
SOURCES = {
    "weights": ("model_executor/model_loader/default_loader.py", "Loading weights took", (2.5,)),
    "model_load": ("v1/worker/gpu_model_runner.py", "Model loading took", ("2.9", 3.1)),
    "compile": ("compilation/monitor.py", "torch.compile took", (14.5,)),
    "graph_capture": ("v1/worker/gpu_model_runner.py", "Graph capturing finished", (23.0, 1.47)),
    "engine_init": ("v1/engine/core.py", "init engine (profile, create kv cache, warmup model) took %", (42.8,)),
}


@pytest.mark.usefixtures("engine_packages")
@pytest.mark.parametrize("phase", list(SOURCES))
def test_the_installed_vllm_logs_each_phase_in_the_words_the_parser_reads(phase: str) -> None:
    path, prefix, values = SOURCES[phase]
    literals = re.findall(r'"((?:[^"\\]|\\.)*)"', _vllm_source(path))
    # A leading %s is the component's tag some versions put first ("" for the language model).
    formats = [f for f in literals if f.removeprefix("%s").startswith(prefix) and "%" in f]
    assert formats, f"vllm/{path} no longer logs a line starting {prefix!r}"
    for format_string in formats:
        line = format_string % ((("",) if format_string.startswith("%s") else ()) + values)
        assert StartupPhases().observe(line) == phase, line
