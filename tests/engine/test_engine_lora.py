"""LoRA adapters on a real vLLM (cpu profile, tiny model): PUT /adapters, generation by adapter name, 404s, gauge.

One engine for the module (a start is most of the time); the tests run in order on its adapter set.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flashmodel_engine.engine_guard import CONTROL_HEADER

from tests.engine.conftest import LaunchedEngine, Reply, engine_config, http, launched, metric
from tests.support.tiny_adapter import build_tiny_adapter, corrupt_adapter

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("engine_packages")]
CONTROL_TOKEN = "operator-token-lora-9d1e"
PROMPT = "the valve on line three"


@pytest.fixture(scope="module")
def adapters_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    build_tiny_adapter(root / "support", seed=1)
    build_tiny_adapter(root / "billing", seed=2, target_modules=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                 "gate_proj", "up_proj", "down_proj"))
    corrupt_adapter(root / "broken")
    return root


@pytest.fixture(scope="module")
def engine(tiny_model: Path, adapters_root: Path, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[LaunchedEngine]:
    workdir = tmp_path_factory.mktemp("engine-lora")
    (workdir / "control-token").write_text(CONTROL_TOKEN + "\n")
    # The prewarm at start waits for the first PUT (as for the operator's new pod), so the gate opens
    # with the set loaded; the wait is far longer than the tests before that PUT take.
    config = engine_config(tiny_model, lora={"maxLoras": 2, "maxRank": 8, "adapterRoots": [str(adapters_root)],
                                             "hubCacheDir": str(workdir / "hub-adapters"),
                                             "awaitAdaptersSeconds": 600})
    config["engine"]["maxModelLen"] = 1024
    config["prewarm"]["requests"] = 2
    config["server"]["controlTokenFile"] = str(workdir / "control-token")
    with launched(workdir, config) as e:
        yield e


def put_adapters(engine: LaunchedEngine, adapters: list[dict[str, str]], token: str | None = CONTROL_TOKEN) -> Reply:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    return http("PUT", engine.shim + "/adapters", json.dumps({"adapters": adapters}).encode(), headers, timeout=300)


def generate(engine: LaunchedEngine, model: str) -> Reply:
    body = json.dumps({"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0})
    return http("POST", engine.engine + "/v1/completions", body.encode(), {"Content-Type": "application/json"})


def states(reply: Reply) -> dict[str, tuple[str, str]]:
    body: dict[str, Any] = reply.json()
    return {a["name"]: (a["state"], a["reason"]) for a in body["adapters"]}


def test_the_gate_stays_closed_until_the_adapters_arrive(engine: LaunchedEngine) -> None:
    time.sleep(2)  # vLLM answered /health: without adapters to wait for, the prewarm would be running now
    assert engine.get("/prewarm").status == 404, "prewarm ran before the adapter set was PUT"
    reply = engine.get("/readyz")
    assert reply.status == 503 and "prewarm has not succeeded" in reply.json()["reason"], reply.text


def test_a_put_without_the_operators_token_is_refused(engine: LaunchedEngine, adapters_root: Path) -> None:
    reply = put_adapters(engine, [{"name": "support", "path": str(adapters_root / "support")}], token=None)
    assert reply.status == 401, reply.text
    assert http("GET", engine.shim + "/adapters").json()["adapters"] == []


def served_models(engine: LaunchedEngine) -> set[str]:
    return {m["id"] for m in http("GET", engine.engine + "/v1/models").json()["data"]}


# vLLM's own loading routes, as a client of the Service or the gateway might spell them.
CLIENT_LOADS = [
    ("/v1/load_lora_adapter", {}),
    ("/v1/load_lora_adapter/", {}),
    ("//v1//load_lora_adapter", {}),
    ("/V1/Load_Lora_Adapter", {}),
    ("/v1/load%5Flora%5Fadapter", {}),
    ("/v1/load_lora_adapter", {CONTROL_HEADER: "a-guess"}),
    ("/v1/load_lora_adapter", {"Authorization": f"Bearer {CONTROL_TOKEN}"}),
    ("/adapters", {}),  # SageMaker's register route, the same loader
]


@pytest.mark.parametrize(("path", "headers"), CLIENT_LOADS)
def test_a_client_cannot_load_through_vllms_own_routes(engine: LaunchedEngine, adapters_root: Path, path: str,
                                                       headers: dict[str, str]) -> None:
    source = str(adapters_root / "support")
    body = json.dumps({"lora_name": "sneaky", "lora_path": source, "name": "sneaky", "src": source}).encode()
    reply = http("POST", engine.engine + path, body, {"Content-Type": "application/json", **headers})
    assert reply.status == 403, (path, reply.status, reply.text)
    assert "only the engine pod's shim" in reply.json()["error"]["message"], reply.text
    assert "sneaky" not in served_models(engine)
    assert generate(engine, "sneaky").status == 404


def test_two_adapters_load_and_answer_by_name(engine: LaunchedEngine, adapters_root: Path) -> None:
    reply = put_adapters(engine, [{"name": "support", "path": str(adapters_root / "support")},
                                  {"name": "billing", "path": str(adapters_root / "billing")}])
    assert reply.status == 200, reply.text
    assert {n: s for n, (s, _) in states(reply).items()} == {"support": "loaded", "billing": "loaded"}, reply.text
    texts = {}
    for model in ("tiny", "support", "billing"):
        answer = generate(engine, model)
        assert answer.status == 200, answer.text
        assert answer.json()["model"] == model
        texts[model] = answer.json()["choices"][0]["text"]
    # Random adapters move the logits: greedy answers through them differ from the base model's.
    assert texts["support"] != texts["tiny"] and texts["billing"] != texts["tiny"], texts
    gauges = engine.metrics()
    assert metric(gauges, "flashmodel_adapter_loaded", 'adapter="support"') == 1
    assert metric(gauges, "flashmodel_adapter_loaded", 'adapter="billing"') == 1


def test_a_client_cannot_unload_a_loaded_adapter(engine: LaunchedEngine) -> None:
    for path in ("/v1/unload_lora_adapter", "/v1/unload_lora_adapter//", "/adapters/support"):
        method = "DELETE" if path.startswith("/adapters") else "POST"
        reply = http(method, engine.engine + path, json.dumps({"lora_name": "support"}).encode(),
                     {"Content-Type": "application/json"})
        assert reply.status == 403, (path, reply.status, reply.text)
    assert {"support", "billing"} <= served_models(engine)
    assert generate(engine, "support").status == 200


def test_the_prewarm_at_start_runs_once_the_set_is_loaded(engine: LaunchedEngine) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and engine.get("/prewarm").status == 404:
        time.sleep(0.5)
    prewarm = engine.get("/prewarm")
    assert prewarm.status == 200 and prewarm.json()["ok"], prewarm.text
    assert engine.get("/readyz").status == 200


def test_an_unknown_model_name_gets_vllms_404(engine: LaunchedEngine) -> None:
    answer = generate(engine, "no-such-adapter")
    assert answer.status == 404, answer.text
    assert "no-such-adapter" in answer.json()["error"]["message"]


def test_the_same_set_again_changes_nothing(engine: LaunchedEngine, adapters_root: Path) -> None:
    before = http("GET", engine.shim + "/adapters").json()
    reply = put_adapters(engine, [{"name": "billing", "path": str(adapters_root / "billing")},
                                  {"name": "support", "path": str(adapters_root / "support")}])
    assert reply.status == 200
    assert reply.json()["set"] == before["set"]
    assert states(reply)["support"] == {a["name"]: (a["state"], a["reason"]) for a in before["adapters"]}["support"]


def test_a_prewarm_covers_the_adapters(engine: LaunchedEngine) -> None:
    reply = engine.post("/prewarm")
    assert reply.status == 200, reply.text
    assert {n: s for n, (s, _) in states(http("GET", engine.shim + "/adapters")).items()} == {
        "support": "loaded", "billing": "loaded"}


def test_an_adapter_left_out_of_the_set_is_unloaded(engine: LaunchedEngine, adapters_root: Path) -> None:
    reply = put_adapters(engine, [{"name": "support", "path": str(adapters_root / "support")}])
    assert reply.status == 200, reply.text
    assert list(states(reply)) == ["support"]
    gone = generate(engine, "billing")
    assert gone.status == 404, gone.text
    assert generate(engine, "support").status == 200
    gauges = engine.metrics()
    assert 'adapter="billing"' not in gauges
    assert metric(gauges, "flashmodel_adapter_loaded", 'adapter="support"') == 1


def test_a_corrupt_adapter_fails_alone(engine: LaunchedEngine, adapters_root: Path) -> None:
    reply = put_adapters(engine, [{"name": "support", "path": str(adapters_root / "support")},
                                  {"name": "broken", "path": str(adapters_root / "broken")}])
    assert reply.status == 200, reply.text
    found = states(reply)
    assert found["support"][0] == "loaded"
    assert found["broken"][0] == "failed" and "truncated" in found["broken"][1], found
    assert generate(engine, "tiny").status == 200
    assert generate(engine, "support").status == 200
    assert generate(engine, "broken").status == 404
    assert metric(engine.metrics(), "flashmodel_adapter_loaded", 'adapter="broken"') == 0
    assert engine.get("/readyz").status == 200


def test_an_adapter_vllm_refuses_fails_alone(engine: LaunchedEngine, adapters_root: Path) -> None:
    """Past the shim's checks vLLM has the last word: its refusal is the adapter's reason."""
    odd = adapters_root / "odd"
    build_tiny_adapter(odd, seed=3)
    config = json.loads((odd / "adapter_config.json").read_text())
    (odd / "adapter_config.json").write_text(json.dumps({**config, "init_lora_weights": "pissa"}))
    reply = put_adapters(engine, [{"name": "support", "path": str(adapters_root / "support")},
                                  {"name": "odd", "path": str(odd)}])
    found = states(reply)
    assert found["support"][0] == "loaded"
    assert found["odd"][0] == "failed" and "init_lora_weights" in found["odd"][1], found
    assert generate(engine, "support").status == 200


def test_a_path_outside_the_roots_is_refused(engine: LaunchedEngine, tiny_model: Path) -> None:
    reply = put_adapters(engine, [{"name": "escape", "path": str(tiny_model)}])
    assert reply.status == 200
    state, reason = states(reply)["escape"]
    assert state == "failed" and "outside the adapter folders" in reason
