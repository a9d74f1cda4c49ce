"""The engine's lora section: profile limits, vLLM's flags and environment, the LoRA buffers in the memory plan."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from flashmodel_engine.config import ConfigError, EngineConfig, parse_config
from flashmodel_engine.preflight import GIB, DeviceInfo, ModelShape, lora_buffer_bytes, plan_gpu_memory, run_preflight
from flashmodel_engine.profiles import ProfileError, resolve, vllm_args, vllm_env
from flashmodel_engine.vllm_options import TABLES

T4 = DeviceInfo(name="Tesla T4", compute_capability=(7, 5), total_memory_bytes=15 * 1024**3)
# Qwen2.5-1.5B: 28 layers, hidden 1536, 12 heads of 128, 2 KV heads, intermediate 8960.
QWEN_1_5B = ModelShape(layers=28, hidden=1536, intermediate=8960, kv_heads=2, head_dim=128, vocab=151936, heads=12)


def make(lora: dict[str, Any] | None, accelerator: str = "t4", **engine: Any) -> EngineConfig:
    data: dict[str, Any] = {"accelerator": accelerator, "model": {"path": "/models/qwen", "servedName": "qwen"},
                            "engine": engine}
    if lora is not None:
        data["lora"] = lora
    return parse_config(data)


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_without_a_lora_section_vllm_serves_no_adapters() -> None:
    config = make(None)
    assert "--enable-lora" not in vllm_args(config)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in vllm_env(config)


def test_the_lora_section_turns_on_lora_with_the_profiles_defaults() -> None:
    config = make({})
    args = vllm_args(config)
    assert "--enable-lora" in args
    limits = (flag(args, "--max-loras"), flag(args, "--max-lora-rank"), flag(args, "--max-cpu-loras"))
    assert limits == ("4", "16", "16")
    assert vllm_env(config)["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"


def test_the_lora_flags_exist_in_every_supported_vllm() -> None:
    for version, table in TABLES.items():
        for name in ("--enable-lora", "--max-loras", "--max-lora-rank", "--max-cpu-loras"):
            assert name in table, (version, name)


def test_limits_above_the_profile_are_refused_with_why() -> None:
    with pytest.raises(ProfileError) as e:
        resolve(make({"maxLoras": 16, "maxRank": 128}))
    text = str(e.value)
    assert "lora.maxLoras is 16; it must be <= 8 on t4" in text
    assert "lora.maxRank is 128; it must be <= 64 on t4" in text
    assert "provisional" in text


def test_a_rank_vllm_does_not_take_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"lora\.maxRank"):
        make({"maxRank": 12})


def test_fewer_cpu_loras_than_loras_is_refused() -> None:
    with pytest.raises(ProfileError, match=r"lora\.maxCpuLoras is 2, below lora\.maxLoras 4"):
        resolve(make({"maxLoras": 4, "maxCpuLoras": 2}))


def test_relative_adapter_roots_are_refused() -> None:
    with pytest.raises(ConfigError, match="absolute path"):
        make({"adapterRoots": ["adapters"]})


@pytest.mark.parametrize("extra", [["--enable-lora"], ["--max-loras", "8"], ["--max-lora-rank=64"],
                                   ["--max-cpu-loras", "99"], ["--no-enable-lora"], ["--lora-modules", "x=/tmp/x"],
                                   ["--lora-dtype", "float32"]])
def test_extra_args_cannot_set_the_lora_flags(extra: list[str]) -> None:
    with pytest.raises(ProfileError):
        resolve(make({}, extraArgs=extra))


def test_the_buffers_are_what_vllm_allocates_for_qwen2() -> None:
    # Per slot, layer and rank: qkv A 3x1536 + B (1536 + 2x256), o A 1536 + B 1536, gate_up A 2x1536 +
    # B 2x8960, down A 8960 + B 1536 elements (vllm/lora/layers create_lora_weights), in fp16.
    per_rank = 3 * 1536 + 2048 + 1536 + 1536 + 2 * 1536 + 2 * 8960 + 8960 + 1536
    assert lora_buffer_bytes(QWEN_1_5B, 1, 1, 2) == 28 * per_rank * 2
    assert lora_buffer_bytes(QWEN_1_5B, 8, 64, 2) == pytest.approx(1.10 * GIB, rel=0.01)


def test_the_memory_plan_takes_the_buffers_out_of_the_kv_cache() -> None:
    weights = int(2.9 * GIB)
    without = plan_gpu_memory(QWEN_1_5B, resolve(make(None)), weights, 15 * GIB, 2)
    with_lora = plan_gpu_memory(QWEN_1_5B, resolve(make({"maxLoras": 8, "maxRank": 64})), weights, 15 * GIB, 2)
    assert with_lora.lora_bytes == lora_buffer_bytes(QWEN_1_5B, 8, 64, 2)
    assert without.kv_free_bytes - with_lora.kv_free_bytes == with_lora.lora_bytes


def test_limits_the_card_cannot_hold_are_refused_with_numbers(tiny_model: Path, tmp_path: Path) -> None:
    """A wide model whose weights fit the T4 alone, but not with 8 rank-64 adapter slots beside them."""
    model = tmp_path / "wide"
    shutil.copytree(tiny_model, model)
    cfg = json.loads((model / "config.json").read_text())
    cfg.update(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
               num_key_value_heads=8)
    cfg.pop("layer_types", None)  # one per layer in transformers 5
    (model / "config.json").write_text(json.dumps(cfg))
    small = run_preflight(make({"maxLoras": 1, "maxRank": 8}, maxModelLen=1024, maxNumSeqs=8,
                               maxNumBatchedTokens=1024, enforceEager=True), model, device=T4, raise_nofile=False)
    assert small.ok, small.failures
    report = run_preflight(make({"maxLoras": 8, "maxRank": 64}, maxModelLen=1024, maxNumSeqs=8,
                                maxNumBatchedTokens=1024, enforceEager=True), model, device=T4, raise_nofile=False)
    text = " ".join(report.failures)
    wide = ModelShape(layers=80, hidden=8192, intermediate=28672, kv_heads=8, head_dim=128, vocab=512, heads=64)
    assert lora_buffer_bytes(wide, 8, 64, 2) / GIB == pytest.approx(12.34, abs=0.01)
    assert "+ LoRA buffers 12.34 GiB (maxLoras 8 x maxRank 64)" in text, text
    assert "lower lora.maxLoras to" in text and "lora.maxRank to" in text
