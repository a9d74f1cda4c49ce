"""The real autoscaling parts together: documented scrape config, Prometheus, KEDA, the HPA, a scale subresource."""

from __future__ import annotations

import http.server
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml

from e2e.harness.autoscaling import Keda, Prometheus
from e2e.harness.cluster import KWOK_TOLERATION, ControlPlane, free_ports, wait_until

MODEL_LABEL = "serving.flashmodel.io/model"

# A CRD shaped like FlashModel where the HPA looks: a scale subresource over .spec.replicas,
# .status.replicas and .status.selector.
WIDGET_CRD: dict[str, Any] = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.com"},
    "spec": {
        "group": "example.com",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"replicas": {"type": "integer"}}},
                            "status": {
                                "type": "object",
                                "properties": {"replicas": {"type": "integer"}, "selector": {"type": "string"}},
                            },
                        },
                    }
                },
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
            }
        ],
    },
}


@pytest.fixture(scope="module")
def prometheus(control_plane: ControlPlane) -> Iterator[Prometheus]:
    with Prometheus(control_plane) as prom:
        yield prom


@pytest.fixture(scope="module")
def keda(control_plane: ControlPlane) -> Iterator[Keda]:
    with Keda(control_plane) as k:
        yield k


class _Metrics(http.server.BaseHTTPRequestHandler):
    """What an engine's health port serves on /metrics, reduced to one gauge."""

    def do_GET(self) -> None:
        body = b"flashmodel_parts_test_up 1\n"
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _pod(name: str, port: int, labels: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "tolerations": [KWOK_TOLERATION],
            "containers": [
                {
                    "name": "engine",
                    "image": "flashmodel-engine:e2e",
                    "ports": [{"name": "health", "containerPort": port}, {"name": "http", "containerPort": port + 1}],
                }
            ],
        },
    }


def _pod_ip(cp: ControlPlane, namespace: str, name: str) -> str:
    ip = ""

    def running() -> bool:
        nonlocal ip
        pod = json.loads(cp.kubectl("get", "pod", name, "-n", namespace, "-o", "json").stdout)
        ip = pod.get("status", {}).get("podIP", "")
        return bool(ip) and pod["status"].get("phase") == "Running"

    wait_until(f"pod {namespace}/{name} Running with an IP", running, 60)
    return ip


def test_documented_scrape_config_scrapes_engine_pods_with_their_model_labels(
    control_plane: ControlPlane, prometheus: Prometheus, k8s_namespace: str
) -> None:
    # kwok marks the pods Running with an IP in 127.16.0.0/16, which is on lo: a server bound
    # to that IP is "the pod" for Prometheus. The port is picked free, since other sessions'
    # kwok hand out the same IPs.
    port = free_ports(1)[0]
    control_plane.kubectl(
        "apply", "-n", k8s_namespace, "-f", "-",
        input=yaml.safe_dump_all([
            _pod("engine-0", port, {MODEL_LABEL: "tiny"}),
            # Not an engine pod: the documented config must leave it alone.
            _pod("bystander", port, {"app": "bystander"}),
        ]),
    )  # fmt: skip
    servers = []
    ips = [_pod_ip(control_plane, k8s_namespace, name) for name in ("engine-0", "bystander")]
    for ip in ips:
        server = http.server.ThreadingHTTPServer((ip, port), _Metrics)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
    try:
        samples = prometheus.wait_for_series(f'flashmodel_parts_test_up{{namespace="{k8s_namespace}"}}', timeout=30)
        assert [(s.labels.get("pod"), s.labels.get("flashmodel")) for s in samples] == [("engine-0", "tiny")]
        assert samples[0].labels["job"] == "flashmodel-engines"
        # One target per pod (the health port only), none for the pod without the model label.
        ours = [t for t in prometheus.targets() if t["labels"].get("namespace") == k8s_namespace]
        assert [t["scrapeUrl"] for t in ours] == [f"http://{ips[0]}:{port}/metrics"]
    finally:
        for server in servers:
            server.shutdown()
            server.server_close()


def _hpa_condition(cp: ControlPlane, namespace: str, hpa: str, kind: str) -> tuple[str, str, str]:
    out = cp.kubectl("get", "hpa", hpa, "-n", namespace, "-o", "json", check=False)
    if out.returncode != 0:
        return ("", "", out.stderr.strip())
    for c in json.loads(out.stdout).get("status", {}).get("conditions") or []:
        if c["type"] == kind:
            return (c["status"], c.get("reason", ""), c.get("message", ""))
    return ("", "", "no condition yet")


def _replicas(cp: ControlPlane, namespace: str) -> int:
    out = cp.kubectl("get", "widget", "w1", "-n", namespace, "-o", "jsonpath={.spec.replicas}")
    return int(out.stdout)


def test_keda_scales_a_scale_subresource_from_prometheus_and_reports_when_prometheus_is_gone(
    control_plane: ControlPlane, prometheus: Prometheus, keda: Keda, k8s_namespace: str
) -> None:
    cp, ns = control_plane, k8s_namespace
    cp.kubectl("apply", "--server-side", "-f", "-", input=yaml.safe_dump(WIDGET_CRD))
    cp.wait_established("widgets.example.com")
    cp.kubectl(
        "apply", "-n", ns, "-f", "-",
        input=yaml.safe_dump({"apiVersion": "example.com/v1", "kind": "Widget", "metadata": {"name": "w1"},
                              "spec": {"replicas": 1}}),
    )  # fmt: skip
    # The HPA refuses a target without a selector ("selector is required"); FlashModel's
    # reconcile writes it, here the test plays that controller.
    cp.kubectl(
        "patch", "widget", "w1", "-n", ns, "--subresource=status", "--type=merge",
        "-p", json.dumps({"status": {"replicas": 1, "selector": "app=w1"}}),
    )  # fmt: skip
    scaled_object = {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": "w1"},
        "spec": {
            "scaleTargetRef": {"apiVersion": "example.com/v1", "kind": "Widget", "name": "w1"},
            "pollingInterval": 2,
            "minReplicaCount": 1,
            "maxReplicaCount": 5,
            # 42 against an average target of 15 per replica: ceil(42 / 15) = 3 replicas.
            "triggers": [
                {
                    "type": "prometheus",
                    "metadata": {"serverAddress": prometheus.url, "query": "vector(42)", "threshold": "15"},
                }
            ],
        },
    }
    t0 = time.monotonic()
    cp.kubectl("apply", "-n", ns, "-f", "-", input=yaml.safe_dump(scaled_object))

    wait_until("HPA scales widget w1 to 3", lambda: _replicas(cp, ns) == 3, 60)
    scaled = time.monotonic() - t0
    assert keda.external_metric(ns, "s0-prometheus", "w1") == 42
    assert _hpa_condition(cp, ns, "keda-hpa-w1", "ScalingActive")[:2] == ("True", "ValidMetricFound")

    prometheus.stop()
    try:
        t1 = time.monotonic()
        wait_until(
            "HPA reports FailedGetExternalMetric with Prometheus stopped",
            lambda: _hpa_condition(cp, ns, "keda-hpa-w1", "ScalingActive")[:2] == ("False", "FailedGetExternalMetric"),
            60,
        )
        lost = time.monotonic() - t1
        # Without a metric the HPA keeps what it had instead of guessing.
        assert _replicas(cp, ns) == 3
    finally:
        prometheus.start()
    t2 = time.monotonic()
    wait_until(
        "HPA finds the metric again after Prometheus is back",
        lambda: _hpa_condition(cp, ns, "keda-hpa-w1", "ScalingActive")[:2] == ("True", "ValidMetricFound"),
        60,
    )
    print(f"scaled_seconds={scaled:.1f} lost_seconds={lost:.1f} recovered_seconds={time.monotonic() - t2:.1f}")
