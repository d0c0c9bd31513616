"""The OTLP exporter's span shape, with the SDK's in-memory exporter: a part that is not on the
timeline's critical path (one a later change adds, booked after the fact) still gets its child
span, and the children always add up to the request's e2e."""
from __future__ import annotations

import pytest

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from tokenloom.metrics.otel import OtlpExporter, request_segments  # noqa: E402
from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput  # noqa: E402


def _output(parts: dict[str, float], causes: dict[str, float]) -> RequestOutput:
    m = RequestMetrics(arrival_time=100.0, num_prompt_tokens=4, finished_time=100.0 + sum(parts.values()),
                       num_generation_tokens=2, first_token_time=100.5, temperature=0.7, top_p=1.0, max_tokens=2)
    m.returned_time = m.finished_time
    m.parts, m.wait_by_cause = parts, causes
    m.dominant_wait = max(causes, key=causes.__getitem__) if causes else None
    done = CompletionOutput(0, "ab", [1, 2], None, None, finish_reason="length")
    return RequestOutput("r1", "p", [1, 2, 3, 4], None, [done], True, m)


def test_parts_not_on_the_path_are_laid_out_and_add_up():
    parts = {"tokenize": 0.1, "machine_contention": 0.25, "prefill": 0.4, "decode": 0.25}
    out = _output(parts, {"token_budget": 0.05})
    segments = request_segments(out.metrics)
    assert [s[0] for s in segments] == list(parts)
    memory = InMemorySpanExporter()
    exporter = OtlpExporter("http://127.0.0.1:1", "m", span_exporter=memory)
    exporter.export(out)
    exporter.flush()
    spans = memory.get_finished_spans()
    (root,) = [s for s in spans if s.name == "llm_request"]
    children = [s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id]
    assert {c.name for c in children} == set(parts)
    assert sum(c.end_time - c.start_time for c in children) == pytest.approx(root.end_time - root.start_time, abs=10)
    assert root.attributes["tokenloom.part.machine_contention"] == 0.25
    assert root.attributes["gen_ai.request.temperature"] == 0.7
    assert root.attributes["gen_ai.latency.e2e"] == pytest.approx(1.0)
    (event,) = root.events
    assert event.attributes["tokenloom.wait.cause"] == "token_budget"
    exporter.shutdown()


def test_unsupported_protocol_is_refused(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")
    with pytest.raises(ValueError, match="http/json"):
        OtlpExporter("http://127.0.0.1:1", "m", span_exporter=InMemorySpanExporter())
