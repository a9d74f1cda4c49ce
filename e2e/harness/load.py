"""A client load through a FlashModel Service's ready endpoints, counting what happened to each request."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from flashmodel_operator.remediation import GENERATION_HUNG, MEMORY_DIVERGENCE
from flashmodel_operator.render import PREWARM_GATE

from e2e.harness.cluster import ControlPlane
from e2e.harness.operator_run import get_json


@dataclass
class Load:
    """A steady client load through the Service's ready endpoints, counting what happened to each request."""

    cp: ControlPlane
    namespace: str
    model: str
    """The FlashModel, which is also its Service's name."""
    workers: int = 2
    pause: float = 0.1
    """Seconds each worker waits after a request: a steady trickle, not a flood."""
    period: float | None = None
    """When set, each worker starts a request every `period` seconds whatever its latency: a fixed rate
    of workers / period requests per second while the engines keep up (pause is then unused)."""
    api_key: str = ""
    """Sent as a Bearer token where the FlashModel has spec.auth; empty sends none."""
    accepted: int = 0
    completed: int = 0
    lost: list[str] = field(default_factory=list)
    """Requests an engine accepted (the connection was made and the request sent) that never completed."""
    refused: int = 0
    min_ready_endpoints: int = 99
    min_ready_seen: str = ""
    """When the fewest ready endpoints were seen, and the EndpointSlices then (for the failure message)."""
    drained_at_zero: list[str] = field(default_factory=list)
    """Moments with no ready endpoint while the operator had a pod drained (its gate off for a remediation)."""
    stop: threading.Event = field(default_factory=threading.Event)
    endpoints: list[str] = field(default_factory=list)

    def _pods(self) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = get_json(
            self.cp, "pods", "-n", self.namespace, "-l", f"serving.flashmodel.io/model={self.model}"
        )["items"]
        return [p for p in items if not p["metadata"].get("deletionTimestamp")]

    def refresh(self) -> None:
        while not self.stop.is_set():
            slices = get_json(
                self.cp, "endpointslices", "-n", self.namespace, "-l", f"kubernetes.io/service-name={self.model}"
            )["items"]
            ready = [
                a
                for s in slices
                for e in s.get("endpoints") or []
                if (e.get("conditions") or {}).get("ready")
                for a in e["addresses"]
            ]
            self.endpoints = ready
            if not ready:
                drained = [
                    p["metadata"]["name"]
                    for p in self._pods()
                    for c in p["status"].get("conditions") or []
                    if c["type"] == PREWARM_GATE
                    and c["status"] != "True"
                    and c.get("reason") in (MEMORY_DIVERGENCE, GENERATION_HUNG)
                ]
                if drained:
                    self.drained_at_zero.append(f"{time.strftime('%H:%M:%S')}: drained {drained}")
            if len(ready) < self.min_ready_endpoints:
                self.min_ready_endpoints = len(ready)
                # Why the pods were not ready (which condition, set by whom) for the failure message.
                why = {
                    p["metadata"]["name"]: [
                        (c["type"], c["status"], c.get("reason"), c.get("message"))
                        for c in p["status"].get("conditions") or []
                        if c["status"] != "True"
                    ]
                    for p in self._pods()
                }
                self.min_ready_seen = f"{time.strftime('%H:%M:%S')}: unready conditions {why}; slices {slices}"
            self.stop.wait(0.3)

    def client(self, worker: int) -> None:
        n = 0
        while not self.stop.is_set():
            targets = list(self.endpoints)
            if not targets:
                time.sleep(0.2)
                continue
            ip = targets[(worker + n) % len(targets)]
            n += 1
            started = time.monotonic()
            conn = http.client.HTTPConnection(ip, 8000, timeout=60)
            try:
                conn.connect()
            except OSError:
                self.refused += 1  # never accepted: a load balancer retries elsewhere
                time.sleep(0.05)
                continue
            body = json.dumps(
                {"model": "tiny", "prompt": "the valve on line three was inspected", "max_tokens": 8, "temperature": 0}
            )
            try:
                headers = {"Content-Type": "application/json"}
                if self.api_key:
                    headers["Authorization"] = f"Bearer {self.api_key}"
                conn.request("POST", "/v1/completions", body=body, headers=headers)
                self.accepted += 1
                resp = conn.getresponse()
                data = resp.read()
                if resp.status == 200 and json.loads(data)["choices"][0]["text"] is not None:
                    self.completed += 1
                else:
                    self.lost.append(f"{ip}: HTTP {resp.status} {data[:200]!r}")
            except (OSError, http.client.HTTPException, ValueError) as exc:
                self.lost.append(f"{ip}: {type(exc).__name__}: {exc}")
            finally:
                conn.close()
            if self.period is None:
                time.sleep(self.pause)
            else:
                self.stop.wait(max(0.0, self.period - (time.monotonic() - started)))

    def __enter__(self) -> Load:
        self.threads = [threading.Thread(target=self.refresh, daemon=True)]
        self.threads += [threading.Thread(target=self.client, args=(i,), daemon=True) for i in range(self.workers)]
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=90)
