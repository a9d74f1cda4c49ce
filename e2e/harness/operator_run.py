"""Run the operator as a real process against a control plane, with the chart's ServiceAccount identity."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness.cluster import ControlPlane

ROOT = Path(__file__).resolve().parents[2]
RELEASE = "flashmodel"
SYSTEM_NAMESPACE = "flashmodel-system"


def helm_install(cp: ControlPlane, *values: str) -> None:
    """Install (or upgrade) the chart for real: CRD, RBAC, ServiceAccount, operator Deployment."""
    args = [
        "upgrade",
        "--install",
        RELEASE,
        str(ROOT / "charts" / "flashmodel-operator"),
        "--namespace",
        SYSTEM_NAMESPACE,
        "--create-namespace",
        "--wait=false",
        # Tests in the same session may have applied crds/flashmodel.yaml with kubectl; the chart
        # then adopts that CRD instead of refusing to install over an object it does not own.
        "--take-ownership",
    ]
    for value in values:
        args += ["--set", value]
    cp.helm(*args)
    cp.wait_established("flashmodels.serving.flashmodel.io")


def service_account_kubeconfig(cp: ControlPlane, path: Path, account: str) -> Path:
    """A kubeconfig that authenticates as the chart's ServiceAccount: RBAC is then really tested."""
    token = cp.kubectl("create", "token", account, "-n", SYSTEM_NAMESPACE, "--duration=2h").stdout.strip()
    admin = yaml.safe_load(cp.kubeconfig.read_text())
    cluster = admin["clusters"][0]
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": cluster["name"], "user": account}}],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    return path


def chart_service_account(cp: ControlPlane) -> str:
    names = cp.kubectl(
        "get",
        "serviceaccounts",
        "-n",
        SYSTEM_NAMESPACE,
        "-l",
        f"app.kubernetes.io/instance={RELEASE}",
        "-o",
        "jsonpath={.items[*].metadata.name}",
    ).stdout
    accounts = names.split()
    assert len(accounts) == 1, f"the chart should create one ServiceAccount, found {accounts}"
    return accounts[0]


@contextmanager
def running_operator(
    kubeconfig: Path, log_path: Path, resync_seconds: float = 5, extra_env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m flashmodel_operator --all-namespaces` as a child process; stopped with SIGTERM at the end."""
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "FLASHMODEL_RESYNC_SECONDS": str(resync_seconds),
        "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("operator", "engine", "kernels", ".")),
    }
    env.update(extra_env or {})
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "flashmodel_operator", "--all-namespaces", "--standalone"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            yield proc
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()


def scrape(url: str, name: str, labels: dict[str, str]) -> float:
    """The sum of the samples `name` whose labels include `labels`, read from a /metrics URL now (0 if none)."""
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def get_json(cp: ControlPlane, *args: str) -> Any:
    return json.loads(cp.kubectl("get", *args, "-o", "json").stdout)


def live_pods(cp: ControlPlane, namespace: str, model: str) -> list[dict[str, Any]]:
    """The model's engine pods that are not on their way out."""
    items: list[dict[str, Any]] = get_json(cp, "pods", "-n", namespace, "-l", f"serving.flashmodel.io/model={model}")[
        "items"
    ]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def wait_for(what: str, check: Any, timeout: float = 60, interval: float = 0.25) -> Any:
    """Poll `check()` until it returns something truthy; fail with `what` and the last value."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        try:
            last = check()
        except (AssertionError, KeyError, IndexError, ValueError, subprocess.CalledProcessError) as exc:  # not yet
            last = exc
        else:
            if last:
                return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last seen: {last!r}")


def create_model_volume(
    cp: ControlPlane, namespace: str, claim: str, size: str = "20Gi", host_path: Path | None = None
) -> None:
    """A bound PVC for `claim` (a static hostPath PV): the scheduler places no pod whose claim is unbound.

    The e2e kubelet mounts `host_path` (default /models/<claim>) where a pod mounts the claim.
    """
    pv_name = f"{namespace}-{claim}"[:63]
    docs = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolume",
            "metadata": {"name": pv_name},
            "spec": {
                "capacity": {"storage": size},
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "persistentVolumeReclaimPolicy": "Retain",
                "hostPath": {"path": str(host_path or f"/models/{claim}")},
                "claimRef": {"namespace": namespace, "name": claim},
            },
        },
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": claim, "namespace": namespace},
            "spec": {
                "accessModes": ["ReadOnlyMany"],
                "storageClassName": "",
                "volumeName": pv_name,
                "resources": {"requests": {"storage": size}},
            },
        },
    ]
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs))
