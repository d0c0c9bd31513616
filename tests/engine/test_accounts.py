"""Every finished request's metrics are ready once, and only with the engine core's account: the
output processor fed hand-made outputs (real SmolLM2 token ids), as the engine core sends them
with the ledger on. No engine."""
from __future__ import annotations

from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, RequestTiming, now
from tokenloom.sampling_params import SamplingParams

EOS = 2


def request(tokenizer, request_id: str, **params) -> EngineCoreRequest:
    return EngineCoreRequest(request_id=request_id, prompt_token_ids=tokenizer.encode("Say:", add_special_tokens=False),
                             sampling_params=SamplingParams(**params), eos_token_id=EOS, arrival_time=now())


def timing(t: float) -> RequestTiming:
    """An account of 10 ms: 4 queued, 2 prefill, 4 decode (buckets 2, 8, 9)."""
    seconds = [0.0] * 13
    seconds[2], seconds[8], seconds[9] = 0.004, 0.002, 0.004
    return RequestTiming(t - 0.011, t - 0.01, t - 0.01, t - 0.006, t - 0.004, t, seconds, last_bucket=9)


def test_finished_in_core_is_ready_at_once(tokenizer):
    p = OutputProcessor(tokenizer, expect_timing=True)
    p.add_user_request(request(tokenizer, "a", max_tokens=1), "Say:")
    [out] = p.process_outputs([EngineCoreOutput("a", [5], finish_reason=FinishReason.LENGTH, timing=timing(now()))]
                              ).request_outputs
    assert p.pop_ready() == [out] and p.pop_ready() == []
    assert out.metrics.core is not None and not p.owes_timing()


def test_aborted_waits_for_its_account_then_is_ready_once(tokenizer):
    p = OutputProcessor(tokenizer, expect_timing=True)
    p.add_user_request(request(tokenizer, "a", max_tokens=50), "Say:")
    p.process_outputs([EngineCoreOutput("a", [5])])
    outputs, core_ids = p.abort_requests("a")
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort"] and core_ids == ["a"]
    assert p.pop_ready() == [] and p.owes_timing()  # the final output went out; its metrics wait
    # The core's account, sent when it handled the abort (after the caller's end: cut back).
    p.add_user_request(request(tokenizer, "a", max_tokens=1), "Say:")  # the id reused at once
    late = EngineCoreOutput("a", [], finish_reason=FinishReason.ABORT, timing=timing(now() + 0.005))
    assert p.process_outputs([late]).request_outputs == []
    [ready] = p.pop_ready()
    assert ready is outputs[0] and not p.owes_timing()
    m = ready.metrics
    assert m.core is not None and m.parts["core_unattributed"] == 0
    assert abs(sum(m.parts.values()) - m.e2e_latency) < 1e-9 and all(v >= 0 for v in m.parts.values())
    assert "a" in p.request_states  # the new request under the reused id was not touched


def test_parent_waits_for_every_child(tokenizer):
    p = OutputProcessor(tokenizer, expect_timing=True)
    p.add_user_request(request(tokenizer, "r", max_tokens=50, n=2, temperature=1.0, stop=["a"]), "Say:")
    t = now()
    # Child 0 ends in the core; child 1 by a stop string found here (the core still runs it).
    result = p.process_outputs([EngineCoreOutput("0_r", [5], finish_reason=FinishReason.LENGTH, timing=timing(t)),
                                EngineCoreOutput("1_r", tokenizer.encode(" a", add_special_tokens=False))])
    assert result.reqs_to_abort == ["1_r"]
    [final] = [o for o in result.request_outputs if o.finished]
    assert p.pop_ready() == []
    p.process_outputs([EngineCoreOutput("1_r", [], finish_reason=FinishReason.ABORT, timing=timing(now() + 0.01))])
    assert p.pop_ready() == [final] and final.metrics.core is not None


def test_ledger_off_and_dead_core(tokenizer):
    p = OutputProcessor(tokenizer, expect_timing=False)
    p.add_user_request(request(tokenizer, "a", max_tokens=5), "Say:")
    outputs, _ = p.abort_requests("a")
    assert p.pop_ready() == outputs  # no account is coming: ready at once
    p = OutputProcessor(tokenizer, expect_timing=True)
    p.add_user_request(request(tokenizer, "a", max_tokens=5), "Say:")
    p.add_user_request(request(tokenizer, "b", max_tokens=5), "Say:")
    aborted, _ = p.abort_requests("a")
    failed = p.fail_all("engine core died")
    assert {o.request_id for o in p.pop_ready()} == {"a", "b"} and not p.owes_timing()
    assert aborted[0].metrics.parts["core_unattributed"] > 0 and failed[0].outputs[0].finish_reason == "error"
