"""Machine contention: the engine's threads runnable but not running (ops/schedstat.py), booked as
its own part of a request's time (`machine_contention`, taken out of prefill and decode), and the
"contended" verdict in explain, the live view (`GET /ledger`), the plot and the metrics."""
from __future__ import annotations

import contextlib
import os
import time
from types import SimpleNamespace

import pytest

from tokenloom import SamplingParams
from tokenloom.analysis.explain import analyze, format_report
from tokenloom.messages import EngineCoreOutput, LedgerBucket
from tokenloom.metrics.contention import CONTENDED, contention_sentence, machine_summary
from tokenloom.metrics.core_ledger import CoreLedger
from tokenloom.metrics.live import live_view
from tokenloom.metrics.timeline import VERDICT_HEADLINES, group_seconds
from tokenloom.ops.schedstat import StepCpuMeter

from machine_helpers import _PLANTED_NICE, cpu_hog, quiet_machine  # this folder is on the path
from test_ledger import check_parts, check_trace_file, prompt  # this folder is on the path (rootdir-less)

def _decode_step(ledger: CoreLedger, req_ids: list[str], t: float) -> None:
    so = SimpleNamespace(num_scheduled_tokens=dict.fromkeys(req_ids, 1), decode_req_ids=set(req_ids),
                         num_decode_tokens=len(req_ids), num_prefill_tokens=0, wait_reasons={})
    ledger.on_schedule(so, t)  # type: ignore[arg-type]


def test_contention_taken_out_of_decode():
    ledger = CoreLedger(record_segments=True)
    ledger.add("a", 0.0, 0.0, 0.0)
    ledger.add("b", 0.0, 0.0, 0.0)
    _decode_step(ledger, ["a", "b"], 1.0)
    ledger.on_update([], 2.0, contention=0.4)
    _decode_step(ledger, ["a"], 2.0)  # b waits (not scheduled): it owes the first step's only
    ledger.on_update([EngineCoreOutput("a", [7], finish_reason=0)], 3.0, contention=0.5)
    assert "a" not in ledger.entries
    finals = ledger.abort(["b"], 3.0)
    b = finals[0].timing
    assert b.seconds[LedgerBucket.MACHINE_CONTENTION] == pytest.approx(0.4)
    assert b.seconds[LedgerBucket.DECODE] == pytest.approx(2.0 - 0.4)
    assert sum(b.seconds) == pytest.approx(3.0)
    # The phases still tile the request's time, the contention at the end of its decode stretch.
    assert [(LedgerBucket(k), s, e) for k, s, e in b.segments] == [
        (LedgerBucket.STEP_BOUNDARY, 0.0, 1.0), (LedgerBucket.DECODE, 1.0, pytest.approx(2.6)),
        (LedgerBucket.MACHINE_CONTENTION, pytest.approx(2.6), 3.0)]


def test_contention_never_more_than_the_step():
    ledger = CoreLedger()
    ledger.add("a", 0.0, 0.0, 0.0)
    _decode_step(ledger, ["a"], 0.0)
    out = EngineCoreOutput("a", [1], finish_reason=0)
    ledger.on_update([out], 0.1, contention=5.0)
    seconds = out.timing.seconds
    assert seconds[LedgerBucket.MACHINE_CONTENTION] == pytest.approx(0.1)
    assert seconds[LedgerBucket.DECODE] == 0.0 and sum(seconds) == pytest.approx(0.1)


def test_contended_group_and_sentence():
    parts = {"decode": 1.0, "machine_contention": 3.0}
    groups = group_seconds(parts, {})
    assert groups[CONTENDED] == 3.0 and groups["compute-bound"] == 1.0
    steps = [{"dur": 1.0, "run_delay_s": 0.6, "cpu_s": 0.4, "other_cores": 1.8, "cores": 2},
             {"dur": 1.0, "run_delay_s": 0.2, "cpu_s": 0.8, "other_cores": 1.2, "cores": 2}]
    m = machine_summary(steps)
    assert m["contention_ratio"] == pytest.approx(0.4) and m["other_cores"] == pytest.approx(1.5)
    assert contention_sentence(m) == ("the engine waited to run for 40% of its step time; other processes "
                                      "used 1.5 of the 2 cores")
    assert machine_summary([{"dur": 1.0}]) is None


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.serial
def test_meter_sees_a_hog_on_its_core():
    """One thread pinned to a core: alone it waits little to run; beside two busy processes on
    the same core it waits most of the time. Wall time minus CPU time would say neither."""
    core = sorted(os.sched_getaffinity(0))[-1]
    old = os.sched_getaffinity(0)
    os.sched_setaffinity(0, [core])
    try:
        meter = StepCpuMeter()
        assert meter.available
        meter.measure(time.monotonic())
        _spin(0.3)
        _, alone = meter.measure(time.monotonic())
        with cpu_hog(per_core=2, cores=[core]):
            meter.measure(time.monotonic())
            _spin(0.6)
            cpu, hogged = meter.measure(time.monotonic())
        meter.close()
    finally:
        os.sched_setaffinity(0, old)
    assert hogged > 0.3, (alone, hogged)
    assert hogged > alone + 0.2, (alone, hogged)
    assert 0 < cpu < 0.5


def _run(llm, n: int = 6) -> list:
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    return llm.generate([prompt(i, 16) for i in range(n)], params, use_tqdm=False)


def _planted_report(llm, path, tmp_path, hog: bool) -> tuple[dict, dict, str]:
    recorder = llm.llm_engine.ledger.trace
    recorder.steps.clear()
    recorder.requests.clear()
    with cpu_hog(nice=_PLANTED_NICE) if hog else contextlib.nullcontext():
        outputs = _run(llm)
    for out in outputs:
        check_parts(out)
    llm.flush_trace()
    trace = check_trace_file(path)
    report = analyze(trace, top=3)
    live = live_view(recorder, [], [], time.monotonic())
    return report, live, format_report(report)


@pytest.mark.serial
def test_planted_contention(quiet_cores, make_llm, tmp_path, check_plot):
    """The same decode workload without, then beside, a CPU hog (two busy processes per core):
    with the hog, the verdict is "contended" (not compute-bound) in explain, the live view and
    the plot, and the step metrics show it; without it, no contention verdict."""
    path = tmp_path / "trace.json"
    llm = make_llm(trace_path=str(path), warmup=True)
    with quiet_machine(llm.llm_engine.engine_core.info.pid):
        quiet, quiet_live, quiet_text = _planted_report(llm, path, tmp_path, hog=False)
        contended, live, text = _planted_report(llm, path, tmp_path, hog=True)
    ratios = (quiet["machine"]["contention_ratio"], contended["machine"]["contention_ratio"])
    print(f"contention ratio without / with the hog: {ratios[0]:.3f} / {ratios[1]:.3f}; other cores "
          f"{quiet['machine']['other_cores']:.2f} / {contended['machine']['other_cores']:.2f}; shares "
          f"{quiet['group_shares'][CONTENDED]:.2f} / {contended['group_shares'][CONTENDED]:.2f}")
    assert ratios[1] > ratios[0] + 0.15, ratios
    # Without the hog: no contention verdict anywhere.
    assert quiet["verdict"] != CONTENDED, (quiet["group_shares"], ratios)
    assert quiet_live["verdict"]["verdict"] != CONTENDED and "verdict: contended" not in quiet_text
    # With it: contended, with the numbers and what to change, in explain, /ledger and the plot.
    assert contended["verdict"] == CONTENDED, (contended["group_shares"], ratios)
    assert contended["headline"].startswith(VERDICT_HEADLINES[CONTENDED])
    assert "the engine waited to run for" in contended["headline"] and "of the" in contended["headline"]
    assert "verdict: contended" in text and "pin it" in text
    assert contended["parts_seconds"]["machine_contention"] > contended["parts_seconds"]["decode"]
    assert live["verdict"]["verdict"] == CONTENDED and "waited to run" in live["verdict"]["headline"]
    assert contended["machine"]["other_cores"] > quiet["machine"]["other_cores"]
    check_plot(check_trace_file(path), contended, CONTENDED, tmp_path)
    # The Prometheus metrics: every step's CPU seconds and contention ratio.
    names = {m.name: m for m in llm.get_metrics()}
    assert names["tokenloom:step_contention_ratio"].count > 0 and names["tokenloom:step_cpu_seconds"].sum > 0
