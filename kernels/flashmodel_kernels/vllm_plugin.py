"""vLLM general plugin: puts tile attention into vLLM's attention backend registry, CUSTOM slot.

vLLM calls ``register`` in every process it starts (entry point group ``vllm.general_plugins``,
declared in pyproject.toml). Registering only names a class path; vLLM imports the backend
(``flashmodel_kernels.vllm_backend``) when a model asks for ``--attention-backend CUSTOM``.
"""

from __future__ import annotations

import logging

__all__ = ["BACKEND_CLASS_PATH", "SUPPORTED_VLLM", "register", "vllm_is_supported"]

BACKEND_CLASS_PATH = "flashmodel_kernels.vllm_backend.TileAttentionBackend"

SUPPORTED_VLLM = ((0, 26),)
"""vLLM minor releases whose attention-backend interface and KV-cache layout the backend was
written and tested against. The interface moves between minors (the KV layout did in 0.26)."""

# Under the "vllm." namespace so the line lands in vLLM's own log, formatted like its lines.
logger = logging.getLogger("vllm.plugins.flashmodel_tile_attention")


def vllm_is_supported(version: str) -> bool:
    """True for a vLLM version string whose (major, minor) is in ``SUPPORTED_VLLM``."""
    parts = version.split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return major_minor in SUPPORTED_VLLM


def register() -> None:
    """Register the backend as AttentionBackendEnum.CUSTOM, or log why not and leave vLLM as is.

    Never raises: vLLM loads every installed plugin, and one that throws would break engines that
    never asked for tile attention. An engine that asks for CUSTOM on an unsupported vLLM fails
    at start with vLLM's own "must be registered before use" error after the warning below.
    """
    import vllm

    version = str(getattr(vllm, "__version__", "unknown"))
    if not vllm_is_supported(version):
        logger.warning(
            "flashmodel tile attention not registered: vllm=%s supported=%s",
            version,
            ",".join(f"{a}.{b}.x" for a, b in SUPPORTED_VLLM),
        )
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, BACKEND_CLASS_PATH)
    logger.info("flashmodel tile attention registered: slot=CUSTOM class=%s vllm=%s", BACKEND_CLASS_PATH, version)
