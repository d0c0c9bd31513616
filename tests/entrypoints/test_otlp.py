"""OpenTelemetry export (`--otlp-traces-endpoint`, `LLM(otlp_traces_endpoint=)`): spans sent over
OTLP to a receiver started here, decoded with `opentelemetry-proto`. The request's span carries
vLLM's attribute names, is the child of the client's `traceparent`, and its child spans (one per
segment of the ledger's critical path) add up to it, by name to the request's parts.

With the environment variable OTLP_DUMP set to a path, the served request's trace is written
there as OTLP-JSON (how docs/ledger/otlp-trace.json is made)."""
from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk")
from google.protobuf.json_format import MessageToJson  # noqa: E402
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc  # noqa: E402

from conftest import ServerProcess, free_port  # noqa: E402 - tests/entrypoints/conftest.py

SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 * 1024**2), "--served-model-name", "tiny"]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{CALLER_SPAN_ID}-01"
SPAN_KIND_SERVER = 2
NS_SLACK = 1000  # rounding to nanoseconds, per child span


class Receiver:
    """An OTLP trace receiver: gRPC (TraceService.Export) or HTTP/protobuf (POST /v1/traces)."""

    def __init__(self, protocol: str) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []
        self.lock = threading.Lock()
        self.port = free_port()
        self.protocol = protocol
        if protocol == "grpc":
            self._start_grpc()
        else:
            self._start_http()

    def _keep(self, request: trace_service_pb2.ExportTraceServiceRequest) -> None:
        with self.lock:
            self.requests.append(request)

    def _start_grpc(self) -> None:
        receiver = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # noqa: N802 - the service's name
                receiver._keep(request)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def _start_http(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = self.rfile.read(int(self.headers["Content-Length"]))
                ok = self.path == "/v1/traces"
                if ok:
                    receiver._keep(trace_service_pb2.ExportTraceServiceRequest.FromString(body))
                self.send_response(200 if ok else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.end_headers()
                self.wfile.write(trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.protocol == "grpc":
            self.server.stop(None)
        else:
            self.server.shutdown()

    def spans(self) -> list:
        with self.lock:
            return [span for req in self.requests for rs in req.resource_spans for ss in rs.scope_spans
                    for span in ss.spans]

    def wait_request_spans(self, count: int, timeout: float = 60.0) -> list:
        """The `llm_request` spans, once `count` of them (and their children) have come."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.spans()
            roots = [s for s in spans if s.name == "llm_request"]
            if len(roots) >= count and all(children_of(spans, r) for r in roots):
                return roots
            assert time.monotonic() < deadline, f"{len(roots)} of {count} request spans came in {timeout}s"
            time.sleep(0.1)


def children_of(spans: list, parent) -> list:
    return [s for s in spans if s.parent_span_id == parent.span_id and s.trace_id == parent.trace_id]


def attributes(span) -> dict:
    out = {}
    for kv in span.attributes:
        v = kv.value
        kind = v.WhichOneof("value")
        out[kv.key] = list(x.string_value for x in v.array_value.values) if kind == "array_value" else getattr(v, kind)
    return out


def check_request_span(spans: list, root) -> dict:
    """The request span's children tile it and add up, by name, to its parts; returns its
    attributes."""
    attrs = attributes(root)
    children = sorted(children_of(spans, root), key=lambda s: s.start_time_unix_nano)
    assert children, "no child spans"
    duration = root.end_time_unix_nano - root.start_time_unix_nano
    total = sum(c.end_time_unix_nano - c.start_time_unix_nano for c in children)
    assert abs(total - duration) <= NS_SLACK * len(children), (total, duration)
    assert abs(duration / 1e9 - attrs["gen_ai.latency.e2e"]) < 1e-5
    # Consecutive, from the request's start to its end.
    assert abs(children[0].start_time_unix_nano - root.start_time_unix_nano) <= NS_SLACK
    assert abs(children[-1].end_time_unix_nano - root.end_time_unix_nano) <= NS_SLACK
    for a, b in zip(children, children[1:]):
        assert abs(b.start_time_unix_nano - a.end_time_unix_nano) <= NS_SLACK
    by_name: dict[str, int] = {}
    for c in children:
        name = attributes(c)["tokenloom.part"]
        assert name == c.name
        by_name[name] = by_name.get(name, 0) + c.end_time_unix_nano - c.start_time_unix_nano
    parts = {k.removeprefix("tokenloom.part."): v for k, v in attrs.items() if k.startswith("tokenloom.part.")}
    assert parts and abs(sum(parts.values()) - attrs["gen_ai.latency.e2e"]) < 1e-6
    for name, seconds in parts.items():
        assert abs(by_name.get(name, 0) / 1e9 - seconds) < 1e-5 + NS_SLACK * 2 / 1e9, name
    for event in root.events:  # a wait names its cause and the part it was booked to
        ev = attributes(event)
        assert event.name == "wait" and ev["tokenloom.wait.seconds"] > 0 and ev["tokenloom.wait.cause"]
    return attrs


@pytest.fixture(scope="module")
def served():
    receiver = Receiver("grpc")
    env = {"OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "grpc"}
    srv = ServerProcess(SERVER_ARGS + ["--otlp-traces-endpoint", receiver.endpoint], None, env=env)
    try:
        yield srv, receiver
    finally:
        srv.stop()
        os.unlink(srv.log.name)
        receiver.stop()


def test_served_request_span_is_the_callers_child_and_adds_up(served):
    srv, receiver = served
    r = httpx.post(srv.url("/v1/chat/completions"), headers={"traceparent": TRACEPARENT}, timeout=120,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "Count to 3."}],
                         "max_tokens": 6, "temperature": 0.5, "top_p": 0.9})
    assert r.status_code == 200, r.text
    (root,) = receiver.wait_request_spans(1)
    spans = receiver.spans()
    assert root.trace_id.hex() == TRACE_ID and root.parent_span_id.hex() == CALLER_SPAN_ID
    assert root.kind == SPAN_KIND_SERVER
    attrs = check_request_span(spans, root)
    usage = r.json()["usage"]
    assert attrs["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert attrs["gen_ai.usage.completion_tokens"] == usage["completion_tokens"]
    assert attrs["gen_ai.response.model"] == "tiny"
    assert attrs["gen_ai.request.max_tokens"] == 6 and attrs["gen_ai.request.n"] == 1
    assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
    assert attrs["gen_ai.request.top_p"] == pytest.approx(0.9)
    for name in ("gen_ai.request.id", "gen_ai.latency.time_to_first_token", "gen_ai.latency.time_in_queue",
                 "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode"):
        assert name in attrs, name
    assert attrs["gen_ai.latency.time_in_model_prefill"] > 0
    resource = {kv.key: kv.value.string_value for kv in receiver.requests[0].resource_spans[0].resource.attributes}
    assert resource["service.name"] == "tokenloom"
    dump = os.environ.get("OTLP_DUMP")
    if dump:
        trace = trace_service_pb2.ExportTraceServiceRequest()
        for req in receiver.requests:
            trace.MergeFrom(req)
        Path(dump).write_text(otlp_json(trace))


def otlp_json(trace: trace_service_pb2.ExportTraceServiceRequest) -> str:
    """OTLP-JSON (the OTLP specification's JSON encoding): protobuf's JSON mapping, with the
    trace and span ids in hex rather than base64."""
    data = json.loads(MessageToJson(trace))
    for rs in data.get("resourceSpans", []):
        for ss in rs.get("scopeSpans", []):
            for span in ss.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return json.dumps(data, indent=2) + "\n"


def test_served_request_without_traceparent_is_a_root(served):
    srv, receiver = served
    before = len(receiver.wait_request_spans(1))
    r = httpx.post(srv.url("/v1/completions"), timeout=120,
                   json={"model": "tiny", "prompt": "Once upon", "max_tokens": 3})
    assert r.status_code == 200, r.text
    roots = receiver.wait_request_spans(before + 1)
    root = [s for s in roots if s.trace_id.hex() != TRACE_ID][0]
    assert root.parent_span_id == b""
    check_request_span(receiver.spans(), root)


def test_llm_keyword_over_http_protobuf(monkeypatch):
    from tokenloom import LLM, SamplingParams

    receiver = Receiver("http/protobuf")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    try:
        with LLM(dtype="float32", kv_cache_memory_bytes=64 * 1024**2, quantization=None, max_model_len=256,
                 otlp_traces_endpoint=receiver.endpoint) as llm:
            outs = llm.generate(["Hello", "The sky is"], SamplingParams(max_tokens=4, temperature=0))
            llm.llm_engine.flush_trace()  # sends the pending spans
            roots = receiver.wait_request_spans(2, timeout=30)
        spans = receiver.spans()
        for root in roots:
            attrs = check_request_span(spans, root)
            assert root.parent_span_id == b""
            assert attrs["gen_ai.request.id"] in {o.request_id for o in outs}
            out = next(o for o in outs if o.request_id == attrs["gen_ai.request.id"])
            assert attrs["gen_ai.latency.e2e"] == pytest.approx(out.metrics.e2e_latency, abs=1e-6)
    finally:
        receiver.stop()


def test_missing_extra_is_named(monkeypatch):
    from tokenloom.entrypoints.engine_args import EngineArgs
    from tokenloom.metrics.otel import OtelMissingError

    monkeypatch.setitem(sys.modules, "opentelemetry.sdk.trace", None)
    with pytest.raises(OtelMissingError, match=r"pip install 'tokenloom\[otel\]'"):
        EngineArgs(otlp_traces_endpoint="http://127.0.0.1:4317").create_engine_config()


def test_server_start_up_imports_no_sdk():
    code = ("import sys; import tokenloom; from tokenloom.entrypoints.openai import api_server; "
            "from tokenloom.entrypoints.llm import LLM; "
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter', "
            "'grpc'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout
