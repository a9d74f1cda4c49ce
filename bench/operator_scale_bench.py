"""The operator at fleet scale: idle CPU, RSS and API rate, paced and burst latency, from 100 to 1,000 models.

    python bench/operator_scale_bench.py [--levels 100,250,500,1000] [--burst 300] [--json out.json]
    python bench/operator_scale_bench.py --quick        # 50 and 100 models, a burst of 50: a few minutes

Starts its own control plane (e2e/harness/cluster.py, kwok nodes with T4 GPUs), a stand-in shim for every
pod (bench/operator_standin_shim.py: one process answering on each pod IP, which kwok takes from
127.16.0.0/16, so the operator really polls each pod over HTTP), and the operator as a process with its
production settings (nothing overridden but the metrics port). The stand-in answers the operator's
one-request health poll. Then, for each level of the fleet:

1. grow the fleet to the level (models created 8 at a time), wait until every pod is Running and
   prewarmed (its readiness gate opened by the operator) and every model has a status;
2. wait until the API server sees no writes to FlashModels, pods or children for 10 s, then measure an
   idle window: the operator's CPU seconds (utime + stime from /proc/PID/stat) over the window, its RSS,
   the API server's request counts by verb (apiserver_request_total deltas: the operator's reads and
   writes, plus the control plane's own, listed apart), the stand-in's polls per second, the load average;
3. paced creates with the fleet idle: one new model every --pace seconds; for each, create -> its
   children seen (ConfigMap, Deployment, Service), and create -> its first Pod seen (the Deployment ->
   ReplicaSet -> Pod chain included); the median time to each step of that chain;
4. after the last level: a burst of --burst new models created at once (16 client threads), timed to all
   children, all statuses (observedGeneration 1) and all pods prewarmed;
5. optionally (--detect), the detection time of a hung and a diverging pod: the stand-in's /readyz starts
   failing (or its divergence signal turns on) on the pod of each of 4 models with hungReadinessSeconds 10,
   the 4 faults staggered over one poll period; the time from each fault to the operator's decision,
   minus the threshold, is how long the operator took to see it.

Prints the JSON; writes it with --json. The machine's 2 cores are shared: read CPU seconds, not wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
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
from bench.operator_bench import (  # noqa: E402
    CHILD_KINDS,
    component_cpu_seconds,
    cpu_seconds,
    percentile,
    progress,
    rss_mib,
)
from e2e.harness.cluster import ControlPlane, free_ports, testbin_dir  # noqa: E402
from e2e.harness.operator_run import running_operator  # noqa: E402

GROUP, VERSION, PLURAL = "serving.flashmodel.io", "v1alpha1", "flashmodels"
MANAGED = "app.kubernetes.io/managed-by=flashmodel-operator"
GATE = f"{GROUP}/prewarmed"
PREWARMED = ("PrewarmSucceeded", "PrewarmDisabled")
REMEDIATION_REASONS = ("GenerationHung", "MemoryDivergence")


def flashmodel(name: str, remediation: dict[str, Any] | None = None) -> dict[str, Any]:
    spec: dict[str, Any] = {"model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}, "replicas": 1}
    if remediation:
        spec["remediation"] = remediation
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "FlashModel", "metadata": {"name": name}, "spec": spec}


class Fleet:
    """Watches (all namespaces) of the operator's children and pods: when each model got what."""

    def __init__(self, api: Any) -> None:
        from kubernetes import client

        core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
        self.cond = threading.Condition()
        self.kinds: dict[str, set[str]] = {}
        self.children_at: dict[str, float] = {}
        self.child_at: dict[tuple[str, str], float] = {}
        """(model, kind) -> when the first child of that kind was seen: a paced create's chain, step by step."""
        self.first_pod_at: dict[str, float] = {}
        self.pods: dict[str, tuple[str, str, str | None, bool]] = {}
        """pod name -> (model, phase, IP, prewarmed)."""
        self.deleted_at: dict[str, float] = {}
        self.drained_at: dict[str, float] = {}
        """pod name -> when the operator closed its gate to drain it (its remediation decision)."""
        self.stop = threading.Event()
        lists = {
            "deployments": apps.list_deployment_for_all_namespaces,
            "services": core.list_service_for_all_namespaces,
            "configmaps": core.list_config_map_for_all_namespaces,
            "pods": core.list_pod_for_all_namespaces,
        }
        self.status_at: dict[str, float] = {}
        """model -> when its status first said it observed its generation (its first pass's write)."""
        for kind, fn in lists.items():
            threading.Thread(target=self._run, args=(kind, fn), daemon=True).start()
        models = client.CustomObjectsApi(api).list_cluster_custom_object
        threading.Thread(target=self._run, args=("flashmodels", models, GROUP, VERSION, PLURAL), daemon=True).start()

    def _run(self, kind: str, list_fn: Any, *args: str) -> None:
        from kubernetes import watch

        class RawWatch(watch.Watch):  # type: ignore[misc,unused-ignore]  # kubernetes.watch may lack annotations
            """Events as parsed JSON: the client's model classes cost about 1-3 ms of CPU an event (a
            pod's body), some 10 s of the two cores the operator and control plane share in a burst
            of 300, for the four fields read here."""

            def get_return_type(self, func: Any) -> None:
                return None

        while not self.stop.is_set():
            try:
                stream: Any = RawWatch()  # type: ignore[no-untyped-call,unused-ignore]
                selector = {} if kind == "flashmodels" else {"label_selector": MANAGED}
                for event in stream.stream(list_fn, *args, timeout_seconds=3600, **selector):
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        self._on(kind, event["type"], event["object"])
            except Exception as exc:  # a broken watch lists again: every record here is idempotent
                if not self.stop.is_set():
                    progress(f"watch {kind}: {type(exc).__name__}; reconnecting")
                    time.sleep(0.5)

    def _on(self, kind: str, type_: str, obj: dict[str, Any]) -> None:
        now = time.monotonic()
        meta = obj.get("metadata") or {}
        key = f"{meta.get('namespace')}/{(meta.get('labels') or {}).get(f'{GROUP}/model')}"
        with self.cond:
            if kind == "flashmodels":
                observed = (obj.get("status") or {}).get("observedGeneration")
                if type_ != "DELETED" and observed is not None and observed == meta.get("generation"):
                    self.status_at.setdefault(f"{meta.get('namespace')}/{meta.get('name')}", now)
            elif kind == "pods":
                name = f"{meta.get('namespace')}/{meta.get('name')}"
                self.first_pod_at.setdefault(key, now)
                if type_ == "DELETED" or meta.get("deletionTimestamp"):
                    self.deleted_at.setdefault(name, now)
                    self.pods.pop(name, None)
                else:
                    status = obj.get("status") or {}
                    gate = [c for c in status.get("conditions") or [] if c.get("type") == GATE]
                    gated = any(c.get("status") == "True" and c.get("reason") in PREWARMED for c in gate)
                    if any(c.get("status") == "False" and c.get("reason") in REMEDIATION_REASONS for c in gate):
                        self.drained_at.setdefault(name, now)
                    self.pods[name] = (key, str(status.get("phase")), status.get("podIP"), gated)
            elif type_ != "DELETED":
                self.child_at.setdefault((key, kind), now)
                kinds = self.kinds.setdefault(key, set())
                kinds.add(kind)
                if len(kinds) == len(CHILD_KINDS):
                    self.children_at.setdefault(key, now)
            self.cond.notify_all()

    def wait(self, what: str, done: Any, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not done():
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SystemExit(f"timed out after {timeout:.0f} s waiting for {what}")
                self.cond.wait(min(left, 1.0))

    def prewarmed(self, keys: set[str]) -> int:
        return sum(1 for model, phase, _, gated in self.pods.values() if model in keys and gated)

    def pod_of(self, key: str) -> tuple[str, str | None]:
        for name, (model, _, ip, _) in self.pods.items():
            if model == key:
                return name, ip
        raise KeyError(key)


def apiserver_counts(cp: ControlPlane) -> dict[str, float]:
    """apiserver_request_total summed by resource and verb (WATCH excluded: a watch is one long request)."""
    totals: dict[str, float] = {}
    for line in cp.kubectl("get", "--raw", "/metrics").stdout.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.rindex("}")].split(","))
        verb = labels.get("verb", "").strip('"')
        if verb in ("WATCH", "CONNECT"):
            continue
        key = f"{labels.get('resource', '').strip(chr(34))}/{labels.get('subresource', '').strip(chr(34))}:{verb}"
        totals[key] = totals.get(key, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


# Resources only the control plane reads and writes while the fleet is idle (leases: node heartbeats
# and leader election); reported apart from the rest, which the operator touches.
CONTROL_PLANE_ONLY = frozenset({"leases", "nodes", "endpoints", "endpointslices", "events", ""})


def control_plane_only(key: str) -> bool:
    return key.split("/", 1)[0] in CONTROL_PLANE_ONLY


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def standin_counts(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/counts", timeout=10) as resp:
        counts: dict[str, float] = json.loads(resp.read())
        return counts


def cpu_split(pid: int) -> dict[str, float]:
    """CPU seconds so far of the event loop's thread (the main thread: kopf, the pod polls) and of the
    other threads (the resync's reconciles, the API calls run in threads), each user and system."""

    def times(stat: Path) -> tuple[float, float]:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        tick = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) / tick, int(fields[12]) / tick

    (user, system), (main_user, main_system) = (
        times(Path(f"/proc/{pid}/stat")),
        times(Path(f"/proc/{pid}/task/{pid}/stat")),
    )
    return {
        "loop_thread_user": main_user,
        "loop_thread_system": main_system,
        "other_threads_user": user - main_user,
        "other_threads_system": system - main_system,
    }


def fault(port: int, ip: str, kind: str) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}/fault?ip={ip}&kind={kind}", method="POST")
    urllib.request.urlopen(req, timeout=10).read()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="100,250,500,1000")
    parser.add_argument("--burst", type=int, default=300)
    parser.add_argument("--paced", type=int, default=15, help="paced creates per level")
    parser.add_argument("--pace", type=float, default=2.0, help="seconds between paced creates")
    parser.add_argument("--idle-window", type=float, default=60.0)
    parser.add_argument("--detect", action="store_true", help="measure hung and diverging pod detection at the end")
    parser.add_argument("--quick", action="store_true", help="levels 50,100, burst 50, 10 paced, 30 s windows")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--operator-log", type=Path)
    parser.add_argument("--py-spy", type=Path, help="py-spy binary: profile the last level's idle window")
    parser.add_argument("--profile-out", type=Path, default=Path("/tmp/operator-idle-profile.txt"))
    args = parser.parse_args()
    if args.quick:
        args.levels, args.burst, args.paced, args.idle_window = "50,100", 50, 10, 30.0
    levels = [int(x) for x in args.levels.split(",")]
    from kubernetes import client

    results: dict[str, Any] = {"levels": [], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    metrics_port, control_port = free_ports(2)
    e2e.harness.cluster.SERVICE_CIDR = "10.0.0.0/16"  # a ClusterIP Service per model; a /24 holds 253
    standin = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "operator_standin_shim.py"), "--control-port", str(control_port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert standin.stdout is not None
    results["standin"] = json.loads(standin.stdout.readline())
    try:
        with tempfile.TemporaryDirectory() as tmp, ControlPlane(testbin_dir(build=True)) as cp:
            top = levels[-1] + args.paced * len(levels) + args.burst + 4
            cp.add_t4_nodes(top // 16 + 2, gpus=16, kwok_taint=False, gpu_taint=True, timeout=300)
            cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "flashmodel.yaml"))
            cp.kubectl("wait", "--for=condition=Established", "crd/flashmodels.serving.flashmodel.io")
            api = cp.api_client()
            custom = client.CustomObjectsApi(api)
            fleet = Fleet(api)
            ns = cp.create_namespace("fleet")
            from flashmodel_operator.settings import OperatorSettings

            production = OperatorSettings()
            results["settings"] = {
                "resync_seconds": production.resync_seconds,
                "monitor_seconds": production.monitor_seconds,
            }
            env = {"FLASHMODEL_METRICS_PORT": str(metrics_port)}
            log_path = Path(tmp) / "operator.log"
            with running_operator(
                cp.kubeconfig, log_path, resync_seconds=production.resync_seconds, extra_env=env
            ) as proc:
                time.sleep(3)
                made: list[str] = []

                def create(name: str, body: dict[str, Any] | None = None) -> None:
                    custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body or flashmodel(name))

                for level in levels:
                    row: dict[str, Any] = {"models": level}
                    new = [f"m-{i}" for i in range(len(made), level)]
                    t0 = time.monotonic()
                    with ThreadPoolExecutor(8) as pool:
                        list(pool.map(create, new))
                    made += new
                    keys = {f"{ns}/{n}" for n in made}
                    fleet.wait(
                        f"{level} pods prewarmed",
                        lambda k=keys: fleet.prewarmed(k) >= len(k),
                        timeout=120 + 2 * len(new),
                    )
                    row["grow_s"] = time.monotonic() - t0
                    progress(f"level {level}: {len(made)} models prewarmed after {row['grow_s']:.0f} s")

                    # Quiet: no writes to the operator's kinds for 10 s.
                    def writes() -> float:
                        return sum(
                            v
                            for k, v in apiserver_counts(cp).items()
                            if not k.endswith((":GET", ":LIST")) and not control_plane_only(k)
                        )

                    last, quiet_t0 = writes(), time.monotonic()
                    while time.monotonic() - quiet_t0 < 300:
                        time.sleep(10)
                        if (now := writes()) == last:
                            break
                        last = now
                    row["settle_s"] = time.monotonic() - quiet_t0
                    a0, c0, s0, load0, split0 = (
                        apiserver_counts(cp),
                        cpu_seconds(proc.pid),
                        standin_counts(control_port),
                        loadavg(),
                        cpu_split(proc.pid),
                    )
                    w0 = time.monotonic()
                    spy = None
                    if args.py_spy and level == levels[-1]:
                        spy = subprocess.Popen(
                            [
                                str(args.py_spy),
                                "record",
                                "-p",
                                str(proc.pid),
                                "-d",
                                str(int(args.idle_window)),
                                "-f",
                                "raw",
                                "-o",
                                str(args.profile_out),
                                "--nonblocking",
                            ]
                        )
                    time.sleep(args.idle_window)
                    if spy is not None:
                        spy.wait(60)
                    window = time.monotonic() - w0
                    a1, c1, s1 = apiserver_counts(cp), cpu_seconds(proc.pid), standin_counts(control_port)
                    split1 = cpu_split(proc.pid)
                    row["idle_window_s"] = round(window, 1)
                    row["idle_cpu_percent"] = round(100 * (c1 - c0) / window, 2)
                    row["idle_cpu_percent_by_thread"] = {
                        k: round(100 * (split1[k] - split0[k]) / window, 2) for k in split1
                    }
                    row["rss_mib"] = round(rss_mib(proc.pid), 1)
                    delta = {k: v - a0.get(k, 0.0) for k, v in a1.items() if v - a0.get(k, 0.0) > 0}
                    ours = {k: round(v / window, 2) for k, v in delta.items() if not control_plane_only(k)}
                    row["idle_api_rps_operator_kinds"] = round(sum(ours.values()), 2)
                    row["idle_api_rps_by_request"] = ours
                    row["idle_api_rps_control_plane_only"] = round(
                        sum(v for k, v in delta.items() if control_plane_only(k)) / window, 2
                    )
                    row["idle_shim_requests_per_s"] = {k: round((s1.get(k, 0) - s0.get(k, 0)) / window, 1) for k in s1}
                    row["load_before"], row["load_after"] = load0, loadavg()
                    progress(
                        f"level {level}: idle cpu {row['idle_cpu_percent']}% rss {row['rss_mib']} MiB "
                        f"api {row['idle_api_rps_operator_kinds']}/s load {row['load_after']}"
                    )
                    # Paced creates with the fleet idle.
                    children, first_pod = [], []
                    chain: dict[str, list[float]] = {}
                    for i in range(args.paced):
                        name = f"p{level}-{i}"
                        key = f"{ns}/{name}"
                        t0 = time.monotonic()
                        create(name)
                        chain.setdefault("create_call", []).append(time.monotonic() - t0)
                        fleet.wait(
                            f"{name}'s first pod",
                            lambda k=key: k in fleet.first_pod_at and k in fleet.children_at,
                            timeout=60,
                        )
                        children.append(fleet.children_at[key] - t0)
                        first_pod.append(fleet.first_pod_at[key] - t0)
                        for kind in CHILD_KINDS:
                            chain.setdefault(kind, []).append(fleet.child_at[(key, kind)] - t0)
                        made.append(name)
                        time.sleep(max(0.0, args.pace - (time.monotonic() - t0)))
                    if children:  # none with --paced 0: the idle figures alone
                        row["paced_children_ms"] = {
                            "p50": round(1000 * statistics.median(children)),
                            "p99": round(1000 * percentile(children, 99)),
                            "max": round(1000 * max(children)),
                        }
                        row["paced_first_pod_ms"] = {
                            "p50": round(1000 * statistics.median(first_pod)),
                            "p99": round(1000 * percentile(first_pod, 99)),
                            "max": round(1000 * max(first_pod)),
                        }
                        # Where a paced create's time goes: each step of its chain seen, from the create's start.
                        row["paced_chain_p50_ms"] = {k: round(1000 * statistics.median(v)) for k, v in chain.items()}
                        row["paced_chain_p50_ms"]["first_pod"] = row["paced_first_pod_ms"]["p50"]
                        progress(
                            f"level {level}: paced children {row['paced_children_ms']} first pod "
                            f"{row['paced_first_pod_ms']}"
                        )
                    row["load_after_paced"] = loadavg()
                    results["levels"].append(row)

                if args.burst:
                    names = [f"b-{i}" for i in range(args.burst)]
                    keys = {f"{ns}/{n}" for n in names}
                    load0 = loadavg()
                    c0 = cpu_seconds(proc.pid)
                    own0 = os.times()
                    named = {"operator": proc.pid, "standin": standin.pid, "benchmark": os.getpid()}
                    parts0 = component_cpu_seconds(named)
                    burst_a0 = apiserver_counts(cp)
                    t0 = time.monotonic()
                    with ThreadPoolExecutor(16) as pool:
                        list(pool.map(create, names))
                    created = time.monotonic() - t0
                    fleet.wait("burst children", lambda: all(k in fleet.children_at for k in keys), 300)
                    all_children = max(fleet.children_at[k] for k in keys) - t0

                    # From the watch: a LIST of every model twice a second (8 MB at 1,315 models) cost
                    # the API server and this process more CPU than the operator's passes it waited on.
                    fleet.wait("burst statuses", lambda: all(k in fleet.status_at for k in keys), 300)
                    all_status = max(fleet.status_at[k] for k in keys) - t0
                    parts1 = component_cpu_seconds(named)
                    fleet.wait("burst prewarmed", lambda: fleet.prewarmed(keys) >= len(keys), 600)
                    all_prewarmed = time.monotonic() - t0
                    burst_a1 = apiserver_counts(cp)
                    # The operator's (and the benchmark's own few) requests until the last pod prewarmed.
                    burst_api = {
                        k: round(v - burst_a0.get(k, 0.0))
                        for k, v in burst_a1.items()
                        if not control_plane_only(k) and v - burst_a0.get(k, 0.0) > 0
                    }
                    results["burst"] = {
                        "models": args.burst,
                        "fleet_before": len(made),
                        "create_calls_s": round(created, 1),
                        "all_children_s": round(all_children, 1),
                        "all_status_s": round(all_status, 1),
                        "all_prewarmed_s": round(all_prewarmed, 1),
                        # Whether the last status is a straggler or the end of a steady rate.
                        "status_s_quantiles": {
                            f"p{q}": round(percentile([fleet.status_at[k] - t0 for k in keys], q), 1)
                            for q in (10, 50, 90, 99)
                        },
                        "operator_cpu_s": round(cpu_seconds(proc.pid) - c0, 1),
                        # Every process on the two cores until the last status: who the burst waits on.
                        "cpu_s_to_all_status_by_process": {k: round(parts1[k] - parts0[k], 1) for k in parts1},
                        # This process's own watches and creates, on the same two cores.
                        "benchmark_cpu_s": round(sum(os.times()[:2]) - sum(own0[:2]), 1),
                        "load_before": load0,
                        "load_after": loadavg(),
                        "rss_mib_after": round(rss_mib(proc.pid), 1),
                        "api_requests_to_prewarmed": burst_api,
                    }
                    made += names
                    progress(f"burst: {results['burst']}")

                if args.detect:
                    results["detect"] = detect(fleet, create, ns, control_port, production.monitor_seconds)
                    progress(f"detect: {results['detect']}")
                log_text = log_path.read_text(errors="replace")
                results["operator_log_errors"] = sum(
                    1 for line in log_text.splitlines() if "Traceback" in line or "[ERROR" in line
                )
                if args.operator_log:
                    args.operator_log.write_text(log_text)
            fleet.stop.set()
            api.close()  # type: ignore[no-untyped-call]
    finally:
        standin.terminate()
        standin.wait(10)
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


HUNG_READINESS_SECONDS = 10
CONFIRM_SECONDS = 15  # remediation.CONFIRM_SECONDS: the operator's confirmation of a divergence signal


DETECT_PODS = 4
"""Pods faulted per kind, each one sample of the delay. Created together, their pods are polled nearly in
step, so their faults are staggered over one poll period: the samples then cover the poll phase."""


def detect(fleet: Fleet, create: Any, ns: str, control_port: int, monitor_seconds: float) -> dict[str, Any]:
    """Seconds from a fault appearing on a pod to the operator's decision (its gate closed to drain it).

    The decision can come no sooner than the threshold (hungReadinessSeconds, or the operator's
    divergence confirmation); what the polling adds is the rest, `seen_after_s`.
    """
    out: dict[str, Any] = {}
    for kind, threshold in (("hung", HUNG_READINESS_SECONDS), ("diverge", CONFIRM_SECONDS)):
        keys = [f"{ns}/detect-{kind}-{i}" for i in range(DETECT_PODS)]
        for key in keys:
            name = key.split("/")[1]
            create(name, flashmodel(name, {"hungReadinessSeconds": HUNG_READINESS_SECONDS}))
        fleet.wait(f"detect-{kind} prewarmed", lambda k=set(keys): fleet.prewarmed(k) >= len(k), 180)
        time.sleep(7)  # past the first polls after the prewarm: the fault starts on a steady pod
        pods = [fleet.pod_of(key) for key in keys]
        first, started = time.monotonic(), {}
        for i, (name, ip) in enumerate(pods):
            assert ip is not None
            time.sleep(max(0.0, first + i * monitor_seconds / len(pods) - time.monotonic()))
            started[name] = time.monotonic()
            fault(control_port, ip, kind)
        fleet.wait(f"detect-{kind} evictions", lambda p=pods: all(n in fleet.deleted_at for n, _ in p), 240)
        decided = [fleet.drained_at.get(n, fleet.deleted_at[n]) - started[n] for n, _ in pods]
        for _, ip in pods:
            fault(control_port, str(ip), "none")
        out[kind] = {
            "threshold_s": threshold,
            "fault_to_decision_s": [round(d, 1) for d in decided],
            "fault_to_eviction_s": [round(fleet.deleted_at[n] - started[n], 1) for n, _ in pods],
            "seen_after_s_mean": round(statistics.mean(decided) - threshold, 2),
            "seen_after_s_max": round(max(decided) - threshold, 2),
        }
    return out


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
