"""Builds a tiny random LoRA adapter (PEFT layout) for the tiny Qwen2 model of tests/support/tiny_model.py.

An adapter is a folder with `adapter_config.json` and `adapter_model.safetensors` holding, per decoder
layer and target module, `lora_A` ([rank, in]) and `lora_B` ([out, rank]) as PEFT saves them. The
weights are random but large enough that an adapter's answers differ from the base model's.
"""

from __future__ import annotations

import json
import random
import struct
from collections.abc import Sequence
from pathlib import Path

# The tiny model's shapes (tests/support/tiny_model.py): hidden 128, 4 heads of 32, 2 KV heads,
# intermediate 256, 2 layers.
TINY_LAYERS = 2
TINY_DIMS: dict[str, tuple[int, int]] = {
    "q_proj": (128, 128),
    "k_proj": (128, 64),
    "v_proj": (128, 64),
    "o_proj": (128, 128),
    "gate_proj": (128, 256),
    "up_proj": (128, 256),
    "down_proj": (256, 128),
}
"""Module -> (in features, out features)."""
_ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj"}


def build_tiny_adapter(out: Path, *, rank: int = 8, target_modules: Sequence[str] = ("q_proj", "v_proj"),
                       seed: int = 1, layers: int = TINY_LAYERS,
                       dims: dict[str, tuple[int, int]] | None = None) -> Path:
    """Write an adapter into `out` (created) and return it; `dims` overrides TINY_DIMS (a mismatched adapter).

    Plain Python, no torch: the unit tier (and the operator's tests) build adapters too.
    """
    shapes = {**TINY_DIMS, **(dims or {})}
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, list[int]] = {}
    for layer in range(layers):
        for module in target_modules:
            fan_in, fan_out = shapes[module]
            block = "self_attn" if module in _ATTENTION else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = [rank, fan_in]
            tensors[f"{prefix}.lora_B.weight"] = [fan_out, rank]
    write_safetensors(out / "adapter_model.safetensors", tensors, seed)
    config = {
        "base_model_name_or_path": "tiny", "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "r": rank, "lora_alpha": 2 * rank, "lora_dropout": 0.0, "bias": "none",
        "target_modules": list(target_modules), "fan_in_fan_out": False, "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2))
    for f in out.iterdir():
        f.chmod(0o644)
    out.chmod(0o755)
    return out


def write_safetensors(path: Path, shapes: dict[str, list[int]], seed: int = 1) -> None:
    """A safetensors file of float16 tensors with standard-normal values, in the layout's own format.

    The header is JSON (name -> dtype, shape, byte offsets) after its little-endian u64 length.
    """
    rng = random.Random(seed)
    header: dict[str, object] = {}
    blobs: list[bytes] = []
    offset = 0
    for name, shape in shapes.items():
        count = shape[0] * shape[1]
        blob = struct.pack(f"<{count}e", *(rng.gauss(0.0, 1.0) for _ in range(count)))
        header[name] = {"dtype": "F16", "shape": shape, "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))


def corrupt_adapter(out: Path) -> Path:
    """An adapter whose config is fine but whose weights file is cut short: vLLM cannot load it."""
    build_tiny_adapter(out, seed=99)
    weights = out / "adapter_model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 3])
    return out


if __name__ == "__main__":
    import sys

    print(build_tiny_adapter(Path(sys.argv[1])))
