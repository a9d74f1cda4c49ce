"""Where vLLM, Inductor and Triton keep what they compile when the pods of a model share a claim for it.

A new pod that finds the caches an earlier pod wrote skips torch.compile and Inductor's and Triton's
kernel builds (docs/benchmarks/coldstart.md: 108 -> 66 s to /health at capture 4096 on an H100).
vLLM keys its own torch.compile entries by a hash of its config and Inductor and Triton key theirs
by content, but a shared claim outlives image upgrades and spec changes, and an entry built by
another vLLM or torch, or for another model or profile, is one whose validity rests on those keys
alone. So each (vLLM, torch, accelerator, vLLM command line) gets a folder of its own: a changed
version, model, revision, quantization or enforced flag starts a new folder (cold once), never
reuses an old one. Old folders are left for the claim's owner to prune.
"""

from __future__ import annotations

import hashlib
import json
from importlib import metadata
from pathlib import Path

VLLM_DIR, INDUCTOR_DIR, TRITON_DIR = "vllm", "torchinductor", "triton"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "absent"


def cache_key(
    accelerator: str, argv: list[str], vllm_version: str | None = None, torch_version: str | None = None
) -> str:
    """16 hex digits naming the folder for this engine's compiled artifacts."""
    parts = [vllm_version or _version("vllm"), torch_version or _version("torch"), accelerator, argv]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]


def cache_env(root: str, key: str) -> dict[str, str]:
    """The variables that send vLLM's, Inductor's and Triton's caches into the keyed folder under `root`."""
    folder = Path(root) / key
    return {
        "VLLM_CACHE_ROOT": str(folder / VLLM_DIR),
        "TORCHINDUCTOR_CACHE_DIR": str(folder / INDUCTOR_DIR),
        "TRITON_CACHE_DIR": str(folder / TRITON_DIR),
    }
