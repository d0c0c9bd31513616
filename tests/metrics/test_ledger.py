"""The ledger end to end on the real model: every request's latency decomposes into parts that add
up to it; the metrics, the Prometheus text and the trace file are well formed; and a planted
bottleneck (token budget, KV blocks, max_num_seqs) is what `explain` names."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import jsonschema
import pytest
from machine_helpers import quiet_machine  # this folder is on the path
from prometheus_client.parser import text_string_to_metric_families

from tokenloom import SamplingParams
from tokenloom.analysis.explain import analyze, format_report
from tokenloom.metrics.stats import CounterMetric, GaugeMetric, HistogramMetric
from tokenloom.metrics.buckets import WAIT_CAUSES
from tokenloom.metrics.timeline import PART_NAMES, VERDICT_HEADLINES
from tokenloom.metrics.trace import load_trace

SCHEMA = json.loads((Path(__file__).parent / "chrome_trace.schema.json").read_text())


def prompt(i: int, length: int) -> list[int]:
    """Token ids no other prompt shares (no prefix-cache hits between requests)."""
    return [1000 + 97 * i + j for j in range(length)]


def check_parts(out) -> dict[str, float]:
    m = out.metrics
    parts = m.parts
    assert list(parts) == list(PART_NAMES)
    assert all(v >= 0 for v in parts.values()), parts
    e2e = m.e2e_latency
    assert e2e is not None and e2e > 0
    assert abs(sum(parts.values()) - e2e) <= max(1e-3, 0.01 * e2e), (sum(parts.values()), e2e)
    if m.num_generation_tokens:
        assert 0 < m.time_to_first_token <= e2e
        assert len(m.inter_token_latencies) == m.num_generation_tokens - 1
    if m.num_generation_tokens > 1:
        assert m.time_per_output_token == pytest.approx(sum(m.inter_token_latencies) / (m.num_generation_tokens - 1))
    return parts


def check_trace_file(path: Path) -> dict:
    trace = load_trace(path)
    jsonschema.validate(trace, SCHEMA)
    # Perfetto needs the slices of one track to nest: disjoint or contained, never overlapping.
    tracks = defaultdict(list)
    for e in trace["traceEvents"]:
        if e["ph"] == "X":
            tracks[(e["pid"], e["tid"])].append((e["ts"], -e["dur"], e["ts"] + e["dur"]))
    for slices in tracks.values():
        open_ends: list[int] = []
        for start, _, end in sorted(slices):
            while open_ends and open_ends[-1] <= start:
                open_ends.pop()
            assert not open_ends or end <= open_ends[-1], "overlapping slices on one track"
            open_ends.append(end)
    return trace


@pytest.fixture(scope="module")
def mixed(make_llm, tmp_path_factory):
    """A mixed workload on the default configuration, traced."""
    path = tmp_path_factory.mktemp("trace") / "mixed.json"
    llm = make_llm(trace_path=str(path))
    prompts = [
        "What is the capital of France?",
        prompt(1, 40),
        prompt(2, 5),
        "Write a haiku about the sea.",
        prompt(3, 70),
    ]
    params = [
        SamplingParams(max_tokens=6, temperature=0),
        SamplingParams(max_tokens=8, ignore_eos=True),
        SamplingParams(max_tokens=3, ignore_eos=True, n=2, temperature=1.0, seed=1),
        SamplingParams(max_tokens=16, temperature=0, stop=[" "]),  # a stop string ends it in the caller
        SamplingParams(max_tokens=1, ignore_eos=True),
    ]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return llm, outputs, path


def test_parts_add_up_to_e2e(mixed):
    llm, outputs, _ = mixed
    for out in outputs:
        parts = check_parts(out)
        m = out.metrics
        stopped_by_caller = out.outputs[0].stop_reason == " "
        # Every request carries the core's account, also one a stop string ended in the caller
        # (its account arrives with the core's abort, and is cut at the caller's end).
        assert m.core is not None and parts["core_unattributed"] == 0
        if stopped_by_caller:
            assert m.core.finished_time >= m.finished_time and parts["prefill"] > 0
            continue
        assert parts["prefill"] > 0 and parts["ipc_in"] > 0 and parts["ipc_out"] > 0
        assert (parts["decode"] > 0) == (m.num_generation_tokens > 1 or len(out.outputs) > 1)
        core = m.core
        assert m.arrival_time <= m.tokenized_time <= core.sent_time <= core.received_time <= core.queued_time
        assert core.queued_time <= core.first_scheduled_time <= core.first_token_time <= core.finished_time
        assert core.finished_time <= m.finished_time <= m.detokenized_time <= m.returned_time
        assert core.finished_time <= m.output_sent_time <= m.finished_time  # the output thread's stamp
        assert set(m.wait_by_cause) == set(WAIT_CAUSES)
    assert len(outputs[2].outputs) == 2  # n=2: the parent's parts are its slowest child's path


def test_get_metrics_and_prometheus_text(mixed):
    llm, outputs, _ = mixed
    metrics = llm.get_metrics()
    by_name = defaultdict(list)
    for m in metrics:
        by_name[m.name].append(m)
    ttft = by_name["tokenloom:time_to_first_token_seconds"]
    assert len(ttft) == 1 and isinstance(ttft[0], HistogramMetric) and ttft[0].count == len(outputs)
    assert {m.labels["reason"] for m in by_name["tokenloom:request_wait_seconds"]} == {"step_boundary",
        "token_budget", "max_num_seqs", "no_kv_blocks", "head_of_line", "preempted", "grammar_compile"
    }
    budget = {m.labels["kind"]: m for m in by_name["tokenloom:step_budget_tokens"]}
    steps = next(m for m in metrics if m.name == "tokenloom:engine_steps")
    assert isinstance(steps, CounterMetric) and steps.value > 0
    assert budget["prefill"].count == steps.value and budget["prefill"].sum >= 40 + 5 + 70
    blocks = {m.labels["state"]: m.value for m in by_name["tokenloom:kv_blocks"]}
    total = next(m.value for m in metrics if m.name == "tokenloom:num_kv_blocks_total")
    assert all(isinstance(m, GaugeMetric) for m in by_name["tokenloom:kv_blocks"])
    assert sum(blocks.values()) == total and blocks["used"] == 0  # all finished
    decode = by_name["tokenloom:request_decode_time_seconds"][0]
    assert decode.count == len(outputs)  # the stop-string request's account came late, once
    parts_total = sum(m.value for m in by_name["tokenloom:request_part_seconds"])
    assert parts_total == pytest.approx(sum(o.metrics.e2e_latency for o in outputs), rel=1e-6)

    text = llm.llm_engine.ledger.metrics.render().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "tokenloom:num_requests_waiting",
        "tokenloom:num_requests_running",
        "tokenloom:kv_cache_usage_perc",
        "tokenloom:time_to_first_token_seconds",
        "tokenloom:e2e_request_latency_seconds",
        "tokenloom:request_wait_seconds",
        "tokenloom:step_budget_tokens",
        "tokenloom:kv_blocks",
        "tokenloom:request_part_seconds",
        "tokenloom:inter_token_latency_seconds",
        "tokenloom:step_duration_seconds",
    ):
        assert name in families, name


def test_trace_file(mixed):
    llm, outputs, path = mixed
    assert llm.flush_trace() == str(path)
    trace = check_trace_file(path)
    requests = [e for e in trace["traceEvents"] if e.get("cat") == "request"]
    assert sorted(e["args"]["request_id"] for e in requests) == sorted(o.request_id for o in outputs)
    phases = {e["name"] for e in trace["traceEvents"] if e.get("cat") == "phase"}
    assert {"tokenize", "ipc_in", "prefill", "decode", "ipc_out", "detokenize"} <= phases
    assert {"step_phase", "counter", "step", "config"} <= {e.get("cat") for e in trace["traceEvents"]}
    report = analyze(trace, top=3)
    assert report["num_requests"] == len(outputs) and len(report["slowest"]) == 3
    assert report["verdict"] in report["group_shares"]
    assert report["latency"]["e2e"]["count"] == len(outputs)


# ---- planted bottlenecks ------------------------------------------------------------------------

PLANTED = {
    # 12 short requests decode while 3 prompts of 300 tokens are prefilled in chunks of the whole
    # 320-token budget: every decode step is mostly someone else's prefill, and so are the short
    # prompts' own prefills.
    "prefill-bound": (
        dict(max_num_batched_tokens=320, max_model_len=512),
        [prompt(i, 8) for i in range(12)] + [prompt(100 + i, 300) for i in range(3)],
        [SamplingParams(max_tokens=12, ignore_eos=True)] * 12 + [SamplingParams(max_tokens=2, ignore_eos=True)] * 3,
        {"long_prefill"},
    ),
    # 12 prompts of 32 tokens, 16 tokens of budget per step: each prefill takes 2 steps, and the
    # others wait behind it for budget (the wait grows with the square of the queue).
    "budget-bound": (
        dict(max_num_batched_tokens=16),
        [prompt(i, 32) for i in range(12)],
        SamplingParams(max_tokens=1, ignore_eos=True),
        {"token_budget"},
    ),
    # 2 blocks of 16 tokens, 8 requests growing to 32 tokens (2 blocks): one fits at a time, the
    # rest wait for blocks, or are preempted (when two were admitted) and recompute.
    "block-bound": (
        dict(num_kv_blocks=2, kv_cache_memory_bytes=None),
        [prompt(i, 8) for i in range(8)],
        SamplingParams(max_tokens=24, ignore_eos=True),
        {"no_kv_blocks", "preempted"},
    ),
    # One request at a time.
    "seq-limit-bound": (
        dict(max_num_seqs=1),
        [prompt(i, 8) for i in range(8)],
        SamplingParams(max_tokens=10, ignore_eos=True),
        {"max_num_seqs"},
    ),
}


@pytest.mark.serial
# Two of the four planted verdicts in the fast tier (they run alone, on both cores); all four in
# the slow one.
@pytest.mark.parametrize("verdict", [v if v in ("prefill-bound", "block-bound") else pytest.param(v, marks=pytest.mark.slow)
                                     for v in PLANTED])
def test_planted_bottleneck(verdict, quiet_cores, make_llm, tmp_path, check_plot):
    config, prompts, params, causes = PLANTED[verdict]
    path = tmp_path / "trace.json"
    llm = make_llm(trace_path=str(path), warmup=True, **config)
    # The planted cause, not the machine's other work, must decide the verdict (machine_helpers).
    with quiet_machine(llm.llm_engine.engine_core.info.pid):
        outputs = llm.generate(prompts, params, use_tqdm=False)
    for out in outputs:
        check_parts(out)
    # The slowest half waited most for the planted cause (head-of-line counted for its cause).
    # (None: no wait reached the floor, timeline.DOMINANT_WAIT_FLOOR; the verdict below still names the cause.)
    slowest = sorted(outputs, key=lambda o: o.metrics.e2e_latency, reverse=True)[: len(outputs) // 2]
    named = {o.metrics.dominant_wait for o in slowest} - {None}
    assert named <= causes, [o.metrics.wait_by_cause for o in slowest]
    llm.flush_trace()
    trace = check_trace_file(path)
    report = analyze(trace, top=3)
    assert report["verdict"] == verdict, report["group_shares"]
    assert report["headline"] == VERDICT_HEADLINES[verdict] and report["headline"] in format_report(report)
    check_plot(trace, report, verdict, tmp_path)
    assert {r["dominant_wait"] for r in report["slowest"]} <= causes
    if verdict == "block-bound":
        assert report["num_preemptions"] > 0
        preemptions = next(m for m in llm.get_metrics() if m.name == "tokenloom:num_preemptions")
        assert preemptions.value == report["num_preemptions"]
