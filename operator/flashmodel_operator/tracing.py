"""The operator's own OpenTelemetry spans: one per reconcile pass, sent over OTLP when an endpoint is set.

Switched on by the OpenTelemetry SDK's own variables (the chart's `tracing.otlpTracesEndpoint` sets
them): `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (or `OTEL_EXPORTER_OTLP_ENDPOINT`) and
`OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (`grpc`, the default, or `http/protobuf`). The SDK is the
optional `tracing` dependency group: without it, or without an endpoint, `traced` returns the
function it wraps and the operator runs as it does without tracing.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

log = logging.getLogger(__name__)

SERVICE_NAME = "flashmodel-operator"
SPAN_NAME = "reconcile FlashModel"
ENDPOINT_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PROTOCOL_ENVS = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
# The CRD's spec.observability.otlpTracesProtocol defaults to grpc (vLLM's default), so one collector
# address written in both places reaches the same receiver.
DEFAULT_PROTOCOL = "grpc"
PROTOCOLS = ("grpc", "http/protobuf")


class _Problem(Protocol):
    @property
    def reason(self) -> str: ...


class _Outcome(Protocol):
    """What reconcile.Outcome offers the span (kept structural: reconcile.py does not import this)."""

    @property
    def applied(self) -> dict[str, str]: ...
    @property
    def status_written(self) -> bool: ...
    @property
    def problem(self) -> _Problem | None: ...


ClusterT = TypeVar("ClusterT")
OutcomeT = TypeVar("OutcomeT", bound=_Outcome)
Reconcile = Callable[[ClusterT, dict[str, Any]], OutcomeT]


class TracingConfigError(ValueError):
    """The tracing variables are set but cannot work as they are."""


def traces_endpoint(env: Mapping[str, str]) -> str | None:
    """The collector URL the environment names, or None when tracing is off."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return None
    for name in ENDPOINT_ENVS:
        value = env.get(name, "").strip()
        if value:
            return value
    return None


def traces_protocol(env: Mapping[str, str]) -> str:
    """The OTLP transport the environment asks for (grpc unless set)."""
    for name in PROTOCOL_ENVS:
        value = env.get(name, "").strip()
        if value:
            if value not in PROTOCOLS:
                raise TracingConfigError(
                    f"{name}={value!r} is not an OTLP transport the operator sends; "
                    f"set it to one of {', '.join(PROTOCOLS)}"
                )
            return value
    return DEFAULT_PROTOCOL


def otlp_exporter(env: Mapping[str, str]) -> Any:
    """The SDK's OTLP span exporter for the environment's protocol; it reads the endpoint variables itself."""
    if traces_protocol(env) == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

    return HttpExporter()


class ReconcileTracer:
    """Owns the tracer provider; `span` wraps one reconcile pass."""

    def __init__(self, exporter: Any, *, batch: bool = True, env: Mapping[str, str] | None = None) -> None:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

        env = os.environ if env is None else env
        # OTEL_SERVICE_NAME, as the SDK reads it, names the service when set (one operator per cluster
        # in a shared collector).
        service = env.get("OTEL_SERVICE_NAME") or SERVICE_NAME
        self.provider = TracerProvider(resource=Resource.create({"service.name": service}))
        # A batch keeps the exporter's network round trip out of the reconcile; the in-memory test
        # exporter wants each span at once.
        processor = BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter)
        self.provider.add_span_processor(processor)
        self.tracer = self.provider.get_tracer("flashmodel_operator")

    def run(self, fn: Reconcile[ClusterT, OutcomeT], cluster: ClusterT, body: dict[str, Any]) -> OutcomeT:
        """Call `fn(cluster, body)` inside a span named after the model, with the pass's outcome."""
        from opentelemetry.trace import Status, StatusCode

        meta = body.get("metadata", {})
        attributes: dict[str, str | int] = {
            "k8s.namespace.name": str(meta.get("namespace", "")),
            "flashmodel.model.name": str(meta.get("name", "")),
        }
        if isinstance(meta.get("generation"), int):
            attributes["flashmodel.model.generation"] = meta["generation"]
        # record_exception and the status are set here, so the SDK's own (which re-raises) are off.
        with self.tracer.start_as_current_span(
            SPAN_NAME, attributes=attributes, record_exception=False, set_status_on_exception=False
        ) as span:
            try:
                outcome = fn(cluster, body)
            except BaseException as exc:
                span.set_attribute("flashmodel.reconcile.outcome", "error")
                span.record_exception(exc)
                span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"[:512]))
                raise
            changed: Sequence[str] = sorted(k for k, v in outcome.applied.items() if v != "unchanged")
            if outcome.problem is not None:
                result = "problem"
                span.set_attribute("flashmodel.reconcile.problem", outcome.problem.reason)
            else:
                result = "changed" if changed or outcome.status_written else "unchanged"
            span.set_attribute("flashmodel.reconcile.outcome", result)
            span.set_attribute("flashmodel.reconcile.applied", list(changed))
            span.set_attribute("flashmodel.reconcile.status_written", outcome.status_written)
            return outcome

    def flush(self, timeout_millis: int = 10_000) -> bool:
        """Send what the batch holds (tests, and shutdown)."""
        return bool(self.provider.force_flush(timeout_millis))

    def shutdown(self) -> None:
        self.provider.shutdown()


_lock = threading.Lock()
_tracer: ReconcileTracer | None = None
_configured = False


def configure(env: Mapping[str, str] | None = None) -> ReconcileTracer | None:
    """The process's tracer from the environment, made once; None when tracing is off or unavailable."""
    global _tracer, _configured
    with _lock:
        if _configured:
            return _tracer
        _configured = True
        env = os.environ if env is None else env
        endpoint = traces_endpoint(env)
        if endpoint is None:
            return None
        try:
            protocol = traces_protocol(env)
            _tracer = ReconcileTracer(otlp_exporter(env), env=env)
        except ImportError as exc:
            log.warning(
                "event=tracing-off reason=sdk-missing endpoint=%s error=%r hint=%r",
                endpoint,
                str(exc),
                "install the operator with the tracing extra: pip install 'flashmodel[tracing]'",
            )
            return None
        except TracingConfigError as exc:
            log.warning("event=tracing-off reason=config endpoint=%s error=%r", endpoint, str(exc))
            return None
        log.info(
            "event=tracing-on endpoint=%s protocol=%s service=%s",
            endpoint,
            protocol,
            env.get("OTEL_SERVICE_NAME") or SERVICE_NAME,
        )
        return _tracer


def traced(fn: Reconcile[ClusterT, OutcomeT]) -> Reconcile[ClusterT, OutcomeT]:
    """`fn` itself when tracing is off; else `fn` with one span per call (model, generation, outcome)."""
    tracer = configure()
    if tracer is None:
        return fn

    def run(cluster: ClusterT, body: dict[str, Any]) -> OutcomeT:
        return tracer.run(fn, cluster, body)

    return run
