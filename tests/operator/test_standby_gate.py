"""The standby gate writes against an in-memory API: decided again on a fresh pod list, one at a time.

Fault injection for what the e2e tests cannot time: two standbys deciding at once, an operator that
restarted and remembers nothing, a sick standby.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any, Literal

from flashmodel_operator.apply import Cluster
from flashmodel_operator.model import FlashModelSpec
from flashmodel_operator.pod_context import PodContext
from flashmodel_operator.pod_state import PROMOTED, STANDBY, PodRecord, gate_is_standby, gate_is_true, model_state
from flashmodel_operator.remediation import PodHealth
from flashmodel_operator.render import CONFIG_HASH_ANNOTATION, PREWARM_GATE
from flashmodel_operator.standby_gate import open_or_hold, promote_for, serve_if_needed, template_hash

from tests.operator.specs import MINIMAL_T4

_namespaces = itertools.count()


class PodsCluster(Cluster):
    """The real Cluster class with its transport replaced: pods in memory, gate writes applied to them."""

    def __init__(self, pods: list[dict[str, Any]]) -> None:
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.lists = 0
        self.events: list[tuple[str, str]] = []

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        self.lists += 1
        return [dict(p) for p in self.pods.values()]

    def set_pod_condition(self, namespace: str, name: str, kind: str, value: bool, reason: str, message: str) -> None:
        conditions = [c for c in self.pods[name]["status"]["conditions"] if c["type"] != kind]
        conditions.append({"type": kind, "status": str(value), "reason": reason, "message": message})
        self.pods[name]["status"]["conditions"] = conditions

    def event(self, involved: dict[str, Any], type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        self.events.append((reason, message))

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        pass


def _model(replicas: int, standby: int) -> tuple[dict[str, Any], FlashModelSpec]:
    fm = {**MINIMAL_T4, "spec": {**MINIMAL_T4["spec"], "replicas": replicas, "standbyReplicas": standby}}
    return fm, FlashModelSpec.model_validate(fm["spec"])


def _pod(name: str, template: str, gate: Literal["serving", "standby", "none"], ip: str = "") -> dict[str, Any]:
    conditions = []
    if gate == "serving":
        conditions.append({"type": PREWARM_GATE, "status": "True", "reason": "PrewarmSucceeded"})
    elif gate == "standby":
        conditions.append({"type": PREWARM_GATE, "status": "False", "reason": STANDBY})
    return {
        "metadata": {"name": name, "annotations": {CONFIG_HASH_ANNOTATION: template}},
        "status": {"phase": "Running", "podIP": ip or f"10.0.0.{len(name)}", "conditions": conditions},
    }


def _watch(cluster: Cluster, ns: str, name: str, template: str) -> PodContext:
    watch = PodContext(cluster, ns, name, "qwen-small", model_state(ns, "qwen-small"))
    watch.template = template
    return watch


async def test_two_standbys_deciding_at_once_promote_one() -> None:
    fm, spec = _model(replicas=1, standby=2)
    template = template_hash(fm)
    ns = f"two-{next(_namespaces)}"
    # The serving pod is gone: both standbys see one pod missing on their polls at the same time.
    cluster = PodsCluster([_pod("s1", template, "standby"), _pod("s2", template, "standby")])
    watches = [_watch(cluster, ns, name, template) for name in ("s1", "s2")]
    for w in watches:
        w.state.pods[w.name] = PodRecord(prewarmed=True, standby=True, template=template)
    promoted = await asyncio.gather(*(serve_if_needed(w, fm, spec, w.state.pods[w.name]) for w in watches))
    assert sorted(promoted) == [False, True]
    serving = [name for name, p in cluster.pods.items() if gate_is_true(p)]
    assert len(serving) == 1 and cluster.pods[serving[0]]["status"]["conditions"][0]["reason"] == PROMOTED
    assert [reason for reason, _ in cluster.events] == ["Promoted"]


async def test_a_standby_whose_model_serves_enough_reads_nothing_from_the_api() -> None:
    fm, spec = _model(replicas=1, standby=1)
    template = template_hash(fm)
    ns = f"steady-{next(_namespaces)}"
    cluster = PodsCluster([_pod("a", template, "serving"), _pod("s", template, "standby")])
    watch = _watch(cluster, ns, "s", template)
    watch.state.pods["a"] = PodRecord(prewarmed=True, template=template)
    watch.state.pods["s"] = record = PodRecord(prewarmed=True, standby=True, template=template)
    for _ in range(10):
        assert not await serve_if_needed(watch, fm, spec, record)
    assert cluster.lists == 0


async def test_after_an_operator_restart_the_api_not_memory_decides_a_new_pods_gate() -> None:
    # Memory is empty (no other pod's watch has run yet); the API shows the model already served.
    fm, spec = _model(replicas=1, standby=1)
    template = template_hash(fm)
    ns = f"restart-{next(_namespaces)}"
    cluster = PodsCluster([_pod("a", template, "serving"), _pod("b", template, "none")])
    watch = _watch(cluster, ns, "b", template)
    record = PodRecord(template=template)
    serves = await open_or_hold(watch, fm, spec, record, "PrewarmSucceeded", "2 warm-up requests")
    assert not serves and record.standby
    assert gate_is_standby(cluster.pods["b"])
    assert "held as a standby" in cluster.pods["b"]["status"]["conditions"][0]["message"]


async def test_a_drain_promotes_a_healthy_standby_of_the_current_spec_and_learns_its_address() -> None:
    fm, spec = _model(replicas=1, standby=3)
    template = template_hash(fm)
    ns = f"drain-{next(_namespaces)}"
    cluster = PodsCluster([
        _pod("a", template, "serving"),
        _pod("s-old", "an-older-spec", "standby"),
        _pod("s-sick", template, "standby"),
        _pod("s-ok", template, "standby", ip="10.0.9.9"),
    ])
    watch = _watch(cluster, ns, "a", template)
    watch.state.pods["a"] = PodRecord(prewarmed=True, template=template)
    for name, failing in (("s-old", None), ("s-sick", 1.0), ("s-ok", None)):
        watch.state.health[name] = PodHealth(
            name=name, prewarmed=True, livez_ok=True, divergence_recommended=False, divergence_ratio=0.0,
            divergent_since=None, readyz_failing_since=failing, standby=True,
        )
    assert await promote_for(watch, fm, spec, "MemoryDivergence: grew") == ("s-ok", "10.0.9.9")
    assert gate_is_true(cluster.pods["s-ok"])
    assert gate_is_standby(cluster.pods["s-sick"]) and gate_is_standby(cluster.pods["s-old"])
    # A model without standbys promotes nothing and asks the API nothing.
    plain_fm, plain = _model(replicas=1, standby=0)
    lists = cluster.lists
    assert await promote_for(watch, plain_fm, plain, "MemoryDivergence: grew") is None
    assert cluster.lists == lists
