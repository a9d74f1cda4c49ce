"""The operator's reconcile spans: off by default, one span per pass, and exported to real OTLP receivers."""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from flashmodel_operator import tracing
from flashmodel_operator.conditions import Problem
from flashmodel_operator.reconcile import Outcome

otel_sdk = pytest.importorskip("opentelemetry.sdk.trace", reason="the tracing extra is not installed")

from opentelemetry.proto.collector.trace.v1 import trace_service_pb2  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402
from opentelemetry.trace import StatusCode  # noqa: E402


def model_body(generation: int = 3) -> dict[str, Any]:
    return {"metadata": {"namespace": "shop", "name": "qwen", "generation": generation}, "spec": {}}


def changed_pass(cluster: object, body: dict[str, Any]) -> Outcome:
    return Outcome(applied={"Deployment/qwen": "updated", "Service/qwen": "unchanged"}, status_written=True)


@pytest.fixture(autouse=True)
def fresh_tracing(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each test configures the process's tracer from its own environment."""
    monkeypatch.setattr(tracing, "_tracer", None)
    monkeypatch.setattr(tracing, "_configured", False)
    for name in (*tracing.ENDPOINT_ENVS, *tracing.PROTOCOL_ENVS, "OTEL_SERVICE_NAME", "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    yield
    if tracing._tracer is not None:
        tracing._tracer.shutdown()


def test_without_an_endpoint_the_reconcile_runs_unwrapped() -> None:
    assert tracing.configure() is None
    assert tracing.traced(changed_pass) is changed_pass


def test_without_the_sdk_the_reconcile_runs_unwrapped_and_the_log_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4317")
    # A module set to None in sys.modules fails to import, as it does where the extra is absent.
    for module in ("opentelemetry.exporter.otlp.proto.grpc.trace_exporter", "opentelemetry.sdk.trace"):
        monkeypatch.setitem(sys.modules, module, None)
    with caplog.at_level(logging.WARNING, logger="flashmodel_operator.tracing"):
        assert tracing.traced(changed_pass) is changed_pass
    assert "event=tracing-off reason=sdk-missing endpoint=http://collector:4317" in caplog.text
    assert "flashmodel[tracing]" in caplog.text


def test_an_unknown_protocol_leaves_tracing_off_with_the_reason(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "http://collector:4317")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with caplog.at_level(logging.WARNING, logger="flashmodel_operator.tracing"):
        assert tracing.configure() is None
    assert "'http/json' is not an OTLP transport" in caplog.text and "grpc, http/protobuf" in caplog.text


def test_one_span_per_pass_names_the_model_generation_and_outcome() -> None:
    exporter = InMemorySpanExporter()
    tracer = tracing.ReconcileTracer(exporter, batch=False, env={})
    outcome = tracer.run(changed_pass, object(), model_body(generation=7))
    assert outcome.status_written
    (span,) = exporter.get_finished_spans()
    assert span.name == "reconcile FlashModel"
    assert dict(span.attributes or {}) == {
        "k8s.namespace.name": "shop",
        "flashmodel.model.name": "qwen",
        "flashmodel.model.generation": 7,
        "flashmodel.reconcile.outcome": "changed",
        "flashmodel.reconcile.applied": ("Deployment/qwen",),
        "flashmodel.reconcile.status_written": True,
    }
    assert span.resource.attributes["service.name"] == "flashmodel-operator"


def test_a_pass_with_a_problem_or_an_error_says_so_on_its_span() -> None:
    exporter = InMemorySpanExporter()
    tracer = tracing.ReconcileTracer(exporter, batch=False, env={"OTEL_SERVICE_NAME": "ops-east"})

    def held(cluster: object, body: dict[str, Any]) -> Outcome:
        return Outcome(applied={"Deployment/qwen": "unchanged"}, problem=Problem("SecretMissing", "no hf-token"))

    def failing(cluster: object, body: dict[str, Any]) -> Outcome:
        raise RuntimeError("apiserver said 500")

    tracer.run(held, object(), model_body())
    with pytest.raises(RuntimeError, match="apiserver said 500"):
        tracer.run(failing, object(), model_body())
    problem, error = exporter.get_finished_spans()
    assert problem.attributes is not None and error.attributes is not None
    assert problem.attributes["flashmodel.reconcile.outcome"] == "problem"
    assert problem.attributes["flashmodel.reconcile.problem"] == "SecretMissing"
    assert problem.status.status_code is StatusCode.UNSET
    assert error.attributes["flashmodel.reconcile.outcome"] == "error"
    assert error.status.status_code is StatusCode.ERROR
    assert error.status.description == "RuntimeError: apiserver said 500"
    assert [event.name for event in error.events] == ["exception"]
    assert problem.resource.attributes["service.name"] == "ops-east"


class Received:
    """What a receiver was sent: the decoded OTLP export requests."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.paths: list[str] = []

    def spans(self) -> list[dict[str, Any]]:
        found = []
        for request in self.requests:
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    for span in scope_spans.spans:
                        attributes = {kv.key: _value(kv.value) for kv in span.attributes}
                        found.append({"name": span.name, "resource": resource, "attributes": attributes})
        return found


def _value(value: Any) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind)


@pytest.fixture
def http_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/HTTP receiver: POST /v1/traces with a protobuf ExportTraceServiceRequest."""
    received = Received()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            request = trace_service_pb2.ExportTraceServiceRequest()
            request.ParseFromString(body)
            received.paths.append(self.path)
            received.requests.append(request)
            reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, format: str, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", received
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[str, Received]]:
    """An OTLP/gRPC receiver: the collector's TraceService/Export."""
    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc

    received = Received()

    class Service(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:
            received.requests.append(request)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), server)  # type: ignore[no-untyped-call]
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"http://127.0.0.1:{port}", received
    finally:
        server.stop(grace=None)


@pytest.mark.parametrize("protocol", ["http/protobuf", "grpc"])
def test_spans_reach_a_real_otlp_receiver(
    protocol: str, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    endpoint, received = request.getfixturevalue("http_receiver" if protocol == "http/protobuf" else "grpc_receiver")
    # What the chart's Deployment sets when tracing.otlpTracesEndpoint is given.
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", protocol)
    reconcile = tracing.traced(changed_pass)
    assert reconcile is not changed_pass
    reconcile(object(), model_body(generation=2))
    tracer = tracing.configure()
    assert tracer is not None and tracer.flush()
    spans = received.spans()
    assert [s["name"] for s in spans] == ["reconcile FlashModel"]
    (span,) = spans
    assert span["resource"]["service.name"] == "flashmodel-operator"
    assert span["attributes"] == {
        "k8s.namespace.name": "shop",
        "flashmodel.model.name": "qwen",
        "flashmodel.model.generation": 2,
        "flashmodel.reconcile.outcome": "changed",
        "flashmodel.reconcile.applied": ["Deployment/qwen"],
        "flashmodel.reconcile.status_written": True,
    }
    if protocol == "http/protobuf":
        assert received.paths == ["/v1/traces"]


def test_the_handlers_reconcile_sends_its_span(
    http_receiver: tuple[str, Received], monkeypatch: pytest.MonkeyPatch
) -> None:
    from flashmodel_operator import handlers

    class OneModel:
        """The API answer for one FlashModel: all _reconcile_latest reads before it reconciles."""

        def get_flashmodel(self, namespace: str, name: str) -> dict[str, Any]:
            return model_body(generation=5)

    endpoint, received = http_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    monkeypatch.setattr(handlers, "cluster", OneModel)
    monkeypatch.setattr(handlers, "reconcile", lambda cluster, body, **_: changed_pass(cluster, body))
    handlers._reconcile_latest("shop", "qwen")
    tracer = tracing.configure()
    assert tracer is not None and tracer.flush()
    (span,) = received.spans()
    assert span["attributes"]["flashmodel.model.generation"] == 5
    assert span["attributes"]["flashmodel.reconcile.outcome"] == "changed"
