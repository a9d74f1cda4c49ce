"""FlashModel bodies the operator tests share, as the API server would hand them over."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from e2e.harness.cluster import ControlPlane

UID = "6f1c2d3e-0000-4000-8000-000000000001"


def body(name: str, spec: dict[str, Any], namespace: str = "serving", generation: int = 1) -> dict[str, Any]:
    return {
        "apiVersion": "serving.flashmodel.io/v1alpha1",
        "kind": "FlashModel",
        "metadata": {"name": name, "namespace": namespace, "uid": UID, "generation": generation},
        "spec": spec,
    }


MINIMAL_T4 = body("qwen-small", {"model": {"pvc": {"claimName": "models", "path": "qwen2.5-1.5b"}}})

FULL_T4 = body(
    "qwen-prod",
    {
        "model": {
            "image": {"reference": "registry.example/models/qwen2.5-7b-awq:1", "path": "/weights"},
            "servedName": "qwen",
            # A 7B fits a T4 only as INT4 (docs/quantization.md).
            "quantization": "awq",
        },
        "accelerator": "t4",
        "replicas": 2,
        "engine": {
            "maxModelLen": 2048,
            "maxNumSeqs": 128,
            "maxNumBatchedTokens": 2048,
            "extraArgs": ["--enable-prefix-caching"],
        },
        "prewarm": {"requests": 8, "prompts": ["检查工单：阀门泄漏，请给出处理建议。"]},
        "autoscaling": {"minReplicas": 2, "maxReplicas": 6, "targetRequestsPerSecond": 8, "targetKVCacheUsage": 0.8},
        "auth": {"apiKeySecretRef": {"name": "qwen-keys", "key": "api-key"}},
        "resources": {"requests": {"cpu": "4", "memory": "24Gi"}, "limits": {"memory": "24Gi"}},
        "nodeSelector": {"cloud.example/pool": "t4-spot"},
        "tolerations": [{"key": "spot", "operator": "Exists", "effect": "NoSchedule"}],
        "podTemplatePatch": {
            "metadata": {"annotations": {"prometheus.io/scrape": "true"}},
            "spec": {
                "containers": [{"name": "engine", "env": [{"name": "EXTRA", "value": "1"}]}],
            },
        },
    },
)

CPU_HUB = body(
    "tiny-cpu",
    {
        "model": {"hub": {"id": "/opt/models/tiny-qwen2"}, "servedName": "tiny"},
        "accelerator": "cpu",
        "engine": {
            "blockSize": 32,
            "dtype": "float32",
            "maxModelLen": 1024,
            "maxNumBatchedTokens": 1024,
            "maxNumSeqs": 16,
            "attentionBackend": "auto",
        },
    },
)

# A gated hub model pinned to a commit, its token from a Secret, its downloads on a shared claim, traced.
GATED_HUB_T4 = body(
    "llama-gated",
    {
        "model": {
            "hub": {
                "id": "meta-llama/Llama-3.2-1B-Instruct",
                "revision": "9213176726f574b556790deb65791e0c5aa438b6",
                "tokenSecretRef": {"name": "hf-token", "key": "token"},
                "cache": {"pvc": {"claimName": "hf-cache"}},
            },
            "servedName": "llama",
        },
        "observability": {"otlpTracesEndpoint": "http://otel-collector.monitoring:4317"},
    },
)

ALL = {"minimal-t4": MINIMAL_T4, "full-t4": FULL_T4, "cpu-hub": CPU_HUB, "gated-hub-t4": GATED_HUB_T4}


def apply_model(cp: ControlPlane, namespace: str, name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """kubectl-apply a FlashModel with `spec` to the real API server; the stored object, status included."""
    doc = {"apiVersion": "serving.flashmodel.io/v1alpha1", "kind": "FlashModel",
           "metadata": {"name": name, "namespace": namespace}, "spec": spec}
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    return get_model(cp, namespace, name)


def get_model(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(cp.kubectl("get", "flashmodel", name, "-n", namespace, "-o", "json").stdout)
    return found
