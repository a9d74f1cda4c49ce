"""LoRA adapters in the spec and the render: what is refused and why, the volumes, and what rolls the pods."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from flashmodel_operator.adapters import desired
from flashmodel_operator.model import FlashModel
from flashmodel_operator.reconcile import engine_args
from flashmodel_operator.render import (
    CONFIG_HASH_ANNOTATION,
    engine_config,
    pod_template_problems,
    render_pod_template,
)
from pydantic import ValidationError

from tests.operator.specs import body

SHA = "0123456789abcdef0123456789abcdef01234567"


def model(adapters: list[dict[str, Any]], **spec: Any) -> FlashModel:
    spec.setdefault("model", {"pvc": {"claimName": "models", "path": "qwen2.5-1.5b"}})
    return FlashModel.from_body(body("qwen", {**spec, "adapters": adapters}))


def refusal(adapters: list[dict[str, Any]], **spec: Any) -> str:
    with pytest.raises(ValidationError) as caught:
        model(adapters, **spec)
    return str(caught.value)


SUPPORT = {"name": "support", "pvc": {"claimName": "lora", "path": "support/v3"}}
BILLING = {"name": "billing", "pvc": {"claimName": "lora", "path": "billing"}}
TRIAGE_HUB = {"name": "triage", "hub": {"id": "acme/qwen-triage-lora", "revision": SHA}}
LEGAL_IMAGE = {"name": "legal", "image": {"reference": "registry.example/adapters/legal:1", "path": "/lora"}}


# ---- the spec ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("adapters", "spec", "says"),
    [
        ([{"name": "Support_V3", "pvc": {"claimName": "lora"}}], {}, "must be a DNS-1123 label"),
        ([{"name": "a", "pvc": {"claimName": "lora", "path": "x/../../etc"}}], {}, "has a '..' segment"),
        ([{"name": "a", "image": {"reference": "r/x:1", "path": "/.."}}], {}, "has a '..' segment"),
        ([{"name": "a", "hub": {"id": "acme/x", "revision": "main"}}], {}, "not a full 40-hex commit id; pin it"),
        ([{"name": "a", "hub": {"id": "acme/x", "revision": SHA}, "pvc": {"claimName": "l"}}], {},
         "needs exactly one of pvc, image, hub; got 2"),
        ([{"name": "a"}], {}, "needs exactly one of pvc, image, hub; got 0"),
        ([SUPPORT, dict(SUPPORT, pvc={"claimName": "other"})], {}, "names support more than once"),
        ([dict(SUPPORT, name="qwen")], {}, "has the model's served name (metadata.name"),
        ([dict(SUPPORT, name="chat")], {"model": {"hub": {"id": "a/b"}, "servedName": "chat"}},
         "adapter 'chat' has the model's served name; rename the adapter"),
        ([dict(SUPPORT, name=f"a{i}") for i in range(5)], {},
         "spec.adapters lists 5 adapters and a pod holds 4 (spec.lora.maxLoras, at most 8 on t4); raise"),
        ([dict(SUPPORT, name=f"a{i}") for i in range(3)], {"lora": {"maxLoras": 2}},
         "lists 3 adapters and a pod holds 2"),
        ([], {"lora": {"maxLoras": 9}}, "spec.lora.maxLoras is 9; t4 holds at most 8; lower it"),
        ([], {"lora": {"maxRank": 12}}, "spec.lora.maxRank is 12; use one of 8, 16, 32, 64 on t4"),
        ([], {"lora": {"maxRank": 128}}, "spec.lora.maxRank is 128; use one of 8, 16, 32, 64"),
    ],
    ids=[
        "name-not-a-label", "pvc-path-up", "image-path-up", "hub-revision-a-branch", "two-sources", "no-source",
        "same-name-twice", "named-like-metadata-name", "named-like-served-name", "more-than-the-default-loras",
        "more-than-max-loras", "max-loras-over-the-profile", "rank-not-vllms", "rank-over-the-profile",
    ],
)
def test_a_bad_adapter_spec_is_refused_with_what_to_change(
    adapters: list[dict[str, Any]], spec: dict[str, Any], says: str
) -> None:
    assert says in refusal(adapters, **spec)


def test_lora_is_on_with_adapters_or_spec_lora_and_takes_the_profiles_defaults() -> None:
    assert not model([]).spec.lora_on
    assert model([SUPPORT]).spec.lora_on
    assert model([], lora={}).spec.lora_on
    assert model([SUPPORT]).spec.lora_limits() == (4, 16)
    assert model([SUPPORT], lora={"maxLoras": 8, "maxRank": 64}).spec.lora_limits() == (8, 64)
    assert model([SUPPORT], accelerator="cpu").spec.lora_limits() == (4, 16)


# ---- the engine config and the pod -------------------------------------------------------------------


def test_the_engine_config_gets_the_lora_section_only_when_lora_is_on() -> None:
    assert "lora" not in engine_config(model([]))
    # The shim reads adapters from their volumes and from the model's own claim, whatever the set holds.
    roots = ["/adapters", "/models"]
    assert engine_config(model([SUPPORT]))["lora"] == {"maxLoras": 4, "maxRank": 16, "adapterRoots": roots}
    lora_32 = engine_config(model([], lora={"maxRank": 32}))["lora"]
    assert lora_32 == {"maxLoras": 4, "maxRank": 32, "adapterRoots": roots}
    # The adapters themselves are not in the config: they are loaded at run time.
    assert "support" not in str(engine_config(model([SUPPORT])))
    # The reconcile's check of the config against the engine's model passes with the section.
    assert engine_args(engine_config(model([SUPPORT])))


def _pod(fm: FlashModel) -> dict[str, Any]:
    return render_pod_template(fm)


def _hash(fm: FlashModel) -> str:
    return str(_pod(fm)["metadata"]["annotations"][CONFIG_HASH_ANNOTATION])


def _adapter_volumes(fm: FlashModel) -> list[dict[str, Any]]:
    return [v for v in _pod(fm)["spec"]["volumes"] if v["name"].startswith("adapter-")]


def test_one_read_only_volume_per_claim_or_image_mounted_under_adapters() -> None:
    fm = model([SUPPORT, BILLING, TRIAGE_HUB, LEGAL_IMAGE])
    volumes = _adapter_volumes(fm)
    assert [sorted(k for k in v if k != "name") for v in volumes] in (
        [["persistentVolumeClaim"], ["image"]], [["image"], ["persistentVolumeClaim"]]
    )
    claim = next(v for v in volumes if "persistentVolumeClaim" in v)
    assert claim["persistentVolumeClaim"] == {"claimName": "lora", "readOnly": True}
    engine = _pod(fm)["spec"]["containers"][0]
    mounts = {m["name"]: m for m in engine["volumeMounts"] if m["name"].startswith("adapter-")}
    assert mounts == {
        v["name"]: {"name": v["name"], "mountPath": f"/adapters/{v['name']}", "readOnly": True} for v in volumes
    }
    # What the operator PUTs: each adapter at its path inside its volume, a hub adapter as id and commit.
    entries = {e["name"]: e for e in desired(fm).entries}
    assert entries["support"] == {"name": "support", "path": f"/adapters/{claim['name']}/support/v3"}
    assert entries["billing"]["path"] == f"/adapters/{claim['name']}/billing"
    image = next(v for v in volumes if "image" in v)
    assert entries["legal"]["path"] == f"/adapters/{image['name']}/lora"
    assert entries["triage"] == {"name": "triage", "hub": "acme/qwen-triage-lora", "revision": SHA}


def test_an_adapter_on_the_models_own_claim_is_read_from_the_models_mount() -> None:
    fm = model([{"name": "a", "pvc": {"claimName": "models", "path": "/lora//a/"}}])
    assert _adapter_volumes(fm) == []
    assert desired(fm).entries == ({"name": "a", "path": "/models/lora/a"},)


def test_adapter_changes_within_mounted_claims_keep_the_pod_template() -> None:
    """The config hash (and the whole template) is the same whatever adapters a mounted claim serves."""
    one = model([SUPPORT], lora={"maxLoras": 4})
    two = model([SUPPORT, BILLING], lora={"maxLoras": 4})
    changed = model([dict(SUPPORT, pvc={"claimName": "lora", "path": "support/v4"})], lora={"maxLoras": 4})
    reordered = model([BILLING, SUPPORT], lora={"maxLoras": 4})
    hub_added = model([SUPPORT, TRIAGE_HUB], lora={"maxLoras": 4})
    assert _pod(one) == _pod(two) == _pod(changed) == _pod(reordered) == _pod(hub_added)
    # ... while the set the pods are given differs, and only with the adapters.
    assert len({desired(m).set_hash for m in (one, two, changed, hub_added)}) == 4
    assert desired(two).set_hash == desired(reordered).set_hash
    # spec.lora without adapters: the first adapter from the model's claim or the hub rolls nothing either.
    empty = model([], lora={"maxLoras": 4})
    assert _hash(empty) == _hash(model([TRIAGE_HUB], lora={"maxLoras": 4}))


def test_a_new_claim_or_image_and_turning_lora_on_roll_the_pods() -> None:
    base = _hash(model([SUPPORT]))
    assert _hash(model([SUPPORT, LEGAL_IMAGE])) != base  # a new volume
    assert _hash(model([SUPPORT, dict(BILLING, pvc={"claimName": "lora-2"})])) != base
    assert _hash(model([])) != _hash(model([], lora={}))  # --enable-lora is taken at start
    # A model without LoRA renders as before: no lora section, no adapter volume.
    plain = model([])
    assert _adapter_volumes(plain) == [] and "lora" not in engine_config(plain)


# ---- the pod policy ----------------------------------------------------------------------------------


def _patched(patch: dict[str, Any]) -> list[str]:
    raw = body("qwen", {
        "model": {"pvc": {"claimName": "models", "path": "qwen2.5-1.5b"}},
        "adapters": [SUPPORT, LEGAL_IMAGE],
        "podTemplatePatch": patch,
    })
    return pod_template_problems(FlashModel.from_body(raw))


def test_the_pod_policy_keeps_the_adapter_volumes_as_the_engines_own() -> None:
    fm = model([SUPPORT, LEGAL_IMAGE])
    volume = _adapter_volumes(fm)[0]["name"]
    assert _patched({}) == []
    # An unrelated patch leaves the adapter volumes and their mounts as rendered.
    env = {"spec": {"containers": [{"name": "engine", "env": [{"name": "TEAM", "value": "support"}]}]}}
    assert _patched(env) == []
    # Mounting an adapter volume elsewhere in the engine, or in a sidecar, is refused.
    elsewhere = {"spec": {"containers": [{"name": "engine", "volumeMounts": [
        {"name": volume, "mountPath": "/data/lora"}]}]}}
    assert any("the engine's own volumes are mounted where the operator mounts them" in p for p in _patched(elsewhere))
    sidecar = {"spec": {"containers": [{"name": "peek", "image": "busybox", "volumeMounts": [
        {"name": volume, "mountPath": "/x"}]}]}}
    assert any(f"mounts the engine's volume {volume}" in p for p in _patched(sidecar))
    # Replacing the adapter volume's source, or mounting another volume over /adapters, is refused.
    swapped = {"spec": {"volumes": [{"name": volume, "persistentVolumeClaim": {"claimName": "evil"}}]}}
    assert any(f"changes the volume {volume}" in p for p in _patched(swapped))
    over = {"spec": {"volumes": [{"name": "mine", "emptyDir": {}}], "containers": [{"name": "engine",
            "volumeMounts": [{"name": "mine", "mountPath": "/adapters"}]}]}}
    assert any("/adapters" in p for p in _patched(over))


def test_the_same_spec_renders_the_same_volume_names() -> None:
    first = _adapter_volumes(model([SUPPORT, LEGAL_IMAGE]))
    again = _adapter_volumes(FlashModel.from_body(copy.deepcopy(body("other", {
        "model": {"hub": {"id": "a/b"}}, "adapters": [LEGAL_IMAGE, SUPPORT]}))))
    assert first == again
