"""Warm-up before ready (core/warmup.py): the engine's one-time work is done before it reports
ready, so the first request's prefill is a prefill like the next one's; what remains of the first
step is booked as `first_step` (metrics/core_ledger.py), and the parts still add up to e2e."""
from __future__ import annotations

import pytest

from tokenloom.messages import EngineCoreOutput, FinishReason, LedgerBucket
from tokenloom.metrics.core_ledger import CoreLedger
from tokenloom.sched_output import SchedulerOutput

B = LedgerBucket


def _schedule(tokens: dict[str, int], decodes: set[str] = frozenset()) -> SchedulerOutput:
    return SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=None, num_scheduled_tokens=dict(tokens),
                           total_num_scheduled_tokens=sum(tokens.values()), finished_req_ids=set(),
                           decode_req_ids=set(decodes))


def _run(ledger: CoreLedger, first_step_end: float) -> dict:
    """Two requests received at 10.0; "a" is prefilled (32 tokens) in the first step, 10.0 to
    `first_step_end`, while "b" waits; then both compute in a second step of 0.1 and finish."""
    ledger.add("a", 9.9, 10.0, 10.0)
    ledger.add("b", 9.9, 10.0, 10.0)
    first = _schedule({"a": 32})
    first.wait_reasons = {}
    ledger.on_schedule(first, 10.0)
    ledger.on_update([EngineCoreOutput("a", [1])], first_step_end)
    ledger.on_schedule(_schedule({"a": 1, "b": 32}, {"a"}), first_step_end)
    done = [EngineCoreOutput(r, [2], finish_reason=FinishReason.LENGTH) for r in ("a", "b")]
    ledger.on_update(done, first_step_end + 0.1)
    return {o.request_id: o.timing for o in done}


def test_first_step_excess_is_its_own_bucket():
    """The first step's time beyond the warm step (scaled to its tokens) is FIRST_STEP for every
    request in the core then; the rest stays prefill (or the wait it was), and each request's
    seconds still add up to finished - received."""
    ledger = CoreLedger()
    ledger.expect_first_step(16, 0.05)  # a warm step of 16 tokens: 32 are expected in 0.1
    timings = _run(ledger, 12.0)
    a, b = timings["a"], timings["b"]
    assert a.seconds[B.FIRST_STEP] == pytest.approx(1.9)
    assert a.seconds[B.PREFILL] == pytest.approx(0.1)
    assert b.seconds[B.FIRST_STEP] == pytest.approx(1.9)  # waited behind it
    for t in (a, b):
        assert sum(t.seconds) == pytest.approx(t.finished_time - t.received_time, abs=1e-12)
    # Only the first step: a second, as long, is the request's own.
    assert ledger._first_step is None and ledger._first_step_reference is None


def test_no_first_step_without_a_warm_up_or_within_the_expected_time():
    for expect, end in ((None, 12.0), ((16, 0.05), 10.08)):
        ledger = CoreLedger()
        if expect:
            ledger.expect_first_step(*expect)
        a = _run(ledger, end)["a"]
        assert a.seconds[B.FIRST_STEP] == 0.0
        assert a.seconds[B.PREFILL] == pytest.approx(end - 10.0)


@pytest.mark.serial
def test_first_request_prefill_like_the_next(quiet_cores, make_llm):
    """The engine's one-time work (first touch of the weights and KV cache, the kernels' first
    calls) is done before ready: on the embedded model, the first request's prefill part is within
    twice the second's, for prompts of equal length, and its parts add up to its e2e."""
    from tokenloom import SamplingParams

    llm = make_llm()
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    outs = [llm.generate([list(range(1000 + 40 * i, 1024 + 40 * i))], params, use_tqdm=False)[0] for i in range(3)]
    prefill = [o.metrics.parts["prefill"] for o in outs]
    assert prefill[0] <= 2 * prefill[1], [o.metrics.parts for o in outs]
    assert prefill[0] > 0.0
    for o in outs:
        assert sum(o.metrics.parts.values()) == pytest.approx(o.metrics.e2e_latency, abs=1e-9)
    assert llm.llm_engine.engine_core.info.warmup_seconds > 0.0
