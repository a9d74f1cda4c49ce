"""Operator benchmark on the real control plane: apply-to-children latency, a 300-object burst, no-op writes, RSS.

    python bench/operator_bench.py [--latency-objects 100] [--burst-objects 300] [--json out.json]

Starts its own control plane (e2e/harness/cluster.py) with enough fake T4 nodes, runs the operator as a
process (`python -m flashmodel_operator`), creates FlashModels through the API and watches for
their children. Prints a Markdown table for docs/benchmarks/operator.md.
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

import e2e.harness.cluster  # noqa: E402
from e2e.harness.cluster import ControlPlane, free_ports, testbin_dir  # noqa: E402
from e2e.harness.operator_run import running_operator  # noqa: E402

GROUP, VERSION, PLURAL = "serving.flashmodel.io", "v1alpha1", "flashmodels"
# A single-replica model's children: it gets no PodDisruptionBudget (render.needs_pdb).
CHILD_KINDS = ("deployments", "services", "configmaps")


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
    """Watches the children kinds in one namespace and records when each model has all of them."""

    def __init__(self, api: Any, namespace: str) -> None:
        from kubernetes import client, watch

        self.core, self.apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.namespace = namespace
        self.seen: dict[str, set[str]] = {}
        self.complete: dict[str, float] = {}
        self.cond = threading.Condition()
        self.watch: Any = watch  # kubernetes.watch has no annotations
        self.stop = threading.Event()
        lists = {
            "deployments": self.apps.list_namespaced_deployment,
            "services": self.core.list_namespaced_service,
            "configmaps": self.core.list_namespaced_config_map,
        }
        self.threads = [threading.Thread(target=self._run, args=(k, f), daemon=True) for k, f in lists.items()]
        for t in self.threads:
            t.start()

    def _run(self, kind: str, list_fn: Any) -> None:
        # A broken watch is restarted (it lists again, which is harmless: seen is a set); it ends
        # quietly when the control plane goes away at the end of the run.
        while not self.stop.is_set():
            try:
                self._watch(kind, list_fn)
            except Exception as exc:  # any transport error: reconnect
                if not self.stop.is_set():
                    progress(f"watch {kind}: {type(exc).__name__}: {exc}; reconnecting")
                    time.sleep(0.5)

    def _watch(self, kind: str, list_fn: Any) -> None:
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


WRITE_VERBS = ("PATCH", "POST", "PUT", "DELETE", "APPLY")
# What the operator (its own client and kopf's) writes. No other component writes ConfigMaps,
# Services or PDBs here; FlashModels get writes only from the operator and kopf (finalizers,
# annotations) once the benchmark stops creating them; the controller-manager writes Deployment status.
CHILD_RESOURCES = ("deployments", "services", "configmaps", "poddisruptionbudgets")
# Pods only for the GET rate: the scheduler and kwok write pods too.
WATCHED_RESOURCES = ("flashmodels", *CHILD_RESOURCES, "pods")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of the process so far (utime + stime in /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


CONTROL_PLANE_BINARIES = ("kube-apiserver", "etcd", "kube-controller-manager", "kube-scheduler", "kwok")


def component_cpu_seconds(pids: dict[str, int]) -> dict[str, float]:
    """CPU seconds so far of each control-plane process (by its binary's name) and of each named pid."""
    totals = dict.fromkeys(CONTROL_PLANE_BINARIES, 0.0)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            binary = (entry / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace").rsplit("/", 1)[-1]
            if binary in totals:
                totals[binary] += cpu_seconds(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    for name, pid in pids.items():
        totals[name] = cpu_seconds(pid)
    return totals


def apiserver_requests(cp: ControlPlane) -> dict[tuple[str, str], float]:
    """apiserver_request_total summed by (resource, write|get), as the API server itself counted them."""
    text = cp.kubectl("get", "--raw", "/metrics").stdout
    totals: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split(","))
        resource, verb = labels.get("resource", "").strip('"'), labels.get("verb", "").strip('"')
        if resource not in WATCHED_RESOURCES:
            continue
        kind = "write" if verb in WRITE_VERBS else "get" if verb == "GET" else ""
        if kind:
            totals[(resource, kind)] = totals.get((resource, kind), 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


def rss_mib(pid: int) -> float:
    """Resident set of the operator process, from the kernel (VmRSS in /proc/PID/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class RssPeak:
    """Samples the operator's RSS twice a second, for the peak during the burst as well as the end value."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0.0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(0.5):
            try:
                self.peak = max(self.peak, rss_mib(self.pid))
            except OSError:
                return


def progress(message: str) -> None:
    print(f"{time.strftime('%H:%M:%S')} {message}", file=sys.stderr, flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--latency-objects", type=int, default=100)
    parser.add_argument("--burst-objects", type=int, default=300)
    parser.add_argument("--resync-seconds", type=float, default=10.0)
    parser.add_argument("--settle-timeout", type=float, default=600.0, help="seconds to wait for a quiet cluster")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--operator-log", type=Path, help="keep a copy of the operator's log here")
    args = parser.parse_args()
    from kubernetes import client

    results: dict[str, Any] = {}
    metrics_port = free_ports(1)[0]
    # Every FlashModel gets a ClusterIP Service: the e2e default /24 holds only 253 of them, and the
    # API server refuses the rest ("failed to allocate a serviceIP: range is full"). Real clusters
    # use a /16 or /12 (kubeadm: 10.96.0.0/12); 10.0.0.1, in the apiserver certificate, stays the first IP.
    e2e.harness.cluster.SERVICE_CIDR = "10.0.0.0/16"
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
            rss = RssPeak(proc.pid)
            # 1. One object at a time: apply -> all its children present.
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
            progress(f"latency: p50={results['latency_p50_s']:.3f}s p99={results['latency_p99_s']:.3f}s")

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
                listed: dict[str, Any] = custom.list_namespaced_custom_object(GROUP, VERSION, ns, PLURAL)  # type: ignore[assignment]
                items: list[dict[str, Any]] = listed["items"]
                return sum(1 for o in items if (o.get("status") or {}).get("observedGeneration") == 1)

            while (written := statuses()) < len(names) and time.monotonic() - t0 < 300:
                time.sleep(0.5)
            if written < len(names):
                raise SystemExit(f"burst: only {written}/{len(names)} statuses written after 300 s")
            results["burst_objects"] = len(names)
            results["burst_create_s"] = created
            results["burst_children_s"] = all_children
            results["burst_status_s"] = time.monotonic() - t0
            progress(f"burst: children={all_children:.1f}s status={results['burst_status_s']:.1f}s")

            # 3. Settle: the controller-manager (20 writes/s by default) is still writing Deployment and PDB
            # status for minutes after a burst, and each such change is real news the operator mirrors into
            # the FlashModel status. Wait until one full resync period passes with no write to FlashModels or
            # children from anyone, then count writes over three full resync periods with nothing changing.
            def writes_now() -> float:
                counts = apiserver_requests(cp)
                return sum(counts.get((r, "write"), 0.0) for r in ("flashmodels", *CHILD_RESOURCES))

            settle_t0 = time.monotonic()
            last = writes_now()
            while time.monotonic() - settle_t0 < args.settle_timeout:
                time.sleep(args.resync_seconds + 1)
                now = writes_now()
                if now == last:
                    break
                last = now
            else:
                raise SystemExit(f"still writing after {args.settle_timeout:.0f} s of settling; see the operator log")
            results["settle_s"] = time.monotonic() - settle_t0
            progress(f"settled after {results['settle_s']:.0f} s")
            w0, a0, c0 = operator_writes(metrics_port), apiserver_requests(cp), cpu_seconds(proc.pid)
            window = 3 * args.resync_seconds + 1
            time.sleep(window)
            w1, a1, c1 = operator_writes(metrics_port), apiserver_requests(cp), cpu_seconds(proc.pid)
            results["noop_operator_cpu_percent"] = 100 * (c1 - c0) / window
            results["noop_pod_gets_per_s"] = (a1.get(("pods", "get"), 0.0) - a0.get(("pods", "get"), 0.0)) / window
            results["noop_window_s"] = window
            results["noop_resyncs_in_window"] = int(window // args.resync_seconds)
            results["objects_total"] = total
            results["noop_operator_writes"] = w1 - w0
            for (resource, kind), value in sorted(a1.items()):
                results[f"noop_apiserver_{resource}_{kind}s"] = value - a0.get((resource, kind), 0.0)
            # Each resync pass GETs its FlashModel: this shows the passes really ran in the window.
            gets = results.get("noop_apiserver_flashmodels_gets", 0.0)
            results["noop_flashmodel_gets_per_object_per_resync"] = gets / (total * results["noop_resyncs_in_window"])
            results["operator_rss_mib"] = rss_mib(proc.pid)
            rss.stop.set()
            results["operator_rss_peak_mib"] = max(rss.peak, results["operator_rss_mib"])
            results["operator_threads"] = len(list(Path(f"/proc/{proc.pid}/task").iterdir()))
            phases: dict[str, int] = {}
            for pod in (
                client.CoreV1Api(api)
                .list_pod_for_all_namespaces(label_selector="app.kubernetes.io/managed-by=flashmodel-operator")
                .items
            ):
                phase = str(pod.status.phase if pod.status else None)
                phases[phase] = phases.get(phase, 0) + 1
            results["engine_pods_by_phase"] = phases
            log_text = (Path(tmp) / "operator.log").read_text(errors="replace")
            results["operator_log_errors"] = sum(
                1 for line in log_text.splitlines() if "Traceback" in line or " ERROR " in line or "[ERROR" in line
            )
            if args.operator_log:
                args.operator_log.write_text(log_text)
            children.stop.set()
            burst.stop.set()
        api.close()  # type: ignore[no-untyped-call]
    print(json.dumps(results, indent=2))
    print()
    print("| measure | value | goal |")
    print("|---|---|---|")
    print(
        f"| apply -> 3 children, p50 / p99 / max ({args.latency_objects} objects, one at a time) | "
        f"{results['latency_p50_s'] * 1000:.0f} / {results['latency_p99_s'] * 1000:.0f} / "
        f"{results['latency_max_s'] * 1000:.0f} ms | p99 < 1 s |"
    )
    print(
        f"| {results['burst_objects']} created at once: all children / all statuses | "
        f"{results['burst_children_s']:.1f} s / {results['burst_status_s']:.1f} s | < 60 s |"
    )
    child_writes = sum(results.get(f"noop_apiserver_{r}_writes", 0.0) for r in CHILD_RESOURCES)
    print(
        f"| API writes during {results['noop_resyncs_in_window']} no-op resyncs of {total} objects "
        f"(operator's own count / apiserver: FlashModels / children) | {results['noop_operator_writes']:.0f} / "
        f"{results.get('noop_apiserver_flashmodels_writes', 0.0):.0f} / {child_writes:.0f} | 0 |"
    )
    print(
        f"| operator RSS at {total} FlashModels ({total} pods), end / peak | "
        f"{results['operator_rss_mib']:.0f} / {results['operator_rss_peak_mib']:.0f} MiB | < 200 MB |"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
