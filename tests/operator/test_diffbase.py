"""LeanDiffBaseStorage builds the essence kopf's own storage builds, from less copying."""

from __future__ import annotations

import copy
from typing import Any, cast

import kopf
import pytest
from flashmodel_operator import GROUP
from flashmodel_operator.diffbase import HandledSpecs, LeanDiffBaseStorage, UnmarkedProgressStorage


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


def _flashmodel(**changes: Any) -> kopf.Body:
    raw = _bodies()[0]
    for path, value in changes.items():
        section, field = path.split("__")
        raw[section][field] = value
    return kopf.Body(cast(kopf.RawBody, raw))


def test_handled_specs_tell_kopf_what_changed_without_writing_to_the_object() -> None:
    specs = HandledSpecs(prefix=GROUP, key="last-handled-spec")
    body = _flashmodel()
    # Never handled (a new model, or any model after a restart): kopf's "create".
    assert specs.fetch(body=body) is None
    patch = kopf.Patch()
    specs.store(body=body, patch=patch, essence=specs.build(body=body))
    assert not patch, "the diff base must not be written to the object"
    # Handled and unchanged: the same essence, so kopf finds no diff.
    assert specs.fetch(body=body) == specs.build(body=body)
    # What the status, the resourceVersion or kopf's own annotation do is no change of the spec.
    churned = _flashmodel(status__replicas=0, metadata__resourceVersion="78")
    assert specs.fetch(body=churned) == specs.build(body=churned)
    # A spec, label or annotation change: an essence that differs, so kopf runs the update handler.
    for changed in (
        _flashmodel(spec__replicas=3),
        _flashmodel(metadata__labels={"team": "ads"}),
        _flashmodel(metadata__annotations={"serving.flashmodel.io/retry": "2"}),
    ):
        old = specs.fetch(body=changed)
        assert old is not None and old != specs.build(body=changed)


def test_handled_specs_forget_a_deleted_model() -> None:
    specs = HandledSpecs(prefix=GROUP, key="last-handled-spec")
    body = _flashmodel()
    specs.store(body=body, patch=kopf.Patch(), essence=specs.build(body=body))
    assert len(specs) == 1
    specs.forget("u1")
    assert len(specs) == 0 and specs.fetch(body=body) is None
    # A model of the same name made again has a uid of its own: it is new to kopf.
    specs.store(body=body, patch=kopf.Patch(), essence=specs.build(body=body))
    assert specs.fetch(body=_flashmodel(metadata__uid="u2")) is None


def test_a_handler_that_succeeds_at_once_leaves_kopf_nothing_to_patch() -> None:
    progress = UnmarkedProgressStorage(prefix=GROUP)
    body = _flashmodel()
    handler: Any = "on_flashmodel_change"  # a kopf HandlerId
    patch = kopf.Patch()
    # What kopf does in one cycle for a handler that succeeds on its first try: store, then purge.
    progress.store(key=handler, record=cast(Any, {"started": "t", "success": True}), body=body, patch=patch)
    assert patch["metadata"]["annotations"] == {f"{GROUP}/on_flashmodel_change": '{"started":"t","success":true}'}
    progress.purge(key=handler, body=body, patch=patch)
    assert not patch, f"kopf would PATCH the model with {dict(patch)}"
    # A failing handler's record stays in the patch, so kopf's retries keep their count.
    failing = kopf.Patch()
    progress.store(key=handler, record=cast(Any, {"started": "t", "retries": 1}), body=body, patch=failing)
    assert list(failing["metadata"]["annotations"]) == [f"{GROUP}/on_flashmodel_change"]
