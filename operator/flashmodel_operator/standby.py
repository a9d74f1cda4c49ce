"""PURE: which prewarmed pods of a model serve and which wait, warm, as standbys (spec.standbyReplicas).

A standby is a pod whose prewarm succeeded but whose readiness gate this operator keeps closed, so
the Service does not route to it. It takes a serving pod's place with one gate write: before a pod is
drained for remediation, when a serving pod is lost, when replicas grows. Without standbys
(standbyReplicas 0) every prewarmed pod serves, as before.

Only pods of the current spec (config hash) count towards replicas: during a rollout a new pod
serves as soon as it is warm, whatever the old pods still serve, or the Deployment, which waits for
new pods to be available before it removes old ones, would wait for ever.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GateView:
    """One live engine pod as the gate decision sees it."""

    name: str
    template: str
    """The config hash of the spec the pod runs."""
    serving: bool
    """Its gate is open, by this operator after a prewarm."""
    standby: bool = False
    """Its gate is closed by this operator: prewarmed and waiting."""
    leaving: bool = False
    """About to be replaced: its health calls for remediation, or a standby was promoted in its place."""


def _serving(pods: list[GateView], template: str | None, exclude: frozenset[str]) -> list[str]:
    return sorted(
        p.name for p in pods if p.serving and p.name not in exclude and (template is None or p.template == template)
    )


def should_serve(
    me: GateView, pods: list[GateView], template: str, replicas: int, standby_replicas: int, draining: str | None
) -> bool:
    """Whether a prewarmed pod that does not serve (a new one, or a standby) opens its gate now.

    `draining` is the pod being drained for remediation: it no longer counts as serving.
    """
    if standby_replicas == 0:
        return True
    exclude = frozenset({me.name} | ({draining} if draining else set()))
    if me.template == template:
        return len(_serving(pods, template, exclude)) < replicas
    # A pod of an older spec is on its way out: it serves only where too few pods serve at all.
    return len(_serving(pods, None, exclude)) < replicas


def surplus(pods: list[GateView], template: str, replicas: int, draining: str | None) -> bool:
    """More pods of the current spec serve than replicas."""
    return len(_serving(pods, template, frozenset({draining} if draining else set()))) > replicas


def should_stand_by(
    me: GateView, pods: list[GateView], template: str, replicas: int, standby_replicas: int, draining: str | None
) -> bool:
    """Whether a serving pod closes its gate and waits as a standby: more pods of the current spec serve
    than replicas (the model was scaled down, and the Deployment removed a standby rather than it; or
    the operator restarted between promoting a standby and draining the pod it replaces).

    One pod steps back for one surplus pod: a leaving one first (the first by name), else the last
    by name, so a healthy pod is never benched while one about to be replaced keeps serving.
    """
    if standby_replicas == 0 or not me.serving or me.template != template or me.name == draining:
        return False
    if not surplus(pods, template, replicas, draining):
        return False
    serving = _serving(pods, template, frozenset({draining} if draining else set()))
    leaving = [p.name for p in pods if p.leaving and p.name in serving]
    return me.name == (sorted(leaving)[0] if leaving else serving[-1])


def pick_standby(pods: list[GateView], template: str, healthy: frozenset[str]) -> str | None:
    """The standby to promote in a draining pod's place: one of the current spec that passed its last
    health poll, the first by name so the choice is stable; None when there is none."""
    ready = sorted(p.name for p in pods if p.standby and p.template == template and p.name in healthy)
    return ready[0] if ready else None
