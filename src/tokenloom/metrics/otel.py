"""The ledger as OpenTelemetry traces: one span per finished request, sent over OTLP
(`--otlp-traces-endpoint URL`, `LLM(otlp_traces_endpoint=...)`, as vLLM's flag).

The request's span (`llm_request`, kind SERVER) runs from its arrival to its return and carries
vLLM's attribute names (`gen_ai.request.*`, `gen_ai.usage.*`, `gen_ai.response.model` and the
`gen_ai.latency.*` set), so dashboards built for vLLM's traces read it. Beyond vLLM, under it:

- one child span per segment of its critical path (timeline.critical_path), named for the ledger
  part it adds to (attribute `tokenloom.part`). The segments are consecutive and tile the request
  span, so the children's durations add up to the request's e2e and, by name, to
  `RequestOutput.metrics.parts`: a trace viewer shows the same decomposition as `explain`. The
  parts are taken from the timeline whatever their names, so a new part shows up here unchanged;
  should the settled parts ever differ from the path, the children are laid out from the parts.
- one event `wait` per cause it waited for (`wait_by_cause`), with the cause, its seconds and the
  part it was booked to, at the start of that part's first child span;
- `tokenloom.part.<name>` attributes with every part's seconds, and `tokenloom.dominant_wait`.

An incoming W3C `traceparent` (and `tracestate`), passed with the request as `trace_headers`,
makes the request's span a child of the caller's.

The SDK and the exporters are an optional extra (`pip install 'tokenloom[otel]'`), imported only
when an endpoint is set. The protocol is `OTEL_EXPORTER_OTLP_TRACES_PROTOCOL` (or
`OTEL_EXPORTER_OTLP_PROTOCOL`): `grpc` (the default, as vLLM's) or `http/protobuf`; the other
standard `OTEL_*` variables (batch delay, headers, service name) are read by the SDK itself.
Spans are batched and sent off the request path by the SDK's `BatchSpanProcessor`; `flush()`
sends what is pending (at shutdown).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from tokenloom.metrics.buckets import BUCKET_CAUSE, BUCKET_PART
from tokenloom.metrics.timeline import critical_path

if TYPE_CHECKING:
    from tokenloom.outputs import RequestMetrics, RequestOutput

logger = logging.getLogger(__name__)

OTEL_EXTRA = "pip install 'tokenloom[otel]'"
SPAN_NAME = "llm_request"
TRACE_HEADERS = ("traceparent", "tracestate")
PROTOCOLS = ("grpc", "http/protobuf")
# The part each wait cause is booked to, from the ledger's table (first part wins).
CAUSE_PART: dict[str, str] = {}
for _cause, _part in zip(BUCKET_CAUSE, BUCKET_PART):
    if _cause is not None:
        CAUSE_PART.setdefault(_cause, _part)
del _cause, _part
QUEUE_PREFIX = "queue_"


class OtelMissingError(ImportError):
    pass


def trace_headers_of(headers: Mapping[str, str]) -> dict[str, str] | None:
    """The W3C trace-context headers of an incoming request (None: it has none)."""
    found = {name: headers[name] for name in TRACE_HEADERS if name in headers}
    return found or None


def traces_protocol() -> str:
    protocol = os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
    protocol = (protocol or "grpc").strip().lower()
    if protocol not in PROTOCOLS:
        raise ValueError(f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL={protocol!r} is not supported: use one of {PROTOCOLS}.")
    return protocol


def require_otel() -> None:
    """Raises OtelMissingError, naming the extra, unless the SDK and the exporter of the
    configured protocol can be imported: checked when the engine's arguments are, before any
    process starts."""
    try:
        import opentelemetry.sdk.trace  # noqa: F401
        if traces_protocol() == "grpc":
            import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        else:
            import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
    except ImportError as e:
        raise OtelMissingError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and the OTLP exporters: "
                               f"{OTEL_EXTRA} ({e})") from e


def _span_exporter(endpoint: str, protocol: str) -> Any:
    """The OTLP exporter for `protocol`. An HTTP endpoint given without a path gets the standard
    `/v1/traces`."""
    try:
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as e:
        raise OtelMissingError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and the OTLP exporters: "
                               f"{OTEL_EXTRA} ({e})") from e
    if protocol == "http/protobuf" and urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


class OtlpExporter:
    """Turns finished requests into spans and hands them to the SDK's batch processor."""

    def __init__(self, endpoint: str, model_name: str, span_exporter: Any = None) -> None:
        """`span_exporter`: any SDK `SpanExporter` instead of the OTLP one (tests)."""
        try:
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import SpanKind
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise OtelMissingError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK: {OTEL_EXTRA} ({e})") from e
        self.endpoint = endpoint
        self.protocol = traces_protocol()
        self.model_name = model_name
        exporter = span_exporter if span_exporter is not None else _span_exporter(endpoint, self.protocol)
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "tokenloom"})
        # Its own provider, not the global one: an application's tracing is left as it is.
        self.provider = TracerProvider(resource=resource, shutdown_on_exit=True)
        self.provider.add_span_processor(BatchSpanProcessor(exporter))
        self.tracer = self.provider.get_tracer("tokenloom")
        self._server_kind = SpanKind.SERVER
        self._internal_kind = SpanKind.INTERNAL
        self._propagator = TraceContextTextMapPropagator()
        # The ledger's clock is monotonic; spans are stamped in Unix nanoseconds.
        self._offset_ns = time.time_ns() - time.monotonic_ns()
        self._failed = False

    def _ns(self, t: float) -> int:
        return int(round(t * 1e9)) + self._offset_ns

    def export(self, output: RequestOutput) -> None:
        """A finished request whose account is complete (FrontendLedger.record_finished). A span
        that cannot be made is logged, once, and never fails the request path."""
        try:
            self._export(output)
        except Exception:  # noqa: BLE001 - tracing must not break serving
            if not self._failed:
                self._failed = True
                logger.exception("could not export the OpenTelemetry span of request %s", output.request_id)

    def _export(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is None or m.finished_time is None or m.e2e_latency is None:
            return
        segments = request_segments(m)
        parent = self._propagator.extract(m.trace_headers) if m.trace_headers else None
        end = m.arrival_time + m.e2e_latency
        span = self.tracer.start_span(SPAN_NAME, context=parent, kind=self._server_kind,
                                      start_time=self._ns(m.arrival_time),
                                      attributes=request_attributes(output, self.model_name))
        try:
            self._add_children(span, segments)
            for cause, seconds, at in wait_events(m, segments):
                span.add_event("wait", {"tokenloom.wait.cause": cause, "tokenloom.wait.seconds": seconds,
                                        "tokenloom.wait.part": CAUSE_PART.get(cause, "")}, timestamp=self._ns(at))
        finally:
            span.end(end_time=self._ns(end))

    def _add_children(self, span: Any, segments: list[tuple[str, float, float]]) -> None:
        from opentelemetry.trace import set_span_in_context

        context = set_span_in_context(span)
        for name, start, end in segments:
            child = self.tracer.start_span(name, context=context, kind=self._internal_kind,
                                           start_time=self._ns(start), attributes={"tokenloom.part": name})
            child.end(end_time=self._ns(end))

    def flush(self, timeout_millis: int = 10_000) -> bool:
        return self.provider.force_flush(timeout_millis)

    def shutdown(self) -> None:
        self.provider.shutdown()


def request_segments(m: RequestMetrics) -> list[tuple[str, float, float]]:
    """The request's path as (part, start, end), zero-length segments left out. The timeline's
    critical path when its sums by name are the settled parts; otherwise the parts one after
    another from the arrival, so that the children always add up to `parts`."""
    path = [(name, s, e) for name, s, e in critical_path(m) if e > s]
    parts = m.parts
    if not parts:
        return path
    sums: dict[str, float] = {}
    for name, s, e in path:
        sums[name] = sums.get(name, 0.0) + (e - s)
    if all(abs(sums.get(name, 0.0) - seconds) <= 1e-9 for name, seconds in parts.items()) and set(sums) <= set(parts):
        return path
    laid, t = [], m.arrival_time
    for name, seconds in parts.items():
        if seconds > 0:
            laid.append((name, t, t + seconds))
            t += seconds
    return laid


def wait_events(m: RequestMetrics, segments: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """(cause, seconds, when) for every cause the request waited for: when is the start of the
    first segment of the part the cause is booked to (the arrival when it has none)."""
    first = {}
    for name, start, _ in segments:
        first.setdefault(name, start)
    return [(cause, seconds, first.get(CAUSE_PART.get(cause, ""), m.arrival_time))
            for cause, seconds in m.wait_by_cause.items() if seconds > 0]


def request_attributes(output: RequestOutput, model_name: str) -> dict[str, Any]:
    """vLLM's span attributes (vllm/tracing.py SpanAttributes), then the ledger's own."""
    m = output.metrics
    assert m is not None
    parts = m.parts
    queue = sum(s for name, s in parts.items() if name.startswith(QUEUE_PREFIX))
    prefill, decode = parts.get("prefill", 0.0), parts.get("decode", 0.0)
    attrs: dict[str, Any] = {
        "gen_ai.response.model": model_name,
        "gen_ai.request.id": output.request_id,
        "gen_ai.request.n": m.n,
        "gen_ai.usage.num_sequences": m.n,
        "gen_ai.usage.prompt_tokens": m.num_prompt_tokens,
        "gen_ai.usage.completion_tokens": m.num_generation_tokens,
        "gen_ai.latency.e2e": m.e2e_latency,
        "gen_ai.latency.time_in_queue": queue,
        "gen_ai.latency.time_in_model_prefill": prefill,
        "gen_ai.latency.time_in_model_decode": decode,
        "gen_ai.latency.time_in_model_inference": prefill + decode,
    }
    optional = {
        "gen_ai.request.max_tokens": m.max_tokens,
        "gen_ai.request.temperature": m.temperature,
        "gen_ai.request.top_p": m.top_p,
        "gen_ai.latency.time_to_first_token": m.time_to_first_token,
        "tokenloom.dominant_wait": m.dominant_wait,
    }
    attrs.update({k: v for k, v in optional.items() if v is not None})
    reasons = [c.finish_reason for c in output.outputs if c.finish_reason is not None]
    if reasons:
        attrs["gen_ai.response.finish_reasons"] = reasons
    attrs.update({f"tokenloom.part.{name}": seconds for name, seconds in parts.items()})
    return attrs
