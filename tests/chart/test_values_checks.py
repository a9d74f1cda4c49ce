"""What the chart refuses at install beyond types: image forms, DNS names, a request over its limit,
one port for two endpoints; and metrics.enabled: false turns the operator's metrics endpoint off."""

from __future__ import annotations

from typing import Any

import jsonschema
import pytest

from tests.chart.test_chart import CHART, _schema, _values, container, helm, render

pytestmark = pytest.mark.usefixtures("testbin")

DIGEST = "sha256:" + "ab" * 32


def _env(docs: list[dict[str, Any]]) -> dict[str, str]:
    return {e["name"]: e.get("value", "") for e in container(docs)["env"]}


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("tag", "0.1.0 rc1"),
        ("tag", "-leading-dash"),
        ("tag", "x" * 129),
        ("digest", "sha256:abc"),
        ("digest", "md5:" + "ab" * 16),
        ("repository", "ghcr.io/flashmodel/operator:0.1.0"),
        ("repository", "ghcr.io/flashmodel/operator@" + DIGEST),
        ("repository", "GHCR.io/Flashmodel/Operator"),
    ],
)
def test_the_schema_refuses_an_image_value_of_the_wrong_form(key: str, value: str) -> None:
    values = _values()
    values["image"][key] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_schema()).validate(values)


@pytest.mark.parametrize("name", ["Flashmodel", "fm_operator", "-fm", "fm-", "fm.operator"])
@pytest.mark.parametrize("key", ["nameOverride", "fullnameOverride"])
def test_the_schema_refuses_a_name_override_that_is_not_a_dns_label(key: str, name: str) -> None:
    values = _values()
    values[key] = name
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_schema()).validate(values)


def test_a_digest_pins_the_image_and_a_registry_port_is_a_repository() -> None:
    docs = render(
        "image.repository=registry.example.com:5000/ml/flashmodel-operator", "image.tag=0.2.0", f"image.digest={DIGEST}"
    )
    assert container(docs)["image"] == f"registry.example.com:5000/ml/flashmodel-operator:0.2.0@{DIGEST}"


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (
            ["resources.requests.memory=512Mi", "resources.limits.memory=256Mi"],
            "resources.requests.memory (512Mi) is above resources.limits.memory (256Mi)",
        ),
        (
            ["resources.requests.cpu=2", "resources.limits.cpu=1500m"],
            "resources.requests.cpu (2) is above resources.limits.cpu (1500m)",
        ),
        (
            ["resources.requests.memory=1G", "resources.limits.memory=900Mi"],
            "resources.requests.memory (1G) is above resources.limits.memory (900Mi)",
        ),
        (["metrics.enabled=true", "metrics.port=8080", "healthPort=8080"], "healthPort and metrics.port are both 8080"),
    ],
)
def test_helm_refuses_a_request_over_its_limit_and_one_port_for_two_endpoints(sets: list[str], message: str) -> None:
    args = [a for s in sets for a in ("--set", s)]
    proc = helm("template", "fm", str(CHART), *args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "sets",
    [
        ["resources.requests.memory=1Gi", "resources.limits.memory=1024Mi"],
        ["resources.requests.memory=1e9", "resources.limits.memory=1Gi"],
        ["resources.requests.cpu=250m", "resources.limits.cpu=0.5"],
        ["metrics.enabled=false", "metrics.port=8080", "healthPort=8080"],
    ],
)
def test_helm_accepts_a_request_at_or_under_its_limit(sets: list[str]) -> None:
    render(*sets)


def test_metrics_disabled_turns_the_operators_endpoint_off_and_enabled_sets_its_port() -> None:
    assert _env(render())["FLASHMODEL_METRICS_PORT"] == "0"
    assert _env(render("metrics.enabled=true", "metrics.port=9100"))["FLASHMODEL_METRICS_PORT"] == "9100"
    assert "metrics" not in {p["name"] for p in container(render())["ports"]}


def test_the_engine_image_is_the_operators_configuration() -> None:
    env = _env(render())
    assert env["FLASHMODEL_ENGINE_IMAGE"] == "ghcr.io/flashmodel/engine:0.1.0"
    assert "FLASHMODEL_ALLOWED_ENGINE_IMAGES" not in env and "FLASHMODEL_ENGINE_IMAGE_PULL_SECRETS" not in env
    env = _env(
        render(
            "engineImage.repository=registry.example.com/ml/engine",
            "engineImage.tag=0.2.0",
            f"engineImage.digest={DIGEST}",
            "engineImage.allowed={a.example/x:1,b.example/y:2}",
            "engineImage.pullSecrets={regcred,mirror}",
        )
    )
    assert env["FLASHMODEL_ENGINE_IMAGE"] == f"registry.example.com/ml/engine:0.2.0@{DIGEST}"
    assert env["FLASHMODEL_ALLOWED_ENGINE_IMAGES"] == "a.example/x:1,b.example/y:2"
    assert env["FLASHMODEL_ENGINE_IMAGE_PULL_SECRETS"] == "regcred,mirror"


def test_the_allowed_priority_classes_are_the_operators_configuration() -> None:
    assert "FLASHMODEL_ALLOWED_PRIORITY_CLASSES" not in _env(render())
    env = _env(render("podPolicy.allowedPriorityClasses={inference,batch}"))
    assert env["FLASHMODEL_ALLOWED_PRIORITY_CLASSES"] == "inference,batch"
    values = _values()
    values["podPolicy"]["allowedPriorityClasses"] = ["inference,batch"]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_schema()).validate(values)


@pytest.mark.parametrize(
    ("key", "value"), [("allowed", ["a.example/x:1,b.example/y:2"]), ("pullSecrets", ["Reg_Cred"])]
)
def test_the_schema_refuses_an_engine_image_list_entry_of_the_wrong_form(key: str, value: list[str]) -> None:
    values = _values()
    values["engineImage"][key] = value
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_schema()).validate(values)


def test_the_extra_args_allow_list_extension_reaches_the_operator() -> None:
    assert "FLASHMODEL_EXTRA_ARGS_ALLOWED" not in _env(render())
    env = _env(render("engineExtraArgs.allowed={--generation-config,--model-impl}"))
    assert env["FLASHMODEL_EXTRA_ARGS_ALLOWED"] == "--generation-config,--model-impl"


@pytest.mark.parametrize("flag", ["--load-format", "--trust-remote-code", "--gpu-memory-utilization", "--tokenizer",
                                  "generation-config", "--generation-config=vllm"])
def test_the_schema_refuses_an_extension_the_profile_or_the_source_depends_on(flag: str) -> None:
    values = _values()
    values["engineExtraArgs"]["allowed"] = [flag]
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft7Validator(_schema()).validate(values)


def test_the_schemas_never_allowed_flags_are_the_engines() -> None:
    from flashmodel_engine.profiles import NEVER_ALLOWED

    items = _schema()["properties"]["engineExtraArgs"]["properties"]["allowed"]["items"]
    assert items["not"]["enum"] == sorted(set(NEVER_ALLOWED))
