"""The engine image is the cluster's: a FlashModel names another only where the cluster admin allows it."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from flashmodel_operator import engine_image
from flashmodel_operator.engine_image import DEFAULT_IMAGE, LEGACY_DEFAULT, EngineImagePolicy
from flashmodel_operator.model import FlashModel
from flashmodel_operator.render import pod_template_problems, render_pod_template

from tests.operator.specs import FULL_T4

CLUSTER = "registry.example.com/ml/flashmodel-engine:0.1.0"
ALLOWED = "registry.example.com/ml/flashmodel-engine:0.2.0-rc1"


@pytest.fixture
def policy() -> Iterator[EngineImagePolicy]:
    chosen = EngineImagePolicy.from_environ({
        "FLASHMODEL_ENGINE_IMAGE": CLUSTER,
        "FLASHMODEL_ALLOWED_ENGINE_IMAGES": f" {ALLOWED} ,",
        "FLASHMODEL_ENGINE_IMAGE_PULL_SECRETS": "regcred,mirror",
    })
    engine_image.use(chosen)
    yield chosen
    engine_image.use(EngineImagePolicy())


def _model(image: str | None = None, patch: dict[str, Any] | None = None) -> FlashModel:
    spec = {**FULL_T4["spec"], "engine": {k: v for k, v in FULL_T4["spec"]["engine"].items() if k != "image"}}
    if image is not None:
        spec["engine"]["image"] = image
    if patch is not None:
        spec["podTemplatePatch"] = patch
    return FlashModel.from_body({**FULL_T4, "spec": spec})


def _image(fm: FlashModel) -> str:
    engine = next(c for c in render_pod_template(fm)["spec"]["containers"] if c["name"] == "engine")
    image: str = engine["image"]
    return image


def test_the_environment_sets_the_clusters_image_the_allowed_ones_and_the_pull_secrets(
    policy: EngineImagePolicy,
) -> None:
    assert (policy.image, policy.allowed, policy.pull_secrets) == (CLUSTER, (ALLOWED,), ("regcred", "mirror"))
    assert EngineImagePolicy.from_environ({}) == EngineImagePolicy(DEFAULT_IMAGE, (), ())


@pytest.mark.usefixtures("policy")
def test_a_model_without_an_image_and_one_with_the_old_crd_default_run_the_clusters() -> None:
    for fm in (_model(), _model(LEGACY_DEFAULT)):
        assert _image(fm) == CLUSTER
        assert pod_template_problems(fm) == []
    pod = render_pod_template(_model())
    assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}, {"name": "mirror"}]


@pytest.mark.usefixtures("policy")
def test_an_allowed_image_runs_and_any_other_is_refused_with_what_to_do() -> None:
    assert _image(_model(ALLOWED)) == ALLOWED and pod_template_problems(_model(ALLOWED)) == []
    evil = _model("example.org/evil/vllm:latest")
    [problem] = pod_template_problems(evil)
    assert problem.startswith("spec.engine.image 'example.org/evil/vllm:latest' is not an engine image this cluster")
    assert CLUSTER in problem and ALLOWED in problem and "engineImage.allowed" in problem
    assert _image(evil) == CLUSTER  # whatever is refused, the rendered pod never carries it


@pytest.mark.usefixtures("policy")
@pytest.mark.parametrize("image", ["example.org/evil/vllm:latest", ALLOWED])
def test_a_pod_patch_cannot_change_the_engine_image(image: str) -> None:
    fm = _model(patch={"spec": {"containers": [{"name": "engine", "image": image}]}})
    assert any("changes the engine container's image" in p for p in pod_template_problems(fm))
    assert _image(fm) == CLUSTER
