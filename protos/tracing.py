"""OpenTelemetry traces of a request across the router and both workers.

Each process (the router, every prefill and decode worker) has a `Tracer` whose spans carry
`service.name` = its role (`pdserve-router`, `pdserve-prefill`, `pdserve-decode`) and go,
batched, to an OTLP/HTTP collector. The W3C trace context rides the gRPC metadata of each
call (router -> decode `Generate`, decode -> prefill `Prefill`), so the three processes'
spans form one tree per request.

Off (no endpoint) a Tracer imports nothing and hands out one shared no-op span: a request
pays a method call per span, nothing more. Spans of work timed on the engine thread are
recorded afterwards from their `time.perf_counter()` bounds (`Tracer.record`).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

TRACEPARENT = "traceparent"  # the W3C trace-context keys, lower case as gRPC metadata needs
TRACESTATE = "tracestate"


class TracingUnavailable(RuntimeError):
    """Traces were asked for (`--otlp-traces-endpoint`) but OpenTelemetry is not installed."""


def epoch_ns(perf_t: float) -> int:
    """A `time.perf_counter()` reading as nanoseconds since the epoch (what spans carry)."""
    return time.time_ns() - int((time.perf_counter() - perf_t) * 1e9)


def traces_url(endpoint: str) -> str:
    """The collector's OTLP/HTTP traces URL: `http://host:4318` means its `/v1/traces`."""
    parts = urlsplit(endpoint)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--otlp-traces-endpoint must be an http(s) URL of an OTLP/HTTP collector, "
                         f"e.g. http://127.0.0.1:4318, got {endpoint!r}")
    return endpoint if parts.path not in ("", "/") else endpoint.rstrip("/") + "/v1/traces"


class _NoSpan:
    """The span of a Tracer that is off: every call does nothing."""

    def set_attribute(self, key: str, value) -> None:
        pass

    def set_attributes(self, attributes: Mapping) -> None:
        pass

    def end(self, end_time: int | None = None) -> None:
        pass

    def record_error(self, message: str) -> None:
        pass


NO_SPAN = _NoSpan()


class _Span:
    """A live OpenTelemetry span, with the few calls pdserve makes on it."""

    def __init__(self, span):
        self.otel = span

    def set_attribute(self, key: str, value) -> None:
        self.otel.set_attribute(key, value)

    def set_attributes(self, attributes: Mapping) -> None:
        self.otel.set_attributes(dict(attributes))

    def end(self, end_time: int | None = None) -> None:
        self.otel.end(end_time=end_time)

    def record_error(self, message: str) -> None:
        from opentelemetry.trace import Status, StatusCode
        self.otel.set_status(Status(StatusCode.ERROR, message))


class Tracer:
    """One process's tracer (see the module docstring); `endpoint` "" turns it off."""

    def __init__(self, endpoint: str = "", service_name: str = "pdserve", instance_id: str = ""):
        self.enabled = bool(endpoint)
        self.service_name = service_name
        if not self.enabled:
            return
        url = traces_url(endpoint)
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise TracingUnavailable("--otlp-traces-endpoint needs OpenTelemetry: pip install 'pdserve[tracing]' "
                                     f"({e})") from e
        attributes = {"service.name": service_name} | ({"service.instance.id": instance_id} if instance_id else {})
        # a provider of its own, not the global one: workers hosted in one process keep their roles
        self._provider = TracerProvider(resource=Resource.create(attributes))
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=url),
                                                             schedule_delay_millis=1000))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()

    def _context(self, parent):
        """An OpenTelemetry context from a parent: one of our spans, a context, or None."""
        from opentelemetry import trace
        if isinstance(parent, _Span):
            return trace.set_span_in_context(parent.otel)
        return parent

    def start(self, name: str, parent=None, kind: str = "internal", start_s: float | None = None,
              attributes: Mapping | None = None):
        """A span begun now (or at the perf_counter reading `start_s`), under `parent` (one of
        this module's spans, or a context from `extract`; None: a new trace). End it with
        `.end()`. `kind`: internal, server or client."""
        if not self.enabled:
            return NO_SPAN
        from opentelemetry.trace import SpanKind
        span = self._tracer.start_span(name, context=self._context(parent), kind=SpanKind[kind.upper()],
                                       attributes=dict(attributes or {}),
                                       start_time=epoch_ns(start_s) if start_s is not None else None)
        return _Span(span)

    def record(self, name: str, parent, start_s: float, end_s: float, attributes: Mapping | None = None) -> None:
        """A finished span over the perf_counter interval [start_s, end_s] (work timed elsewhere,
        e.g. on the engine thread), under `parent`."""
        if not self.enabled:
            return
        span = self.start(name, parent, start_s=start_s, attributes=attributes)
        span.end(epoch_ns(end_s))

    def metadata(self, span) -> tuple[tuple[str, str], ...]:
        """gRPC metadata carrying `span` as the parent of the spans the callee makes."""
        if not self.enabled or span is NO_SPAN:
            return ()
        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=self._context(span))
        return tuple(carrier.items())

    def extract(self, metadata: Iterable | None):
        """The parent context a caller sent in its gRPC metadata (None: none, or off)."""
        if not self.enabled or not metadata:
            return None
        carrier = {m[0]: m[1] for m in metadata if m[0] in (TRACEPARENT, TRACESTATE)}
        return self._propagator.extract(carrier) if carrier else None

    def shutdown(self) -> None:
        """Export what is buffered, then stop."""
        if self.enabled:
            self._provider.shutdown()


OFF = Tracer()
