"""Real autoscaling parts for e2e: Prometheus, KEDA's operator and metrics adapter, as local processes."""

from __future__ import annotations

import atexit
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, Self

import yaml

from e2e.harness.cluster import (
    REPO_ROOT,
    TESTBIN_SCRIPT,
    Component,
    ControlPlane,
    ControlPlaneError,
    free_ports,
    http_ok,
    openssl,
    wait_until,
)

log = logging.getLogger("flashmodel.e2e.harness.autoscaling")

SCRAPE_CONFIG = REPO_ROOT / "charts" / "flashmodel-operator" / "files" / "prometheus-scrape-config.yaml"
"""The documented scrape config for engine pods; the test Prometheus runs exactly these jobs."""

KEDA_NAMESPACE = "keda"
KEDA_SERVICE = "keda-metrics-apiserver"
EXTERNAL_METRICS_APISERVICE = "v1beta1.external.metrics.k8s.io"
EXTERNAL_METRICS_PATH = "/apis/external.metrics.k8s.io/v1beta1"
KEDA_FILES = ("operator", "adapter", "crds/.complete")


class AutoscalingPartsError(ControlPlaneError):
    """Prometheus or KEDA could not be found, started or reached."""


class PrometheusQueryError(AutoscalingPartsError):
    """Prometheus answered a query with status "error"."""


def _stop(component: Component, grace: float = 10) -> None:
    """SIGTERM to the component's process group, SIGKILL after grace seconds."""
    component.signal_group(signal.SIGTERM)
    if not component.wait_stopped(timeout=grace):
        log.warning("component=%s event=kill reason=sigterm-timeout", component.name)
        component.signal_group(signal.SIGKILL)
        component.wait_stopped(timeout=5)


def _running(component: Component) -> bool:
    return component.proc is not None and component.proc.poll() is None


def _wait(what: str, ok: Callable[[], bool], timeout: float, components: Sequence[Component]) -> None:
    """wait_until that fails early if a component exits and shows every component's log tail on timeout."""

    def alive() -> None:
        for c in components:
            c.check_alive()

    try:
        wait_until(what, ok, timeout, alive)
    except ControlPlaneError as e:
        if any(c.name in str(e) and "exited" in str(e) for c in components):
            raise AutoscalingPartsError(str(e)) from None
        tails = "\n".join(f"--- {c.name} ({c.log_path}):\n{c.log_tail(20)}" for c in components)
        raise AutoscalingPartsError(f"{e}\n{tails}") from None


# -- Prometheus --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sample:
    """One sample of an instant query's result."""

    labels: dict[str, str]
    value: float
    timestamp: float


def prometheus_dir() -> Path:
    """The directory with the `prometheus` binary that scripts/testbin.sh builds (Kubernetes SD included)."""
    return _testbin_print("FLASHMODEL_PROMETHEUS", "--print-prometheus-dir")


def _testbin_print(override_var: str, option: str) -> Path:
    override = os.environ.get(override_var)
    if override:
        return Path(override)
    out = subprocess.run([str(TESTBIN_SCRIPT), option], capture_output=True, text=True, check=True)
    return Path(out.stdout.strip().splitlines()[-1])


def scrape_jobs(cp: ControlPlane, source: Path = SCRAPE_CONFIG) -> list[dict[str, Any]]:
    """The documented scrape jobs, each kubernetes_sd_configs entry pointed at cp's API server.

    Nothing else is changed: the test must run exactly the documented relabeling.
    """
    jobs = yaml.safe_load(source.read_text())
    if not isinstance(jobs, list) or not jobs:
        raise AutoscalingPartsError(f"{source}: expected a list of scrape jobs, got {type(jobs).__name__}")
    pki = cp.pki
    for job in jobs:
        for sd in job.get("kubernetes_sd_configs") or []:
            sd["api_server"] = cp.server
            sd["tls_config"] = {
                "ca_file": str(pki.ca_crt),
                "cert_file": str(pki.admin_crt),
                "key_file": str(pki.admin_key),
            }
    return list(jobs)


class _Part:
    """Processes a test owns: opened on entry; closed on exit, at interpreter exit, or when opening fails."""

    def _open(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        atexit.register(self.close)
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Prometheus(_Part):
    """Prometheus (built by scripts/testbin.sh) on a free loopback port, scraping with the documented config.

    Usage: ``with Prometheus(cp) as prom: prom.wait_for_series('up{job="flashmodel-engines"}')``.
    stop() and start() end and restart the same server (same port, same data), so a test can
    take the metrics source away from an autoscaler and bring it back.
    """

    def __init__(
        self,
        cp: ControlPlane,
        workdir: Path | None = None,
        scrape_interval: str = "2s",
        extra_jobs: Iterable[dict[str, Any]] = (),
        start_timeout: float = 60,
        binary: Path | None = None,
        port: int | None = None,
        rule_files: Iterable[Path] = (),
    ) -> None:
        """`port`: a port chosen before start, when another process (the operator) must know the URL.
        `rule_files`: alerting and recording rules it loads and evaluates every scrape interval."""
        binary = prometheus_dir() / "prometheus" if binary is None else binary
        if not os.access(binary, os.X_OK):
            # Not Debian's package from PATH: it is built without Kubernetes service discovery.
            raise AutoscalingPartsError(f"prometheus not found at {binary}; run scripts/testbin.sh")
        self.cp = cp
        self._owns_workdir = workdir is None
        self.dir = Path(tempfile.mkdtemp(prefix="flashmodel-prom-")) if workdir is None else workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.port = free_ports(1)[0] if port is None else port
        self.start_timeout = start_timeout
        self.config_path = self.dir / "prometheus.yml"
        config = {
            "global": {"scrape_interval": scrape_interval, "evaluation_interval": scrape_interval},
            "scrape_configs": [*scrape_jobs(cp), *extra_jobs],
            "rule_files": [str(p) for p in rule_files],
        }
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.component = Component(
            "prometheus",
            [
                str(binary),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
            ],
            self.dir / "prometheus.log",
        )
        self._closed = False

    @property
    def url(self) -> str:
        """The base URL, e.g. for a KEDA trigger's serverAddress."""
        return f"http://127.0.0.1:{self.port}"

    def _open(self) -> None:
        self.start()

    def start(self) -> None:
        """Starts the server (again) and returns once /-/ready answers."""
        if _running(self.component):
            return
        t0 = time.monotonic()
        self.component.start(os.environ)
        _wait("prometheus /-/ready", lambda: http_ok(f"{self.url}/-/ready"), self.start_timeout, [self.component])
        log.info("event=prometheus-ready seconds=%.1f url=%s", time.monotonic() - t0, self.url)

    def stop(self) -> None:
        """Stops the server; start() brings it back on the same port."""
        _stop(self.component)
        log.info("event=prometheus-stopped url=%s", self.url)

    def close(self) -> None:
        """Stops the server and removes a work dir this object created (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.stop()
        atexit.unregister(self.close)
        if self._owns_workdir and os.environ.get("FLASHMODEL_KEEP_CLUSTER_DIR") != "1":
            shutil.rmtree(self.dir, ignore_errors=True)

    def _get(self, path: str, params: dict[str, str] | None = None) -> Any:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as e:
            # Prometheus answers a bad query with 400/422 and a JSON body that says why.
            try:
                body = json.loads(e.read())
            except ValueError:
                raise AutoscalingPartsError(f"GET {url}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise AutoscalingPartsError(f"GET {url}: {e}; prometheus log:\n{self.component.log_tail(10)}") from None
        if body.get("status") != "success":
            raise PrometheusQueryError(f"GET {path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, promql: str) -> list[Sample]:
        """The instant query's samples (a scalar result is one sample without labels)."""
        data = self._get("/api/v1/query", {"query": promql})
        kind, result = data["resultType"], data["result"]
        if kind == "vector":
            return [Sample(dict(r["metric"]), float(r["value"][1]), float(r["value"][0])) for r in result]
        if kind == "scalar":
            return [Sample({}, float(result[1]), float(result[0]))]
        raise PrometheusQueryError(f"query {promql!r}: result type {kind}, expected vector or scalar")

    def rule_groups(self) -> list[dict[str, Any]]:
        """The loaded rule groups (/api/v1/rules): each rule with its health, lastError and state."""
        groups: list[dict[str, Any]] = self._get("/api/v1/rules")["groups"]
        return groups

    def firing(self, alertname: str, **labels: str) -> list[Sample]:
        """The firing alerts of that name whose labels include `labels` (the ALERTS series)."""
        matchers = "".join(f', {k}="{v}"' for k, v in labels.items())
        return self.query(f'ALERTS{{alertname="{alertname}", alertstate="firing"{matchers}}}')

    def targets(self) -> list[dict[str, Any]]:
        """The active scrape targets (/api/v1/targets): labels, health, lastError, scrapeUrl."""
        active: list[dict[str, Any]] = self._get("/api/v1/targets", {"state": "active"})["activeTargets"]
        return active

    def wait_for_series(
        self, promql: str, timeout: float = 60, where: Callable[[list[Sample]], bool] | None = None
    ) -> list[Sample]:
        """Polls query(promql) until it returns samples (that satisfy `where`, if given); returns them."""
        last: list[Sample] = []

        def ready() -> bool:
            nonlocal last
            last = self.query(promql)
            return bool(last) and (where is None or where(last))

        try:
            wait_until(f"prometheus series {promql}", ready, timeout, self.component.check_alive, interval=0.5)
        except AutoscalingPartsError:
            raise
        except ControlPlaneError as e:
            targets = [f"{t['labels']} health={t['health']} lastError={t.get('lastError')!r}" for t in self.targets()]
            raise AutoscalingPartsError(f"{e}; last result: {last}; active targets: {targets or 'none'}") from None
        return last


class DcgmStandIn:
    """Serves NVIDIA dcgm-exporter's GPU series for the engine pods, for a Prometheus job with honor_labels.

    No GPU here, so no real dcgm-exporter: this serves its metric names and its Kubernetes labels
    (pod, namespace, container of the pod holding the GPU) with fixed values, so that the dashboard's
    GPU panels are tested for how they join DCGM's series to the engine pods, not for DCGM itself.
    """

    VALUES: ClassVar[dict[str, float]] = {
        "DCGM_FI_DEV_GPU_UTIL": 37.0,
        "DCGM_FI_DEV_FB_USED": 11200.0,
        "DCGM_FI_DEV_GPU_TEMP": 64.0,
    }

    def __init__(self) -> None:
        self.pods: Callable[[], list[tuple[str, str]]] = list
        """(namespace, pod) of every engine pod holding a GPU, asked at each scrape."""
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                body = stand_in.exposition().encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self.server.serve_forever, name="dcgm-stand-in", daemon=True)

    def exposition(self) -> str:
        lines = []
        for gpu, (namespace, pod) in enumerate(self.pods()):
            labels = f'gpu="{gpu}",UUID="GPU-stand-in-{gpu}",namespace="{namespace}",pod="{pod}",container="engine"'
            lines += [f"{name}{{{labels}}} {value}" for name, value in self.VALUES.items()]
        return "\n".join(lines) + "\n"

    def scrape_job(self) -> dict[str, Any]:
        return {
            "job_name": "dcgm-exporter",
            "honor_labels": True,
            "static_configs": [{"targets": [f"127.0.0.1:{self.server.server_address[1]}"]}],
        }

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()


# -- KEDA ----------------------------------------------------------------------------------------


def install_keda_crds(cp: ControlPlane, bin_dir: Path | None = None) -> None:
    """KEDA's CRDs alone: ScaledObjects are then served (and stored) with no KEDA running."""
    # --server-side: the ScaledJob CRD is too big for the last-applied annotation.
    crds = (keda_dir() if bin_dir is None else bin_dir) / "crds"
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crds))

    def established() -> bool:
        # Not `kubectl wait`: it fails at once while a just-created CRD has no status yet.
        crd = json.loads(cp.kubectl("get", "crd", "scaledobjects.keda.sh", "-o", "json").stdout)
        conditions = (crd.get("status") or {}).get("conditions") or []
        return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)

    wait_until("CRD scaledobjects.keda.sh established", established, 60)


def keda_dir() -> Path:
    """The directory with KEDA's operator, adapter and crds/ (scripts/testbin.sh builds it)."""
    return _testbin_print("FLASHMODEL_KEDA", "--print-keda-dir")


class Keda(_Part):
    """KEDA's operator and metrics adapter, out of cluster, serving external.metrics.k8s.io to cp.

    Usage: ``with Keda(cp) as keda: ...`` then create ScaledObjects. One Keda per control plane
    at a time (the APIService is cluster-wide). The adapter is reached through an ExternalName
    Service (EndpointSlices refuse loopback addresses). close() deletes every ScaledObject and
    ScaledJob while the operator can still run their finalizers, then the APIService, so
    namespace deletion and discovery work after it.
    """

    def __init__(
        self, cp: ControlPlane, bin_dir: Path | None = None, workdir: Path | None = None, start_timeout: float = 60
    ) -> None:
        self.cp = cp
        self.bin_dir = keda_dir() if bin_dir is None else bin_dir
        missing = [f for f in KEDA_FILES if not (self.bin_dir / f).exists()]
        if missing:
            raise AutoscalingPartsError(
                f"KEDA files missing in {self.bin_dir}: {', '.join(missing)}; run scripts/testbin.sh"
            )
        self._owns_workdir = workdir is None
        self.dir = Path(tempfile.mkdtemp(prefix="flashmodel-keda-")) if workdir is None else workdir
        self.dir.mkdir(parents=True, exist_ok=True)
        self.start_timeout = start_timeout
        self.certs = self.dir / "certs"
        (
            self.operator_metrics_port,
            self.operator_health_port,
            self.metrics_service_port,
            self.adapter_port,
            self.adapter_metrics_port,
        ) = free_ports(5)
        kc = str(cp.kubeconfig)
        self.operator = Component(
            "keda-operator",
            [
                str(self.bin_dir / "operator"),
                f"--kubeconfig={kc}",
                f"--cert-dir={self.certs}",
                "--enable-cert-rotation=false",
                "--enable-webhook-patching=false",
                "--enable-apiservice-patching=false",
                # The defaults bind all interfaces on fixed ports (:8080, :8081, :9666).
                f"--metrics-bind-address=127.0.0.1:{self.operator_metrics_port}",
                f"--health-probe-bind-address=127.0.0.1:{self.operator_health_port}",
                f"--metrics-service-bind-address=127.0.0.1:{self.metrics_service_port}",
                "--leader-elect=false",
            ],
            self.dir / "keda-operator.log",
        )
        self.adapter = Component(
            "keda-adapter",
            [
                str(self.bin_dir / "adapter"),
                # It ignores --kubeconfig for its lister and would look for an in-cluster config.
                f"--lister-kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={self.adapter_port}",
                f"--cert-dir={self.certs}",
                f"--tls-cert-file={self.certs / 'tls.crt'}",
                f"--tls-private-key-file={self.certs / 'tls.key'}",
                f"--metrics-service-address=127.0.0.1:{self.metrics_service_port}",
                # Its own /metrics binds all interfaces whatever we say; at least a free port.
                f"--port={self.adapter_metrics_port}",
            ],
            self.dir / "keda-adapter.log",
        )
        self._lock = threading.Lock()
        self._closed = False

    @property
    def env(self) -> dict[str, str]:
        """The environment both processes need (all three variables, an empty WATCH_NAMESPACE: all)."""
        return {
            **self.cp.env,
            "KEDA_CLUSTER_OBJECT_NAMESPACE": KEDA_NAMESPACE,
            "POD_NAMESPACE": KEDA_NAMESPACE,
            "WATCH_NAMESPACE": "",
        }

    def _open(self) -> None:
        self.install()
        self.start()

    # -- set-up ------------------------------------------------------------------------------

    def _write_certs(self) -> None:
        # One cert for both ends of the operator-adapter gRPC link and for the adapter's HTTPS,
        # signed by the control plane's CA so the APIService can verify it (caBundle) instead
        # of skipping TLS verification. The aggregator checks the name <service>.<namespace>.svc.
        d = self.certs
        d.mkdir(parents=True, exist_ok=True)
        pki = self.cp.pki
        shutil.copyfile(pki.ca_crt, d / "ca.crt")
        (d / "tls.ext").write_text(
            f"subjectAltName=DNS:localhost,IP:127.0.0.1,DNS:{KEDA_SERVICE}.{KEDA_NAMESPACE}.svc\n"
            "extendedKeyUsage=serverAuth,clientAuth\n"
        )
        key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
        openssl("req", *key, "-subj", "/CN=localhost", "-keyout", "tls.key", "-out", "tls.csr", cwd=d)
        openssl("x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", str(pki.ca_key), "-CAcreateserial",
                "-days", "2", "-extfile", "tls.ext", "-out", "tls.crt", cwd=d)  # fmt: skip

    def install(self) -> None:
        """TLS material, KEDA's CRDs, namespace keda, the ExternalName Service and the APIService."""
        t0 = time.monotonic()
        self._write_certs()
        install_keda_crds(self.cp, self.bin_dir)
        ca_bundle = base64.b64encode((self.certs / "ca.crt").read_bytes()).decode()
        docs: list[dict[str, Any]] = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": KEDA_NAMESPACE}},
            {
                "apiVersion": "v1",
                "kind": "Service",
                "metadata": {"name": KEDA_SERVICE, "namespace": KEDA_NAMESPACE},
                # The aggregator resolves an ExternalName Service to https://<externalName>:<port>
                # and skips the endpoints check that a loopback address would fail.
                "spec": {"type": "ExternalName", "externalName": "localhost"},
            },
            {
                "apiVersion": "apiregistration.k8s.io/v1",
                "kind": "APIService",
                "metadata": {"name": EXTERNAL_METRICS_APISERVICE},
                "spec": {
                    "service": {"name": KEDA_SERVICE, "namespace": KEDA_NAMESPACE, "port": self.adapter_port},
                    "group": "external.metrics.k8s.io",
                    "version": "v1beta1",
                    "caBundle": ca_bundle,
                    "groupPriorityMinimum": 100,
                    "versionPriority": 100,
                },
            },
        ]
        self.cp.kubectl(
            "apply", "--server-side", "--force-conflicts", "--field-manager=flashmodel-e2e", "-f", "-",
            input=yaml.safe_dump_all(docs),
        )  # fmt: skip
        log.info("event=keda-installed seconds=%.1f dir=%s", time.monotonic() - t0, self.dir)

    # -- processes ---------------------------------------------------------------------------

    def start(self) -> None:
        """Starts the operator and the adapter (whichever is not running) and waits for both."""
        self.start_operator()
        self.start_adapter()

    def stop(self) -> None:
        """Stops the adapter and the operator; start() brings them back on the same ports."""
        self.stop_adapter()
        self.stop_operator()

    def start_operator(self) -> None:
        """Starts the operator and returns once its /readyz answers."""
        if _running(self.operator):
            return
        t0 = time.monotonic()
        self.operator.start(self.env)
        _wait(
            "keda-operator /readyz",
            lambda: http_ok(f"http://127.0.0.1:{self.operator_health_port}/readyz"),
            self.start_timeout,
            [self.operator],
        )
        log.info("event=keda-operator-ready seconds=%.1f", time.monotonic() - t0)

    def stop_operator(self) -> None:
        """Stops the operator: ScaledObjects are no longer reconciled and metric reads fail."""
        _stop(self.operator)

    def start_adapter(self) -> None:
        """Starts the adapter and returns once the API server serves external metrics through it."""
        if _running(self.adapter):
            return
        t0 = time.monotonic()
        self.adapter.start(self.env)
        # Both: Available alone can be a stale True from before a stop; the raw GET goes through
        # the aggregator to this very process.
        _wait(
            f"APIService {EXTERNAL_METRICS_APISERVICE} Available and {EXTERNAL_METRICS_PATH} answering",
            lambda: self.apiservice_available() and self._external_metrics_answer(),
            self.start_timeout,
            [c for c in (self.operator, self.adapter) if c.proc is not None],
        )
        log.info("event=keda-adapter-ready seconds=%.1f port=%d", time.monotonic() - t0, self.adapter_port)

    def stop_adapter(self) -> None:
        """Stops the adapter: the HPA's external metric reads fail until start_adapter()."""
        _stop(self.adapter)

    def apiservice_available(self) -> bool:
        """True if the external metrics APIService has condition Available=True."""
        out = self.cp.kubectl("get", "apiservice", EXTERNAL_METRICS_APISERVICE, "-o", "json", check=False)
        if out.returncode != 0:
            return False
        conditions = json.loads(out.stdout).get("status", {}).get("conditions") or []
        return any(c.get("type") == "Available" and c.get("status") == "True" for c in conditions)

    def _external_metrics_answer(self) -> bool:
        return self.cp.kubectl("get", "--raw", EXTERNAL_METRICS_PATH, check=False, timeout=10).returncode == 0

    def external_metric(self, namespace: str, metric: str, scaled_object: str) -> float:
        """The value the API server returns for an HPA's external metric (e.g. "s0-prometheus")."""
        selector = urllib.parse.quote(f"scaledobject.keda.sh/name={scaled_object}")
        raw = self.cp.kubectl(
            "get", "--raw", f"{EXTERNAL_METRICS_PATH}/namespaces/{namespace}/{metric}?labelSelector={selector}"
        ).stdout
        items = json.loads(raw)["items"]
        if not items:
            raise AutoscalingPartsError(f"external metric {namespace}/{metric} for {scaled_object}: no items")
        return _quantity(items[0]["value"])

    def log_tails(self, lines: int = 20) -> str:
        """The last log lines of both processes, for a failing test's message."""
        return "\n".join(f"--- {c.name} ({c.log_path}):\n{c.log_tail(lines)}" for c in (self.operator, self.adapter))

    def close(self) -> None:
        """Deletes KEDA's objects (finalizers run), stops both processes, removes the APIService."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        t0 = time.monotonic()
        try:
            self._delete_scaled_objects()
        finally:
            self.stop()
            # A registered APIService without a server breaks discovery for every later client
            # (and the namespace controller's deletion of whole namespaces).
            self.cp.kubectl("delete", "apiservice", EXTERNAL_METRICS_APISERVICE, "--ignore-not-found", check=False)
            atexit.unregister(self.close)
            log.info("event=keda-closed seconds=%.1f", time.monotonic() - t0)
            if self._owns_workdir and os.environ.get("FLASHMODEL_KEEP_CLUSTER_DIR") != "1":
                shutil.rmtree(self.dir, ignore_errors=True)

    def _delete_scaled_objects(self) -> None:
        kinds = "scaledobjects.keda.sh,scaledjobs.keda.sh"
        if _running(self.operator):
            self.cp.kubectl("delete", kinds, "--all", "--all-namespaces", "--wait=false", check=False)
            with contextlib.suppress(ControlPlaneError):
                wait_until(f"{kinds} deleted by the operator", lambda: not self._names(kinds), 30)
        # Whatever is left has a finalizer only the operator could run: drop it, or its namespace
        # would stay Terminating for ever.
        for ref in self._names(kinds):
            namespace, name = ref.split("/", 1)
            self.cp.kubectl(
                "patch", name, "-n", namespace, "--type=merge", "-p", '{"metadata":{"finalizers":null}}', check=False
            )

    def _names(self, kinds: str) -> list[str]:
        out = self.cp.kubectl(
            "get", kinds, "--all-namespaces", "-o",
            'jsonpath={range .items[*]}{.metadata.namespace}/{.kind}/{.metadata.name}{"\\n"}{end}',
            check=False,
        )  # fmt: skip
        if out.returncode != 0:
            return []
        # namespace/Kind/name -> "namespace/kind.keda.sh/name" for kubectl patch.
        refs = []
        for line in out.stdout.split():
            namespace, kind, name = line.split("/")
            refs.append(f"{namespace}/{kind.lower()}s.keda.sh/{name}")
        return refs


def _quantity(value: str) -> float:
    """A Kubernetes quantity as the metrics API writes it ("42", "1500m", "2k")."""
    suffixes = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9}
    if value and value[-1] in suffixes:
        return float(value[:-1]) * suffixes[value[-1]]
    return float(value)
