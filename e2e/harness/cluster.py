"""A real Kubernetes control plane (etcd, kube-apiserver, -controller-manager, -scheduler, kwok) as local processes."""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from kubernetes.client import ApiClient

log = logging.getLogger("flashmodel.e2e.harness.cluster")

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTBIN_SCRIPT = REPO_ROOT / "scripts" / "testbin.sh"
BINARIES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok", "helm")

# Inside 127.0.0.0/8, which Linux routes to the loopback device: a test can bind a real process
# to the IP kwok gives a pod and reach "the pod" at its own address (checked in test_cluster.py).
POD_CIDR = "127.16.0.0/16"
SERVICE_CIDR = "10.0.0.0/24"

T4_PRODUCT = "Tesla-T4"
KWOK_ANNOTATION = "kwok.x-k8s.io/node"
KWOK_TAINT = {"key": "kwok.x-k8s.io/node", "value": "fake", "effect": "NoSchedule"}
KWOK_TOLERATION = {"key": "kwok.x-k8s.io/node", "operator": "Exists", "effect": "NoSchedule"}
# What GPU node pools (GKE, the NVIDIA GPU operator) put on T4 nodes; off by default.
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}

_PR_SET_PDEATHSIG = 1


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or reached."""


class CommandError(subprocess.CalledProcessError):
    """A kubectl/helm call failed; unlike CalledProcessError its message carries stderr."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


def testbin_dir(build: bool = True) -> Path:
    """The directory with the control-plane binaries; builds missing ones via scripts/testbin.sh."""
    override = os.environ.get("FLASHMODEL_TESTBIN")
    if override:
        return Path(override)
    args = [str(TESTBIN_SCRIPT)] if build else [str(TESTBIN_SCRIPT), "--print-dir"]
    # stderr passes through so a cold build (many minutes) shows its progress.
    proc = subprocess.run(args, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise ControlPlaneError(f"scripts/testbin.sh failed rc={proc.returncode}; see its stderr above")
    return Path(proc.stdout.strip().splitlines()[-1])


def missing_binaries(bin_dir: Path) -> list[str]:
    """The names in BINARIES that are not executable files in bin_dir."""
    return [b for b in BINARIES if not os.access(bin_dir / b, os.X_OK)]


def free_ports(n: int) -> list[int]:
    """n distinct free loopback ports (free now; a racing process can still take one)."""
    # Hold all sockets open until every port is chosen, so one call never returns a port twice.
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: if the test process is SIGKILLed, the kernel
    # kills the component too, so a crashed pytest leaves no orphaned apiserver behind. The
    # signal fires when the *thread* that started the child exits: start from a long-lived thread.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def openssl(*args: str, cwd: Path) -> None:
    """Runs openssl in cwd; raises ControlPlaneError with its stderr if it fails."""
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ControlPlaneError(f"openssl {args[0]} failed rc={proc.returncode}: {proc.stderr.strip()}")


@dataclass(frozen=True)
class Pki:
    """Paths of the certificates and keys one control plane uses."""

    ca_crt: Path
    ca_key: Path
    apiserver_crt: Path
    apiserver_key: Path
    admin_crt: Path
    admin_key: Path
    sa_key: Path
    sa_pub: Path
    front_proxy_crt: Path
    front_proxy_key: Path

    @classmethod
    def at(cls, d: Path) -> Pki:
        """The paths of the files generate() writes into d."""
        return cls(
            d / "ca.crt",
            d / "ca.key",
            d / "apiserver.crt",
            d / "apiserver.key",
            d / "admin.crt",
            d / "admin.key",
            d / "sa.key",
            d / "sa.pub",
            d / "front-proxy-client.crt",
            d / "front-proxy-client.key",
        )

    @classmethod
    def generate(cls, d: Path) -> Pki:
        """Writes a CA, an apiserver serving cert, client certs (admin, front proxy) and SA keys into d."""
        d.mkdir(parents=True, exist_ok=True)
        # P-256 instead of RSA: key generation is instant, which matters on a loaded 2-core CI box.
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        days = ["-days", "3650"]
        openssl("req", "-x509", *key, *days, "-subj", "/CN=flashmodel-test-ca",
                 "-keyout", "ca.key", "-out", "ca.crt", cwd=d)  # fmt: skip
        sans = (
            "subjectAltName=IP:127.0.0.1,IP:10.0.0.1,DNS:localhost,DNS:kubernetes,"
            "DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local\n"
            "extendedKeyUsage=serverAuth\n"
        )
        (d / "apiserver.ext").write_text(sans)
        (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
        for name, subj, ext in (
            ("apiserver", "/CN=kube-apiserver", "apiserver.ext"),
            ("admin", "/O=system:masters/CN=flashmodel-admin", "client.ext"),
            # The aggregation layer's identity towards extension API servers (KEDA's metrics adapter).
            ("front-proxy-client", "/CN=front-proxy-client", "client.ext"),
        ):
            openssl("req", *key, "-subj", subj, "-keyout", f"{name}.key", "-out", f"{name}.csr", cwd=d)
            openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
                     *days, "-extfile", ext, "-out", f"{name}.crt", cwd=d)  # fmt: skip
        # The service-account token signing key pair (ES256 tokens).
        openssl("genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256", "-out", "sa.key", cwd=d)
        openssl("pkey", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
        return cls.at(d)


@dataclass
class Component:
    """One running control-plane process, started in its own process group."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self, env: Mapping[str, str]) -> None:
        """Starts the process with stdout and stderr going to log_path."""
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(env),
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        log.info("component=%s event=started pid=%d log=%s", self.name, self.proc.pid, self.log_path)

    def check_alive(self) -> None:
        """Raises ControlPlaneError with the log tail if the process has exited."""
        if self.proc is not None and self.proc.poll() is not None:
            raise ControlPlaneError(f"{self.name} exited rc={self.proc.returncode}; last log lines:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        """The last lines of the component's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal_group(self, sig: signal.Signals) -> None:
        """Sends sig to the process group (the component and anything it forked)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    def wait_stopped(self, timeout: float) -> bool:
        """Waits for exit; True if it exited (or never started)."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


@dataclass
class Ports:
    """The loopback ports of one control plane."""

    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int

    @classmethod
    def allocate(cls) -> Ports:
        """Picks free loopback ports for every component."""
        return cls(*free_ports(6))


def wait_until(
    what: str, ok: Callable[[], bool], timeout: float, alive: Callable[[], None] | None = None, interval: float = 0.2
) -> None:
    """Polls ok() until it is true; raises ControlPlaneError naming `what` after timeout seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if alive is not None:
            alive()
        if ok():
            return
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    """True if a GET of url answers 200 within 2 s."""
    try:
        with urllib.request.urlopen(url, timeout=2, context=context) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _etcd_member_is(url: str, member: str) -> bool:
    req = urllib.request.Request(f"{url}/v3/cluster/member/list", data=b"{}", method="POST")
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            members = json.loads(resp.read()).get("members", [])
    except (urllib.error.URLError, OSError, ValueError):
        return False
    return [m.get("name") for m in members] == [member]


@dataclass
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler + kwok on loopback.

    Usage: ``with ControlPlane(bin_dir) as cp: cp.add_t4_nodes(2); cp.kubectl("get", "nodes")``.
    """

    bin_dir: Path
    workdir: Path | None = None
    start_timeout: float = 120.0
    components: list[Component] = field(default_factory=list)
    startup_seconds: float = 0.0
    _owns_workdir: bool = False
    _node_count: int = 0
    _stopped: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        missing = missing_binaries(self.bin_dir)
        if missing:
            raise ControlPlaneError(f"binaries missing in {self.bin_dir}: {', '.join(missing)}; run scripts/testbin.sh")
        if self.workdir is None:
            self.workdir = Path(tempfile.mkdtemp(prefix="flashmodel-cp-"))
            self._owns_workdir = True
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.ports = Ports.allocate()

    # -- paths and environment -------------------------------------------------------------

    @property
    def dir(self) -> Path:
        """The working directory (PKI, etcd data, logs, kubeconfig)."""
        assert self.workdir is not None
        return self.workdir

    @property
    def kubeconfig(self) -> Path:
        """The admin (system:masters) kubeconfig."""
        return self.dir / "kubeconfig"

    @property
    def pki(self) -> Pki:
        """The certificates and keys of this control plane (written by start())."""
        return Pki.at(self.dir / "pki")

    @property
    def server(self) -> str:
        """The apiserver URL."""
        return f"https://127.0.0.1:{self.ports.apiserver}"

    @property
    def env(self) -> dict[str, str]:
        """os.environ plus KUBECONFIG, bin_dir first on PATH, and helm dirs inside workdir."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["PATH"] = f"{self.bin_dir}{os.pathsep}{env.get('PATH', '')}"
        # Keep helm's repositories and cache out of the user's home.
        for var, sub in (("HELM_CACHE_HOME", "cache"), ("HELM_CONFIG_HOME", "config"), ("HELM_DATA_HOME", "data")):
            env[var] = str(self.dir / "helm" / sub)
        return env

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Generates PKI, starts every component, and returns once the API is ready."""
        t0 = time.monotonic()
        atexit.register(self.stop)
        (self.dir / "logs").mkdir(exist_ok=True)
        try:
            for attempt in range(1, 4):
                try:
                    self._start()
                    break
                except ControlPlaneError as e:
                    # A free port can be taken by someone else's socket between picking and binding
                    # (other test sessions run control planes on this machine too): pick again.
                    if "address already in use" not in str(e) or attempt == 3:
                        raise
                    log.warning("event=port-taken attempt=%d error=%s", attempt, str(e).splitlines()[0])
                    self._terminate_components()
                    self.components.clear()
                    subprocess.run(["rm", "-rf", str(self.dir / "etcd")], check=False)
                    self.ports = Ports.allocate()
        except BaseException:
            self.stop()
            raise
        self.startup_seconds = time.monotonic() - t0
        log.info("event=control-plane-ready seconds=%.1f server=%s dir=%s", self.startup_seconds, self.server, self.dir)

    def _start(self) -> None:
        t0 = time.monotonic()
        pki = Pki.generate(self.dir / "pki")
        self._write_kubeconfig(pki)
        log.info("event=pki-ready seconds=%.1f", time.monotonic() - t0)
        p = self.ports
        b = self.bin_dir
        base_env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}

        # A unique member name lets the readiness check tell our etcd from another one that won
        # the port race: pointing our apiserver at someone else's etcd would mix two clusters.
        member = f"flashmodel-{secrets.token_hex(4)}"
        etcd = self._component(
            "etcd",
            [
                str(b / "etcd"),
                f"--name={member}",
                f"--data-dir={self.dir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{p.etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{p.etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{p.etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{p.etcd_peer}",
                f"--initial-cluster={member}=http://127.0.0.1:{p.etcd_peer}",
                # Test data is disposable; fsync dominates write latency on CI disks.
                "--unsafe-no-fsync=true",
                "--log-level=warn",
            ],
        )
        etcd.start(base_env)
        wait_until(
            f"etcd member {member}",
            lambda: _etcd_member_is(f"http://127.0.0.1:{p.etcd_client}", member),
            self.start_timeout,
            etcd.check_alive,
        )
        log.info("component=etcd event=ready seconds=%.1f", time.monotonic() - t0)

        apiserver = self._component(
            "kube-apiserver",
            [
                str(b / "kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{p.etcd_client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={p.apiserver}",
                f"--tls-cert-file={pki.apiserver_crt}",
                f"--tls-private-key-file={pki.apiserver_key}",
                f"--client-ca-file={pki.ca_crt}",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=RBAC",
                "--allow-privileged=true",
                # No kubelet runs the apiserver's "kubernetes" Service endpoint; nothing needs it here.
                "--endpoint-reconciler-type=none",
                f"--cert-dir={self.dir / 'pki' / 'apiserver-certs'}",
                # The aggregation layer's front proxy: without it the apiserver calls an extension
                # API server (KEDA's metrics adapter) with no client cert, the adapter sees
                # system:anonymous and refuses discovery and every metric read with 403.
                f"--requestheader-client-ca-file={pki.ca_crt}",
                "--requestheader-allowed-names=front-proxy-client",
                "--requestheader-username-headers=X-Remote-User",
                "--requestheader-group-headers=X-Remote-Group",
                "--requestheader-extra-headers-prefix=X-Remote-Extra-",
                f"--proxy-client-cert-file={pki.front_proxy_crt}",
                f"--proxy-client-key-file={pki.front_proxy_key}",
            ],
        )
        apiserver.start(base_env)
        ctx = self._admin_ssl_context(pki)
        wait_until(
            "kube-apiserver /readyz",
            lambda: http_ok(f"{self.server}/readyz", ctx),
            self.start_timeout,
            apiserver.check_alive,
        )
        log.info("component=kube-apiserver event=ready seconds=%.1f", time.monotonic() - t0)

        kc = str(self.kubeconfig)
        # Authn/authz kubeconfigs let the components check tokens on their own /metrics; without
        # them they log warnings and look for an in-cluster config.
        auth = [f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}"]
        kcm = self._component(
            "kube-controller-manager",
            [
                str(b / "kube-controller-manager"),
                *auth,
                "--leader-elect=false",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--root-ca-file={pki.ca_crt}",
                "--use-service-account-credentials=false",
                # With one shared credential every controller draws on one client's rate limit
                # (default 20 requests/s); namespace deletion after each test spends it in bursts,
                # and ReplicaSet/Deployment status updates can wait behind them.
                "--kube-api-qps=100",
                "--kube-api-burst=200",
                f"--cluster-signing-cert-file={pki.ca_crt}",
                f"--cluster-signing-key-file={pki.ca_key}",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.controller_manager}",
                f"--cert-dir={self.dir / 'pki' / 'kcm-certs'}",
                # kwok renews the fake nodes' leases; when real engines load the two cores, a late
                # renewal made the node controller mark every pod on a healthy node NotReady, which
                # emptied the Service for seconds. No test here simulates a node failure.
                "--node-monitor-grace-period=10m",
                # The HPA acts every sync period (default 15 s); 5 s lets an autoscaling test see
                # a scale step in seconds. With no HorizontalPodAutoscaler (every other test) the
                # controller has nothing to sync, so this costs them nothing.
                "--horizontal-pod-autoscaler-sync-period=5s",
            ],
        )
        scheduler = self._component(
            "kube-scheduler",
            [
                str(b / "kube-scheduler"),
                *auth,
                "--leader-elect=false",
                "--bind-address=127.0.0.1",
                f"--secure-port={p.scheduler}",
                f"--cert-dir={self.dir / 'pki' / 'scheduler-certs'}",
            ],
        )
        kwok = self._component(
            "kwok",
            [
                str(b / "kwok"),
                f"--kubeconfig={kc}",
                "--manage-all-nodes=false",
                f"--manage-nodes-with-annotation-selector={KWOK_ANNOTATION}=fake",
                "--manage-nodes-with-label-selector=",
                # Pods annotated so are left to the test (e2e/harness/kubelet.py runs real engines for them).
                "--disregard-status-with-annotation-selector=kwok.x-k8s.io/status=custom",
                "--disregard-status-with-label-selector=",
                f"--cidr={POD_CIDR}",
                "--node-ip=127.0.0.1",
                f"--server-address=127.0.0.1:{p.kwok}",
            ],
        )
        for c in (kcm, scheduler, kwok):
            c.start(base_env)
        insecure = ssl.create_default_context()
        # Their serving certs are self-signed at start-up; only liveness is checked here.
        insecure.check_hostname = False
        insecure.verify_mode = ssl.CERT_NONE
        wait_until(
            "kube-controller-manager /healthz",
            lambda: http_ok(f"https://127.0.0.1:{p.controller_manager}/healthz", insecure),
            self.start_timeout,
            kcm.check_alive,
        )
        wait_until(
            "kube-scheduler /healthz",
            lambda: http_ok(f"https://127.0.0.1:{p.scheduler}/healthz", insecure),
            self.start_timeout,
            scheduler.check_alive,
        )
        wait_until(
            "kwok /healthz",
            lambda: http_ok(f"http://127.0.0.1:{p.kwok}/healthz"),
            self.start_timeout,
            kwok.check_alive,
        )
        # Pods need the "default" ServiceAccount, which the controller-manager creates.
        wait_until(
            "default ServiceAccount",
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", "default", check=False).returncode == 0,
            self.start_timeout,
            self.check_alive,
        )
        self.check_alive()
        self._write_state()

    def _component(self, name: str, argv: list[str]) -> Component:
        c = Component(name, argv, self.dir / "logs" / f"{name}.log")
        self.components.append(c)
        return c

    def check_alive(self) -> None:
        """Raises ControlPlaneError if any component has exited."""
        for c in self.components:
            c.check_alive()

    def stop(self) -> None:
        """Stops every component by process group: clients first, then apiserver, then etcd."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._terminate_components()
        with contextlib.suppress(OSError):
            (self.dir / "state.json").unlink()
        atexit.unregister(self.stop)
        log.info("event=control-plane-stopped dir=%s", self.dir)
        if self._owns_workdir and os.environ.get("FLASHMODEL_KEEP_CLUSTER_DIR") != "1":
            subprocess.run(["rm", "-rf", str(self.dir)], check=False)

    def _terminate_components(self) -> None:
        # Clients first so the apiserver has no watches to drain, etcd last so the apiserver can flush.
        by_name = {c.name: c for c in self.components}
        waves = [["kwok", "kube-scheduler", "kube-controller-manager"], ["kube-apiserver"], ["etcd"]]
        for wave in waves:
            procs = [by_name[n] for n in wave if n in by_name]
            for c in procs:
                c.signal_group(signal.SIGTERM)
            for c in procs:
                if not c.wait_stopped(timeout=15):
                    log.warning("component=%s event=kill reason=sigterm-timeout", c.name)
                    c.signal_group(signal.SIGKILL)
                    c.wait_stopped(timeout=5)

    # -- files -----------------------------------------------------------------------------

    def _write_kubeconfig(self, pki: Pki) -> None:
        def b64(p: Path) -> str:
            return base64.b64encode(p.read_bytes()).decode()

        cfg = {
            "apiVersion": "v1",
            "kind": "Config",
            "current-context": "flashmodel",
            "clusters": [
                {
                    "name": "flashmodel",
                    "cluster": {"server": self.server, "certificate-authority-data": b64(pki.ca_crt)},
                }
            ],
            "users": [
                {
                    "name": "admin",
                    "user": {"client-certificate-data": b64(pki.admin_crt), "client-key-data": b64(pki.admin_key)},
                }
            ],
            "contexts": [{"name": "flashmodel", "context": {"cluster": "flashmodel", "user": "admin"}}],
        }
        self.kubeconfig.write_text(yaml.safe_dump(cfg))
        self.kubeconfig.chmod(0o600)

    def _admin_ssl_context(self, pki: Pki) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(pki.ca_crt))
        ctx.load_cert_chain(str(pki.admin_crt), str(pki.admin_key))
        return ctx

    def _write_state(self) -> None:
        # Lets `python -m e2e.harness.cluster down --dir` find the processes of an `up` in another shell.
        state = {
            "owner_pid": os.getpid(),
            "server": self.server,
            "kubeconfig": str(self.kubeconfig),
            "components": {c.name: c.proc.pid for c in self.components if c.proc is not None},
        }
        (self.dir / "state.json").write_text(json.dumps(state, indent=2))

    # -- clients ---------------------------------------------------------------------------

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Runs kubectl against this control plane; raises CommandError (with stderr) if check fails."""
        return self._run(["kubectl", *args], check=check, input=input, timeout=timeout)

    def wait_established(self, crd: str, timeout: float = 60) -> None:
        """Waits until the CRD named `crd` serves its kind.

        Not `kubectl wait --for=condition=Established`: for a CRD whose status the API server has not
        written yet it fails at once ("status.conditions accessor error"), which a large CRD on a busy
        machine hits.
        """
        deadline = time.monotonic() + timeout
        query = "jsonpath={.status.conditions[?(@.type==\"Established\")].status}"
        while self.kubectl("get", "crd", crd, "-o", query, check=False).stdout.strip() != "True":
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"CRD {crd} not Established within {timeout:.0f} s")
            time.sleep(0.2)

    def helm(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        """Runs the testbin helm against this control plane."""
        return self._run([str(self.bin_dir / "helm"), *args], check=check, input=input, timeout=timeout)

    def _run(self, argv: list[str], check: bool, input: str | None, timeout: float) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            argv, env=self.env, input=input, capture_output=True, text=True, timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise CommandError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    def api_client(self) -> ApiClient:
        """A kubernetes.client.ApiClient for this control plane (the caller closes it)."""
        from kubernetes import config  # imported here so the module loads without the client

        # kubernetes.config has no annotations (kubernetes.client has).
        api: ApiClient = config.new_client_from_config(config_file=str(self.kubeconfig))  # type: ignore[no-untyped-call]
        return api

    def create_namespace(self, prefix: str = "e2e", timeout: float = 60) -> str:
        """Creates a namespace named prefix-<random> and returns once its default ServiceAccount exists."""
        slug = "".join(ch if ch.isalnum() else "-" for ch in prefix.lower()).strip("-")[:40].strip("-")
        name = f"{slug or 'e2e'}-{secrets.token_hex(3)}"
        self.kubectl("create", "namespace", name)
        # Pods are refused until the controller-manager has created the namespace's default SA.
        wait_until(
            f"ServiceAccount {name}/default",
            lambda: self.kubectl("get", "serviceaccount", "default", "-n", name, check=False).returncode == 0,
            timeout,
        )
        return name

    def delete_namespace(self, name: str, timeout: float = 120) -> None:
        """Deletes a namespace and waits until it is gone, so its pods no longer hold any node."""
        self.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)
        # Pods no kubelet runs (kwok told to leave them alone, none of e2e/harness/kubelet.py's) would stay
        # Terminating for ever and hold the namespace; a real cluster's pod GC removes such pods.
        self.kubectl("delete", "pods", "--all", "-n", name, "--grace-period=0", "--force", "--wait=false", check=False)
        wait_until(
            f"namespace {name} deleted",
            lambda: self.kubectl("get", "namespace", name, check=False).returncode != 0,
            timeout,
        )

    # -- fake T4 nodes ---------------------------------------------------------------------

    def add_t4_nodes(
        self,
        n: int,
        gpus: int = 1,
        kwok_taint: bool = True,
        gpu_taint: bool = False,
        timeout: float = 60,
        labels: Mapping[str, str] | None = None,
    ) -> list[str]:
        """Creates n kwok-managed nodes shaped like g4dn.xlarge T4 nodes; returns their names once Ready."""
        names: list[str] = []
        docs: list[dict[str, Any]] = []
        for _ in range(n):
            name = f"t4-node-{self._node_count}"
            self._node_count += 1
            names.append(name)
            docs.append(t4_node(name, gpus=gpus, kwok_taint=kwok_taint, gpu_taint=gpu_taint, labels=labels))
        self.kubectl("create", "-f", "-", input=yaml.safe_dump_all(docs))
        self.kubectl(
            "wait",
            "--for=condition=Ready",
            f"--timeout={int(timeout)}s",
            *(f"node/{x}" for x in names),
            timeout=timeout + 10,
        )
        log.info("event=nodes-ready count=%d gpus_per_node=%d", n, gpus)
        return names


def t4_node(
    name: str, gpus: int = 1, kwok_taint: bool = True, gpu_taint: bool = False, labels: Mapping[str, str] | None = None
) -> dict[str, Any]:
    """A Node manifest for a fake T4 node (status included: Node create keeps it, kwok keeps capacity)."""
    # g4dn.xlarge: 4 vCPU, 16 GiB, one T4 -- the cheapest T4 shape users run.
    resources = {
        "cpu": str(4 * gpus),
        "memory": f"{16 * gpus}Gi",
        "pods": "110",
        "ephemeral-storage": "100Gi",
        "nvidia.com/gpu": str(gpus),
    }
    taints = ([KWOK_TAINT] if kwok_taint else []) + ([GPU_TAINT] if gpu_taint else [])
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "annotations": {KWOK_ANNOTATION: "fake", "node.alpha.kubernetes.io/ttl": "0"},
            "labels": {
                "type": "kwok",
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "nvidia.com/gpu.product": T4_PRODUCT,
                "nvidia.com/gpu.count": str(gpus),
                "nvidia.com/gpu.memory": "15360",
                **(labels or {}),
            },
        },
        "spec": {"taints": taints},
        "status": {"capacity": resources, "allocatable": dict(resources)},
    }


# -- CLI ---------------------------------------------------------------------------------------


def _pid_is(pid: int, binary_hint: str) -> bool:
    # Guards against killing an unrelated process that reused a PID after a reboot or crash.
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return any(binary_hint.encode() in part for part in cmdline[:2])


def down(workdir: Path, timeout: float = 40) -> int:
    """Stops the control plane an `up` started in workdir; returns how many processes were signalled."""
    state_path = workdir / "state.json"
    if not state_path.exists():
        log.info("event=down-nothing-running dir=%s", workdir)
        return 0
    state = json.loads(state_path.read_text())
    owner = int(state["owner_pid"])
    if _pid_is(owner, "python"):
        # The owner stops its children in order and removes state.json.
        os.kill(owner, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while state_path.exists() and time.monotonic() < deadline:
            time.sleep(0.2)
    signalled = 0
    for name, pid in state["components"].items():
        if _pid_is(int(pid), name):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(pid), signal.SIGKILL)
                signalled += 1
                log.warning("component=%s pid=%d event=killed reason=owner-did-not-stop-it", name, pid)
    with contextlib.suppress(OSError):
        state_path.unlink()
    return signalled


def _up(workdir: Path, nodes: int, gpus: int, kwok_taint: bool) -> int:
    bin_dir = testbin_dir(build=True)
    stop_event = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop_event.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    cp = ControlPlane(bin_dir, workdir=workdir)
    with cp:
        if nodes:
            cp.add_t4_nodes(nodes, gpus=gpus, kwok_taint=kwok_taint)
        print(f"KUBECONFIG={cp.kubeconfig}", flush=True)
        print(f"PATH={bin_dir}:$PATH  # kwok, helm", flush=True)
        while not stop_event.wait(1.0):
            cp.check_alive()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`up --dir DIR` runs a control plane in the foreground until SIGINT/SIGTERM; `down --dir DIR` ends it."""
    parser = argparse.ArgumentParser(prog="python -m e2e.harness.cluster", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    up_p = sub.add_parser("up", help="start a control plane and stay in the foreground")
    up_p.add_argument("--dir", type=Path, required=True, help="working directory (PKI, etcd data, logs)")
    up_p.add_argument("--nodes", type=int, default=2, help="fake T4 nodes to create")
    up_p.add_argument("--gpus", type=int, default=1, help="nvidia.com/gpu per node")
    up_p.add_argument(
        "--no-kwok-taint",
        action="store_true",
        help="leave off the kwok.x-k8s.io/node taint, so pods need no kwok toleration",
    )
    down_p = sub.add_parser("down", help="stop the control plane that `up` started in --dir")
    down_p.add_argument("--dir", type=Path, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(message)s")
    if args.command == "up":
        workdir: Path = args.dir.resolve()
        if (workdir / "state.json").exists():
            down(workdir)
        # A reused directory would carry an old etcd; start every cluster empty.
        subprocess.run(["rm", "-rf", str(workdir / "etcd")], check=False)
        return _up(workdir, args.nodes, args.gpus, not args.no_kwok_taint)
    down(args.dir.resolve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
