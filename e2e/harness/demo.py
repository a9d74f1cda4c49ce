"""The demo behind `bash scripts/demo.sh`: the operator's main job, shown on a real control plane with real engines.

Act 0 (also `--objects-only`): a control plane (e2e/harness/cluster.py), the CRD, the operator, the
examples/ FlashModels and the children the operator made for them. Their pods land on kwok
nodes, which start no engine.

Act 1: a FlashModel for a tiny random-weight model on the cpu profile, with an API key, one replica
and one standby; each of its two pods runs the real launcher, health shim and vLLM for the CPU
(e2e/harness/kubelet.py). The prewarm gate opens on one, the other is held out of the Service as the
standby, the model turns Ready with each pod's cold and warm TTFT, and a chat completion is asked of
one of its Service's endpoints.

Act 2: the serving pod's engine grows its memory behind vLLM's back (the kubelet's hog file); the
operator promotes the standby, drains the diverging pod and evicts it, and a new standby starts,
while a client keeps sending requests through the Service's ready endpoints; none may fail.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from flashmodel_operator.render import PREWARM_GATE

from e2e.harness.cluster import ControlPlane, ControlPlaneError, testbin_dir
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model, engine_python
from e2e.harness.load import Load
from e2e.harness.operator_run import create_model_volume, get_json, running_operator, scrape

ROOT = Path(__file__).resolve().parents[2]
MODEL = "tiny"
API_KEY_SECRET = "tiny-api-key"
NODES = 3
ENGINE_START_TIMEOUT = 480.0
"""Two vLLM engines loading side by side on two cores: one to two minutes here, more on a busy machine."""
REPLACEMENT_TIMEOUT = 420.0
EXAMPLES_TIMEOUT = 60.0
# The operator's waits, shortened the way the e2e tests shorten them so both acts take minutes.
OPERATOR_ENV = {
    "FLASHMODEL_MONITOR_SECONDS": "2",
    "FLASHMODEL_REMEDIATION_BACKOFF_SECONDS": "30",
    # No /metrics port: a fixed one would collide with another operator on this machine.
    "FLASHMODEL_METRICS_PORT": "0",
}
DIVERGENCE_MIB = "1536"
"""What the hog file makes the engine's API-server process allocate: far past a 3 % divergence."""


class DemoError(RuntimeError):
    """A step failed; the message says what to do."""


# -- printing ------------------------------------------------------------------------------------


def say(text: str = "") -> None:
    print(text, flush=True)


@contextlib.contextmanager
def step(what: str, slow_hint: str = "") -> Iterator[None]:
    """Prints `what`, then how long it took (or that it failed)."""
    say(f"==> {what}" + (f" ({slow_hint})" if slow_hint else ""))
    t0 = time.monotonic()
    try:
        yield
    except BaseException:
        say(f"    FAILED after {time.monotonic() - t0:.1f}s: {what}")
        raise
    say(f"    done in {time.monotonic() - t0:.1f}s")


def show(cp: ControlPlane, *args: str) -> str:
    """Runs kubectl as the user would and prints the command and its output."""
    say(f"$ kubectl {' '.join(args)}")
    out = cp.kubectl(*args, check=False)
    text = (out.stdout + out.stderr).rstrip()
    say(text)
    return text


# -- watching the model --------------------------------------------------------------------------


class Reads:
    """The watch loop's reads through one kept-open API client: a kubectl process per look every 2 s
    would take CPU from the engines loading on the same two cores."""

    def __init__(self, cp: ControlPlane) -> None:
        from kubernetes import client  # imported here: --help needs no client

        self.api = cp.api_client()
        self.core = client.CoreV1Api(self.api)
        self.custom = client.CustomObjectsApi(self.api)
        self.discovery = client.DiscoveryV1Api(self.api)

    def close(self) -> None:
        self.api.close()  # type: ignore[no-untyped-call]

    @staticmethod
    def _json(raw: Any) -> Any:
        return json.loads(raw.data)

    def pods(self, namespace: str, model: str) -> list[dict[str, Any]]:
        raw = self.core.list_namespaced_pod(namespace, label_selector=f"serving.flashmodel.io/model={model}",
                                            _preload_content=False)
        items: list[dict[str, Any]] = self._json(raw)["items"]
        return items

    def events(self, namespace: str, name: str) -> list[dict[str, Any]]:
        raw = self.core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}",
                                              _preload_content=False)
        items: list[dict[str, Any]] = self._json(raw)["items"]
        return items

    def flashmodel(self, namespace: str, name: str) -> dict[str, Any]:
        raw = self.custom.get_namespaced_custom_object("serving.flashmodel.io", "v1alpha1", namespace,
                                                       "flashmodels", name, _preload_content=False)
        fm: dict[str, Any] = self._json(raw)
        return fm

    def model_ready(self, namespace: str, name: str) -> bool:
        return bool(_condition(self.flashmodel(namespace, name), "Ready").get("status") == "True")

    def ready_endpoints(self, namespace: str, service: str) -> list[str]:
        raw = self.discovery.list_namespaced_endpoint_slice(
            namespace, label_selector=f"kubernetes.io/service-name={service}", _preload_content=False)
        return sorted(
            a for s in self._json(raw)["items"] for e in s.get("endpoints") or []
            if (e.get("conditions") or {}).get("ready") for a in e["addresses"]
        )


def _condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    found: dict[str, Any] = next(
        (c for c in (obj.get("status") or {}).get("conditions") or [] if c.get("type") == kind), {}
    )
    return found


def pod_facts(pod: dict[str, Any]) -> dict[str, str]:
    """What a watcher of one engine pod would want to see change, in words."""
    status = pod.get("status") or {}
    containers = status.get("containerStatuses") or [{}]
    gate = _condition(pod, PREWARM_GATE)
    gate_text = "not set yet"
    if gate:
        gate_text = gate.get("status", "?")
        if gate.get("reason"):
            gate_text += f" ({gate['reason']}: {str(gate.get('message', ''))[:220]})"
    facts = {
        "phase": f"{status.get('phase', 'Pending')} ip={status.get('podIP', '-')}",
        "engine": "started" if containers[0].get("started") else "loading",
        "health (one-token generation)": _condition(pod, "ContainersReady").get("status", "False"),
        f"gate {PREWARM_GATE}": gate_text,
        "Ready (in the Service)": _condition(pod, "Ready").get("status", "False"),
    }
    if pod["metadata"].get("deletionTimestamp"):
        facts["deleting"] = "yes (terminating: preStop sleep, SIGTERM, engine drains)"
    return facts


@dataclass
class Timeline:
    """Prints each change to the model's pods and each new event of the model, stamped from t0."""

    reads: Reads
    namespace: str
    model: str
    kubelet: EngineKubelet | None = None
    """Where the engines' logs are, for the heartbeat's "how far"."""
    t0: float = field(default_factory=time.monotonic)
    pods: dict[str, dict[str, str]] = field(default_factory=dict)
    events: set[str] = field(default_factory=set)
    last_said: float = field(default_factory=time.monotonic)

    def line(self, text: str, at: float | None = None) -> None:
        """Prints `text` stamped with `at` (monotonic; now when None)."""
        say(f"  +{(time.monotonic() if at is None else at) - self.t0:6.1f}s  {text}")
        self.last_said = time.monotonic()

    def look(self) -> list[dict[str, Any]]:
        """One look: prints what changed; returns the model's pods (terminating ones included).

        Every change one look finds carries the look's time: the changes happened before it, in an
        order one list of the pods cannot tell, so their offsets must not suggest one."""
        at = time.monotonic()
        items = self.reads.pods(self.namespace, self.model)
        present = set()
        for pod in items:
            name = pod["metadata"]["name"]
            present.add(name)
            facts = pod_facts(pod)
            before = self.pods.get(name)
            if before is None:
                self.line(f"pod {name}: created; " + "; ".join(f"{k}: {v}" for k, v in facts.items()), at)
            else:
                for key, value in facts.items():
                    if before.get(key) != value:
                        self.line(f"pod {name}: {key}: {before.get(key, '-')} -> {value}", at)
            self.pods[name] = facts
        for name in sorted(set(self.pods) - present):
            self.line(f"pod {name}: gone (deleted)", at)
            del self.pods[name]
        events = self.reads.events(self.namespace, self.model)
        for event in sorted(events, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or ""):
            uid = event["metadata"]["uid"]
            if uid not in self.events:
                self.events.add(uid)
                self.line(f"event {event['type']} {event['reason']}: {event.get('message', '')[:300]}")
        return items

    def heartbeat(self, waiting_for: str, every: float = 20) -> None:
        if time.monotonic() - self.last_said < every:
            return
        self.line(f"... still waiting for {waiting_for}")
        for name, pod in sorted((self.kubelet.pods if self.kubelet else {}).items()):
            if not pod.ready:
                self.line(f"    {name} engine log: {engine_log_tail(pod.workdir / 'engine.log')}")


LOG_PREFIX = re.compile(r"^(\([A-Za-z]+ pid=\d+\) )?(INFO|WARNING|DEBUG)? ?(\d\d-\d\d \d\d:\d\d:\d\d )?(\[[^]]+\] )?")


def engine_log_tail(path: Path) -> str:
    """The engine's last log line, less vLLM's prefix: where its start-up has got to."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, path.stat().st_size - 4096))
            lines = [line for line in f.read().decode(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "(no log yet)"
    # vLLM's INFO lines and the engine's own event= lines say the stage; a dump's inner lines do not.
    stages = [LOG_PREFIX.sub("", line) for line in lines if " INFO " in line or "event=" in line]
    # An indented message continues a dump (vLLM's thread-binding table); the line above it says the stage.
    stages = [line for line in stages if not line[:1].isspace()] or lines
    return stages[-1][:140] if stages else "(no log yet)"


def wait_and_watch(timeline: Timeline, what: str, done: Callable[[list[dict[str, Any]]], bool], timeout: float,
                   hint: str) -> None:
    """Looks every 2 s, printing changes, until done(pods); DemoError with `hint` after timeout."""
    deadline = time.monotonic() + timeout
    while True:
        pods = timeline.look()
        if done(pods):
            return
        if time.monotonic() > deadline:
            raise DemoError(f"timed out after {timeout:.0f}s waiting for {what}. {hint}")
        timeline.heartbeat(what)
        time.sleep(2)


def _live(pods: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [p for p in pods if not p["metadata"].get("deletionTimestamp")]


def _gate_open(pod: dict[str, Any]) -> bool:
    return _condition(pod, PREWARM_GATE).get("status") == "True"


def _standing_by(pod: dict[str, Any]) -> bool:
    gate = _condition(pod, PREWARM_GATE)
    return gate.get("status") == "False" and gate.get("reason") == "Standby"


def _serving_with_standby(pods: list[dict[str, Any]]) -> tuple[str, str] | None:
    """(serving pod, standby pod) where exactly those two live pods exist, one serving, one a prewarmed standby."""
    live = _live(pods)
    serving = [p["metadata"]["name"] for p in live if _gate_open(p)]
    standby = [p["metadata"]["name"] for p in live if _standing_by(p)]
    if len(live) != 2 or len(serving) != 1 or len(standby) != 1:
        return None
    return serving[0], standby[0]


# -- the acts ------------------------------------------------------------------------------------


def apply_examples(cp: ControlPlane) -> list[str]:
    """What examples/ refers to (Secrets, model and hub-cache volumes), then examples/ itself; returns the names."""
    docs = [d for f in sorted((ROOT / "examples").glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    models = [d for d in docs if d.get("kind") == "FlashModel"]
    for doc in models:
        spec = doc["spec"]
        ref = (spec.get("auth") or {}).get("apiKeySecretRef")
        if ref:
            cp.kubectl("create", "secret", "generic", ref["name"],
                       f"--from-literal={ref.get('key', 'api-key')}=demo-{secrets.token_hex(8)}", check=False)
        hub = (spec.get("model") or {}).get("hub") or {}
        token = hub.get("tokenSecretRef")
        if token:
            # kwok pods start no engine, so the token is never presented to the hub.
            cp.kubectl("create", "secret", "generic", token["name"],
                       f"--from-literal={token.get('key', 'token')}=hf_demo", check=False)
        claims = [((spec.get("model") or {}).get("pvc") or {}).get("claimName"),
                  ((hub.get("cache") or {}).get("pvc") or {}).get("claimName")]
        for claim in filter(None, claims):
            # A static PV per claim: a real cluster has a storage class.
            create_model_volume(cp, "default", claim)
    cp.kubectl("apply", "-f", str(ROOT / "examples"))
    return [d["metadata"]["name"] for d in models]


def act_objects(cp: ControlPlane, objects_only: bool) -> list[str]:
    with step("Applying examples/ (with the Secrets and volumes they refer to)"):
        names = apply_examples(cp)

        def reconciled() -> bool:
            items = get_json(cp, "flashmodels")["items"]
            pods = get_json(cp, "pods", "-l", "app.kubernetes.io/managed-by=flashmodel-operator")["items"]
            # Written status and every pod placed: what the listing below is meant to show.
            return (len(items) == len(names) and all(_condition(fm, "Ready") for fm in items)
                    and bool(pods) and all(_condition(p, "PodScheduled").get("status") == "True" for p in pods))

        deadline = time.monotonic() + EXAMPLES_TIMEOUT
        while not reconciled():
            if time.monotonic() > deadline:
                raise DemoError(f"the operator wrote no status on {names} in {EXAMPLES_TIMEOUT:.0f}s; "
                                "read the operator log (its path is printed above)")
            time.sleep(1)
    say()
    show(cp, "get", "fm", "-o", "wide")
    say()
    show(cp, "get", "deployments,services,configmaps,poddisruptionbudgets,hpa,pods",
         "-l", "app.kubernetes.io/managed-by=flashmodel-operator", "-o", "wide")
    say()
    say("The vLLM command line each model's pods run (status.engineArgs):")
    for fm in get_json(cp, "flashmodels")["items"]:
        say(f"  {fm['metadata']['name']}: {' '.join((fm.get('status') or {}).get('engineArgs') or [])}")
    if objects_only:
        say("These pods sit on kwok nodes, which start no engine; without --objects-only the demo goes on to "
            "pods that run real vLLM engines.")
    else:
        say("These pods sit on kwok nodes, which start no engine: the next acts run real ones.")
    return names


def check_engine_python(python: str) -> None:
    """DemoError saying what to run where the engine venv or vLLM is missing, or pod networks cannot be made."""
    if not Path(python).exists():
        raise DemoError(f"no engine Python at {python}: run `bash scripts/setup-engine.sh` "
                        "(installs torch and vLLM for the CPU, ~5 GB), or pass --objects-only")
    probe = subprocess.run([python, "-c", "import importlib.util as u; import sys; "
                            "sys.exit(0 if u.find_spec('vllm') and u.find_spec('aiohttp') else 1)"], check=False)
    if probe.returncode != 0:
        raise DemoError(f"{python} has no vLLM (or no aiohttp): run `bash scripts/setup-engine.sh`")
    if os.geteuid() != 0 or shutil.which("ip") is None:
        raise DemoError("the serving acts give every engine pod a network namespace of its own (`ip netns`), "
                        "which needs root and iproute2; run the demo as root, or pass --objects-only")


def build_tiny_model(python: str) -> Path:
    # In the engine venv: the operator's has no torch.
    out = subprocess.run([python, "-m", "tests.support.tiny_model"], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    if out.returncode != 0:
        raise DemoError(f"building the tiny model failed: {out.stderr.strip()[-1500:]}; "
                        "rerun `bash scripts/setup-engine.sh` to repair the engine venv")
    return Path(out.stdout.strip().splitlines()[-1])


def chat(endpoint: str, key: str, content: str, max_tokens: int = 16) -> tuple[int, dict[str, Any]]:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": content}],
                       # Sampled, not greedy: greedy on random weights repeats one token.
                       "max_tokens": max_tokens, "temperature": 1.0, "seed": 7}).encode()
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"{endpoint}/v1/chat/completions", data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            answer: dict[str, Any] = json.loads(resp.read())
            return int(resp.status), answer
    except urllib.error.HTTPError as err:
        return int(err.code), {"error": err.read(300).decode(errors="replace")}


def act_serving(cp: ControlPlane, reads: Reads, namespace: str, kubelet: EngineKubelet, tiny: Path, key: str) -> None:
    say()
    say(f"==> Act 1: FlashModel {namespace}/{MODEL}, a tiny random-weight Qwen2 on vLLM for the CPU: one replica "
        "serving and one standby (loaded and prewarmed, kept out of the Service until it is needed)")
    doc = cpu_model(
        namespace,
        MODEL,
        tiny,
        replicas=1,
        standby_replicas=1,
        auth={"apiKeySecretRef": {"name": API_KEY_SECRET}},
        prewarm={"requests": 3, "maxTokens": 8, "timeoutSeconds": 120},
        health={"readinessDeadlineSeconds": 10, "startupTimeoutSeconds": 600},
        # The e2e tests' short window, so a divergence is acted on in seconds rather than minutes.
        remediation={"divergenceRatio": 0.03, "divergenceWindowSeconds": 10, "maxRestartsPerHour": 4},
        grace_seconds=20,
    )
    say(yaml.safe_dump(doc, sort_keys=False).rstrip())
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    say("Each pod's engine loads (about a minute or two here); a pod joins the Service only once the operator's "
        f"prewarm succeeded and set its readiness gate {PREWARM_GATE}. The second prewarmed pod is held as the "
        "standby (gate False, reason Standby):")
    timeline = Timeline(reads, namespace, MODEL, kubelet)
    wait_and_watch(
        timeline,
        "one pod serving, one standby and the model Ready",
        lambda pods: _serving_with_standby(pods) is not None and reads.model_ready(namespace, MODEL),
        ENGINE_START_TIMEOUT,
        f"Engine logs: {kubelet.workdir}/<pod>/engine.log; the operator's log is printed above.",
    )
    say()
    show(cp, "get", "pods", "-n", namespace, "-o", "wide")
    say()
    show(cp, "get", "fm", "-n", namespace)
    say()
    fm = reads.flashmodel(namespace, MODEL)
    say("Prewarm time to first token per pod (status.pods[]: coldTTFTMs is the first warm-up request, "
        "warmTTFTMs the last):")
    say(f"  {'POD':<34}{'PREWARMED':<11}{'ROLE':<9}{'COLD TTFT':>12}{'WARM TTFT':>12}")
    for entry in fm["status"].get("pods") or []:
        role = "standby" if entry.get("standby") else "serving"
        say(f"  {entry['name']:<34}{entry.get('prewarmed')!s:<11}{role:<9}"
            f"{entry.get('coldTTFTMs', 0):>9.1f} ms{entry.get('warmTTFTMs', 0):>9.1f} ms")
    say(f"status.standbyReplicas: {fm['status'].get('standbyReplicas')}")
    say()
    endpoint = f"http://{reads.ready_endpoints(namespace, MODEL)[0]}:8000"
    say(f"A chat completion from a ready endpoint of Service {namespace}/{MODEL} (the key is in Secret "
        f"{API_KEY_SECRET}; random weights, so the words are noise):")
    say(f"$ curl {endpoint}/v1/chat/completions -H \"Authorization: Bearer $KEY\" "
        f"-d '{{\"model\": \"{MODEL}\", \"messages\": [{{\"role\": \"user\", \"content\": \"Say hello.\"}}], "
        "\"max_tokens\": 16}'")
    t0 = time.monotonic()
    code, answer = chat(endpoint, key, "Say hello.")
    if code != 200:
        raise DemoError(f"the chat completion answered HTTP {code}: {answer}; see {kubelet.workdir}/*/engine.log")
    choice, usage = answer["choices"][0], answer["usage"]
    brief = {"id": answer.get("id"), "model": answer["model"], "message": choice["message"]["content"],
             "finish_reason": choice["finish_reason"],
             "usage": {k: usage[k] for k in ("prompt_tokens", "completion_tokens")}}
    say(f"HTTP {code} in {1000 * (time.monotonic() - t0):.0f} ms: {json.dumps(brief, ensure_ascii=False)}")
    code, _ = chat(endpoint, "", "Say hello.", max_tokens=1)
    say(f"The same request without the key: HTTP {code}")


def _divergence_signal(shim: str) -> bool:
    try:
        return scrape(f"{shim}/metrics", "flashmodel_remediation_recommended", {"reason": "memory_divergence"}) == 1
    except OSError:
        return False


def act_remediation(cp: ControlPlane, reads: Reads, namespace: str, kubelet: EngineKubelet, key: str) -> bool:
    """Returns whether no accepted request was lost."""
    say()
    say("==> Act 2: the serving pod's memory diverges; the operator promotes the standby, drains the diverging "
        "pod, evicts it, and a new standby starts, while a client keeps sending requests through the Service's "
        "ready endpoints")
    # One client at a steady few requests a second: a flood would starve the new standby's engine
    # of the two cores it loads on, and the point is that every request is answered.
    with Load(cp, namespace, MODEL, workers=1, pause=0.2, api_key=key) as load:
        deadline = time.monotonic() + 60
        while load.completed < 5:
            if time.monotonic() > deadline:
                raise DemoError(f"the client got no answers in 60s (lost: {load.lost[:3]})")
            time.sleep(0.5)
        say(f"Client running: {load.completed} requests completed so far.")
        roles = _serving_with_standby(reads.pods(namespace, MODEL))
        if roles is None:
            raise DemoError("act 1 left no serving pod and standby; read the operator log (path above)")
        target, spare = roles
        pod = kubelet.pods[target]
        say(f"Pod {target} serves and pod {spare} stands by. Pod {target}'s engine now allocates {DIVERGENCE_MIB} "
            f"MiB that vLLM does not account for (written to {pod.hog_file}):")
        timeline = Timeline(reads, namespace, MODEL, kubelet)
        # What act 1 already showed is not news.
        timeline.pods = {p["metadata"]["name"]: pod_facts(p) for p in reads.pods(namespace, MODEL)}
        timeline.events = {e["metadata"]["uid"] for e in reads.events(namespace, MODEL)}
        pod.hog_file.write_text(DIVERGENCE_MIB)
        signalled = False

        def replaced(pods: list[dict[str, Any]]) -> bool:
            nonlocal signalled
            if not signalled and _divergence_signal(pod.shim):
                signalled = True
                timeline.line(f"pod {target}: the engine's divergence signal is up "
                              "(flashmodel_remediation_recommended{reason=\"memory_divergence\"} 1)")
            live = {p["metadata"]["name"]: p for p in _live(pods)}
            return (target not in live and spare in live and _gate_open(live[spare])
                    and reads.model_ready(namespace, MODEL))

        wait_and_watch(timeline, "the standby serving in the diverging pod's place", replaced,
                       REPLACEMENT_TIMEOUT, "Read the operator log (path above) for event=remediation-held lines.")
        took = time.monotonic() - timeline.t0
        say(f"Replaced in {took:.0f}s from the first byte of divergence: the standby serves and the diverging pod "
            "is evicted (the engine's divergence window and the operator's confirmation are most of it).")
        wait_and_watch(timeline, f"pod {target} gone", lambda pods: target not in {p["metadata"]["name"] for p in pods},
                       REPLACEMENT_TIMEOUT, "Its engine drains for at most terminationGracePeriodSeconds.")
        time.sleep(2)
    say()
    show(cp, "get", "events", "-n", namespace, "--field-selector", f"involvedObject.name={MODEL}",
         "--sort-by=.lastTimestamp")
    say()
    show(cp, "get", "fm", "-n", namespace)
    say()
    say(f"Client during act 2: accepted={load.accepted} completed={load.completed} failed={len(load.lost)} "
        f"refused-before-sending={load.refused} fewest-ready-endpoints={load.min_ready_endpoints}")
    for lost in load.lost[:5]:
        say(f"  failed: {lost}")
    return not load.lost


# -- the whole run -------------------------------------------------------------------------------


def say_next_steps(objects_only: bool) -> None:
    say("Next:")
    say("  bash scripts/demo.sh --keep        # the same, then stays up: kubectl and curl against it")
    if objects_only:
        say("  bash scripts/demo.sh               # with real vLLM engines: prewarm, a chat completion, self-healing")
    say("  README.md, 'Install on a real cluster'   # images, the chart, alerts")


def wait_for_ctrl_c(cp: ControlPlane, namespace: str) -> None:
    say()
    say("Up until Ctrl-C. In another shell:")
    say(f"  export KUBECONFIG={cp.kubeconfig} PATH={cp.bin_dir}:$PATH")
    say("  kubectl get fm -A; kubectl get pods -A -o wide")
    if namespace:
        key = f"$(kubectl get secret -n {namespace} {API_KEY_SECRET} -o jsonpath='{{.data.api-key}}' | base64 -d)"
        ip = f"$(kubectl get endpointslices -n {namespace} -l kubernetes.io/service-name={MODEL} " \
             "-o jsonpath='{.items[0].endpoints[0].addresses[0]}')"
        say(f"  curl http://{ip}:8000/v1/chat/completions -H \"Authorization: Bearer {key}\" "
            f"-H 'Content-Type: application/json' -d '{{\"model\": \"{MODEL}\", "
            "\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 8}'")
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda s, f: stop.set())
    while not stop.wait(1.0):
        cp.check_alive()


def run(objects_only: bool, keep: bool, engine_python: str) -> int:
    t_start = time.monotonic()
    if not objects_only:
        try:
            check_engine_python(engine_python)
        except DemoError as exc:
            say(f"demo: cannot run the serving acts: {exc}")
            return 1
    work = Path(tempfile.mkdtemp(prefix="flashmodel-demo."))
    ok = False
    try:
        with step("Locating the control-plane binaries (scripts/testbin.sh builds them once)"):
            bin_dir = testbin_dir(build=True)
        tiny = Path()
        if not objects_only:
            with step("Building the tiny random-weight model", "first run only; cached under ~/.cache/flashmodel"):
                tiny = build_tiny_model(engine_python)
                say(f"    model: {tiny}")
        cp = ControlPlane(bin_dir, workdir=work / "cluster")
        with step("Starting the control plane: etcd, kube-apiserver, controller-manager, scheduler, kwok"):
            cp.start()
        with contextlib.ExitStack() as stack:
            stack.callback(cp.stop)
            with step(f"Adding {NODES} fake T4 nodes (kwok)"):
                cp.add_t4_nodes(NODES, kwok_taint=False)
            with step("Installing the FlashModel CRD"):
                cp.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "flashmodel.yaml"))
                cp.wait_established("flashmodels.serving.flashmodel.io")
            log = work / "operator.log"
            with step("Starting the operator"):
                stack.enter_context(running_operator(cp.kubeconfig, log, extra_env=OPERATOR_ENV))
                say(f"    log: {log}")
            names = act_objects(cp, objects_only)
            namespace = ""
            if not objects_only:
                with step("Removing the examples (their pods have no engine) before real engines start"):
                    cp.kubectl("delete", "flashmodels", *names, "--wait=true", "--timeout=60s", check=False)
                namespace = cp.create_namespace("demo")
                key = secrets.token_urlsafe(24)
                cp.kubectl("create", "secret", "generic", API_KEY_SECRET, "-n", namespace,
                           f"--from-literal=api-key={key}")
                kubelet = stack.enter_context(
                    EngineKubelet(cp, namespace, work / "kubelet", python=engine_python, env=ENGINE_ENV))
                reads = Reads(cp)
                stack.callback(reads.close)
                act_serving(cp, reads, namespace, kubelet, tiny, key)
                if not act_remediation(cp, reads, namespace, kubelet, key):
                    raise DemoError("requests failed during the remediation (listed above); "
                                    f"engine logs: {work}/kubelet/<pod>/engine.log, operator log: {log}")
            say()
            say(f"demo: done in {time.monotonic() - t_start:.0f}s")
            ok = True
            if keep:
                wait_for_ctrl_c(cp, namespace)
            else:
                say_next_steps(objects_only)
            say("demo: stopping")
    except (DemoError, ControlPlaneError, subprocess.CalledProcessError) as exc:
        # A kubectl that failed says so in its stderr, which CommandError's message carries.
        say(f"demo: FAILED: {exc}")
        say(f"demo: logs kept in {work}")
        return 1
    finally:
        if ok:
            shutil.rmtree(work, ignore_errors=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m e2e.harness.demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects-only", action="store_true",
                        help="only act 0: the examples' objects, no vLLM (seconds)")
    parser.add_argument("--keep", action="store_true", help="stay up at the end until Ctrl-C")
    parser.add_argument("--engine-python", default=engine_python(),
                        help="the Python of the venv with vLLM for the CPU (scripts/setup-engine.sh makes it)")
    args = parser.parse_args(argv)

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt  # unwinds every context: engines, operator, control plane

    signal.signal(signal.SIGTERM, on_term)
    try:
        return run(args.objects_only, args.keep, args.engine_python)
    except KeyboardInterrupt:
        say("demo: interrupted, stopped everything")
        return 130


if __name__ == "__main__":
    sys.exit(main())
