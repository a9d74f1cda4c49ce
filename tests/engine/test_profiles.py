"""Pure tests: engine config parsing, the per-profile vLLM command line, refusal messages."""

from __future__ import annotations

from typing import Any

import pytest
from flashmodel_engine.config import ConfigError, EngineConfig, parse_config
from flashmodel_engine.engine_process import engine_command, engine_environment
from flashmodel_engine.profiles import ProfileError, vllm_args, vllm_env


def make(accelerator: str = "t4", **engine: Any) -> EngineConfig:
    return parse_config({"accelerator": accelerator, "model": {"path": "/models/qwen", "servedName": "qwen"},
                         "engine": engine})


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_t4_defaults_enforce_the_field_report_settings() -> None:
    args = vllm_args(make("t4"))
    assert args[:8] == ["--model", "/models/qwen", "--served-model-name", "qwen", "--host", "0.0.0.0",
                        "--port", "8000"]
    assert flag(args, "--block-size") == "16"
    assert flag(args, "--dtype") == "float16"
    assert flag(args, "--gpu-memory-utilization") == "0.85"
    assert flag(args, "--max-num-seqs") == "256"
    assert flag(args, "--max-model-len") == "4096"
    assert flag(args, "--max-num-batched-tokens") == "4096"
    assert flag(args, "--attention-backend") == "TRITON_ATTN"
    assert flag(args, "--shutdown-timeout") == "25"
    # CUDA graphs on, captured for every step up to the prefill budget (maxNumBatchedTokens).
    assert "--enforce-eager" not in args
    assert flag(args, "--max-cudagraph-capture-size") == "4096"
    assert "--api-key" not in args


def test_t4_graph_capture_follows_the_prefill_budget_and_eager_drops_it() -> None:
    assert flag(vllm_args(make("t4", maxNumBatchedTokens=8192)), "--max-cudagraph-capture-size") == "8192"
    assert flag(vllm_args(make("t4", maxNumSeqs=64)), "--max-cudagraph-capture-size") == "4096"
    eager = vllm_args(make("t4", enforceEager=True))
    assert "--enforce-eager" in eager and "--max-cudagraph-capture-size" not in eager


def test_cpu_stays_eager_by_default() -> None:
    # No CUDA graphs on a CPU; vLLM's CPU backend would torch.compile the model at every start.
    args = vllm_args(make("cpu"))
    assert "--enforce-eager" in args and "--max-cudagraph-capture-size" not in args


def test_t4_tile_backend_and_extra_args_before_the_enforced_flags() -> None:
    args = vllm_args(make("t4", attentionBackend="tile", extraArgs=["--seed", "7"]))
    assert flag(args, "--attention-backend") == "CUSTOM"
    assert args[:2] == ["--seed", "7"]


def test_cpu_profile_uses_block_32_and_no_gpu_flags() -> None:
    config = make("cpu", maxModelLen=2048, cpuKVCacheSpaceGiB=2)
    args = vllm_args(config)
    assert flag(args, "--block-size") == "32"
    assert flag(args, "--dtype") == "float32"
    assert flag(args, "--max-num-batched-tokens") == "2048"
    assert "--gpu-memory-utilization" not in args
    assert "--attention-backend" not in args
    assert vllm_env(config) == {"VLLM_CPU_KVCACHE_SPACE": "2"}
    assert vllm_env(make("t4")) == {}


def test_launcher_command_and_api_key_through_environment(tmp_path: Any) -> None:
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    config = parse_config({"accelerator": "cpu", "model": {"path": "/m", "servedName": "m"},
                           "auth": {"apiKeyFile": str(key)}})
    argv = engine_command(config, "/py")
    assert argv[:3] == ["/py", "-m", "vllm.entrypoints.openai.api_server"]
    assert "s3cret" not in " ".join(argv)
    env = engine_environment(config, {"PATH": "/bin"})
    assert env["VLLM_API_KEY"] == "s3cret"
    assert env["VLLM_CPU_KVCACHE_SPACE"] == "1"
    assert "PYTHONPATH" not in env  # the memory-hog hook stays out unless a test asks for it
    hooked = engine_environment(config, {"FLASHMODEL_TEST_MEMORY_HOG_FILE": "/tmp/x"})
    assert hooked["PYTHONPATH"].endswith("testhooks")


@pytest.mark.parametrize(("accelerator", "engine", "message"), [
    ("t4", {"blockSize": 32}, "engine.blockSize is 32; it must be 16 on t4"),
    ("t4", {"dtype": "bfloat16"}, "engine.dtype is bfloat16; allowed on t4: float16, float32, auto "
                                  "(the T4 (sm_75) has no bf16 units; use float16)"),
    ("t4", {"gpuMemoryUtilization": 0.93}, "engine.gpuMemoryUtilization is 0.93; it must be <= 0.9 on t4"),
    ("t4", {"maxNumSeqs": 512}, "engine.maxNumSeqs is 512; it must be <= 256 on t4"),
    ("t4", {"maxModelLen": 8192}, "engine.maxModelLen is 8192; it must be <= 4096 on t4"),
    ("t4", {"maxNumBatchedTokens": 1024}, "engine.maxNumBatchedTokens is 1024, below maxModelLen 4096"),
    ("cpu", {"blockSize": 16}, "engine.blockSize is 16; it must be a multiple of 32 on cpu"),
    ("cpu", {"attentionBackend": "tile"}, "engine.attentionBackend is tile; allowed on cpu: triton, auto"),
    ("t4", {"extraArgs": ["--block-size", "32"]},
     "engine.extraArgs[0] '--block-size' sets the enforced flag --block-size; remove it and set "
     "engine.blockSize instead"),
    ("t4", {"extraArgs": ["--seed=1", "--max_num_seqs=512"]},
     "engine.extraArgs[1] '--max_num_seqs=512' sets the enforced flag --max-num-seqs"),
    ("t4", {"extraArgs": ["--no-enforce-eager"]}, "sets the enforced flag --enforce-eager"),
    ("t4", {"extraArgs": ["--api-key=abc"]}, "remove it and set auth.apiKeyFile instead"),
    ("t4", {"extraArgs": ["--config", "x.yaml"]}, "a vLLM config file could override enforced flags"),
    ("t4", {"extraArgs": ["--revision", "dev"]}, "sets the enforced flag --revision; remove it and set model.revision"),
    ("t4", {"extraArgs": ["--code_revision=dev"]}, "sets the enforced flag --code-revision"),
    ("t4", {"extraArgs": ["--otlp-traces-endpoint", "http://x:4317"]},
     "remove it and set observability.otlpTracesEndpoint instead"),
])
def test_conflicts_are_refused_with_the_reason(accelerator: str, engine: dict[str, Any], message: str) -> None:
    with pytest.raises(ProfileError) as err:
        vllm_args(make(accelerator, **engine))
    assert message in str(err.value)


def test_every_problem_is_reported_at_once() -> None:
    with pytest.raises(ProfileError) as err:
        vllm_args(make("t4", blockSize=32, dtype="bfloat16", extraArgs=["--port", "1"]))
    assert len(err.value.problems) == 3


def test_chunked_prefill_allows_a_lower_prefill_cap() -> None:
    args = vllm_args(make("t4", maxNumBatchedTokens=1024, extraArgs=["--enable-chunked-prefill"]))
    assert flag(args, "--max-num-batched-tokens") == "1024"


def test_config_rejects_unknown_keys_and_bad_values_naming_them() -> None:
    with pytest.raises(ConfigError, match=r"engine\.blokSize: Extra inputs are not permitted"):
        parse_config({"model": {"path": "/m", "servedName": "m"}, "engine": {"blokSize": 16}})
    with pytest.raises(ConfigError, match=r"engine\.maxNumSeqs: .*less than or equal to 1024 \(got 5000\)"):
        parse_config({"model": {"path": "/m", "servedName": "m"}, "engine": {"maxNumSeqs": 5000}})
    with pytest.raises(ConfigError, match="accelerator"):
        parse_config({"accelerator": "a100", "model": {"path": "/m", "servedName": "m"}})


def test_design_doc_example_parses() -> None:
    config = parse_config({
        "accelerator": "t4",
        "model": {"path": "/models/qwen2.5-1.5b", "servedName": "qwen"},
        "engine": {"image": "ghcr.io/flashmodel/engine:0.1.0", "blockSize": 16, "gpuMemoryUtilization": 0.85,
                   "maxNumSeqs": 256, "maxModelLen": 4096, "maxNumBatchedTokens": 4096, "dtype": "float16",
                   "enforceEager": True, "attentionBackend": "triton", "extraArgs": []},
        "prewarm": {"enabled": True, "requests": 5, "prompts": [], "maxTokens": 16, "timeoutSeconds": 120},
        "health": {"readinessDeadlineSeconds": 5, "readinessCacheSeconds": 5, "startupTimeoutSeconds": 900},
        "remediation": {"enabled": True, "divergenceRatio": 0.10, "divergenceWindowSeconds": 300,
                        "lowKVCacheUsage": 0.5, "maxRestartsPerHour": 2, "hungReadinessSeconds": 120},
        "auth": {"apiKeyFile": "/etc/flashmodel/auth/api-key"},
        "server": {"host": "0.0.0.0", "enginePort": 8000, "shimPort": 8081},
    })
    assert config.remediation.low_kv_cache_usage == 0.5
    assert config.model.served_name == "qwen"


def hub(**model: Any) -> EngineConfig:
    return parse_config({"accelerator": "t4", "model": {"path": "org/llm", "servedName": "llm", **model}})


def test_hub_revision_pins_the_weights_and_the_remote_code() -> None:
    args = vllm_args(hub(revision="v1.2"))
    assert flag(args, "--revision") == "v1.2" and flag(args, "--code-revision") == "v1.2"
    # The tokenizer follows --revision inside vLLM; a flag here would pin a --tokenizer from extraArgs wrongly.
    assert "--tokenizer-revision" not in args
    assert "--revision" not in vllm_args(hub()) and "--code-revision" not in vllm_args(hub())


def test_tracing_sets_the_endpoint_flag_protocol_and_service_name() -> None:
    config = parse_config({"accelerator": "t4", "model": {"path": "org/llm", "servedName": "llm"},
                           "observability": {"otlpTracesEndpoint": "https://otel:4318/v1/traces",
                                             "otlpTracesProtocol": "http/protobuf"}})
    assert flag(vllm_args(config), "--otlp-traces-endpoint") == "https://otel:4318/v1/traces"
    assert vllm_env(config) == {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "llm"}
    assert engine_environment(config, {})["OTEL_SERVICE_NAME"] == "llm"
    assert "--otlp-traces-endpoint" not in vllm_args(hub())
    assert not any(k.startswith("OTEL_") for k in vllm_env(hub()))


@pytest.mark.parametrize(("setting", "expect", "absent"), [
    (True, "--enable-prefix-caching", "--no-enable-prefix-caching"),
    (False, "--no-enable-prefix-caching", "--enable-prefix-caching"),
])
def test_prefix_caching_set_in_the_spec_reaches_vllm(setting: bool, expect: str, absent: str) -> None:
    for accelerator in ("t4", "cpu"):
        args = vllm_args(make(accelerator, enablePrefixCaching=setting))
        assert expect in args and absent not in args


def test_prefix_caching_unset_leaves_it_to_vllm_and_to_extra_args() -> None:
    assert not any("prefix-caching" in a for a in vllm_args(make("t4")))
    # FlashModels from before the field may name the flag in extraArgs, and keep running.
    args = vllm_args(make("t4", extraArgs=["--no-enable-prefix-caching"]))
    assert args[0] == "--no-enable-prefix-caching" and args.count("--no-enable-prefix-caching") == 1


@pytest.mark.parametrize("extra", [["--enable-prefix-caching"], ["--no-enable-prefix-caching"], ["--enable-prefix"]])
def test_extra_args_cannot_contradict_a_prefix_caching_field(extra: list[str]) -> None:
    with pytest.raises(ProfileError, match=r"engine\.enablePrefixCaching is set and decides it"):
        vllm_args(make("t4", enablePrefixCaching=True, extraArgs=extra))
