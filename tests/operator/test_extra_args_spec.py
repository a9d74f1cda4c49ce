"""The operator's side of the extraArgs allow-list, trusted remote code and model paths (pure, no cluster)."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
from flashmodel_operator import extra_args_policy
from flashmodel_operator.conditions import Problem
from flashmodel_operator.model import FlashModel
from flashmodel_operator.reconcile import _parse, engine_args
from flashmodel_operator.render import engine_config, model_path, render_pod_template
from pydantic import ValidationError

from tests.operator.specs import ALL, GATED_HUB_T4, MINIMAL_T4, body

COMMIT = "9213176726f574b556790deb65791e0c5aa438b6"
DIGEST = "sha256:" + "ab" * 32


@pytest.fixture
def extension() -> Iterator[None]:
    extra_args_policy.use(("--generation-config", "--model-impl"))
    yield
    extra_args_policy.use(())


def _with(base: dict[str, Any], **model: Any) -> dict[str, Any]:
    out = copy.deepcopy(base)
    out["spec"]["model"].update(model)
    return out


def _args(extra: list[str]) -> dict[str, Any]:
    out = copy.deepcopy(MINIMAL_T4)
    out["spec"]["engine"] = {"extraArgs": extra}
    return out


def test_a_flag_off_the_allow_list_stops_the_pass_with_what_to_do() -> None:
    problem = _parse(_args(["--seed", "1", "--generation-config", "vllm"]))
    assert isinstance(problem, Problem) and problem.reason == "EngineConfigRefused"
    assert "engine.extraArgs[2] '--generation-config': --generation-config is not on the allow-list" in problem.message
    assert "ask the cluster admin to add it to the chart's engineExtraArgs.allowed" in problem.message


@pytest.mark.parametrize(("extra", "expect"), [
    (["--load-format", "dummy"], "changes the model's source with --load-format"),
    (["--load-f", "dummy"], "(vLLM reads --load-f as --load-format)"),
    (["--trust-remote-code"], "set spec.model.trustRemoteCode instead"),
    (["--tokenizer", "org/x"], "the tokenizer comes from the model's own source"),
])
def test_the_admins_extension_never_opens_a_source_flag(extension: None, extra: list[str], expect: str) -> None:
    problem = _parse(_args(extra))
    assert isinstance(problem, Problem) and problem.reason == "EngineConfigRefused" and expect in problem.message


def test_the_admins_extension_is_accepted_and_reaches_the_engine(extension: None) -> None:
    fm = FlashModel.from_body(_args(["--generation-config=vllm", "--seed", "1"]))
    config = engine_config(fm)
    # Only the entries this model uses: a change to the cluster's list rolls no other model.
    assert config["engine"]["extraArgsAllowed"] == ["--generation-config"]
    assert engine_args(config)[:3] == ["--generation-config=vllm", "--seed", "1"]
    assert "extraArgsAllowed" not in engine_config(FlashModel.from_body(_args(["--seed", "1"])))["engine"]


@pytest.mark.parametrize("case", sorted(ALL))
def test_an_extension_a_model_does_not_use_rolls_none_of_its_pods(case: str) -> None:
    fm = FlashModel.from_body(ALL[case])
    before = render_pod_template(fm)
    extra_args_policy.use(("--generation-config",))
    try:
        assert render_pod_template(fm) == before
    finally:
        extra_args_policy.use(())


@pytest.mark.parametrize("value", ["--load-format", "--generation-config,--trust-remote-code", "--max-model-len",
                                   "--seed=1", "--no-such-flag"])
def test_the_operator_does_not_start_with_an_extension_it_cannot_allow(value: str) -> None:
    with pytest.raises(ValueError, match="FLASHMODEL_EXTRA_ARGS_ALLOWED"):
        extra_args_policy.from_environ({extra_args_policy.ENV: value})
    assert extra_args_policy.from_environ({extra_args_policy.ENV: " --generation-config, --model-impl "}) == (
        "--generation-config", "--model-impl")


def test_trusted_remote_code_needs_a_pinned_hub_revision() -> None:
    hub = {"id": "org/custom-arch", "revision": "main"}
    with pytest.raises(ValidationError, match="pinned to a full 40-hex commit id"):
        FlashModel.from_body(body("m", {"model": {"hub": hub, "trustRemoteCode": True}}))
    fm = FlashModel.from_body(body("m", {"model": {"hub": {**hub, "revision": COMMIT}, "trustRemoteCode": True}}))
    config = engine_config(fm)
    assert config["model"]["trustRemoteCode"] is True
    args = engine_args(config)
    assert "--trust-remote-code" in args and args[args.index("--code-revision") + 1] == COMMIT


def test_trusted_remote_code_from_an_image_needs_a_digest_and_from_a_claim_is_the_claims() -> None:
    image = {"reference": "registry.example/models/custom:1"}
    with pytest.raises(ValidationError, match="pinned to a digest"):
        FlashModel.from_body(body("m", {"model": {"image": image, "trustRemoteCode": True}}))
    pinned = {"reference": f"registry.example/models/custom@{DIGEST}"}
    assert "--trust-remote-code" in engine_args(engine_config(FlashModel.from_body(
        body("m", {"model": {"image": pinned, "trustRemoteCode": True}}))))
    assert "--trust-remote-code" in engine_args(engine_config(FlashModel.from_body(
        _with(MINIMAL_T4, trustRemoteCode=True))))


@pytest.mark.parametrize("case", sorted(ALL))
def test_trust_remote_code_unset_changes_no_existing_engine_config(case: str) -> None:
    config = engine_config(FlashModel.from_body(ALL[case]))
    assert "trustRemoteCode" not in config["model"] and "--trust-remote-code" not in engine_args(config)


@pytest.mark.parametrize(("source", "path"), [
    ("pvc", "../../etc"), ("pvc", "qwen/../../etc"), ("pvc", "/.."), ("image", "weights/.."), ("image", "../x"),
])
def test_a_model_path_that_leaves_its_source_is_refused(source: str, path: str) -> None:
    spec = {"pvc": {"claimName": "models", "path": path}} if source == "pvc" else {
        "image": {"reference": "registry.example/m:1", "path": path}}
    problem = _parse(body("m", {"model": spec}))
    assert isinstance(problem, Problem) and problem.reason == "SpecInvalid"
    assert "'..' segment" in problem.message and "stay inside its source" in problem.message
    # The render refuses it too, for a model built without the spec's validation.
    fm = FlashModel.from_body(MINIMAL_T4)
    sneaked = fm.spec.model.pvc.model_construct(claim_name="models", path=path)  # type: ignore[union-attr]
    bad = fm.model_copy(update={"spec": fm.spec.model_copy(update={"model": fm.spec.model.model_copy(
        update={"pvc": sneaked, "image": None, "hub": None})})})
    with pytest.raises(ValueError, match="leaves /models"):
        model_path(bad)


def test_paths_inside_their_source_still_render() -> None:
    assert model_path(FlashModel.from_body(_with(MINIMAL_T4, pvc={"claimName": "m", "path": "a/..b/c.."}))) == (
        "/models/a/..b/c..")
    assert engine_config(FlashModel.from_body(GATED_HUB_T4))["model"]["path"] == "meta-llama/Llama-3.2-1B-Instruct"


def test_the_engine_refuses_a_path_that_leaves_its_volume() -> None:
    from flashmodel_engine.config import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"'\.\.' segment"):
        parse_config({"model": {"path": "/models/../../etc", "servedName": "x"}})
