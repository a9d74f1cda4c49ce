"""Who may reach a FlashModel's engine pods, where the cluster admin turns it on (the chart's networkPolicy).

An engine pod listens on two ports: `http`, vLLM's OpenAI API behind the model's Service, and
`health`, the shim (probes, /metrics, and POST /prewarm, which the operator's control token guards).
With the policy on, each model gets a NetworkPolicy that admits the API from the clients the admin
lists (any source where none are listed: the Service has no identity of its own to admit), and the
shim only from the operator and the metrics scrapers the admin lists. The policy is off by default:
a NetworkPolicy that names the wrong peers cuts a model off, and only the admin knows the cluster's
labels. Kubelet probes come from the node, which the common CNIs (Calico, Cilium) admit without a rule.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENV = "FLASHMODEL_ENGINE_NETWORK_POLICY"
_PEER_KEYS = frozenset({"podSelector", "namespaceSelector", "ipBlock"})


@dataclass(frozen=True)
class EngineNetworkPolicy:
    """The peers each engine port admits; `enabled` False: no NetworkPolicy is rendered."""

    enabled: bool = False
    operator: tuple[dict[str, Any], ...] = ()
    """The operator's pods (namespace and pod selector): they poll and prewarm through the shim port."""
    api_from: tuple[dict[str, Any], ...] = ()
    """Who may call the OpenAI API port; empty: any source."""
    health_from: tuple[dict[str, Any], ...] = ()
    """Who may reach the shim port beside the operator: the metrics scrapers (Prometheus)."""

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> EngineNetworkPolicy:
        """FLASHMODEL_ENGINE_NETWORK_POLICY: JSON {"operator": [peer], "apiFrom": [peer], "healthFrom": [peer]}."""
        raw = environ.get(ENV, "").strip()
        if not raw:
            return cls()
        try:
            given = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV} is not JSON ({exc}); set it through the chart's networkPolicy") from None
        if not isinstance(given, dict) or set(given) - {"operator", "apiFrom", "healthFrom"}:
            raise ValueError(f"{ENV} must be an object with operator, apiFrom and healthFrom lists of peers")
        operator = _peers(given, "operator")
        if not operator:
            raise ValueError(f"{ENV}.operator is empty: the operator could not reach the pods it prewarms")
        return cls(True, operator, _peers(given, "apiFrom"), _peers(given, "healthFrom"))


def _peers(given: dict[str, Any], key: str) -> tuple[dict[str, Any], ...]:
    peers = given.get(key) or []
    if not isinstance(peers, list):
        raise ValueError(f"{ENV}.{key} must be a list of NetworkPolicy peers")
    for peer in peers:
        if not isinstance(peer, dict) or not peer or set(peer) - _PEER_KEYS:
            raise ValueError(
                f"{ENV}.{key}: {peer!r} is not a NetworkPolicy peer (podSelector, namespaceSelector, ipBlock)"
            )
    return tuple(peers)


def render(
    policy: EngineNetworkPolicy, metadata: dict[str, Any], selector: dict[str, str]
) -> dict[str, Any] | None:
    """The model's NetworkPolicy (named and labelled by `metadata`, for the pods `selector` matches), or None."""
    if not policy.enabled:
        return None
    api: dict[str, Any] = {"ports": [{"port": "http", "protocol": "TCP"}]}
    if policy.api_from:
        api["from"] = list(policy.api_from)
    health = {"ports": [{"port": "health", "protocol": "TCP"}], "from": [*policy.operator, *policy.health_from]}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata,
        "spec": {"podSelector": {"matchLabels": selector}, "policyTypes": ["Ingress"], "ingress": [api, health]},
    }


_current = EngineNetworkPolicy()


def current() -> EngineNetworkPolicy:
    return _current


def load(environ: Mapping[str, str] | None = None) -> EngineNetworkPolicy:
    """Read the environment once, at start-up, beside the operator's settings."""
    global _current
    _current = EngineNetworkPolicy.from_environ(os.environ if environ is None else environ)
    return _current


def use(policy: EngineNetworkPolicy) -> None:
    """Install a policy directly (tests)."""
    global _current
    _current = policy
