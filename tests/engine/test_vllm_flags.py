"""Extra args are judged by the flag vLLM's parser resolves them to, whatever their spelling."""

from __future__ import annotations

import argparse
import importlib
import inspect
from typing import Any

import pytest
from flashmodel_engine.config import parse_config
from flashmodel_engine.engine_guard import MIDDLEWARE
from flashmodel_engine.preflight import run_preflight
from flashmodel_engine.profiles import ProfileError, check_extra_args, vllm_args
from flashmodel_engine.vllm_flags import installed_vllm_version, parser_options, resolve, vllm_parser
from flashmodel_engine.vllm_options import TABLES


def make(**engine: Any) -> Any:
    return parse_config({"accelerator": "t4", "model": {"path": "/models/qwen", "servedName": "qwen"},
                         "engine": engine})


# (extraArgs, the flag the refusal names, what it says to do): the spellings seen getting through.
BYPASSES: list[tuple[list[str], str, str]] = [
    (["--max-model", "2048"], "--max-model-len", "set engine.maxModelLen instead"),
    (["--gpu-memory-util=0.99"], "--gpu-memory-utilization", "set engine.gpuMemoryUtilization instead"),
    (["--gpu_memory_util", "0.99"], "--gpu-memory-utilization", "set engine.gpuMemoryUtilization instead"),
    (["--device-memory-utilization", "0.99"], "--gpu-memory-utilization", "engine.gpuMemoryUtilization"),
    (["--dtyp", "bfloat16"], "--dtype", "set engine.dtype instead"),
    (["--no-enforce"], "--enforce-eager", "set engine.enforceEager instead"),
    (["--enforce"], "--enforce-eager", "set engine.enforceEager instead"),
    (["--kv-cache-memory-bytes", "8g"], "--kv-cache-memory-bytes", "engine.gpuMemoryUtilization"),
    (["--kv-cache-mem=8g"], "--kv-cache-memory-bytes", "engine.gpuMemoryUtilization"),
    (["--max-cudagraph", "512"], "--max-cudagraph-capture-size", "engine.maxNumBatchedTokens"),
    (["--cudagraph-capture-sizes", "1", "2", "512"], "--cudagraph-capture-sizes", "engine.maxNumBatchedTokens"),
    (["--compilation-config.cudagraph_capture_sizes", "[512]"], "--compilation-config", "engine.enforceEager"),
    (["-cc", '{"mode": 0}'], "--compilation-config", "engine.enforceEager"),
    (["-O3"], "--enforce-eager", "engine.enforceEager"),
    (["-O", "0"], "--enforce-eager", "engine.enforceEager"),
    (["--block_size=32"], "--block-size", "set engine.blockSize instead"),
    (["--max-num-se", "512"], "--max-num-seqs", "set engine.maxNumSeqs instead"),
    (["--served", "gpt-4"], "--served-model-name", "set model.servedName instead"),
    (["--api-k", "x"], "--api-key", "set auth.apiKeyFile instead"),
    (["--num-gpu-blocks-override", "100000"], "--num-gpu-blocks-override", "engine.gpuMemoryUtilization"),
    (["--swap-space", "16"], "--swap-space", "CPU swap"),
    (["--cpu-offload-gb=8"], "--cpu-offload-gb", "offloaded weights"),
    (["--max-seq-len-to-capture", "8192"], "--max-seq-len-to-capture", "engine.maxNumBatchedTokens"),
    (["-tp", "2"], "--tensor-parallel-size", "one GPU"),
    (["--tensor-parallel", "2"], "--tensor-parallel-size", "one GPU"),
    (["--kv-cache-dtype", "fp8"], "--kv-cache-dtype", "sm_89"),
    (["-q", "awq"], "--quantization", "set spec.model.quantization instead"),
    (["--quantization=gptq"], "--quantization", "set spec.model.quantization instead"),
    (["--quantization-config", "{}"], "--quantization-config", "set spec.model.quantization instead"),
    (["--speculative-config", "{}"], "--speculative-config", "draft model"),
]


@pytest.mark.parametrize(("args", "flag", "instead"), BYPASSES, ids=[" ".join(b[0]) for b in BYPASSES])
def test_every_spelling_of_a_guarded_flag_is_refused(args: list[str], flag: str, instead: str) -> None:
    problems = check_extra_args(["--seed", "7", *args])
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"engine.extraArgs[2] {args[0]!r}"), problems
    assert f" {flag};" in problems[0] and instead in problems[0], problems
    with pytest.raises(ProfileError):
        vllm_args(make(extraArgs=args))


@pytest.mark.parametrize(("args", "expect"), [
    (["--config", "x.yaml"], "a vLLM config file could override enforced flags"),
    (["--conf", "x.yaml"], "abbreviates several vLLM flags (--config, --config-format), among them the enforced "
                           "--config; write the flag in full"),
    (["--max", "3"], "abbreviates several vLLM flags"),
    (["/other/model"], "vLLM would take it for its positional model argument"),
    (["--max-model 2048"], "vLLM would take it for its positional model argument"),
    (["--seed", "1", "2"], "engine.extraArgs[2] '2' is not the value of a flag before it"),
    (["--", "/other/model"], "vLLM would take every entry after it for positional arguments"),
])
def test_abbreviations_stray_values_and_config_files_are_refused(args: list[str], expect: str) -> None:
    problems = check_extra_args(args)
    assert len(problems) == 1 and expect in problems[0], problems


def test_flags_that_only_look_like_guarded_ones_pass() -> None:
    args = ["--enable-prefix-caching", "--seed", "-1", "--max-log-len", "100", "--enable-chunked-prefill",
            "--override-generation-config.temperature", "0.5", "--tool-call-parser=hermes", "--no-enable-log-requests"]
    assert check_extra_args(args) == []
    for table in TABLES.values():
        assert check_extra_args(args, table, strict=True) == []


def test_a_flag_no_supported_vllm_has_is_refused_before_a_pod_starts() -> None:
    problems = check_extra_args(["--seed", "1", "--some-new-flag", "1"])
    assert problems == [
        "engine.extraArgs[2] '--some-new-flag': vLLM has no flag --some-new-flag in any supported version with a "
        "stored table (0.26.0, 0.32.0); check its spelling (vLLM would refuse to start)"
    ]
    # In the pod, the installed vLLM's own table judges: strictly when it is the real parser's.
    assert check_extra_args(["--some-new-flag", "1"], TABLES["0.32.0"]) == []
    assert "vLLM has no flag --some-new-flag" in check_extra_args(["--some-new-flag", "1"], TABLES["0.32.0"],
                                                                  strict=True)[0]


@pytest.mark.parametrize(("flag", "having", "lacking"), [
    ("--calculate-kv-scales", "0.26.0", "0.32.0"),
    ("--max-num-partial-prefills=2", "0.26.0", "0.32.0"),
    ("--sse-keep-alive-interval=5", "0.32.0", "0.26.0"),
])
def test_a_flag_only_some_supported_vllms_have_is_refused_naming_them(flag: str, having: str, lacking: str) -> None:
    # The operator cannot see the image's vLLM before a pod starts; one without the flag crash-loops.
    # None is on the allow-list: the cluster admin's extension allows it.
    allowed = [flag.split("=")[0]]
    problems = check_extra_args([flag], extension=allowed)
    assert len(problems) == 1, problems
    assert f"only vLLM {having} has this flag, {lacking} does not" in problems[0], problems
    assert ">=0.26.0,<0.33.0" in problems[0]
    with pytest.raises(ProfileError, match="only vLLM"):
        vllm_args(make(extraArgs=[flag], extraArgsAllowed=allowed))
    # A pod whose vLLM has it takes it; one whose vLLM lacks it refuses it at its preflight.
    assert check_extra_args([flag], TABLES[having], strict=True, extension=allowed) == []
    assert any("vLLM has no flag" in p for p in check_extra_args([flag], TABLES[lacking], strict=True,
                                                                 extension=allowed))


def test_every_supported_version_with_a_stored_table_is_in_the_supported_range() -> None:
    from flashmodel_engine.engine_version import version_refusal

    assert list(TABLES) == ["0.26.0", "0.32.0"]
    assert all(version_refusal(v) is None for v in TABLES)


def test_enforced_flags_come_after_the_extra_args() -> None:
    # argparse keeps a flag's last value: whatever got past the checks, the profile's value wins.
    args = vllm_args(make(extraArgs=["--seed", "7", "--enable-prefix-caching"]))
    assert args[:3] == ["--seed", "7", "--enable-prefix-caching"]
    assert args[3:5] == ["--model", "/models/qwen"]


def test_chunked_prefill_counts_however_it_is_spelt() -> None:
    assert vllm_args(make(maxNumBatchedTokens=1024, extraArgs=["--enable_chunked_prefill"]))
    with pytest.raises(ProfileError, match="below maxModelLen"):
        vllm_args(make(maxNumBatchedTokens=1024, extraArgs=["--no-enable-chunked-prefill"]))


def test_preflight_refuses_what_the_profile_refuses() -> None:
    report = run_preflight(make(extraArgs=["--max-model", "8192"]), detect=False)
    assert any("--max-model-len; remove it and set engine.maxModelLen instead" in f for f in report.failures), report


# Each must resolve as the installed vLLM parses it; a flag that vLLM lacks (refused by name only) it refuses.
PARSED = [b[0] for b in BYPASSES] + [
    ["--enable-prefix-caching", "--seed", "-1", "--middleware", "a.b", "--no-enable-log-requests"]
]


@pytest.mark.usefixtures("engine_packages")
class TestAgainstVLLMsParser:
    """The stored table and the resolution are vLLM's own: checked against the real parser."""

    @pytest.fixture(scope="class")
    def parser(self) -> Any:
        return vllm_parser()

    @pytest.fixture(scope="class")
    def table(self) -> dict[str, tuple[str, str]]:
        version = (installed_vllm_version() or "").split("+")[0]
        assert version in TABLES, (
            f"no stored table for the installed vLLM {version}: python -m flashmodel_engine.vllm_flags"
        )
        return TABLES[version]

    def test_stored_table_is_the_installed_parsers(self, parser: Any, table: dict[str, tuple[str, str]]) -> None:
        assert parser_options(parser) == table, "regenerate: python -m flashmodel_engine.vllm_flags"

    @pytest.mark.parametrize("args", PARSED, ids=lambda a: " ".join(a))
    def test_resolution_matches_what_vllm_parses(
        self, parser: Any, table: dict[str, tuple[str, str]], args: list[str]
    ) -> None:
        if any(r.kind == "unknown" for r in resolve(args, table)):
            with pytest.raises(SystemExit):  # argparse's error exit: this vLLM would not start
                parser.parse_args(args)
            return
        # Every dest starts as a marker, so the ones the parser set show even when set to their default.
        # A list, so that append actions can add to it.
        class Unset(list[Any]):
            pass

        start = argparse.Namespace(**{a.dest: Unset() for a in parser._actions})
        parsed = vars(parser.parse_args(args, start))
        # argparse always fills the optional positional, with None when nothing is left for it.
        touched = {k for k, v in parsed.items() if (not isinstance(v, Unset) or v) and (k, v) != ("model_tag", None)}
        resolved = {r.dest for r in resolve(args, table)}
        assert touched == resolved, (touched, resolved)

    def test_the_profile_value_wins_over_an_extra_arg_that_came_earlier(self, parser: Any) -> None:
        ns = parser.parse_args(["--max-model-len", "2048", "--max-model-len", "1024"])
        assert ns.max_model_len == 1024

    def test_the_control_route_guard_reaches_vllm_as_its_only_middleware(self, parser: Any) -> None:
        config = parse_config({"accelerator": "cpu", "model": {"path": "/m", "servedName": "m"},
                               "engine": {"extraArgs": ["--seed", "1"]}})
        ns = parser.parse_args(vllm_args(config))
        assert ns.middleware == [MIDDLEWARE]
        # As vLLM loads it (init_entrypoints_middleware): a class, given to app.add_middleware.
        module, name = MIDDLEWARE.rsplit(".", 1)
        assert inspect.isclass(getattr(importlib.import_module(module), name))

    def test_hub_revision_and_tracing_flags_reach_vllms_settings(self, parser: Any) -> None:
        config = parse_config({"accelerator": "t4",
                               "model": {"path": "org/llm", "servedName": "llm", "revision": "abc"},
                               "observability": {"otlpTracesEndpoint": "http://otel:4317"}})
        ns = parser.parse_args(vllm_args(config))
        assert (ns.revision, ns.code_revision, ns.otlp_traces_endpoint) == ("abc", "abc", "http://otel:4317")
        assert ns.tokenizer_revision is None  # vLLM then gives the tokenizer the model's revision
