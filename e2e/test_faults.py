"""The control loop under API faults: 10 % of the operator's requests fail (429, 500, dropped, delayed).

A failed request is resent after short jittered pauses and a failed handler runs again after 2 s,
so thirty models converge under faults within half a minute of the clean time (a handler left to
kopf's 60 s retry would miss that by far), and no healthy model shows Degraded.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.cluster import ControlPlane
from e2e.harness.fault_proxy import FaultProxy

MODELS = 30
FAULT_RATE = 0.10
RETRY_SLACK_S = 30.0
"""How much longer than the clean run the faulty one may take: half of the 60 s kopf retry it must avoid."""


def _models(prefix: str) -> str:
    # Pods no kubelet runs (kwok leaves their status alone): convergence is the operator's work only.
    spec = {
        "model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}},
        "podTemplatePatch": {"metadata": {"annotations": {"kwok.x-k8s.io/status": "custom"}}},
    }
    return yaml.safe_dump_all(
        {"apiVersion": "serving.flashmodel.io/v1alpha1", "kind": "FlashModel",
         "metadata": {"name": f"{prefix}-{i:02d}"}, "spec": spec}
        for i in range(MODELS)
    )


def _items(cp: ControlPlane, kind: str, ns: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = json.loads(cp.kubectl("get", kind, "-n", ns, "-o", "json").stdout)["items"]
    return items


def _converged(cp: ControlPlane, ns: str) -> bool:
    """Every model has its Deployment and a status written for its generation."""
    models = _items(cp, "flashmodels", ns)
    deployments = {d["metadata"]["name"] for d in _items(cp, "deployments", ns)}
    return len(models) == MODELS and all(
        (m.get("status") or {}).get("observedGeneration") == m["metadata"]["generation"]
        and (m.get("status") or {}).get("engineArgs")
        and m["metadata"]["name"] in deployments
        for m in models
    )


class DegradedWatch:
    """Polls the models of some namespaces and keeps every Degraded=True it sees (through the clean API)."""

    def __init__(self, cp: ControlPlane, namespaces: list[str]) -> None:
        self.cp, self.namespaces = cp, namespaces
        self.seen: list[tuple[str, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            for ns in self.namespaces:
                for m in _items(self.cp, "flashmodels", ns):
                    for c in (m.get("status") or {}).get("conditions") or []:
                        if c["type"] == "Degraded" and c["status"] == "True":
                            self.seen.append((m["metadata"]["name"], c["reason"], c["message"][:200]))

    def __enter__(self) -> DegradedWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def _converge(cp: ControlPlane, ns: str, prefix: str, timeout: float) -> float:
    started = time.monotonic()
    cp.kubectl("apply", "-n", ns, "-f", "-", input=_models(prefix))
    while time.monotonic() - started < timeout:
        if _converged(cp, ns):
            return time.monotonic() - started
        time.sleep(0.25)
    raise AssertionError(f"{MODELS} models in {ns} did not converge within {timeout}s")


@pytest.fixture
def namespaces(control_plane: ControlPlane) -> Iterator[tuple[str, str]]:
    clean, faulty = control_plane.create_namespace("faults-clean"), control_plane.create_namespace("faults-10pc")
    yield clean, faulty
    # Sixty models' children take the garbage collector a while on a small machine: both go at once.
    for ns in (clean, faulty):
        control_plane.kubectl("delete", "namespace", ns, "--wait=false", check=False)
    for ns in (clean, faulty):
        control_plane.delete_namespace(ns, timeout=360)


def test_thirty_models_converge_under_ten_percent_faults_without_a_long_retry_or_degraded(
    control_plane: ControlPlane, operator: Path, fault_proxy: FaultProxy, namespaces: tuple[str, str]
) -> None:
    """Slow (a few minutes): thirty models converge twice, once clean and once with one API request in ten
    failing, and the faults then go on for 15 s to show no resync turns them into Degraded."""
    clean_ns, faulty_ns = namespaces
    with DegradedWatch(control_plane, [clean_ns, faulty_ns]) as degraded:
        clean = _converge(control_plane, clean_ns, "clean", timeout=180)
        fault_proxy.rate = FAULT_RATE
        try:
            requests_before = fault_proxy.requests
            faulty = _converge(control_plane, faulty_ns, "faulty", timeout=max(180, 4 * clean))
            # The faults go on a while after convergence: resyncs and watches must not turn them into Degraded.
            time.sleep(15)
            injected = sum(fault_proxy.injected.values())
            requests = fault_proxy.requests - requests_before
        finally:
            fault_proxy.rate = 0.0
    print(f"clean={clean:.1f}s faulty={faulty:.1f}s injected={dict(fault_proxy.injected)} requests={requests}")
    assert injected >= 20, f"the proxy injected only {injected} faults in {requests} requests"
    # The bound is the retry design's, with room for two shared cores: a clean run of 4-13 s varies
    # by seconds between runs, so a ratio to it measures the machine, while one handler waiting out
    # kopf's 60 s retry breaks this by half a minute (the ratio is printed above for the record).
    assert faulty <= clean + RETRY_SLACK_S, (
        f"under {FAULT_RATE:.0%} faults convergence took {faulty:.1f}s, clean {clean:.1f}s: more than "
        f"{RETRY_SLACK_S:.0f}s longer, as if a failed handler waited for kopf's 60 s retry"
    )
    assert not degraded.seen, f"healthy models reported Degraded: {sorted(set(degraded.seen))[:10]}"
    # The operator's own writes went through the proxy too (events are POSTs without a patch type).
    applied = control_plane.kubectl(
        "get", "events", "-n", faulty_ns, "--field-selector", "reason=Applied", "-o", "name"
    )
    assert applied.stdout.strip(), "no Applied event reached the API server through the proxy"
