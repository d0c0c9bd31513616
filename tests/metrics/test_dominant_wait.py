"""`dominant_wait` names a wait only when it is a meaningful share of the request's e2e
(DOMINANT_WAIT_FLOOR): property tests over synthetic timelines, on the server's path (`settle`,
what `RequestOutput.metrics.dominant_wait` holds) and the trace's (`summarize`, what `explain`
reads)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.analysis.explain import analyze, format_report
from tokenloom.messages import LedgerBucket, RequestTiming
from tokenloom.metrics.buckets import BUCKET_CAUSE
from tokenloom.metrics.timeline import DOMINANT_WAIT_FLOOR, dominant_wait, settle, summarize
from tokenloom.outputs import RequestMetrics

B = LedgerBucket
seconds = st.floats(min_value=0.0, max_value=30.0, allow_nan=False, allow_infinity=False)
phases = st.lists(st.tuples(st.sampled_from(list(LedgerBucket)), seconds), min_size=1, max_size=12)


def metrics_of(arrival: float, timeline: list[tuple[LedgerBucket, float]], caller: float) -> RequestMetrics:
    """A finished request that spent `timeline` (bucket, seconds) in the core and `caller`
    seconds in each of its caller-side parts."""
    sent, received = arrival + 2 * caller, arrival + 3 * caller
    secs = [0.0] * len(LedgerBucket)
    for bucket, dur in timeline:
        secs[bucket] += dur
    end = received + sum(secs)
    core = RequestTiming(sent, received, received, received, received, end, secs)
    m = RequestMetrics(arrival, num_prompt_tokens=8, tokenized_time=arrival + caller, core=core)
    m.record_tokens(1, end + caller)
    m.finished_time = end + caller
    m.detokenized_time = end + 2 * caller
    m.returned_time = end + 3 * caller
    settle(m)
    return m


def check(m: RequestMetrics, named: str | None) -> None:
    assert 0.0 < DOMINANT_WAIT_FLOOR < 1.0
    e2e = sum(m.parts.values())
    waits = m.wait_by_cause
    if named is None:
        # Nothing was named: no wait reached the floor.
        assert all(w < DOMINANT_WAIT_FLOOR * e2e or w <= 0.0 for w in waits.values()), (waits, e2e)
    else:
        # Never a wait below the floor, and always the longest one.
        assert waits[named] >= DOMINANT_WAIT_FLOOR * e2e and waits[named] > 0.0, (named, waits, e2e)
        assert waits[named] == max(waits.values())


@settings(max_examples=300, deadline=None)
@given(arrival=st.floats(min_value=0.0, max_value=1e6), timeline=phases,
       caller=st.floats(min_value=0.0, max_value=5.0, allow_nan=False))
def test_dominant_wait_never_names_a_wait_below_the_floor(arrival, timeline, caller):
    m = metrics_of(arrival, timeline, caller)
    check(m, m.dominant_wait)
    summary = summarize("r", m)
    assert summary["dominant_wait"] == m.dominant_wait
    check(m, summary["dominant_wait"])


@settings(max_examples=300, deadline=None)
@given(causes=st.dictionaries(st.sampled_from([c for c in BUCKET_CAUSE if c]), seconds),
       e2e=st.one_of(st.none(), st.floats(min_value=0.0, max_value=100.0)))
def test_dominant_wait_on_any_causes(causes, e2e):
    named = dominant_wait(causes, e2e)
    if named is not None:
        assert e2e and causes[named] >= DOMINANT_WAIT_FLOOR * e2e and causes[named] == max(causes.values())
    elif e2e:
        assert all(w < DOMINANT_WAIT_FLOOR * e2e or w <= 0.0 for w in causes.values())


def test_a_trivial_wait_in_a_long_request_is_no_significant_wait():
    """The issue's case: e2e of many seconds, its only wait a fraction of a millisecond behind the
    step in flight. It is not "waited most for: step_in_flight"; explain says what took the time."""
    m = metrics_of(100.0, [(B.STEP_BOUNDARY, 0.0004), (B.PREFILL, 0.3), (B.DECODE, 26.0)], 0.001)
    assert m.wait_by_cause["step_in_flight"] > 0.0
    assert m.dominant_wait is None
    summary = summarize("slow", m)
    assert summary["dominant_wait"] is None
    trace = {"traceEvents": [{"ph": "X", "cat": "request", "name": "slow", "ts": 0, "dur": 1, "pid": 1, "tid": 1,
                              "args": summary}]}
    text = format_report(analyze(trace, top=1))
    assert "step_in_flight" not in text.split("slow: ")[1].splitlines()[0]
    assert "no significant wait" in text and "most of its time: decode" in text
    # A wait that does hold a share of the e2e is still named.
    m = metrics_of(100.0, [(B.TOKEN_BUDGET, 1.0), (B.PREFILL, 0.3), (B.DECODE, 2.0)], 0.001)
    assert m.dominant_wait == "token_budget"
