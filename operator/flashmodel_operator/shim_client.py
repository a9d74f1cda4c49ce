"""The operator's client of an engine pod's health shim: startup, readiness, prewarm, metrics."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import aiohttp
from flashmodel_engine.contract import (
    ENGINE_GENERATION,
    LIVENESS_PATH,
    MEMORY_DIVERGENCE_RATIO,
    MEMORY_DIVERGENCE_REASON,
    METRICS_PATH,
    PREWARM_PATH,
    PREWARM_SUCCEEDED,
    READINESS_PATH,
    REMEDIATION_REASON_LABEL,
    REMEDIATION_RECOMMENDED,
    SHIM_PORT,
    STARTUP_PATH,
)
from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class ShimReading:
    """One reading of a pod's shim /metrics: the few series the operator decides on.

    Not the engine's exporter (`flashmodel_engine.metrics.EngineMetrics`), which writes them.
    """

    generation: float
    divergence_ratio: float
    divergence_recommended: bool
    requests_running: float
    requests_waiting: float
    prewarm_succeeded: bool


def parse_metrics(text: str) -> ShimReading:
    values: dict[str, float] = {}
    recommended = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == REMEDIATION_RECOMMENDED and sample.value >= 1:
                reason = sample.labels.get(REMEDIATION_REASON_LABEL, MEMORY_DIVERGENCE_REASON)
                recommended = recommended or reason == MEMORY_DIVERGENCE_REASON
            elif sample.name.startswith("vllm:num_requests_"):
                # One series per model name; a pod serves one model, summing is safe.
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
            else:
                values.setdefault(sample.name, sample.value)
    return ShimReading(
        generation=values.get(ENGINE_GENERATION, 0.0),
        divergence_ratio=values.get(MEMORY_DIVERGENCE_RATIO, 0.0),
        divergence_recommended=recommended,
        requests_running=values.get("vllm:num_requests_running", 0.0),
        requests_waiting=values.get("vllm:num_requests_waiting", 0.0),
        prewarm_succeeded=values.get(PREWARM_SUCCEEDED, 0.0) >= 1,
    )


class ShimClient:
    """HTTP calls to one pod's shim at http://<pod IP>:SHIM_PORT."""

    def __init__(
        self, session: aiohttp.ClientSession, pod_ip: str, port: int = SHIM_PORT, token: str | None = None
    ) -> None:
        self.session = session
        self.pod_ip = pod_ip
        self.base = f"http://{pod_ip}:{port}"
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        """The model's control token: the shim runs a prewarm only for the operator."""

    async def _status(self, path: str, timeout: float) -> int:
        try:
            async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
                await resp.read()
                return resp.status
        except (aiohttp.ClientError, TimeoutError):
            return 0

    async def started(self) -> bool:
        return await self._status(STARTUP_PATH, 5) == 200

    async def live(self) -> bool:
        return await self._status(LIVENESS_PATH, 5) == 200

    async def ready(self, timeout: float) -> bool:
        return await self._status(READINESS_PATH, timeout) == 200

    async def prewarm(self, requests: int, prompts: list[str], timeout: float) -> dict[str, Any]:
        """POST /prewarm; a transport failure is reported like a failed prewarm, never raised."""
        body: dict[str, Any] = {"requests": requests}
        if prompts:
            body["prompts"] = prompts
        try:
            async with self.session.post(
                self.base + PREWARM_PATH, json=body, headers=self.headers, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            return {"ok": False, "error": f"prewarm request failed: {type(exc).__name__}: {exc}"}
        try:
            result: dict[str, Any] = json.loads(text)
        except ValueError:
            return {"ok": False, "error": f"prewarm answered HTTP {resp.status} with non-JSON: {text[:200]}"}
        if resp.status != 200:
            result.setdefault("ok", False)
            result.setdefault("error", result.get("reason") or f"prewarm answered HTTP {resp.status}")
        result["status"] = resp.status
        return result

    async def metrics(self) -> ShimReading | None:
        try:
            async with self.session.get(self.base + METRICS_PATH, timeout=aiohttp.ClientTimeout(total=5)) as resp:
                if resp.status != 200:
                    return None
                return parse_metrics(await resp.text())
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
