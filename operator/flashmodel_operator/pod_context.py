"""What one engine pod's watch hands its steps (prewarm, standby gate, eviction): the pod, its model's memory, the API.

The steps take this, not the watch (gating.PodWatch): they see the pod and its model, never the
watch's loop, its poll timing or its connection, so they cannot depend on how the watch works.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from flashmodel_operator.apply import Cluster
from flashmodel_operator.model_status import write_pods
from flashmodel_operator.pod_state import ModelState
from flashmodel_operator.render import PREWARM_GATE

T = TypeVar("T")


class PodContext:
    """One engine pod as its watch's steps see it."""

    def __init__(
        self,
        cluster: Cluster,
        namespace: str,
        name: str,
        model: str,
        state: ModelState,
        request_pass: Callable[[str, str], None] | None = None,
    ) -> None:
        self.cluster = cluster
        self._request_pass = request_pass
        self.namespace = namespace
        self.name = name
        """The pod's name."""
        self.model = model
        """The FlashModel's name."""
        self.state = state
        """The operator's memory of the model's pods, shared by all of its pods' watches."""
        self.template = ""
        """The pod's config hash (which spec it runs), from its annotation."""
        self.gate_written: bool | None = None
        """The gate value last written; the watch stream may not show it yet."""

    def request_pass(self) -> None:
        """Ask for a pass of the model: what the pod watch learned changes its status (a remediation held)."""
        if self._request_pass is not None:
            self._request_pass(self.namespace, self.model)

    async def api(self, fn: Callable[..., T], *args: Any) -> T:
        # The API client is synchronous; keep the event loop free for the other pods.
        return await asyncio.to_thread(fn, *args)

    async def set_gate(self, value: bool, reason: str, message: str) -> None:
        await self.api(self.cluster.set_pod_condition, self.namespace, self.name, PREWARM_GATE, value, reason, message)
        self.gate_written = value

    async def write_pods_status(self) -> None:
        await write_pods(self.cluster, self.namespace, self.model, self.state)


@dataclass
class PodClocks:
    """What the watch remembers of its pod's engine between polls; a prewarm starts them again."""

    generation_seen: float | None = None
    """The engine's generation (its process start) at the last poll: a change is a restart inside the pod."""
    restarts_seen: int | None = None
    """The container restarts the kubelet counted at the last poll."""
    divergent_since: float | None = None
    readyz_failing_since: float | None = None
    attempts: int = 0
    """Failed prewarms in a row."""
    prewarm_failure: str | None = None
    """Set once every prewarm attempt failed: the pod waits for its turn to be replaced."""

    def prewarmed(self, generation: float | None, restarts: int) -> None:
        """A prewarm succeeded: the engine as it is now is the one watched, and no fault is pending."""
        self.generation_seen = generation
        self.restarts_seen = restarts
        self.attempts = 0
        self.divergent_since = self.readyz_failing_since = None
