"""The engine core's ledger on the scheduler alone (a fake model and a fake clock, no torch):
each request's seconds add up to finished - received, every step's time lands in the bucket the
step's schedule() put the request in, and head-of-line waits go to what blocked the head."""
from __future__ import annotations

import sys
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "core"))  # the scheduler tests' helpers
from sched_helpers import fake_runner_output, make_request, make_scheduler  # noqa: E402

from tokenloom.core.scheduler import Scheduler  # noqa: E402
from tokenloom.messages import LedgerBucket, RequestTiming  # noqa: E402
from tokenloom.metrics.core_ledger import CoreLedger  # noqa: E402

B = LedgerBucket


class Clock:
    """Every step lasts one second; requests arrive between steps."""

    def __init__(self) -> None:
        self.t = 100.0


def run(scheduler: Scheduler, requests, *, record_segments: bool = False, max_steps: int = 500, arrivals=None):
    """Drives schedule -> fake runner -> update with a CoreLedger, as EngineCore.step does.
    `arrivals`: step index -> requests added before that step (all at step 0 by default)."""
    ledger = CoreLedger(record_segments=record_segments)
    clock = Clock()
    arrivals = arrivals if arrivals is not None else {0: requests}
    timings: dict[str, RequestTiming] = {}
    for step in range(max_steps):
        for r in arrivals.get(step, []):
            received = clock.t
            scheduler.add_request(r)
            ledger.add(r.request_id, received - 0.25, received, received)
        clock.t += 0.5  # the busy loop drains inputs
        if not scheduler.has_unfinished_requests():
            if step > max(arrivals):
                break
            continue
        start = clock.t
        so = scheduler.schedule()
        ledger.on_schedule(so, start)
        outputs = scheduler.update_from_output(so, fake_runner_output(scheduler, so))
        clock.t += 1.0
        ledger.on_update(outputs.outputs, clock.t)
        for out in outputs.outputs:
            if out.finished:
                assert out.timing is not None and out.request_id not in timings
                timings[out.request_id] = out.timing
    assert not len(ledger), "every request's entry leaves the ledger with its final output"
    return timings


def check_sums(timing: RequestTiming) -> None:
    assert all(s >= 0 for s in timing.seconds)
    assert abs(sum(timing.seconds) - (timing.finished_time - timing.received_time)) < 1e-9


def test_token_budget_and_head_of_line():
    # Budget 8, prompts of 16: A prefills in steps 1-2, B waits for budget (head), C behind it.
    s = make_scheduler(max_num_batched_tokens=8, num_blocks=64, block_size=4)
    reqs = [make_request(name, 16, max_tokens=2) for name in ("A", "BB", "CCC")]
    timings = run(s, reqs)
    for t in timings.values():
        check_sums(t)
    a, b, c = timings["A"], timings["BB"], timings["CCC"]
    assert a.seconds[B.PREFILL] > 0 and a.seconds[B.DECODE] > 0
    assert a.seconds[B.TOKEN_BUDGET] == a.seconds[B.HOL_TOKEN_BUDGET] == 0
    assert b.seconds[B.TOKEN_BUDGET] >= 2.0  # two whole steps (1.5 s each, loop included)
    assert c.seconds[B.HOL_TOKEN_BUDGET] >= 2.0
    assert a.first_scheduled_time < b.first_scheduled_time < c.first_scheduled_time
    assert a.first_token_time <= b.first_token_time <= c.first_token_time
    # Arrived during the busy loop: its first bucket is the wait for the step to start.
    assert a.seconds[B.STEP_BOUNDARY] == 0.5


def test_max_num_seqs():
    s = make_scheduler(max_num_seqs=1)
    timings = run(s, [make_request(name, 4, max_tokens=3) for name in ("A", "BB", "CCC")])
    for t in timings.values():
        check_sums(t)
    assert timings["BB"].seconds[B.MAX_NUM_SEQS] > 0
    assert timings["CCC"].seconds[B.HOL_MAX_NUM_SEQS] > 0 and timings["CCC"].seconds[B.MAX_NUM_SEQS] > 0


def test_preemption_counts_until_decoding_again():
    # 6 blocks of 4 tokens, three requests growing to 12 tokens (3 blocks) each: preemptions.
    s = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=64)
    timings = run(s, [make_request(name, 4, max_tokens=8, ignore_eos=True) for name in ("A", "BB", "CCC")],
                  record_segments=True)
    preempted = [t for t in timings.values() if t.num_preemptions]
    assert preempted and s.num_preemptions == sum(t.num_preemptions for t in timings.values())
    for t in timings.values():
        check_sums(t)
        # Phases tile the request's time in the core, in order, with its totals.
        assert t.segments[0][1] == t.received_time and t.segments[-1][2] == t.finished_time
        assert all(x[2] == y[1] for x, y in zip(t.segments, t.segments[1:]))
        per_bucket = [0.0] * len(LedgerBucket)
        for bucket, start, end in t.segments:
            per_bucket[bucket] += end - start
        assert all(abs(x - y) < 1e-9 for x, y in zip(per_bucket, t.seconds))
    for t in preempted:
        assert t.seconds[B.PREEMPTED] > 0
        # Once preempted, a request is in PREEMPTED until it decodes: no prefill after it.
        first = next(i for i, seg in enumerate(t.segments) if seg[0] == B.PREEMPTED)
        assert all(seg[0] in (B.PREEMPTED, B.DECODE) for seg in t.segments[first:])


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    specs=st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 24), st.integers(1, 12)), min_size=1, max_size=8
    ),
    budget=st.sampled_from([4, 8, 32]),
    max_num_seqs=st.sampled_from([1, 2, 8]),
    num_blocks=st.sampled_from([8, 16, 64]),
)
def test_random_workloads_add_up(specs, budget, max_num_seqs, num_blocks):
    s = make_scheduler(
        max_num_batched_tokens=budget, max_num_seqs=max_num_seqs, num_blocks=num_blocks, block_size=4
    )
    arrivals: dict[int, list] = {}
    for i, (arrival, prompt_len, max_tokens) in enumerate(specs):
        arrivals.setdefault(arrival, []).append(make_request(f"r{i}", prompt_len, max_tokens=max_tokens, ignore_eos=True))
    timings = run(s, None, arrivals=arrivals, max_steps=2000, record_segments=True)
    assert len(timings) == len(specs)  # rejected requests too: their error output carries timing
    for t in timings.values():
        check_sums(t)
