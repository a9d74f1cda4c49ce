"""End to end: a real launcher refuses a spec the API server admits, and the operator holds the model.

The CRD cannot know a model's shape, so a cpu FlashModel whose model has 16-wide attention heads
is admitted; the engine's preflight refuses it (vLLM's CPU attention needs head sizes of at least
32). The launcher exits with the contract's preflight code and writes its reason to the
termination log; the operator must then hold the model at zero replicas with that reason, not
let the pod crash-loop.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.cluster import ControlPlane
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.operator_run import get_json, wait_for

MODEL = "narrow-heads"


def _narrow_head_model(tmp: Path) -> Path:
    """The tiny model with 8 heads of 16 instead of 4 of 32: everything else about it is valid."""
    from tests.support.tiny_model import build_tiny_model

    model = tmp / "narrow-heads"
    shutil.copytree(build_tiny_model(), model)
    config = json.loads((model / "config.json").read_text())
    assert config["hidden_size"] == 128, config  # so 8 heads are 16 wide
    config.update(num_attention_heads=8, num_key_value_heads=4)
    (model / "config.json").write_text(json.dumps(config))
    return model


def _condition(fm: dict[str, Any], kind: str) -> dict[str, Any]:
    conditions = (fm.get("status") or {}).get("conditions") or []
    return next((c for c in conditions if c["type"] == kind), {})


def test_a_spec_the_launcher_refuses_holds_the_model_at_zero_with_the_launchers_reason(
    engine_python: str, control_plane: ControlPlane, operator: Path, k8s_namespace: str, tmp_path: Path
) -> None:
    ns = k8s_namespace
    model = _narrow_head_model(tmp_path)
    with EngineKubelet(control_plane, ns, tmp_path / "kubelet", python=engine_python, env=ENGINE_ENV) as kubelet:
        doc = cpu_model(ns, MODEL, model, replicas=1, grace_seconds=5)
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

        def held() -> dict[str, Any]:
            fm: dict[str, Any] = get_json(control_plane, "flashmodel", MODEL, "-n", ns)
            return fm if (fm.get("status") or {}).get("preflightRefusal") else {}

        fm = wait_for("the model held after the launcher's refusal", held, timeout=180, interval=2)
        refusal = fm["status"]["preflightRefusal"]
        # The launcher's own words reach the user, not a generic crash.
        assert "head size 16 is below 32" in refusal["message"], refusal
        degraded = _condition(fm, "Degraded")
        assert degraded.get("status") == "True" and degraded.get("reason") == "PreflightFailed", degraded
        assert "head size 16" in degraded["message"], degraded
        assert _condition(fm, "Ready").get("status") == "False", fm["status"]

        def scaled_to_zero() -> bool:
            deployment = get_json(control_plane, "deployment", MODEL, "-n", ns)
            pods = get_json(control_plane, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={MODEL}")["items"]
            return deployment["spec"]["replicas"] == 0 and not pods

        assert wait_for("the Deployment at 0 and its pod gone", scaled_to_zero, timeout=90)
        # The refusal came from the launcher this kubelet ran; the operator matched its exit code
        # (PREFLIGHT_EXIT_CODE) to hold, so no engine runs on for the held model.
        engine_log = (tmp_path / "kubelet" / refusal["pod"] / "engine.log").read_text()
        assert "head size 16 is below 32" in engine_log, engine_log[-2000:]
        assert not kubelet.pods, f"an engine still runs for a held model: {list(kubelet.pods)}"
