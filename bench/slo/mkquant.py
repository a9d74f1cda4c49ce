#!/usr/bin/env python3
"""Write random-weight INT4 checkpoints (AWQ or GPTQ layout) of mkmodel's shapes, loadable by vLLM.

    python3 bench/slo/mkquant.py OUTDIR SHAPE METHOD [OUTDIR SHAPE METHOD ...]
    # SHAPE: tiny | 0.5b | 1.5b | 3b | 7b | qwen3-4b     METHOD: awq | gptq | fp16

The tokenizer and the Qwen2.5 shapes are bench/slo/mkmodel.py's. Only the decoder's linear layers
(q/k/v/o, gate/up/down) are quantized, group size 128; embeddings, norms, biases and lm_head stay
fp16, as in the AutoAWQ and AutoGPTQ checkpoints published for Qwen2.5:

- awq (AutoAWQ GEMM): `qweight` [in, out/8] and `qzeros` [in/128, out/8] int32, 8 nibbles packed
  along the output in AWQ's order (nibble i holds column AWQ_ORDER[i]), `scales` [in/128, out]
  fp16; w = (q - z) * s.
- gptq (AutoGPTQ, desc_act false, sym): `qweight` [in/8, out] int32 packed along the input rows in
  plain order, `qzeros` [in/128, out/8] holding z - 1 = 7 (AutoGPTQ's stored form), `scales`,
  `g_idx` [in] = row // 128; w = (q - 8) * s.
- fp16: the same tensors unquantized, for the fp16 side of a comparison at a shape mkmodel lacks.

qwen3-4b is Qwen3-4B's shape as a Qwen3ForCausalLM (q/k RMSNorm, no q/k/v bias): it does not fit
mkmodel's Qwen2 architecture, whose attention derives head_dim as hidden/heads (2560/32 = 80, and
Qwen3-4B's is 128; vllm/model_executor/models/qwen2.py:149 in vLLM 0.26).

The values are random but the dequantized weights are those of a sane model: every nibble uniform
over 0..15, zero points 7 or 8, scales around 0.0043 (+-25%), so each weight has the standard
deviation 0.02 of mkmodel's fp16 weights (Qwen's initializer_range) and a forward pass stays finite.
The checkpoint streams into one model.safetensors tensor by tensor, so a 7B build holds one tensor
(at most a 64 MiB chunk of it) in memory; random bits come from the GPU when there is one.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as `python3 bench/slo/mkquant.py`
    sys.path.insert(0, str(ROOT))
from bench.slo.mkmodel import SHAPES, make_readable, qwen2_config, write_tokenizer  # noqa: E402

Method = Literal["awq", "gptq", "fp16"]
METHODS: tuple[Method, ...] = ("awq", "gptq", "fp16")
QWEN3_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-4b": dict(
        hidden_size=2560,
        intermediate_size=9728,
        num_hidden_layers=36,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
}
ALL_SHAPES = (*SHAPES, *QWEN3_SHAPES)

BITS = 4
PACK = 32 // BITS  # nibbles per int32
GROUP_SIZE = 128
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's pack order: nibble i holds column AWQ_ORDER[i]
PLAIN_ORDER = tuple(range(PACK))
WEIGHT_STD = 0.02  # Qwen's initializer_range: what mkmodel's fp16 weights have
# E[(q - z)^2] for q uniform on 0..15 and z in {7, 8} (GPTQ: z = 8): 21.25 variance + 0.25 offset.
SCALE = WEIGHT_STD / math.sqrt(21.5)
INT8_STD = math.sqrt((256**2 - 1) / 12)  # a uniform int8's standard deviation
CHUNK = 16 * 2**20  # elements per generated piece: 64 MiB of int32 at most in memory

Fill = Literal["normal", "ones", "zeros", "bits", "scales", "awq_zeros", "gptq_zeros", "g_idx"]
SAFETENSORS_DTYPE = {torch.float16: "F16", torch.int32: "I32"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "vocab.json", "merges.txt")


def quantization_config(method: Method) -> dict[str, Any] | None:
    """The config.json `quantization_config` AutoAWQ / AutoGPTQ write (None: fp16)."""
    if method == "awq":
        return {
            "quant_method": "awq",
            "bits": BITS,
            "group_size": GROUP_SIZE,
            "zero_point": True,
            "version": "gemm",
            "modules_to_not_convert": None,
        }
    if method == "gptq":
        return {
            "quant_method": "gptq",
            "bits": BITS,
            "group_size": GROUP_SIZE,
            "desc_act": False,
            "sym": True,
            # "gptq" (v1): qzeros hold z - 1, as AutoGPTQ stores them; "gptq_v2" would hold z.
            "checkpoint_format": "gptq",
        }
    return None


def pack_int4(values: torch.Tensor, dim: int, order: Sequence[int] = PLAIN_ORDER) -> torch.Tensor:
    """Pack 4-bit values (0..15) into int32 along `dim`, 8 per word; nibble i holds element order[i]."""
    moved = values.movedim(dim, -1).to(torch.int64)
    if moved.shape[-1] % PACK:
        raise ValueError(f"pack_int4: dim {dim} has {moved.shape[-1]} values, not a multiple of {PACK}")
    if moved.numel() and (int(moved.min()) < 0 or int(moved.max()) > 15):
        raise ValueError("pack_int4: values must lie in 0..15")
    groups = moved.reshape(*moved.shape[:-1], -1, PACK)[..., list(order)]
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)
    words = (groups << shifts).sum(-1)
    words = torch.where(words >= 2**31, words - 2**32, words)  # the unsigned word as int32's bits
    return words.to(torch.int32).movedim(-1, dim)


def unpack_int4(packed: torch.Tensor, dim: int, order: Sequence[int] = PLAIN_ORDER) -> torch.Tensor:
    """The inverse of pack_int4: int32 words along `dim` back to 8 values each (int32, 0..15)."""
    words = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(0, 32, BITS, dtype=torch.int64)
    nibbles = (words.unsqueeze(-1) >> shifts) & 0xF  # [..., words, nibble position]
    inverse = [0] * PACK
    for position, element in enumerate(order):
        inverse[element] = position
    values = nibbles[..., inverse].reshape(*words.shape[:-1], -1)
    return values.to(torch.int32).movedim(-1, dim)


def dequantize_awq(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """AWQ GEMM tensors -> the weight as [in, out] float32 (y = x @ w)."""
    q = unpack_int4(qweight, 1, AWQ_ORDER)
    z = unpack_int4(qzeros, 1, AWQ_ORDER).repeat_interleave(GROUP_SIZE, 0)
    return (q - z).float() * scales.float().repeat_interleave(GROUP_SIZE, 0)


def dequantize_gptq(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """GPTQ (v1) tensors -> the weight as [in, out] float32 (y = x @ w)."""
    q = unpack_int4(qweight, 0)
    z = unpack_int4(qzeros, 1) + 1  # v1 stores z - 1
    groups = g_idx.long()
    return (q - z[groups]).float() * scales.float()[groups]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the checkpoint: its name, type, shape and how its values are made."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    fill: Fill

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * (2 if self.dtype == torch.float16 else 4)


def linear(name: str, n_in: int, n_out: int, method: Method) -> list[TensorSpec]:
    """The tensors of one nn.Linear(n_in, n_out) in `method`'s layout."""
    if method == "fp16":
        return [TensorSpec(f"{name}.weight", torch.float16, (n_out, n_in), "normal")]
    if n_in % GROUP_SIZE or n_out % PACK:
        raise ValueError(f"{name}: {n_in} -> {n_out} does not split into groups of {GROUP_SIZE} and words of {PACK}")
    groups = n_in // GROUP_SIZE
    scales = TensorSpec(f"{name}.scales", torch.float16, (groups, n_out), "scales")
    if method == "awq":
        return [
            TensorSpec(f"{name}.qweight", torch.int32, (n_in, n_out // PACK), "bits"),
            TensorSpec(f"{name}.qzeros", torch.int32, (groups, n_out // PACK), "awq_zeros"),
            scales,
        ]
    return [
        TensorSpec(f"{name}.qweight", torch.int32, (n_in // PACK, n_out), "bits"),
        TensorSpec(f"{name}.qzeros", torch.int32, (groups, n_out // PACK), "gptq_zeros"),
        scales,
        TensorSpec(f"{name}.g_idx", torch.int32, (n_in,), "g_idx"),
    ]


def model_config(shape: str) -> Any:
    """The transformers config of a shape: mkmodel's Qwen2 ones, or Qwen3 for qwen3-4b."""
    if shape in SHAPES:
        cfg = qwen2_config(shape)
        cfg.architectures = ["Qwen2ForCausalLM"]
        return cfg
    from transformers import Qwen3Config

    size = 151936
    cfg = Qwen3Config(
        vocab_size=size,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},  # Qwen3-4B's
        eos_token_id=size - 1,
        bos_token_id=size - 3,
        **QWEN3_SHAPES[shape],
    )
    cfg.architectures = ["Qwen3ForCausalLM"]
    return cfg


def checkpoint_tensors(cfg: Any, method: Method) -> list[TensorSpec]:
    """Every tensor of the checkpoint, in file order: embeddings, then layer by layer, then norm and lm_head."""
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    qwen3 = cfg.model_type == "qwen3"
    head_dim = cfg.head_dim if qwen3 else hidden // cfg.num_attention_heads
    q_out, kv_out = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    specs = [TensorSpec("model.embed_tokens.weight", torch.float16, (cfg.vocab_size, hidden), "normal")]
    for i in range(cfg.num_hidden_layers):
        layer = f"model.layers.{i}"
        attn = f"{layer}.self_attn"
        specs += [
            TensorSpec(f"{layer}.input_layernorm.weight", torch.float16, (hidden,), "ones"),
            TensorSpec(f"{layer}.post_attention_layernorm.weight", torch.float16, (hidden,), "ones"),
        ]
        for proj, n_out in (("q_proj", q_out), ("k_proj", kv_out), ("v_proj", kv_out)):
            specs += linear(f"{attn}.{proj}", hidden, n_out, method)
            if not qwen3:  # Qwen2's attention has q/k/v biases (fp16 in quantized checkpoints too)
                specs.append(TensorSpec(f"{attn}.{proj}.bias", torch.float16, (n_out,), "zeros"))
        if qwen3:
            specs += [
                TensorSpec(f"{attn}.q_norm.weight", torch.float16, (head_dim,), "ones"),
                TensorSpec(f"{attn}.k_norm.weight", torch.float16, (head_dim,), "ones"),
            ]
        specs += linear(f"{attn}.o_proj", q_out, hidden, method)
        specs += linear(f"{layer}.mlp.gate_proj", hidden, inter, method)
        specs += linear(f"{layer}.mlp.up_proj", hidden, inter, method)
        specs += linear(f"{layer}.mlp.down_proj", inter, hidden, method)
    specs.append(TensorSpec("model.norm.weight", torch.float16, (hidden,), "ones"))
    if not cfg.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", torch.float16, (cfg.vocab_size, hidden), "normal"))
    return specs


class RandomBits:
    """Seeded random int32 words: torch's generator on the GPU, numpy's SFC64 on the CPU (3x torch's there)."""

    def __init__(self, seed: int, device: str) -> None:
        self.device = device
        self._torch = torch.Generator(device=device).manual_seed(seed) if device != "cpu" else None
        self._numpy = np.random.Generator(np.random.SFC64(seed))

    def words(self, n: int) -> torch.Tensor:
        if self._torch is not None:
            return torch.randint(-(2**31), 2**31, (n,), dtype=torch.int32, device=self.device, generator=self._torch)
        return torch.from_numpy(self._numpy.integers(0, 2**32, size=n, dtype=np.uint32)).view(torch.int32)

    def int8(self, n: int) -> torch.Tensor:
        return self.words((n + 3) // 4).view(torch.int8)[:n]


def fill_values(spec: TensorSpec, bits: RandomBits) -> Iterator[torch.Tensor]:
    """The tensor's values, flat, in pieces of at most CHUNK elements (row-major order)."""
    if spec.fill in ("normal", "ones", "zeros", "bits"):
        # Element-wise independent fills: a piece needs nothing of its neighbours.
        for start in range(0, spec.numel, CHUNK):
            n = min(CHUNK, spec.numel - start)
            if spec.fill == "bits":  # any 32-bit word is 8 valid nibbles, each uniform on 0..15
                yield bits.words(n)
            elif spec.fill == "normal":  # uniform with the std of mkmodel's normal weights
                yield bits.int8(n).to(torch.float16).mul_(WEIGHT_STD / INT8_STD)
            else:
                yield torch.full((n,), 1.0 if spec.fill == "ones" else 0.0, dtype=torch.float16, device=bits.device)
        return
    if spec.fill == "scales":
        jitter = bits.int8(spec.numel).to(torch.float32) / 512  # +-25%
        yield ((1 + jitter) * SCALE).to(torch.float16)
    elif spec.fill == "awq_zeros":
        # Zero points 7 or 8 drawn per nibble, straight into packed words: 7 + a random bit never
        # carries into the next nibble, and iid nibbles need no reordering into AWQ's order.
        yield (bits.words(spec.numel) & 0x11111111) + 0x77777777
    elif spec.fill == "gptq_zeros":  # every nibble 7: the symmetric zero point 8, stored minus one
        yield torch.full((spec.numel,), 0x77777777, dtype=torch.int32)
    elif spec.fill == "g_idx":
        yield torch.arange(spec.numel, dtype=torch.int32) // GROUP_SIZE


def safetensors_header(specs: Sequence[TensorSpec]) -> bytes:
    """The length-prefixed JSON header, padded to 8 bytes as the format asks."""
    entries: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in specs:
        entries[s.name] = {
            "dtype": SAFETENSORS_DTYPE[s.dtype],
            "shape": list(s.shape),
            "data_offsets": [offset, offset + s.nbytes],
        }
        offset += s.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def write_checkpoint(path: Path, specs: Sequence[TensorSpec], bits: RandomBits) -> int:
    """Stream the tensors into one safetensors file; returns its weight bytes (the file less its header)."""
    total = 0
    with open(path, "wb") as f:
        f.write(safetensors_header(specs))
        for spec in specs:
            written = 0
            for piece in fill_values(spec, bits):
                array = piece.to(spec.dtype).cpu().numpy()
                f.write(array.data)
                written += array.nbytes
            if written != spec.nbytes:  # the header's offsets would point into the wrong tensor
                raise AssertionError(f"{spec.name}: wrote {written} bytes, the header says {spec.nbytes}")
            total += written
    return total


def build(out: str, shape: str, method: Method, seed: int = 0, tokenizer_from: str | None = None) -> str:
    """Write the checkpoint (config, tokenizer, model.safetensors) into `out`; returns the event line.

    tokenizer_from: a folder this process wrote the same vocabulary into, to copy instead of
    rebuilding it (6 s at Qwen's 151936 tokens).
    """
    started = time.monotonic()
    os.makedirs(out, exist_ok=True)
    cfg = model_config(shape)
    if tokenizer_from is None:
        write_tokenizer(out, cfg.vocab_size)
    else:
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(tokenizer_from, name)):
                shutil.copyfile(os.path.join(tokenizer_from, name), os.path.join(out, name))
    specs = checkpoint_tensors(cfg, method)
    config = cfg.to_dict()
    config["dtype"] = config["torch_dtype"] = "float16"  # transformers 5 reads dtype, 4.x torch_dtype
    if (qc := quantization_config(method)) is not None:
        config["quantization_config"] = qc
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    weight_bytes = write_checkpoint(Path(out) / "model.safetensors", specs, RandomBits(seed, device))
    make_readable(out)
    linear_bytes = sum(s.nbytes for s in specs if "_proj." in s.name and not s.name.endswith(".bias"))
    seconds = time.monotonic() - started
    return (
        f"event=quant_model_built shape={shape} method={method} weight_bytes={weight_bytes} "
        f"linear_bytes={linear_bytes} tensors={len(specs)} device={device} seconds={seconds:.1f} path={out}"
    )


if __name__ == "__main__":
    # Several checkpoints per call: importing torch and transformers is 10-15 s of each build.
    args = sys.argv[1:]
    triples = list(zip(args[::3], args[1::3], args[2::3], strict=True)) if args and len(args) % 3 == 0 else []
    if not triples or any(shape not in ALL_SHAPES or method not in METHODS for _, shape, method in triples):
        sys.exit(
            f"usage: mkquant.py OUTDIR {{{'|'.join(ALL_SHAPES)}}} {{{'|'.join(METHODS)}}} [OUTDIR SHAPE METHOD ...]"
        )
    written: dict[int, str] = {}  # vocabulary size -> the first folder holding its tokenizer
    for out, shape, method in triples:
        vocab = model_config(shape).vocab_size
        print(build(out, shape, cast(Method, method), tokenizer_from=written.get(vocab)), flush=True)
        written.setdefault(vocab, out)
