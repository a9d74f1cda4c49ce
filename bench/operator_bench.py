"""Operator benchmark on the real control plane: apply-to-children latency, a 300-object burst, no-op writes, RSS.

    python bench/operator_bench.py [--latency-objects 100] [--burst-objects 300] [--json out.json]

Starts its own control plane (e2e/cluster.py) with enough fake T4 nodes, runs the operator as a
process (`python -m flashmodel_operator`), creates FlashModels through the API and watches for
their children. Prints a Markdown table for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "operator"), str(ROOT / "engine")]

from e2e.cluster import ControlPlane, testbin_dir  # noqa: E402
from e2e.operator_run import running_operator  # noqa: E402

GROUP, VERSION, PLURAL = "serving.flashmodel.io", "v1alpha1", "flashmodels"
CHILD_KINDS = ("deployments", "services", "configmaps", "poddisruptionbudgets")


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = max(0, min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def flashmodel(name: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "FlashModel",
        "metadata": {"name": name},
        "spec": {"model": {"pvc": {"claimName": "models", "path": name}}, "replicas": 1},
    }


class Children:
    """Watches the four children kinds in one namespace and records when each model has all of them."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client, watch

        self.core, self.apps, self.policy = client.CoreV1Api(api), client.AppsV1Api(api), client.PolicyV1Api(api)
        self.namespace = namespace
        self.seen: dict[str, set[str]] = {}
        self.complete: dict[str, float] = {}
        self.cond = threading.Condition()
        self.watch = watch
        self.stop = threading.Event()
        lists = {
            "deployments": self.apps.list_namespaced_deployment,
            "services": self.core.list_namespaced_service,
            "configmaps": self.core.list_namespaced_config_map,
            "poddisruptionbudgets": self.policy.list_namespaced_pod_disruption_budget,
        }
        self.threads = [threading.Thread(target=self._run, args=(k, f), daemon=True) for k, f in lists.items()]
        for t in self.threads:
            t.start()

    def _run(self, kind: str, list_fn: Any) -> None:
        w = self.watch.Watch()
        for event in w.stream(
            list_fn,
            self.namespace,
            label_selector="app.kubernetes.io/managed-by=flashmodel-operator",
            timeout_seconds=3600,
        ):
            if self.stop.is_set():
                return
            obj = event["object"]
            model = (obj.metadata.labels or {}).get("serving.flashmodel.io/model")
            if not model or event["type"] == "DELETED":
                continue
            with self.cond:
                kinds = self.seen.setdefault(model, set())
                kinds.add(kind)
                if len(kinds) == len(CHILD_KINDS) and model not in self.complete:
                    self.complete[model] = time.monotonic()
                    self.cond.notify_all()

    def wait(self, names: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not all(n in self.complete for n in names):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(left)
        return True


def operator_writes(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("flashmodel_operator_api_writes_total{")
    )


def apiserver_flashmodel_writes(cp: ControlPlane) -> float:
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    total = 0.0
    for line in text.splitlines():
        if (
            line.startswith("apiserver_request_total{")
            and 'resource="flashmodels"' in line
            and any(f'verb="{v}"' in line for v in ("PATCH", "POST", "PUT", "DELETE", "APPLY"))
        ):
            total += float(line.rsplit(" ", 1)[1])
    return total


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-objects", type=int, default=100)
    parser.add_argument("--burst-objects", type=int, default=300)
    parser.add_argument("--resync-seconds", type=float, default=10.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    from kubernetes import client

    results: dict[str, Any] = {}
    metrics_port = 18090
    with tempfile.TemporaryDirectory() as tmp, ControlPlane(testbin_dir(build=True)) as cp:
        total = args.latency_objects + args.burst_objects
        cp.add_t4_nodes(max(1, total // 8 + 2), gpus=8, kwok_taint=False, gpu_taint=True)
        cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "flashmodel.yaml"))
        cp.kubectl("wait", "--for=condition=Established", "crd/flashmodels.serving.flashmodel.io")
        api = cp.api_client()
        custom = client.CustomObjectsApi(api)
        env = {"FLASHMODEL_METRICS_PORT": str(metrics_port)}
        with running_operator(
            cp.kubeconfig, Path(tmp) / "operator.log", resync_seconds=args.resync_seconds, extra_env=env
        ) as proc:
            time.sleep(3)
            # 1. One object at a time: apply -> all four children present.
            ns = cp.create_namespace("latency")
            children = Children(api, ns)
            latencies = []
            for i in range(args.latency_objects):
                name = f"lat-{i}"
                t0 = time.monotonic()
                custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, flashmodel(name))
                if not children.wait([name], 30):
                    raise SystemExit(f"{name}: children not complete within 30 s")
                latencies.append(children.complete[name] - t0)
            results["latency_p50_s"] = statistics.median(latencies)
            results["latency_p99_s"] = percentile(latencies, 99)
            results["latency_max_s"] = max(latencies)

            # 2. A burst: create N at once, wait for all children and a status on each.
            ns = cp.create_namespace("burst")
            burst = Children(api, ns)
            names = [f"burst-{i}" for i in range(args.burst_objects)]
            t0 = time.monotonic()
            with ThreadPoolExecutor(16) as pool:
                list(
                    pool.map(
                        lambda n: custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, flashmodel(n)),
                        names,
                    )
                )
            created = time.monotonic() - t0
            if not burst.wait(names, 300):
                raise SystemExit(f"burst: only {len(burst.complete)}/{len(names)} complete after 300 s")
            all_children = max(burst.complete[n] for n in names) - t0

            def statuses() -> int:
                items = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)["items"]
                return sum(1 for o in items if (o.get("status") or {}).get("observedGeneration") == 1)

            while statuses() < len(names) and time.monotonic() - t0 < 300:
                time.sleep(0.5)
            results["burst_objects"] = len(names)
            results["burst_create_s"] = created
            results["burst_children_s"] = all_children
            results["burst_status_s"] = time.monotonic() - t0

            # 3. Settle, then count writes over three full resync periods with nothing changing.
            time.sleep(max(30.0, 3 * args.resync_seconds))
            w0, a0 = operator_writes(metrics_port), apiserver_flashmodel_writes(cp)
            window = 3 * args.resync_seconds + 1
            time.sleep(window)
            w1, a1 = operator_writes(metrics_port), apiserver_flashmodel_writes(cp)
            results["noop_window_s"] = window
            results["noop_resyncs_in_window"] = int(window // args.resync_seconds)
            results["objects_total"] = total
            results["noop_operator_writes"] = w1 - w0
            results["noop_apiserver_flashmodel_writes"] = a1 - a0
            results["operator_rss_mib"] = rss_mib(proc.pid)
        api.close()
    print(json.dumps(results, indent=2))
    print()
    print("| measure | value | goal |")
    print("|---|---|---|")
    print(
        f"| apply -> 4 children, p50 / p99 / max ({args.latency_objects} objects, one at a time) | "
        f"{results['latency_p50_s'] * 1000:.0f} / {results['latency_p99_s'] * 1000:.0f} / "
        f"{results['latency_max_s'] * 1000:.0f} ms | p99 < 1 s |"
    )
    print(
        f"| {results['burst_objects']} created at once: all children / all statuses | "
        f"{results['burst_children_s']:.1f} s / {results['burst_status_s']:.1f} s | < 60 s |"
    )
    print(
        f"| API writes during {results['noop_resyncs_in_window']} no-op resyncs of {total} objects "
        f"(operator count / apiserver flashmodels writes) | {results['noop_operator_writes']:.0f} / "
        f"{results['noop_apiserver_flashmodel_writes']:.0f} | 0 |"
    )
    print(f"| operator RSS at {total} FlashModels ({total} pods) | {results['operator_rss_mib']:.0f} MiB | < 200 MB |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
