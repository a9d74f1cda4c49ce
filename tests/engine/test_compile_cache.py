"""The shared compile cache's folder: one per vLLM, torch, accelerator and command line."""

from __future__ import annotations

from pathlib import Path

import pytest
from flashmodel_engine.compile_cache import cache_env, cache_key
from flashmodel_engine.config import EngineConfig
from flashmodel_engine.engine_process import engine_command, engine_environment

ARGV = ["-m", "vllm.entrypoints.openai.api_server", "--model", "/models/qwen", "--block-size", "16"]


def test_the_key_changes_with_what_the_artifacts_were_built_for_and_only_with_that() -> None:
    key = cache_key("t4", ARGV, "0.26.0", "2.11.0")
    assert key == cache_key("t4", list(ARGV), "0.26.0", "2.11.0") and len(key) == 16
    others = {
        cache_key("t4", ARGV, "0.32.0", "2.11.0"),  # another vLLM
        cache_key("t4", ARGV, "0.26.0", "2.12.0"),  # another torch
        cache_key("cpu", ARGV, "0.26.0", "2.11.0"),  # another accelerator
        cache_key("t4", [*ARGV[:-1], "32"], "0.26.0", "2.11.0"),  # another enforced flag
        cache_key("t4", [*ARGV[:3], "/models/other", *ARGV[4:]], "0.26.0", "2.11.0"),  # another model
    }
    assert key not in others and len(others) == 5


def test_the_caches_go_under_the_keyed_folder() -> None:
    assert cache_env("/compile-cache", "abc") == {
        "VLLM_CACHE_ROOT": "/compile-cache/abc/vllm",
        "TORCHINDUCTOR_CACHE_DIR": "/compile-cache/abc/torchinductor",
        "TRITON_CACHE_DIR": "/compile-cache/abc/triton",
    }


@pytest.mark.parametrize("shared", [True, False])
def test_the_engine_environment_uses_the_claim_only_when_the_config_names_one(shared: bool, tmp_path: Path) -> None:
    raw = {"accelerator": "cpu", "model": {"path": "/models/tiny", "servedName": "tiny"},
           "engine": {"blockSize": 32, "dtype": "float32"}}
    if shared:
        raw["server"] = {"compileCacheDir": str(tmp_path)}
    config = EngineConfig.model_validate(raw)
    argv = engine_command(config, "/usr/bin/python3")
    base = {"VLLM_CACHE_ROOT": "/cache/vllm", "TRITON_CACHE_DIR": "/cache/triton"}
    env = engine_environment(config, base=base, argv=argv)
    if not shared:
        assert env["VLLM_CACHE_ROOT"] == "/cache/vllm" and env["TRITON_CACHE_DIR"] == "/cache/triton"
        return
    key = cache_key("cpu", argv[1:])
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / key / "vllm")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / key / "torchinductor")
    # The interpreter's path is not part of the key: another image's Python finds the same folder.
    assert engine_environment(config, base=base, argv=engine_command(config, "/opt/py/bin/python"))[
        "VLLM_CACHE_ROOT"] == env["VLLM_CACHE_ROOT"]
