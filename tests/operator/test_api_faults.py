"""The API client rides out transient faults (429, 5xx, dropped connections) and reports the rest at once.

Against a loopback HTTP server that injects the faults (the real Cluster and kubernetes client in front).
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

import aiohttp
import pytest
import urllib3
from flashmodel_operator import gating, settings
from flashmodel_operator.apply import Cluster
from flashmodel_operator.reconcile import reconcile
from flashmodel_operator.settings import OperatorSettings
from kubernetes import client as k8s
from kubernetes.client.exceptions import ApiException


class FaultyAPI(ThreadingHTTPServer):
    """Answers each request with the next planned fault, then with `ok` once the plan is used up."""

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.plan: list[int | str] = []
        self.requests: list[str] = []
        self.ok: tuple[int, dict[str, Any]] = (200, {"kind": "ConfigMap", "metadata": {"name": "x"}})


class _Handler(BaseHTTPRequestHandler):
    server: FaultyAPI

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        self.server.requests.append(f"{self.command} {self.path}")
        fault = self.server.plan.pop(0) if self.server.plan else None
        if fault == "close":
            self.close_connection = True
            self.connection.close()  # no answer at all: the client sees the connection dropped
            return
        status, body = (fault, {"kind": "Status", "message": "injected"}) if isinstance(fault, int) else self.server.ok
        # "ok" in the plan is an ordinary answer
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if status == 429:
            self.send_header("Retry-After", "0")
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PATCH = do_DELETE = _answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def api() -> Iterator[tuple[FaultyAPI, Cluster]]:
    server = FaultyAPI()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    configuration = k8s.Configuration(host=f"http://127.0.0.1:{server.server_address[1]}")
    client = k8s.ApiClient(configuration)
    yield server, Cluster(client)
    client.close()  # type: ignore[no-untyped-call]
    server.shutdown()
    server.server_close()


def test_transient_faults_are_retried_until_the_answer(api: tuple[FaultyAPI, Cluster]) -> None:
    server, cluster = api
    server.plan = [500, 429, "close", 503, 502]
    assert cluster.get("v1", "ConfigMap", "ns", "x") == server.ok[1]
    assert len(server.requests) == 6


def test_a_refusal_is_not_retried(api: tuple[FaultyAPI, Cluster]) -> None:
    server, cluster = api
    server.plan = ["ok", 422]
    with pytest.raises(ApiException) as err:
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "namespace": "ns"}})
    assert err.value.status == 422
    # The GET before the apply found the object; the PATCH was refused once and not sent again.
    assert [r.split("?")[0] for r in server.requests] == [
        "GET /api/v1/namespaces/ns/configmaps/x",
        "PATCH /api/v1/namespaces/ns/configmaps/x",
    ]


def test_an_eviction_a_budget_refuses_is_not_retried(api: tuple[FaultyAPI, Cluster]) -> None:
    server, cluster = api
    server.plan = [429]
    assert cluster.evict("ns", "pod-a") == "blocked"
    assert len(server.requests) == 1
    server.plan = [500, "close"]
    assert cluster.evict("ns", "pod-a") == "evicted"


def test_faults_that_outlast_the_retries_surface(api: tuple[FaultyAPI, Cluster]) -> None:
    server, cluster = api
    server.plan = [500] * 10
    with pytest.raises(ApiException) as err:
        cluster.get("v1", "ConfigMap", "ns", "x")
    assert err.value.status == 500
    assert len(server.requests) == 6


class FlakyCluster(Cluster):
    """The real Cluster class with its transport replaced: every apply fails as an overloaded API server's would."""

    def __init__(self) -> None:
        self.status_patches: list[dict[str, Any]] = []
        self.gets = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        return None

    def list(self, api_version: str, kind: str, namespace: str, selector: str) -> list[dict[str, Any]]:
        return []

    def create(self, desired: dict[str, Any]) -> bool:
        return True

    def apply(
        self,
        desired: dict[str, Any],
        known_absent: bool = False,
        live: dict[str, Any] | None = None,
        spec_matched: bool = False,
        matched: Callable[[dict[str, Any], str], None] | None = None,
        digest: str | None = None,
    ) -> Literal["created", "updated", "unchanged"]:
        raise ApiException(status=503, reason="Service Unavailable")

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        self.status_patches.append(status)

    def event(self, involved: dict[str, Any], type_: Literal["Normal", "Warning"], reason: str, message: str) -> None:
        pass


def _body(name: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": "ns-faults", "uid": "u1", "generation": 1},
            "spec": {"model": {"hub": {"id": "Qwen/Qwen2.5-0.5B-Instruct"}}}}


def test_a_transient_failure_marks_no_model_degraded_until_it_lasts(monkeypatch: pytest.MonkeyPatch) -> None:
    cluster = FlakyCluster()
    with pytest.raises(ApiException):
        reconcile(cluster, _body("flaky"))
    assert cluster.status_patches == [], "a transient failure wrote Degraded at once"
    # Lasting past the grace period it is a problem worth showing.
    monkeypatch.setattr(settings, "_current", OperatorSettings(transient_grace_seconds=0.0))
    with pytest.raises(ApiException):
        reconcile(cluster, _body("flaky"))
    degraded = next(c for c in cluster.status_patches[-1]["conditions"] if c["type"] == "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApplyFailed")


class DroppingCluster(Cluster):
    """The real Cluster class with its transport replaced: the first reads of the pod fail, then it is gone."""

    def __init__(self, failures: int) -> None:
        self.failures = failures
        self.gets = 0

    def get(self, api_version: str, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        self.gets += 1
        if self.gets <= self.failures:
            raise urllib3.exceptions.ProtocolError("Connection aborted.", ConnectionResetError(104, "reset"))
        return None

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        pass


async def test_a_failed_read_does_not_end_a_pods_watch(monkeypatch: pytest.MonkeyPatch) -> None:
    # Seen: one failed GET stopped a pod's watcher for kopf's 60 s daemon back-off.
    monkeypatch.setattr(settings, "_current", OperatorSettings(monitor_seconds=0.05))
    cluster = DroppingCluster(failures=3)
    async with aiohttp.ClientSession() as session:
        watch = gating.PodWatch(cluster, session, "ns-faults", "qwen-a", "qwen")
        await asyncio.wait_for(watch.run(stopped=False), 10)
    assert cluster.gets == 4  # three failed reads, then the one that found the pod gone
