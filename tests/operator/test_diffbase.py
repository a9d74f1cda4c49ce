"""LeanDiffBaseStorage builds the essence kopf's own storage builds, from less copying."""

from __future__ import annotations

import copy
from typing import Any, cast

import kopf
import pytest
from flashmodel_operator import GROUP
from flashmodel_operator.diffbase import LeanDiffBaseStorage


def _bodies() -> list[dict[str, Any]]:
    flashmodel = {
        "apiVersion": f"{GROUP}/v1alpha1",
        "kind": "FlashModel",
        "metadata": {
            "name": "qwen",
            "namespace": "ns",
            "uid": "u1",
            "generation": 3,
            "resourceVersion": "77",
            "labels": {"team": "search"},
            "annotations": {
                "kubectl.kubernetes.io/last-applied-configuration": "{...}",
                f"{GROUP}/last-handled-spec": '{"spec": {"replicas": 1}}',
                "kopf.zalando.org/touch-dummy": "x",
                "owner": "search-team",
            },
            "managedFields": [{"manager": "kubectl", "fieldsV1": {"f:spec": {}}}],
        },
        "spec": {"model": {"hub": {"repo": "Qwen/Qwen2.5-1.5B"}}, "replicas": 2},
        "status": {"replicas": 2, "conditions": [{"type": "Ready", "status": "True"}], "pods": [{"name": "p"}]},
    }
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": "qwen-abc",
            "namespace": "ns",
            "labels": {f"{GROUP}/model": "qwen"},
            "ownerReferences": [{"kind": "ReplicaSet", "name": "qwen-5f", "uid": "r1"}],
            "managedFields": [{"manager": "kubelet"}],
        },
        "spec": {"containers": [{"name": "engine", "image": "vllm"}]},
        "status": {"phase": "Running", "podIP": "10.0.0.5"},
    }
    replica_set = {
        "apiVersion": "apps/v1",
        "kind": "ReplicaSet",
        "metadata": {
            "name": "qwen-5f",
            "ownerReferences": [{"kind": "Deployment", "name": "qwen", "uid": "d1"}],
            "annotations": {f"{GROUP}/last-handled-spec-ofDRS": "{}", "deployment.kubernetes.io/revision": "2"},
        },
        "spec": {"replicas": 1},
    }
    bare = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "c"}, "data": {"k": "v"}}
    return [flashmodel, pod, replica_set, bare]


@pytest.mark.parametrize("raw", _bodies(), ids=lambda b: b["kind"])
def test_the_essence_is_kopfs_and_the_body_is_untouched(raw: dict[str, Any]) -> None:
    kopfs = kopf.AnnotationsDiffBaseStorage(prefix=GROUP, key="last-handled-spec")
    lean = LeanDiffBaseStorage(prefix=GROUP, key="last-handled-spec")
    before = copy.deepcopy(raw)
    assert lean.build(body=kopf.Body(cast(kopf.RawBody, raw))) == kopfs.build(body=kopf.Body(cast(kopf.RawBody, raw)))
    with_fields = [("status", "replicas")]
    assert lean.build(body=kopf.Body(cast(kopf.RawBody, raw)), extra_fields=with_fields) == kopfs.build(
        body=kopf.Body(cast(kopf.RawBody, raw)), extra_fields=with_fields
    )
    assert raw == before


def test_the_essence_is_a_copy() -> None:
    raw = _bodies()[0]
    essence = LeanDiffBaseStorage(prefix=GROUP, key="last-handled-spec").build(body=kopf.Body(cast(kopf.RawBody, raw)))
    essence["spec"]["replicas"] = 9
    essence["metadata"]["labels"]["team"] = "other"
    assert raw["spec"]["replicas"] == 2 and raw["metadata"]["labels"]["team"] == "search"
