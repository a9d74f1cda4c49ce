"""Each FlashModel's conditions as a Prometheus series, for alerts that fire on the operator's own verdict.

`flashmodel_operator_model_condition{namespace, flashmodel, type, status, reason} 1`, one series per
model and condition type, the way kube-state-metrics exports a Deployment's conditions. The chart's
alerts read it (the autoscaler unable to act, the restart budget spent): the reason the operator
wrote in status is the reason the alert carries. Served from the last status each pass computed,
at scrape time, so a model whose conditions did not change costs nothing between scrapes.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from typing import Any

from prometheus_client.core import REGISTRY, GaugeMetricFamily
from prometheus_client.registry import Collector

LABELS = ("namespace", "flashmodel", "type", "status", "reason")


class ModelConditions(Collector):
    """The last conditions of every model the operator holds; dropped with the model."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._conditions: dict[tuple[str, str], tuple[tuple[str, str, str], ...]] = {}

    def record(self, namespace: str, name: str, conditions: Iterable[dict[str, Any]]) -> None:
        rows = tuple(
            (str(c.get("type", "")), str(c.get("status", "")), str(c.get("reason", ""))) for c in conditions
        )
        with self._lock:
            self._conditions[(namespace, name)] = rows

    def forget(self, namespace: str, name: str) -> None:
        with self._lock:
            self._conditions.pop((namespace, name), None)

    def retain(self, models: set[tuple[str, str]]) -> None:
        with self._lock:
            for key in [k for k in self._conditions if k not in models]:
                del self._conditions[key]

    def models(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self._conditions)

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "flashmodel_operator_model_condition",
            "1 for each condition of each FlashModel as the operator last wrote it, with its status and reason.",
            labels=LABELS,
        )
        with self._lock:
            items = list(self._conditions.items())
        for (namespace, name), rows in items:
            for kind, status, reason in rows:
                family.add_metric([namespace, name, kind, status, reason], 1.0)
        yield family


MODEL_CONDITIONS = ModelConditions()
REGISTRY.register(MODEL_CONDITIONS)
