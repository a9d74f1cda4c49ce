"""The gateway for e2e: the operator's endpoint pickers run for real, and Envoy in front as GIE's standalone gateway.

Two parts, each playing a role a cluster would give to someone else:

- `PickerKubelet` plays the kubelet for the EPP pods the operator's picker Deployments create: it
  starts the real EPP v1.5.0 binary (scripts/gateway.sh builds it) with the container's own args,
  probes its gRPC health port as the pod's readinessProbe says, and writes the pod's status, so the
  Deployment's availability (the operator's Routing condition) follows the real process.
- `GatewayController` plays a GIE-aware Gateway's controller for one Gateway: for each HTTPRoute
  attached to it, an Envoy route that matches the route's headers and asks the route's pool's EPP
  (ext_proc) which pod serves; the request goes where the EPP's `x-gateway-destination-endpoint`
  says (an ORIGINAL_DST cluster), as in GIE's standalone chart. It writes the pools' and routes'
  `status.parents` (Accepted), which the operator's Routing condition reads. In front of the route
  choice it runs GIE's body-based router (`BodyRouter`, the real cmd/bbr v1.5.0) as a first ext_proc:
  the router turns the body's `model` into the X-Gateway-Base-Model-Name header the routes match, from
  the bbr-managed ConfigMaps the operator renders, so clients send plain OpenAI requests.

What is translated, and why (everything else is the rendered pod's as the operator wrote it):
- The EPP pods are adopted before they are scheduled: the harness adds kwok's "leave my status
  alone" annotation and a toleration for the kwok nodes' taint, as it does for engine pods through
  podTemplatePatch (the operator has no patch for picker pods).
- Each EPP runs in this machine's network namespace (the test API server listens on loopback only,
  which a pod's own namespace cannot reach), and binds its three ports (gRPC 9002, health 9003,
  metrics 9090) on every interface, so they are moved to free local ports, appended as
  --grpc-port/--grpc-health-port/--metrics-port. The pod still has an address of its own: a
  loopback address no other pod has (Linux routes all of 127.0.0.0/8 to the loopback device), its
  podIP, where each container port is forwarded to the moved one. So Prometheus's pod discovery
  scrapes `podIP:9090` as in a cluster, the way it reaches the engine pods at theirs. Address and
  ports stay with the pod across restarts of its EPP.
- KUBECONFIG (the EPP has no --kubeconfig flag): the test API server with a token of the pod's own
  ServiceAccount (`kubectl create token`), so the operator's Role for the picker is what it gets.
- `--config-file /config/picker.yaml`: the ConfigMap volume's file, written to the pod's work folder.
- Envoy has no route for requests that match no HTTPRoute (a Gateway answers those 404 itself).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import http.client
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.cluster import KWOK_TOLERATION, ControlPlane, free_ports
from e2e.harness.kubelet import CUSTOM_STATUS

log = logging.getLogger(__name__)

PICKER_NAME_LABEL = ("app.kubernetes.io/name", "flashmodel-epp")
"""The label of the operator's picker pods (routing.picker_labels)."""
DESTINATION_HEADER = "x-gateway-destination-endpoint"
RESTART_BACKOFF_SECONDS = 5.0
GATEWAY_GROUP = "gateway.networking.k8s.io"
CONTROLLER_NAME = "flashmodel.io/e2e-gateway"
RETRY_AFTER_SECONDS = 5
"""What Envoy's Retry-After says on a 503 it answers itself: the picker's "request timed out in queue"
(the model's hold limit ran out while no pod was ready) is the one a client should come back from."""
HELD_REQUEST_TIMEOUT = "3600s"
"""Envoy's ext_proc message timeout and stream idle timeout, while the picker holds a request: the
longest hold a FlashModel allows (spec.routing.holdSeconds, at most 3600 s), which is also the
longest message timeout Envoy accepts. Envoy's own defaults would end a held request first (GIE's
standalone Envoy: a 1000 s message timeout and Envoy's default 300 s stream idle timeout, which
answers 504 "stream timeout"), and only the picker's 503 says when to come back."""
# Picker pod n of this process lives at 127.<PICKER_NET>.<n // 250>.<n % 250 + 1>: outside kwok's
# POD_CIDR (127.16.0.0/16), and per process so that two harnesses on one machine never share one.
PICKER_NET = 100 + os.getpid() % 100
PICKER_NUMBERS = itertools.count(1)


def picker_address(n: int) -> str:
    return f"127.{PICKER_NET}.{n // 250}.{n % 250 + 1}"


def gateway_api_crds() -> list[dict[str, Any]]:
    """Gateway and HTTPRoute (gateway.networking.k8s.io/v1) with open schemas.

    The Gateway API's own CRDs are not among the modules the set-up can fetch; the operator only
    applies HTTPRoutes and the harness only reads them, so the kinds need to be served, not
    validated field by field (the operator's golden tests check what it renders).
    """
    def crd(kind: str, plural: str) -> dict[str, Any]:
        open_object = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            # *.k8s.io groups need this annotation; the Gateway API's own CRDs carry the same one.
            "metadata": {"name": f"{plural}.{GATEWAY_GROUP}",
                         "annotations": {"api-approved.kubernetes.io": "https://github.com/kubernetes-sigs/gateway-api/pull/1538"}},
            "spec": {
                "group": GATEWAY_GROUP,
                "scope": "Namespaced",
                "names": {"kind": kind, "plural": plural, "singular": kind.lower(), "listKind": f"{kind}List"},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "subresources": {"status": {}},
                        "schema": {"openAPIV3Schema": {"type": "object",
                                                       "properties": {"spec": open_object, "status": open_object}}},
                    }
                ],
            },
        }

    return [crd("Gateway", "gateways"), crd("HTTPRoute", "httproutes")]


def install_gateway_api(cp: ControlPlane) -> None:
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(gateway_api_crds()))
    for plural in ("gateways", "httproutes"):
        cp.wait_established(f"{plural}.{GATEWAY_GROUP}")


def serve_gateway_kinds(cp: ControlPlane) -> None:
    """The chart's InferencePool CRD option (GIE v1.5.0's) and the Gateway API kinds: what a model's routing needs."""
    from e2e.harness.operator_run import helm_install  # the chart's install; imported where it is used

    helm_install(cp, "gateway.installInferencePoolCRD=true")
    cp.wait_established("inferencepools.inference.networking.k8s.io")
    install_gateway_api(cp)


def create_gateway(cp: ControlPlane, namespace: str, name: str) -> None:
    """The Gateway a GatewayController plays the controller of, with one HTTP listener."""
    gateway = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
               "metadata": {"name": name, "namespace": namespace},
               "spec": {"gatewayClassName": "e2e", "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}}
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(gateway))


@dataclass
class Answer:
    """One request's answer through the Gateway."""

    status: int
    """The HTTP status; 0 when no HTTP answer came."""
    body: str
    seconds: float
    client_id: str
    headers: dict[str, str] = field(default_factory=dict)
    """Response headers, lower-cased names."""
    answered_at: float = 0.0
    """time.time() when the answer (or the failure) came."""


def post_completion(port: int, headers: dict[str, str], client_id: str, *, model: str, prompt: str = "hello",
                    max_tokens: int = 4, timeout: float = 120) -> Answer:
    """One /v1/completions through the Gateway on 127.0.0.1:port, tagged X-Client-Id (Envoy's access log has it)."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    t0 = time.monotonic()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body=body,
                     headers={"Content-Type": "application/json", "X-Client-Id": client_id, **headers})
        resp = conn.getresponse()
        text = resp.read().decode(errors="replace")
        return Answer(resp.status, text, time.monotonic() - t0, client_id,
                      {k.lower(): v for k, v in resp.getheaders()}, time.time())
    except OSError as exc:
        return Answer(0, f"{type(exc).__name__}: {exc}", time.monotonic() - t0, client_id, answered_at=time.time())
    finally:
        conn.close()


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def grpc_health(port: int, service: str, timeout: float = 1.0) -> bool:
    """grpc.health.v1.Health/Check on 127.0.0.1:port: True when SERVING."""
    import grpc  # the engine venv has grpcio (vLLM's dependency); imported here, where it is used

    # HealthCheckRequest{service = 1}; HealthCheckResponse{status = 1}, SERVING = 1: the two messages
    # by hand, so no generated code is needed.
    encoded = service.encode()
    request = b"\x0a" + bytes([len(encoded)]) + encoded if encoded else b""
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = channel.unary_unary("/grpc.health.v1.Health/Check")
        try:
            answer: bytes = check(request, timeout=timeout)
        except grpc.RpcError:
            return False
    return answer == b"\x08\x01"


class PortForward:
    """Accepts TCP on ip:port and relays each connection to 127.0.0.1:target (a pod port to where its process is)."""

    def __init__(self, ip: str, port: int, target: int) -> None:
        self.ip, self.port, self.target = ip, port, target
        self._server = socket.socket()
        self._server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._server.bind((ip, port))
        except OSError as exc:
            self._server.close()
            raise RuntimeError(f"picker pod address {ip}:{port}: cannot listen ({exc}); another process of "
                               f"this machine holds port {port} on every address") from None
        self._server.listen(64)
        self._thread = threading.Thread(target=self._accept, name=f"forward-{ip}:{port}", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._relay, args=(client,), daemon=True).start()

    def _relay(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
        except OSError:  # the process is not listening (yet): the client sees a refused connection
            client.close()
            return
        upstream.settimeout(None)

        def pump(src: socket.socket, dst: socket.socket) -> None:
            with contextlib.suppress(OSError):
                while data := src.recv(65536):
                    dst.sendall(data)
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

        back = threading.Thread(target=pump, args=(upstream, client), daemon=True)
        back.start()
        pump(client, upstream)
        back.join()
        client.close()
        upstream.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)
        self._server.close()


def token_kubeconfig(cp: ControlPlane, namespace: str, account: str, path: Path) -> Path:
    """A kubeconfig for the test API server with a token of the ServiceAccount `namespace/account`.

    GIE's binaries have no --kubeconfig flag; they read KUBECONFIG. A token of the account the pod (or
    GIE's chart) would run as means the RBAC the manifests grant is what the process gets.
    """
    token = cp.kubectl("create", "token", account, "-n", namespace, "--duration=2h").stdout.strip()
    admin = yaml.safe_load(cp.kubeconfig.read_text())
    config = {
        "apiVersion": "v1", "kind": "Config", "clusters": admin["clusters"],
        "users": [{"name": account, "user": {"token": token}}],
        "contexts": [{"name": account, "context": {"cluster": admin["clusters"][0]["name"], "user": account,
                                                   "namespace": namespace}}],
        "current-context": account,
    }
    path.write_text(yaml.safe_dump(config))
    path.chmod(0o600)
    return path


@dataclass
class PickerPod:
    """One EPP pod this kubelet runs."""

    name: str
    uid: str
    workdir: Path
    ports: dict[int, int]
    """containerPort -> the local port it was moved to."""
    ip: str = "127.0.0.1"
    """The pod's own address (podIP): each container port is forwarded from here to its local port."""
    forwards: list[PortForward] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    ready: bool = False
    restarts: int = 0
    backoff_until: float = 0.0
    held: bool = False
    """A test stopped it and keeps it down (like an image that no longer pulls) until `release`."""
    health_service: str = ""
    probe_period: float = 2.0
    last_probe: float = 0.0
    exit_code: int | None = None


class PickerKubelet:
    """Runs the real EPP for each picker pod in one namespace (see the module docstring for what is translated)."""

    def __init__(self, cp: ControlPlane, namespace: str, workdir: Path, epp: Path) -> None:
        self.cp, self.namespace, self.workdir, self.epp = cp, namespace, workdir, epp
        self.pods: dict[str, PickerPod] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="picker-kubelet", daemon=True)

    def __enter__(self) -> PickerKubelet:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        for pod in list(self.pods.values()):
            self._remove(pod)

    # -- for tests -------------------------------------------------------------------------

    def pod_for(self, selector: dict[str, str]) -> PickerPod | None:
        """The running, ready picker pod whose labels match `selector` (a Service's), or None."""
        pods = json.loads(self.cp.kubectl("get", "pods", "-n", self.namespace, "-o", "json").stdout)["items"]
        with self.lock:
            for pod in pods:
                labels = pod["metadata"].get("labels") or {}
                mine = self.pods.get(pod["metadata"]["name"])
                if mine is not None and all(labels.get(k) == v for k, v in selector.items()):
                    return mine
        return None

    def kill(self, name: str) -> None:
        """SIGKILL the pod's EPP and keep it down until `release` (the kubelet would restart it at once)."""
        with self.lock:
            pod = self.pods[name]
            pod.held = True
        self._stop_process(pod, signal.SIGKILL)

    def release(self, name: str) -> None:
        with self.lock:
            self.pods[name].held = False
            self.pods[name].backoff_until = 0.0

    # -- the sync loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception:  # a failed pass must not end the kubelet; the next pass retries
                log.exception("event=picker-kubelet-sync-failed namespace=%s", self.namespace)
            self._stop.wait(0.5)

    def sync_once(self) -> None:
        key, value = PICKER_NAME_LABEL
        out = self.cp.kubectl("get", "pods", "-n", self.namespace, "-l", f"{key}={value}", "-o", "json", check=False)
        if out.returncode != 0:
            return
        seen: set[str] = set()
        for pod in json.loads(out.stdout)["items"]:
            meta, spec = pod["metadata"], pod["spec"]
            name = meta["name"]
            seen.add(name)
            annotations = meta.get("annotations") or {}
            if annotations.get("kwok.x-k8s.io/status") != "custom":
                self._adopt(pod)
                continue
            if not spec.get("nodeName"):
                continue
            with self.lock:
                running = self.pods.get(name)
            if meta.get("deletionTimestamp"):
                if running is not None:
                    self._remove(running)
                    with self.lock:
                        self.pods.pop(name, None)
                self.cp.kubectl("delete", "pod", name, "-n", self.namespace, "--grace-period=0", "--force",
                                "--wait=false", check=False)
                continue
            if running is None:
                running = self._new_pod(pod)
            self._run_and_report(pod, running)
        with self.lock:
            gone = [p for n, p in self.pods.items() if n not in seen]
            for p in gone:
                self.pods.pop(p.name, None)
        for p in gone:
            self._remove(p)

    def _remove(self, picker: PickerPod) -> None:
        """The pod is gone: its process, and its address with it."""
        self._stop_process(picker)
        for forward in picker.forwards:
            forward.close()
        picker.forwards.clear()

    def _adopt(self, pod: dict[str, Any]) -> None:
        # What podTemplatePatch does for engine pods: kwok leaves the status to this kubelet, and the
        # pod may land on the kwok nodes (tainted so that no other pod does).
        tolerations = list(pod["spec"].get("tolerations") or [])
        if KWOK_TOLERATION not in tolerations:
            tolerations.append(KWOK_TOLERATION)
        patch = {"metadata": {"annotations": dict(CUSTOM_STATUS)}, "spec": {"tolerations": tolerations}}
        self.cp.kubectl("patch", "pod", pod["metadata"]["name"], "-n", self.namespace, "--type=merge",
                        "-p", json.dumps(patch), check=False)

    def _new_pod(self, pod: dict[str, Any]) -> PickerPod:
        meta, container = pod["metadata"], pod["spec"]["containers"][0]
        container_ports = [int(p["containerPort"]) for p in container.get("ports") or []]
        probe = container.get("readinessProbe") or {}
        picker = PickerPod(
            name=meta["name"],
            uid=meta["uid"],
            workdir=self.workdir / meta["name"],
            ports=dict(zip(container_ports, free_ports(len(container_ports)), strict=True)),
            health_service=str((probe.get("grpc") or {}).get("service", "")),
            probe_period=float(probe.get("periodSeconds", 10)),
            ip=picker_address(next(PICKER_NUMBERS)),
        )
        picker.forwards = [PortForward(picker.ip, container_port, local)
                           for container_port, local in picker.ports.items()]
        picker.workdir.mkdir(parents=True, exist_ok=True)
        with self.lock:
            self.pods[picker.name] = picker
        return picker

    def _argv_and_env(self, pod: dict[str, Any], picker: PickerPod) -> tuple[list[str], dict[str, str]]:
        meta, spec = pod["metadata"], pod["spec"]
        container = spec["containers"][0]
        args = list(container.get("args") or [])
        # The ConfigMap volume, mounted as files in the pod's work folder.
        mounts = {m["name"]: m["mountPath"] for m in container.get("volumeMounts") or []}
        for volume in spec.get("volumes") or []:
            if "configMap" not in volume or volume["name"] not in mounts:
                continue
            raw = self.cp.kubectl("get", "configmap", volume["configMap"]["name"], "-n", self.namespace,
                                  "-o", "json").stdout
            folder = picker.workdir / volume["name"]
            folder.mkdir(exist_ok=True)
            for key, text in (json.loads(raw).get("data") or {}).items():
                (folder / key).write_text(text)
            mount = mounts[volume["name"]].rstrip("/")
            args = [a.replace(mount + "/", f"{folder}/") for a in args]
        by_name = {int(p["containerPort"]): p["name"] for p in container.get("ports") or []}
        flags = {"grpc": "--grpc-port", "grpc-health": "--grpc-health-port", "metrics": "--metrics-port"}
        for container_port, local in picker.ports.items():
            flag = flags.get(by_name.get(container_port, ""))
            if flag is None:
                raise ValueError(f"picker pod {picker.name}: no flag known for its port {by_name.get(container_port)}")
            args.append(f"{flag}={local}")
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(picker.workdir),
               "KUBECONFIG": str(self._kubeconfig(spec.get("serviceAccountName") or "default", picker))}
        fields = {"metadata.namespace": self.namespace, "metadata.name": meta["name"]}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = item["value"]
            elif "fieldRef" in (item.get("valueFrom") or {}):
                env[item["name"]] = fields[item["valueFrom"]["fieldRef"]["fieldPath"]]
        return [str(self.epp), *args], env

    def _kubeconfig(self, account: str, picker: PickerPod) -> Path:
        return token_kubeconfig(self.cp, self.namespace, account, picker.workdir / "kubeconfig")

    def _run_and_report(self, pod: dict[str, Any], picker: PickerPod) -> None:
        now = time.monotonic()
        if picker.proc is not None and picker.proc.poll() is not None:
            picker.exit_code = picker.proc.returncode
            picker.proc = None
            picker.ready = False
            picker.restarts += 1
            picker.backoff_until = now + RESTART_BACKOFF_SECONDS
            log.warning("event=picker-exited pod=%s code=%s", picker.name, picker.exit_code)
        if picker.proc is None and not picker.held and now >= picker.backoff_until:
            argv, env = self._argv_and_env(pod, picker)
            with (picker.workdir / "epp.log").open("ab") as out:
                picker.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                               stdin=subprocess.DEVNULL, start_new_session=True)
            (picker.workdir / "argv.json").write_text(json.dumps(argv))
            log.info("event=picker-started pod=%s pid=%d ports=%s", picker.name, picker.proc.pid, picker.ports)
        if picker.proc is None:
            picker.ready = False
        elif now - picker.last_probe >= picker.probe_period:
            picker.last_probe = now
            health_port = picker.ports.get(9003)
            picker.ready = health_port is not None and grpc_health(health_port, picker.health_service)
        self._patch_status(pod, picker)

    def _patch_status(self, pod: dict[str, Any], picker: PickerPod) -> None:
        conditions = {c["type"]: c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
        wanted = {"PodScheduled": True, "Initialized": True, "ContainersReady": picker.ready, "Ready": picker.ready}
        changed = [t for t, v in wanted.items() if conditions.get(t) != ("True" if v else "False")]
        running = (pod.get("status") or {}).get("phase") == "Running"
        if not changed and running:
            return
        state: dict[str, Any] = (
            {"running": {"startedAt": _now()}} if picker.proc is not None
            else {"waiting": {"reason": "CrashLoopBackOff" if picker.restarts else "ContainerCreating"}}
        )
        container: dict[str, Any] = {
            "name": "epp", "image": "epp:v1.5.0", "imageID": "", "ready": picker.ready,
            "started": picker.proc is not None, "restartCount": picker.restarts, "state": state,
            "containerID": f"proc://{picker.proc.pid if picker.proc is not None else 0}",
        }
        if picker.exit_code is not None:
            container["lastState"] = {"terminated": {"exitCode": picker.exit_code, "reason": "Error"}}
        status = {
            "phase": "Running", "podIP": picker.ip, "podIPs": [{"ip": picker.ip}], "hostIP": "127.0.0.1",
            "startTime": (pod.get("status") or {}).get("startTime") or _now(),
            "conditions": [{"type": t, "status": "True" if wanted[t] else "False", "lastTransitionTime": _now()}
                           for t in changed],
            "containerStatuses": [container],
        }
        self.cp.kubectl("patch", "pod", picker.name, "-n", self.namespace, "--subresource=status", "--type=strategic",
                        "-p", json.dumps({"status": status}), check=False)

    def _stop_process(self, picker: PickerPod, sig: int = signal.SIGTERM) -> None:
        proc = picker.proc
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


# -- the Gateway ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Route:
    """One HTTPRoute rule's match, and the pool's picker it asks."""

    name: str
    """namespace/name of the HTTPRoute."""
    headers: tuple[tuple[str, str], ...]
    pool: str
    """namespace/name of the InferencePool."""
    picker_port: int
    failure_mode: str


ROUTER_ACCOUNT = "body-based-router"
"""The ServiceAccount (and Role) name of GIE's body-based-routing chart (values.yaml: bbr.name)."""


def router_rbac(namespace: str) -> list[dict[str, Any]]:
    """What GIE v1.5.0's body-based-routing chart grants its router when it watches one namespace
    (templates/rbac.yaml, multiNamespace false): read ConfigMaps there, nothing else."""
    meta = {"name": ROUTER_ACCOUNT, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta,
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get", "list", "watch"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
         "subjects": [{"kind": "ServiceAccount", "name": ROUTER_ACCOUNT, "namespace": namespace}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": ROUTER_ACCOUNT}},
    ]


def stop_process_group(proc: subprocess.Popen[bytes], grace: float = 10) -> None:
    """SIGTERM to the process's group (it was started in a session of its own), SIGKILL after `grace` seconds."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@dataclass
class BodyRouter:
    """GIE v1.5.0's body-based router (cmd/bbr), the real binary, in front of the Gateway's route choice.

    Its default plugins copy the body's `model` into X-Gateway-Model-Name and map it to
    X-Gateway-Base-Model-Name (the header the operator's HTTPRoutes match) by the ConfigMaps labelled
    inference.networking.k8s.io/bbr-managed=true: an adapter to its `baseModel`, a base model to itself,
    any other name to "". It watches the Gateway's namespace (NAMESPACE, the chart's default), with the
    chart's Role, so the map is what the operator rendered there. Not streaming: Envoy sends it the
    buffered body, and its answer (headers set, clear_route_cache) makes Envoy choose the route again.
    The ext_proc port keeps the binary's default TLS (self-signed, like the EPP's); metrics auth and
    tracing are off, as the chart sets them for a loopback process.
    """

    cp: ControlPlane
    namespace: str
    binary: Path
    workdir: Path
    port: int = 0
    health_port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BodyRouter:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(router_rbac(self.namespace)))
        self.port, self.health_port, metrics_port = free_ports(3)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(self.workdir), "NAMESPACE": self.namespace,
               "KUBECONFIG": str(token_kubeconfig(self.cp, self.namespace, ROUTER_ACCOUNT,
                                                  self.workdir / "kubeconfig"))}
        argv = [str(self.binary), f"--grpc-port={self.port}", f"--grpc-health-port={self.health_port}",
                f"--metrics-port={metrics_port}", "--metrics-endpoint-auth=false", "--tracing=false",
                "--enable-pprof=false"]
        with (self.workdir / "bbr.log").open("ab") as out:
            self.proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        log.info("event=router-started pid=%d port=%d namespace=%s", self.proc.pid, self.port, self.namespace)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the body-based router exited {self.proc.returncode}: "
                                   f"{(self.workdir / 'bbr.log').read_text()[-2000:]}")
            if grpc_health(self.health_port, ""):
                return self
            time.sleep(0.2)
        self.__exit__()
        raise RuntimeError(f"the body-based router did not serve: {(self.workdir / 'bbr.log').read_text()[-2000:]}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
        self.proc = None


ROUTER_CLUSTER = "ext_proc/body-based-router"


def envoy_config(listen_port: int, admin_port: int, routes: list[Route], access_log: Path,
                 router_port: int | None = None) -> dict[str, Any]:
    """GIE's standalone Envoy (config/charts/standalone/values.yaml in v1.5.0), one ext_proc cluster per pool.

    Each route asks its own pool's picker (a per-route ext_proc override of the gRPC service); the
    ext_proc filter fails closed (`failure_mode_allow: false`, Envoy's default, written out): with
    the picker unreachable Envoy answers 500 at once rather than sending the request anywhere.

    With `router_port`, a first ext_proc filter asks the body-based router (BodyRouter) before any route
    is final: Envoy buffers the body for it and, as its answer sets clear_route_cache with the
    X-Gateway-Base-Model-Name header, matches the routes again (ext_proc's route_cache_action DEFAULT
    honours that flag); the pool's EPP filter then runs with the route chosen by the body's `model`.
    """
    big = {"thresholds": [{"max_connections": 40000, "max_pending_requests": 40000, "max_requests": 40000,
                           "max_retries": 1024}]}
    ordered = sorted(routes, key=lambda r: (-len(r.headers), r.name))
    pools = sorted({r.pool: r for r in ordered}.values(), key=lambda r: r.pool)

    def cluster_name(pool: str) -> str:
        return "ext_proc/" + pool

    def grpc_service(route: Route) -> dict[str, Any]:
        return {"envoy_grpc": {"cluster_name": cluster_name(route.pool), "authority": f"localhost:{route.picker_port}"},
                "timeout": "10s"}

    for r in ordered:
        if r.failure_mode != "FailClose":
            raise ValueError(f"route {r.name}: failureMode {r.failure_mode} is not what this harness's Gateway does; "
                             "it fails closed only")
    envoy_routes: list[dict[str, Any]] = [
        {
            "name": r.name,
            "match": {"prefix": "/", "headers": [{"name": h, "string_match": {"exact": v}} for h, v in r.headers]},
            "route": {"cluster": "original_destination_cluster", "timeout": "0s"},
            "typed_per_filter_config": {
                "envoy.filters.http.ext_proc": {
                    "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                    "overrides": {"grpc_service": grpc_service(r)},
                }
            },
        }
        for r in ordered
    ]
    envoy_routes.append({"name": "no-route", "match": {"prefix": "/"},
                         "direct_response": {"status": 404, "body": {"inline_string": "no HTTPRoute matches\n"}},
                         "typed_per_filter_config": {"envoy.filters.http.ext_proc": {
                             "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExtProcPerRoute",
                             "disabled": True}}})
    filters: list[dict[str, Any]] = []
    if ordered:
        filters.append({
            "name": "envoy.filters.http.ext_proc",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": grpc_service(ordered[0]),
                "failure_mode_allow": False,
                "processing_mode": {
                    "request_header_mode": "SEND", "response_header_mode": "SEND",
                    "request_body_mode": "FULL_DUPLEX_STREAMED", "response_body_mode": "FULL_DUPLEX_STREAMED",
                    "request_trailer_mode": "SEND", "response_trailer_mode": "SEND",
                },
                "message_timeout": HELD_REQUEST_TIMEOUT,
            },
        })
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router", "suppress_envoy_headers": True}})
    log_format = {
        "start": "%START_TIME(%s.%3f)%", "upstream": "%UPSTREAM_HOST%", "code": "%RESPONSE_CODE%",
        "flags": "%RESPONSE_FLAGS%", "route": "%ROUTE_NAME%", "id": "%REQ(X-REQUEST-ID)%",
        "client_id": "%REQ(X-CLIENT-ID)%", "details": "%RESPONSE_CODE_DETAILS%",
    }
    # A 503 Envoy answers itself (an ext_proc ImmediateResponse is a local reply too) says when to
    # come back; an engine's own 503 is an upstream's answer and passes unchanged.
    retry_after_mapper = {
        "filter": {"status_code_filter": {"comparison": {
            "op": "EQ", "value": {"default_value": 503, "runtime_key": "gateway.retry_after.status"}}}},
        "headers_to_add": [{"header": {"key": "Retry-After", "value": str(RETRY_AFTER_SECONDS)},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}],
    }
    h2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
        "explicit_http_config": {"http2_protocol_options": {"initial_stream_window_size": 65536,
                                                            "initial_connection_window_size": 1048576}}}}
    def ext_proc_cluster(name: str, port: int) -> dict[str, Any]:
        return {
            "name": name,
            "type": "STATIC",
            "connect_timeout": "5s",
            "lb_policy": "LEAST_REQUEST",
            "circuit_breakers": big,
            "health_checks": [{"timeout": "2s", "interval": "10s", "unhealthy_threshold": 3, "healthy_threshold": 2,
                               "reuse_connection": True,
                               "grpc_health_check": {"service_name": "envoy.service.ext_proc.v3.ExternalProcessor"},
                               "tls_options": {"alpn_protocols": ["h2"]}}],
            # The EPP and the router serve ext_proc over TLS with a self-signed certificate (their
            # --secure-serving default, which the operator keeps): encrypted, not verified, as in GIE's chart.
            "transport_socket": {"name": "envoy.transport_sockets.tls", "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.UpstreamTlsContext",
                "common_tls_context": {"validation_context": {}, "alpn_protocols": ["h2"]}}},
            "typed_extension_protocol_options": h2,
            "load_assignment": {"cluster_name": name, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": port}}}}]}]},
        }

    picker_clusters = [ext_proc_cluster(cluster_name(r.pool), r.picker_port) for r in pools]
    if router_port is not None:
        picker_clusters.append(ext_proc_cluster(ROUTER_CLUSTER, router_port))
        filters.insert(0, {
            "name": "body-based-router",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor",
                "grpc_service": {"envoy_grpc": {"cluster_name": ROUTER_CLUSTER,
                                                "authority": f"localhost:{router_port}"}, "timeout": "10s"},
                "failure_mode_allow": False,
                # The router answers once, on the whole body (it is not run with --streaming).
                "processing_mode": {
                    "request_header_mode": "SEND", "response_header_mode": "SKIP",
                    "request_body_mode": "BUFFERED", "response_body_mode": "NONE",
                    "request_trailer_mode": "SKIP", "response_trailer_mode": "SKIP",
                },
                "message_timeout": "10s",
            },
        })
    return {
        "admin": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": admin_port}}},
        "static_resources": {
            "listeners": [{
                "name": "gateway",
                "address": {"socket_address": {"address": "127.0.0.1", "port_value": listen_port}},
                "filter_chains": [{"filters": [{
                    "name": "envoy.filters.network.http_connection_manager",
                    "typed_config": {
                        "@type": "type.googleapis.com/envoy.extensions.filters.network."
                                 "http_connection_manager.v3.HttpConnectionManager",
                        "stat_prefix": "gateway",
                        "route_config": {"name": "gateway", "virtual_hosts": [
                            {"name": "gateway", "domains": ["*"], "routes": envoy_routes}]},
                        "http_filters": filters,
                        "access_log": [{"name": "envoy.access_loggers.file", "typed_config": {
                            "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3.FileAccessLog",
                            "path": str(access_log), "log_format": {"json_format": log_format}}}],
                        "use_remote_address": True,
                        "stream_idle_timeout": HELD_REQUEST_TIMEOUT,
                        "local_reply_config": {"mappers": [retry_after_mapper]},
                    },
                }]}],
            }],
            "clusters": [
                {
                    "name": "original_destination_cluster",
                    "type": "ORIGINAL_DST",
                    "connect_timeout": "5s",
                    "lb_policy": "CLUSTER_PROVIDED",
                    "circuit_breakers": big,
                    "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER},
                },
                *picker_clusters,
            ],
        },
    }


@dataclass
class GatewayController:
    """A GIE-aware Gateway for the Gateway `namespace/name`: Envoy, configured from the HTTPRoutes attached to it."""

    cp: ControlPlane
    namespace: str
    name: str
    pickers: dict[str, PickerKubelet]
    """namespace -> the picker kubelet of that namespace (where the pools' pickers run)."""
    envoy: Path
    workdir: Path
    bbr: Path
    """GIE's body-based router binary, run in front of the route choice (BodyRouter)."""
    port: int = 0
    admin_port: int = 0
    routes: list[Route] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    router: BodyRouter | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def access_log(self) -> Path:
        return self.workdir / "access.log"

    def __enter__(self) -> GatewayController:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port, self.admin_port = free_ports(2)
        self.router = BodyRouter(self.cp, self.namespace, self.bbr, self.workdir / "router").__enter__()
        self._thread = threading.Thread(target=self._loop, name="gateway-controller", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._stop_envoy()
        if self.router is not None:
            self.router.__exit__()

    def requests(self) -> list[dict[str, Any]]:
        """Envoy's access log: one dict per finished request (start, upstream, code, flags, route, ...)."""
        if not self.access_log.exists():
            return []
        return [json.loads(line) for line in self.access_log.read_text().splitlines() if line.strip()]

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception:  # the next pass retries
                log.exception("event=gateway-sync-failed gateway=%s/%s", self.namespace, self.name)
            self._stop.wait(1.0)

    def _attached(self) -> Iterator[dict[str, Any]]:
        routes = json.loads(self.cp.kubectl("get", "httproutes", "-A", "-o", "json").stdout)["items"]
        for route in routes:
            ns = route["metadata"]["namespace"]
            for parent in (route.get("spec") or {}).get("parentRefs") or []:
                if parent.get("name") == self.name and parent.get("namespace", ns) == self.namespace \
                        and parent.get("kind", "Gateway") == "Gateway":
                    yield route
                    break

    def sync_once(self) -> None:
        routes: list[Route] = []
        for route in self._attached():
            ns, rname = route["metadata"]["namespace"], route["metadata"]["name"]
            for rule in route["spec"].get("rules") or []:
                backend = next((b for b in rule.get("backendRefs") or [] if b.get("kind") == "InferencePool"), None)
                if backend is None:
                    continue
                out = self.cp.kubectl("get", "inferencepool", backend["name"], "-n", ns, "-o", "json", check=False)
                if out.returncode != 0:
                    continue
                pool = json.loads(out.stdout)
                self._accept(pool, route)
                ref = pool["spec"]["endpointPickerRef"]
                port = self._picker_port(ns, ref["name"], int(ref["port"]["number"]))
                if port is None:
                    continue
                for match in rule.get("matches") or [{}]:
                    headers = tuple(sorted((h["name"].lower(), h["value"]) for h in match.get("headers") or []))
                    routes.append(Route(f"{ns}/{rname}", headers, f"{ns}/{backend['name']}", port,
                                        str(ref.get("failureMode", "FailClose"))))
        if routes != self.routes or self.proc is None or self.proc.poll() is not None:
            self._restart_envoy(routes)

    def _picker_port(self, ns: str, service: str, port: int) -> int | None:
        """The local port of the picker behind the Service's port (translated like the pod's ports)."""
        out = self.cp.kubectl("get", "service", service, "-n", ns, "-o", "json", check=False)
        kubelet = self.pickers.get(ns)
        if out.returncode != 0 or kubelet is None:
            return None
        svc = json.loads(out.stdout)
        pod = kubelet.pod_for(svc["spec"].get("selector") or {})
        if pod is None:
            return None
        target = next((p.get("targetPort") for p in svc["spec"]["ports"] if int(p["port"]) == port), None)
        # The picker's Service names its container port ("grpc", 9002); a number is the port itself.
        container_port = 9002 if target == "grpc" else int(target) if isinstance(target, int) else port
        return pod.ports.get(container_port)

    def _accept(self, pool: dict[str, Any], route: dict[str, Any]) -> None:
        parent = {"group": GATEWAY_GROUP, "kind": "Gateway", "namespace": self.namespace, "name": self.name}
        accepted = {"type": "Accepted", "status": "True", "reason": "Accepted", "lastTransitionTime": _now(),
                    "observedGeneration": pool["metadata"].get("generation", 1), "message": "e2e gateway"}
        have = (pool.get("status") or {}).get("parents") or []
        if not any(p.get("parentRef", {}).get("name") == self.name for p in have):
            self.cp.kubectl("patch", "inferencepool", pool["metadata"]["name"], "-n", pool["metadata"]["namespace"],
                            "--subresource=status", "--type=merge", "-p",
                            json.dumps({"status": {"parents": [{"parentRef": parent, "conditions": [accepted]}]}}),
                            check=False)
        route_parents = (route.get("status") or {}).get("parents") or []
        if not route_parents:
            self.cp.kubectl("patch", "httproute", route["metadata"]["name"], "-n", route["metadata"]["namespace"],
                            "--subresource=status", "--type=merge", "-p",
                            json.dumps({"status": {"parents": [{"parentRef": parent, "controllerName": CONTROLLER_NAME,
                                                                "conditions": [accepted]}]}}), check=False)

    def _restart_envoy(self, routes: list[Route]) -> None:
        self._stop_envoy()
        config = self.workdir / "envoy.yaml"
        config.write_text(yaml.safe_dump(envoy_config(self.port, self.admin_port, routes, self.access_log,
                                                        self.router.port if self.router is not None else None)))
        with (self.workdir / "envoy.log").open("ab") as out:
            self.proc = subprocess.Popen(
                # The access log (which pod served each request, for the tests) is flushed every 100 ms,
                # not Envoy's default 10 s.
                [str(self.envoy), "-c", str(config), "--log-level", "warn", "--base-id", str(self.port),
                 "--concurrency", "1", "--file-flush-interval-msec", "100"],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
            )
        log.info("event=envoy-started pid=%d port=%d routes=%s", self.proc.pid, self.port, [r.name for r in routes])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and self.proc.poll() is None:
            with contextlib.suppress(OSError):
                import urllib.request

                with urllib.request.urlopen(f"http://127.0.0.1:{self.admin_port}/ready", timeout=1) as resp:
                    if resp.status == 200:
                        # Only now: a test that sees its route in `routes` can send through it.
                        self.routes = routes
                        return
            time.sleep(0.2)
        raise RuntimeError(f"Envoy did not become ready: {(self.workdir / 'envoy.log').read_text()[-2000:]}")

    def _stop_envoy(self) -> None:
        if self.proc is not None:
            stop_process_group(self.proc)
        self.proc = None

