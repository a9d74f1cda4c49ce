"""e2e fixtures: the chart installed for real and the operator running with exactly its RBAC."""

from __future__ import annotations

import os
import re
import socket
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import yaml

from e2e.harness.cluster import ControlPlane, free_ports
from e2e.harness.fault_proxy import FaultProxy
from e2e.harness.operator_run import (
    chart_service_account,
    helm_install,
    running_operator,
    scrape,
    service_account_kubeconfig,
)
from tests.support.parts import missing_part

REMEDIATION_BACKOFF_SECONDS = 30
"""The operator's back-off between remediations of one model in e2e (production: 60 s): long
enough that a test can tell it from a drain's few seconds, short enough for a test's minutes."""
RBAC_DENIAL = re.compile(r"forbidden: User .{0,200}? cannot ", re.IGNORECASE)


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """The tiny random-weight model the real engines serve (built once, cached)."""
    from tests.support.tiny_model import build_tiny_model

    return build_tiny_model()


@pytest.fixture(scope="session")
def gateway_parts() -> Path:
    """The gateway's EPP, body-based router and Envoy (scripts/gateway.sh): FLASHMODEL_GATEWAY, else under the cache."""
    cache = Path(os.environ.get("FLASHMODEL_CACHE", Path.home() / ".cache" / "flashmodel"))
    parts = Path(os.environ.get("FLASHMODEL_GATEWAY") or cache / "gateway")
    absent = [p for p in ("epp", "bbr", "envoy") if not os.access(parts / p, os.X_OK)]
    if absent:
        missing_part(f"the gateway parts at {parts} lack {', '.join(absent)}: run scripts/gateway.sh")
    return parts


@pytest.fixture(scope="session")
def operator_metrics_port() -> int:
    """A free local port for the operator's /metrics, so tests read its counters as Prometheus would."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


OperatorMetric = Callable[[str, dict[str, str]], float]


@pytest.fixture(scope="session")
def prometheus_port() -> int:
    """The port the autoscaling tests' Prometheus listens on: the operator points KEDA's triggers there."""
    return free_ports(1)[0]


@pytest.fixture(scope="session")
def operator_metric(operator: Path, operator_metrics_port: int) -> OperatorMetric:
    """operator_metric(sample name, labels) -> its value scraped from the running operator now (0 if absent)."""

    def read(name: str, labels: dict[str, str]) -> float:
        return scrape(f"http://127.0.0.1:{operator_metrics_port}/metrics", name, labels)

    return read


@pytest.fixture(scope="session")
def fault_proxy(control_plane: ControlPlane) -> Iterator[FaultProxy]:
    """The loopback proxy the operator reaches the API server through; faults only while a test sets its rate."""
    pki = control_plane.dir / "pki"
    proxy = FaultProxy(control_plane.server, pki / "apiserver.crt", pki / "apiserver.key", pki / "ca.crt").start()
    yield proxy
    proxy.stop()


@pytest.fixture(scope="session")
def operator(
    control_plane: ControlPlane,
    operator_metrics_port: int,
    prometheus_port: int,
    fault_proxy: FaultProxy,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Path]:
    """helm install, then `python -m flashmodel_operator` as the chart's ServiceAccount; yields its log path.

    It talks to the API server through `fault_proxy`, which passes everything on unless a test asks
    for faults.
    """
    # Nodes without the kwok taint, tainted like GPU pools: only pods that tolerate
    # nvidia.com/gpu (the t4 profile adds it) land here.
    control_plane.add_t4_nodes(8, kwok_taint=False, gpu_taint=True)
    helm_install(control_plane)
    work = tmp_path_factory.mktemp("operator")
    kubeconfig = service_account_kubeconfig(control_plane, work / "kubeconfig", chart_service_account(control_plane))
    config = yaml.safe_load(kubeconfig.read_text())
    config["clusters"][0]["cluster"]["server"] = fault_proxy.url
    kubeconfig.write_text(yaml.safe_dump(config))
    log = work / "operator.log"
    # Short waits so the self-healing tests finish in minutes; production keeps the defaults.
    env = {
        "FLASHMODEL_MONITOR_SECONDS": "2",
        "FLASHMODEL_REMEDIATION_BACKOFF_SECONDS": str(REMEDIATION_BACKOFF_SECONDS),
        "FLASHMODEL_METRICS_PORT": str(operator_metrics_port),
        "FLASHMODEL_PROMETHEUS_URL": f"http://127.0.0.1:{prometheus_port}",
    }
    with running_operator(kubeconfig, log, extra_env=env) as proc:
        yield log
        assert proc.poll() is None, f"the operator exited: {log.read_text()[-3000:]}"
    # An RBAC denial names the user ("... is forbidden: User \"system:serviceaccount:...\" cannot
    # patch resource ..."); a 403 for a namespace being deleted does not and is not RBAC's doing.
    denials = [line for line in log.read_text().splitlines() if RBAC_DENIAL.search(line)]
    assert not denials, "RBAC denied the operator something:\n" + "\n".join(denials[:20])
