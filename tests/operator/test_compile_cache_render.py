"""spec.compileCache: the claim in the pod, the folder in the engine config, and nothing for models without one."""

from __future__ import annotations

from flashmodel_operator.model import FlashModel
from flashmodel_operator.render import (
    COMPILE_CACHE_DIR,
    CONFIG_HASH_ANNOTATION,
    engine_config,
    render_pod,
    render_pod_template,
)

from tests.operator.specs import MINIMAL_T4, body

SHARED = body("qwen-small", {**MINIMAL_T4["spec"], "compileCache": {"pvc": {"claimName": "compile-cache"}}})


def test_the_claim_is_mounted_and_the_engine_config_names_it() -> None:
    fm = FlashModel.from_body(SHARED)
    pod, problems = render_pod(fm)
    assert problems == []
    spec = pod["spec"]
    assert {"name": "compile-cache", "persistentVolumeClaim": {"claimName": "compile-cache"}} in spec["volumes"]
    engine = spec["containers"][0]
    assert {"name": "compile-cache", "mountPath": COMPILE_CACHE_DIR} in engine["volumeMounts"]
    assert engine_config(fm)["server"]["compileCacheDir"] == COMPILE_CACHE_DIR


def test_a_model_without_one_keeps_its_config_hash() -> None:
    plain = FlashModel.from_body(MINIMAL_T4)
    assert "compileCacheDir" not in engine_config(plain)["server"]
    shared_hash = render_pod_template(FlashModel.from_body(SHARED))["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    plain_hash = render_pod_template(plain)["metadata"]["annotations"][CONFIG_HASH_ANNOTATION]
    assert shared_hash != plain_hash
    # The golden pods (tests/data/render) pin the plain model's whole template, hash included.
