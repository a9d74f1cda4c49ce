"""Preflight against real model directories (the tiny model and broken copies of it); no vLLM started."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flashmodel_engine.config import EngineConfig, parse_config
from flashmodel_engine.contract import PREFLIGHT_EXIT_CODE
from flashmodel_engine.preflight import DeviceInfo, PreflightReport, graph_pool_bytes, run_preflight

from tests.engine.conftest import REPO

T4 = DeviceInfo(name="Tesla T4", compute_capability=(7, 5), total_memory_bytes=15 * 1024**3)


def config(accelerator: str = "cpu", path: str = "/models/x", **engine: Any) -> EngineConfig:
    return parse_config({"accelerator": accelerator, "model": {"path": path, "servedName": "m"},
                         "engine": engine, "prewarm": {"maxTokens": 16}})


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model, dst)
    return dst


def edit_config(model_dir: Path, **changes: Any) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg.update(changes)
    (model_dir / "config.json").write_text(json.dumps(cfg))


def failures(report: PreflightReport) -> str:
    return "\n".join(report.failures)


def test_tiny_model_passes_and_reports_the_prompt_budget(tiny_model: Path) -> None:
    report = run_preflight(config(path=str(tiny_model)))
    assert report.ok, report.failures
    # The chat template of an empty user turn costs tokens; the budget is what is left.
    assert report.template_overhead_tokens is not None and report.template_overhead_tokens > 3
    assert report.safe_prompt_tokens == 4096 - report.template_overhead_tokens - 16
    assert report.kv_bytes_per_token == 2 * 2 * 2 * 32 * 4  # k+v, 2 layers, 2 kv heads, head 32, fp32
    assert report.open_files_soft_limit is not None


def test_tiny_model_passes_on_a_t4(tiny_model: Path) -> None:
    report = run_preflight(config("t4", path=str(tiny_model)), device=T4)
    assert report.ok, report.failures
    assert report.max_full_length_sequences is not None and report.max_full_length_sequences > 256


def test_t4_without_a_gpu_says_so(tiny_model: Path) -> None:
    report = run_preflight(config("t4", path=str(tiny_model)))
    assert "no NVIDIA GPU visible through NVML; the t4 profile needs one" in failures(report)


def test_profile_conflicts_are_preflight_failures(tiny_model: Path) -> None:
    report = run_preflight(config("t4", path=str(tiny_model), dtype="bfloat16"), device=T4)
    assert "engine.dtype is bfloat16" in failures(report)


def test_bf16_on_an_older_card_is_refused(tiny_model: Path) -> None:
    v100 = DeviceInfo(name="Tesla V100", compute_capability=(7, 0), total_memory_bytes=16 * 1024**3)
    report = run_preflight(config("t4", path=str(tiny_model)), device=v100)
    assert "below the t4 profile's sm_75" in failures(report)


def test_missing_files(model_copy: Path) -> None:
    (model_copy / "config.json").unlink()
    (model_copy / "tokenizer.json").unlink()
    (model_copy / "model.safetensors").unlink()
    text = failures(run_preflight(config(path=str(model_copy))))
    assert f"{model_copy}/config.json is missing" in text
    assert f"no tokenizer in {model_copy}" in text
    assert "no weight files (*.safetensors, *.bin)" in text
    assert "does not exist" in failures(run_preflight(config(path=str(model_copy / "nope"))))


def test_head_size_not_a_multiple_of_16_on_t4(model_copy: Path) -> None:
    edit_config(model_copy, head_dim=40)
    text = failures(run_preflight(config("t4", path=str(model_copy)), device=T4))
    assert "head size 40 is not a multiple of 16, which the t4 attention kernel needs" in text
    assert run_preflight(config("cpu", path=str(model_copy))).ok  # the CPU kernel takes 40


def test_head_size_below_32_on_cpu(model_copy: Path) -> None:
    edit_config(model_copy, head_dim=16)
    assert "head size 16 is below 32" in failures(run_preflight(config(path=str(model_copy))))


def test_max_position_embeddings_too_small(model_copy: Path) -> None:
    edit_config(model_copy, max_position_embeddings=2048)
    text = failures(run_preflight(config(path=str(model_copy))))
    assert "engine.maxModelLen is 4096 but the model's max_position_embeddings is 2048; set maxModelLen <= 2048" \
        in text
    assert run_preflight(config(path=str(model_copy), maxModelLen=2048)).ok


def test_tokenizer_larger_than_the_embedding(model_copy: Path) -> None:
    edit_config(model_copy, vocab_size=100)
    assert "ids past the embedding crash the engine" in failures(run_preflight(config(path=str(model_copy))))


@pytest.fixture
def world_dir(tiny_model: Path) -> Iterator[Path]:
    # Outside pytest's 0700 tmp dirs, so another uid can reach it.
    d = Path(tempfile.mkdtemp(prefix="fm-preflight-", dir="/tmp"))
    d.chmod(0o755)
    shutil.copytree(tiny_model, d / "model")
    (d / "model").chmod(0o755)
    yield d / "model"
    shutil.rmtree(d)


@pytest.mark.skipif(os.getuid() != 0, reason="switching to another uid needs root")
def test_unreadable_weights_as_the_pod_user(world_dir: Path) -> None:
    (world_dir / "model.safetensors").chmod(0o600)  # readable by root only
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child becomes uid 65534, as an engine pod with runAsUser would be
        try:
            os.close(read_fd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            report = run_preflight(config(path=str(world_dir)), raise_nofile=False)
            os.write(write_fd, json.dumps(report.failures).encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        got = json.loads(f.read() or "[]")
    os.waitpid(pid, 0)
    assert any(f"model file {world_dir}/model.safetensors is not readable by uid=65534 (mode -rw-------"
               in line and "chmod a+r" in line for line in got), got
    # As root the same file reads, but preflight warns: root-only model files slow start-up.
    report = run_preflight(config(path=str(world_dir)))
    assert report.ok
    assert any("root-only-readable" in n and "model.safetensors" in n for n in report.notes)


def test_missing_api_key_file(tiny_model: Path, tmp_path: Path) -> None:
    cfg = parse_config({"accelerator": "cpu", "model": {"path": str(tiny_model), "servedName": "m"},
                        "auth": {"apiKeyFile": str(tmp_path / "nope")}})
    assert f"auth.apiKeyFile {tmp_path / 'nope'} cannot be read (No such file or directory)" in failures(
        run_preflight(cfg))


def _low_nofile() -> None:
    # The common container default that breaks at ~50 concurrent connections.
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=f"{REPO / 'engine'}:{REPO}",
               FLASHMODEL_TERMINATION_LOG=str(tmp_path / "termination-log"))
    return subprocess.run([sys.executable, "-m", "flashmodel_engine", *args], capture_output=True, text=True,
                          env=env, timeout=120, preexec_fn=_low_nofile)


def test_preflight_cli_and_termination_message(model_copy: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("accelerator: cpu\nmodel: {path: /elsewhere, servedName: m}\n")
    ok = _cli(["preflight", "--config", str(cfg), "--model-dir", str(model_copy)], tmp_path)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "event=preflight-done ok=true" in ok.stdout
    assert "safe_prompt_tokens=" in ok.stdout
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard > 1024:
        assert f"open_files_soft_limit={hard} raised_from=1024" in ok.stdout
    edit_config(model_copy, max_position_embeddings=1024)
    bad = _cli(["preflight", "--config", str(cfg), "--model-dir", str(model_copy)], tmp_path)
    assert bad.returncode == 1
    assert "event=preflight-failure" in bad.stdout
    assert "max_position_embeddings is 1024" in (tmp_path / "termination-log").read_text()


# The launcher checks the installed vLLM before anything else, so these need the engine venv.
@pytest.mark.usefixtures("engine_packages")
def test_launch_refuses_a_bad_config_before_starting_vllm(tmp_path: Path) -> None:
    cfg = tmp_path / "engine.yaml"
    cfg.write_text("accelerator: t4\nmodel: {path: /m, servedName: m}\nengine: {blockSize: 32}\n")
    r = _cli(["launch", "--config", str(cfg)], tmp_path)
    assert r.returncode == PREFLIGHT_EXIT_CODE  # what the operator's hold reads
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith("preflight failed: engine.blockSize is 32; it must be 16 on t4")
    assert "vllm.entrypoints" not in r.stderr  # vLLM was never started
    cfg.write_text("accelerator: t4\nmodel: {path: /m, servedName: m}\nengine: {blockSize: sixteen}\n")
    r = _cli(["launch", "--config", str(cfg)], tmp_path)
    assert r.returncode == PREFLIGHT_EXIT_CODE  # what the operator's hold reads
    assert "engine.blockSize: Input should be a valid integer" in (tmp_path / "termination-log").read_text()


# The spellings issue 15 saw get past the launcher, each with the flag vLLM's parser reads it as.
LAUNCH_BYPASSES = [
    (["--max-model", "2048"], "--max-model-len"),
    (["--gpu-memory-util=0.99"], "--gpu-memory-utilization"),
    (["--dtyp", "bfloat16"], "--dtype"),
    (["--no-enforce"], "--enforce-eager"),
    (["--kv-cache-memory-bytes", "8g"], "--kv-cache-memory-bytes"),
]


# The launcher checks the installed vLLM before anything else, so these need the engine venv.
@pytest.mark.usefixtures("engine_packages")
@pytest.mark.parametrize(("extra", "flag"), LAUNCH_BYPASSES, ids=[" ".join(b[0]) for b in LAUNCH_BYPASSES])
def test_launch_refuses_an_abbreviated_enforced_flag_before_starting_vllm(
    tmp_path: Path, extra: list[str], flag: str
) -> None:
    # The pod's engine.yaml as the operator writes it, had the API server let such extraArgs through.
    cfg = tmp_path / "engine.yaml"
    cfg.write_text(json.dumps({"accelerator": "t4", "model": {"path": "/m", "servedName": "m"},
                               "engine": {"extraArgs": extra}}))
    r = _cli(["launch", "--config", str(cfg)], tmp_path)
    assert r.returncode == PREFLIGHT_EXIT_CODE, r.stdout + r.stderr
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith("preflight failed: ") and flag in message, message
    assert "vllm.entrypoints" not in r.stderr  # vLLM was never started


def test_the_memory_plan_counts_the_cuda_graph_pool(tiny_model: Path) -> None:
    graphs = run_preflight(config("t4", path=str(tiny_model)), device=T4)
    eager = run_preflight(config("t4", path=str(tiny_model), enforceEager=True), device=T4)
    assert graphs.graph_pool_bytes and eager.graph_pool_bytes == 0
    # The pool comes out of the KV cache's share: fewer full-length sequences fit.
    assert graphs.max_full_length_sequences is not None and eager.max_full_length_sequences is not None
    assert graphs.max_full_length_sequences < eager.max_full_length_sequences


def test_the_graph_pool_estimate_reproduces_its_measurements() -> None:
    gib = 1024**3
    # 1.5B shape: 0.28 GiB captured up to 256 tokens, 1.21 GiB more up to 4096 (vLLM 0.26).
    assert graph_pool_bytes(1536, 8960, 256) == int(0.28 * gib)
    assert abs(graph_pool_bytes(1536, 8960, 4096) - 1.49 * gib) < 0.01 * gib
    assert graph_pool_bytes(1536, 8960, 64) == int(0.28 * gib) // 4
    # The 3B width (2048 + 11008) at 4096: 1.72 GiB measured; the estimate may not fall below it.
    assert 1.72 * gib <= graph_pool_bytes(2048, 11008, 4096) < 1.95 * gib

