"""Decomposition, trace and explain on hand-made timelines (no model): exact sums, the verdict
rule, and a trace file that validates and nests."""
from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest

from tokenloom.messages import EngineCoreOutputs, LedgerBucket, RequestTiming, SchedulerStats
from tokenloom.analysis.explain import analyze, format_report
from tokenloom.metrics.timeline import PART_NAMES, decompose, settle
from tokenloom.metrics.trace import TraceRecorder, load_trace
from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput

SCHEMA = json.loads((Path(__file__).parent / "chrome_trace.schema.json").read_text())
B = LedgerBucket


def finished(request_id: str, arrival: float, phases: list[tuple[LedgerBucket, float]]) -> RequestOutput:
    """A request that spent `phases` (bucket, seconds) in the core, with small caller parts."""
    sent, received = arrival + 0.002, arrival + 0.003
    seconds = [0.0] * len(LedgerBucket)
    segments, t = [], received
    for bucket, dur in phases:
        seconds[bucket] += dur
        segments.append((int(bucket), t, t + dur))
        t += dur
    core = RequestTiming(sent, received, received, received, received + 0.01, t, seconds, segments=segments)
    m = RequestMetrics(arrival, num_prompt_tokens=8, tokenized_time=arrival + 0.001, core=core)
    m.record_tokens(1, received + 0.02)
    m.record_tokens(1, t + 0.001)
    m.finished_time = t + 0.001
    m.detokenized_time = t + 0.0015
    m.returned_time = t + 0.002
    settle(m)  # as the output processor and the ledger do
    return RequestOutput(request_id, None, [1] * 8, None, [CompletionOutput(0, "", [5, 6], None, None, "length")], True, m)


def test_parts_are_the_critical_path():
    out = finished("a", 10.0, [(B.STEP_BOUNDARY, 0.5), (B.TOKEN_BUDGET, 1.0), (B.HOL_TOKEN_BUDGET, 2.0),
                               (B.PREFILL, 0.25), (B.DECODE, 0.75)])
    m = out.metrics
    parts = decompose(m)
    assert list(parts) == list(PART_NAMES)
    assert sum(parts.values()) == pytest.approx(m.e2e_latency, abs=1e-12)
    assert parts["tokenize"] == pytest.approx(0.001) and parts["ipc_in"] == pytest.approx(0.001)
    assert parts["queue_head_of_line"] == 2.0 and parts["queue_token_budget"] == 1.0
    assert parts["ipc_out"] == pytest.approx(0.001) and parts["detokenize"] == pytest.approx(0.0005)
    assert m.wait_by_cause == {"step_in_flight": 0.5, "long_prefill": 0.0, "token_budget": 3.0, "max_num_seqs": 0.0,
                               "no_kv_blocks": 0.0, "preempted": 0.0, "grammar_compile": 0.0}
    assert m.dominant_wait == "token_budget"
    assert m.time_per_output_token == pytest.approx(m.last_token_time - m.first_token_time)


def test_trace_and_verdict(tmp_path):
    path = tmp_path / "t.json"
    rec = TraceRecorder(path, config={"max_num_batched_tokens": 16, "num_kv_blocks": 4, "block_size": 16})
    for step in range(5):
        stats = SchedulerStats(step=step + 1, num_prefill_tokens=12, num_decode_tokens=2, token_budget=16,
                               num_free_blocks=3, num_cached_free_blocks=1, num_total_blocks=4,
                               schedule_time=0.001, forward_time=0.05, update_time=0.002, step_time=0.053)
        rec.record_step(EngineCoreOutputs(scheduler_stats=stats, timestamp=100.0 + 0.06 * (step + 1)))
    # Two requests blocked on KV blocks (one of them preempted), one that ran at once.
    rec.record_request(finished("slow", 100.0, [(B.NO_KV_BLOCKS, 1.0), (B.PREFILL, 0.1), (B.PREEMPTED, 0.5),
                                                (B.DECODE, 0.2)]))
    rec.record_request(finished("slower", 100.0, [(B.HOL_NO_KV_BLOCKS, 2.0), (B.PREFILL, 0.1), (B.DECODE, 0.2)]))
    rec.record_request(finished("fast", 100.0, [(B.PREFILL, 0.1), (B.DECODE, 0.3)]))
    rec.write()
    trace = load_trace(path)
    jsonschema.validate(trace, SCHEMA)

    report = analyze(trace, top=2)
    assert report["verdict"] == "block-bound"
    assert report["group_seconds"]["block-bound"] == pytest.approx(3.5)
    assert report["group_seconds"]["compute-bound"] == pytest.approx(1.0)
    assert [r["request_id"] for r in report["slowest"]] == ["slower", "slow"]
    assert [r["dominant_wait"] for r in report["slowest"]] == ["no_kv_blocks", "no_kv_blocks"]
    assert report["num_steps"] == 5 and report["steps"]["mean_budget_used"] == pytest.approx(14 / 16)
    phases = [e["name"] for e in trace["traceEvents"] if e.get("cat") == "phase" and e["tid"] == 1 and e["ph"] == "X"]
    assert phases == ["tokenize", "frontend_other", "ipc_in", "queued: no_kv_blocks", "prefill", "preempted", "decode",
                      "ipc_out", "detokenize", "frontend_other"]
    text = format_report(report)
    assert "verdict: block-bound" in text and "slower" in text


def test_bounded_memory():
    rec = TraceRecorder(None, max_steps=3, max_requests=2)
    for step in range(5):
        rec.record_step(EngineCoreOutputs(scheduler_stats=SchedulerStats(step=step), timestamp=float(step)))
    for i in range(4):
        rec.record_request(finished(f"r{i}", 1.0, [(B.PREFILL, 0.1)]))
    assert len(rec.steps) == 3 and rec.num_steps_dropped == 2
    assert len(rec.requests) == 2 and rec.num_requests_dropped == 2
    config = next(e for e in rec.to_json()["traceEvents"] if e.get("cat") == "config")
    assert config["args"]["num_requests_dropped"] == 2


def test_a_run_waiting_for_grammars_is_grammar_bound_and_the_plot_shows_the_wait(tmp_path):
    """Time spent waiting for a structured-output grammar to compile is its own verdict group and
    its own slice of the plot's bars, so the slices still add up to each request's e2e."""
    from tokenloom.analysis.plot_parts import request_slices

    path = tmp_path / "t.json"
    rec = TraceRecorder(path, config={"max_num_batched_tokens": 16, "num_kv_blocks": 4, "block_size": 16})
    compiling = finished("json", 100.0, [(B.GRAMMAR_COMPILE, 1.0), (B.PREFILL, 0.05), (B.DECODE, 0.05)])
    rec.record_request(compiling)
    rec.record_request(finished("plain", 100.0, [(B.PREFILL, 0.05), (B.DECODE, 0.05)]))
    rec.write()
    report = analyze(load_trace(path), top=2)
    assert report["verdict"] == "grammar-bound"
    assert report["group_seconds"]["grammar-bound"] == pytest.approx(1.0)
    assert "verdict: grammar-bound" in format_report(report)
    slowest = report["slowest"][0]  # a request's summary, as the plot reads it
    assert slowest["request_id"] == "json"
    slices = request_slices(slowest)
    assert slices["wait: grammar compile"] == pytest.approx(1.0)
    assert sum(slices.values()) == pytest.approx(compiling.metrics.e2e_latency, abs=1e-9)
