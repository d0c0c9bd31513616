"""Scheduler behaviour without a model: requests in, hand-made runner outputs back."""
import pytest
from sched_helpers import EOS, check_block_invariants, fake_runner_output, make_request, make_scheduler, run_step

from tokenloom.core.request import RequestStatus
from tokenloom.sched_output import WaitReason
from tokenloom.messages import FinishReason, LogprobsLists, PooledData
from tokenloom.pooling_params import PoolingParams
from tokenloom.runner_output import ModelRunnerOutput


def drain(scheduler, next_token=7, max_steps=500):
    """Run to completion; returns {req_id: (token_ids, final output)}."""
    results: dict[str, list] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return results
        so, outs = run_step(scheduler, next_token)
        assert so.total_num_scheduled_tokens <= scheduler.max_num_batched_tokens
        check_block_invariants(scheduler)
        for out in outs.outputs:
            tokens, final = results.setdefault(out.request_id, [[], None])
            assert final is None, "output after the final one"
            tokens.extend(out.new_token_ids)
            if out.finished:
                results[out.request_id][1] = out
    raise AssertionError("did not finish")


def test_budget_and_chunked_prefill_split():
    s = make_scheduler(max_num_batched_tokens=16, block_size=4)
    s.add_request(make_request("long", 50, max_tokens=2))
    chunks = []
    for _ in range(4):
        so, outs = run_step(s)
        assert so.total_num_scheduled_tokens <= 16
        chunks.append(so.num_scheduled_tokens["long"])
        assert so.num_prefill_tokens == chunks[-1] and so.num_decode_tokens == 0
        if len(chunks) < 4:
            assert outs.outputs == []  # mid-prefill chunks sample nothing
    assert chunks == [16, 16, 16, 2] and sum(chunks) == 50
    assert [o.new_token_ids for o in outs.outputs] == [[7]]
    assert len(so.scheduled_new_reqs) == 0 and so.scheduled_cached_reqs.num_computed_tokens == [48]
    so, outs = run_step(s)
    assert so.num_decode_tokens == 1 and so.num_prefill_tokens == 0
    assert outs.outputs[0].finish_reason == FinishReason.LENGTH


def test_running_requests_come_first_and_share_the_budget():
    s = make_scheduler(max_num_batched_tokens=10)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 8, "b": 2}
    so, _ = run_step(s)
    # a decodes (1), b continues its prefill with what is left of the budget.
    assert so.num_scheduled_tokens == {"a": 1, "b": 6}
    assert so.num_decode_tokens == 1 and so.num_prefill_tokens == 6
    assert so.scheduled_cached_reqs.req_ids == ["a", "b"]


def test_chunked_prefill_off():
    s = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False)
    s.add_request(make_request("a", 10))
    s.add_request(make_request("b", 10))
    s.add_request(make_request("too-long", 17))
    so, outs = run_step(s)
    assert so.num_scheduled_tokens == {"a": 10}  # b does not get a 6-token chunk
    assert so.wait_reasons == {"b": WaitReason.TOKEN_BUDGET}
    [err] = [o for o in outs.outputs if o.request_id == "too-long"]
    assert err.finish_reason == FinishReason.ERROR and "max_num_batched_tokens" in err.error
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 10}


def test_max_num_seqs_and_fcfs_order():
    s = make_scheduler(max_num_seqs=2)
    for name in ["r0", "r1", "r2", "r3"]:
        s.add_request(make_request(name, 4, max_tokens=1))
    so, _ = run_step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r0", "r1"]
    assert so.wait_reasons == {"r2": WaitReason.MAX_NUM_SEQS, "r3": WaitReason.HEAD_OF_LINE}
    so, _ = run_step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["r2", "r3"]
    assert so.finished_req_ids == {"r0", "r1"}


def test_priority_order():
    s = make_scheduler(max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_request("low", 4, max_tokens=1, priority=5, arrival_time=0.0))
    s.add_request(make_request("high-late", 4, max_tokens=1, priority=0, arrival_time=2.0))
    s.add_request(make_request("high-early", 4, max_tokens=1, priority=0, arrival_time=1.0))
    order = []
    for _ in range(3):
        so, _ = run_step(s)
        order += [r.req_id for r in so.scheduled_new_reqs]
    assert order == ["high-early", "high-late", "low"]


def test_fcfs_ignores_priority():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("first", 4, max_tokens=1, priority=9, arrival_time=0.0))
    s.add_request(make_request("second", 4, max_tokens=1, priority=0, arrival_time=1.0))
    so, _ = run_step(s)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["first"]


def test_preemption_and_resume_in_full():
    # 4 blocks of 4 tokens. Two 6-token prompts take 2 blocks each; a's decode needs a 3rd block
    # at position 8, so b (admitted last) is preempted.
    s = make_scheduler(num_blocks=4, block_size=4, enable_prefix_caching=False)
    s.add_request(make_request("a", 6, max_tokens=5))
    s.add_request(make_request("b", 6, max_tokens=5))
    run_step(s)  # prefill both: positions 0-5; 1 token sampled each
    run_step(s)  # decode position 6
    run_step(s)  # decode position 7
    b = s.requests["b"]
    assert b.num_output_tokens == 3
    so, _ = run_step(s)  # a needs a block for position 8: b gives way
    assert so.wait_reasons == {"b": WaitReason.PREEMPTED}
    assert "b" in so.finished_req_ids  # the runner drops it
    assert so.num_scheduled_tokens == {"a": 1}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.kv_cache_manager.get_block_ids("b") == ([],)
    assert list(s.waiting) == [b] and b.num_preemptions == 1
    check_block_invariants(s)
    # b resumes once a finishes, in full, with its outputs so far, recomputing 6 + 3 tokens.
    for _ in range(5):
        so, outs = run_step(s)
        if so.scheduled_new_reqs:
            break
    [new] = so.scheduled_new_reqs
    assert new.req_id == "b" and new.output_token_ids == [7, 7, 7] and new.num_computed_tokens == 0
    assert so.num_scheduled_tokens["b"] == 9 and so.num_prefill_tokens == 9
    results = drain(s)
    assert results["b"][1].finish_reason == FinishReason.LENGTH
    assert b.output_token_ids == [7] * 5
    assert s.make_stats().num_preemptions == 1


def test_preemption_of_itself():
    # One request alone cannot preempt anyone else: a prompt that fills the whole cache finishes
    # with LENGTH (the cache bounds its length) instead of preempting itself forever.
    s = make_scheduler(num_blocks=2, block_size=4)
    s.add_request(make_request("a", 8, max_tokens=10))
    results = drain(s)
    assert results["a"][1].finish_reason == FinishReason.LENGTH and results["a"][0] == [7]


def test_self_preemption_when_last():
    s = make_scheduler(num_blocks=3, block_size=4, enable_prefix_caching=False)
    s.add_request(make_request("a", 4, max_tokens=8))
    s.add_request(make_request("b", 7, max_tokens=8))
    run_step(s)  # a: 1 block, b: 2 blocks; cache full
    so, _ = run_step(s)
    # a (position 4) needs a new block: b, last admitted, is preempted; b's own decode (position
    # 7) is then not scheduled.
    assert so.wait_reasons == {"b": WaitReason.PREEMPTED} and so.num_scheduled_tokens == {"a": 1}
    results = drain(s)
    assert {k: v[1].finish_reason for k, v in results.items()} == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}


def test_priority_preempts_lowest_priority():
    s = make_scheduler(num_blocks=4, block_size=4, scheduling_policy="priority", enable_prefix_caching=False)
    s.add_request(make_request("vip-late", 6, priority=0, arrival_time=1.0))
    s.add_request(make_request("low", 6, priority=3, arrival_time=0.0))
    run_step(s)
    assert [r.request_id for r in s.running] == ["vip-late", "low"]
    run_step(s)
    run_step(s)
    so, _ = run_step(s)
    assert so.wait_reasons == {"low": WaitReason.PREEMPTED}


def test_resumed_request_reuses_its_cached_prefix():
    s = make_scheduler(num_blocks=5, block_size=4, enable_prefix_caching=True)
    s.add_request(make_request("a", 6, max_tokens=9))
    s.add_request(make_request("b", [5] * 9, max_tokens=9))
    while "b" not in (so := run_step(s)[0]).wait_reasons:
        pass
    assert so.wait_reasons["b"] == WaitReason.PREEMPTED
    while not so.scheduled_new_reqs:
        so, _ = run_step(s)
    [new] = so.scheduled_new_reqs
    assert new.req_id == "b" and new.num_computed_tokens > 0  # its full blocks were still cached
    num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
    assert so.num_scheduled_tokens["b"] == num_tokens - new.num_computed_tokens
    drain(s)


@pytest.mark.parametrize(
    "params, tokens, expect_tokens, reason, stop_reason",
    [
        ({}, [5, EOS, 5], [5, EOS], FinishReason.STOP, None),
        ({"ignore_eos": True, "max_tokens": 3}, [EOS, EOS, EOS, EOS], [EOS] * 3, FinishReason.LENGTH, None),
        ({"stop_token_ids": [42]}, [5, 42, 5], [5, 42], FinishReason.STOP, 42),
        ({"max_tokens": 3}, [5, 5, 5, 5], [5, 5, 5], FinishReason.LENGTH, None),
        ({"min_tokens": 3}, [EOS, EOS, EOS, 5], [EOS] * 3, FinishReason.STOP, None),
        ({"min_tokens": 2, "stop_token_ids": [42]}, [42, 42], [42, 42], FinishReason.STOP, 42),
        ({"max_tokens": 1}, [EOS], [EOS], FinishReason.STOP, None),  # EOS wins over max_tokens
    ],
)
def test_stop_conditions(params, tokens, expect_tokens, reason, stop_reason):
    s = make_scheduler()
    s.add_request(make_request("r", 5, **{"max_tokens": 16, **params}))
    script = iter(tokens)
    results = drain(s, next_token=lambda _: next(script))
    got, final = results["r"]
    assert got == expect_tokens
    assert final.finish_reason == reason and final.stop_reason == stop_reason


def test_max_model_len_stops_with_length():
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("r", 5, max_tokens=None))
    results = drain(s)
    assert results["r"][0] == [7, 7, 7] and results["r"][1].finish_reason == FinishReason.LENGTH


def test_abort_frees_blocks_and_emits_nothing():
    s = make_scheduler(max_num_seqs=1)
    s.add_request(make_request("run", 9))
    s.add_request(make_request("wait", 9))
    so, _ = run_step(s)
    assert s.kv_cache_manager.num_used_blocks == 3
    s.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    s.finish_requests("run", RequestStatus.FINISHED_ABORTED)  # twice: ignored
    assert s.kv_cache_manager.num_used_blocks == 0 and not s.has_unfinished_requests()
    assert not s.running and not s.waiting
    check_block_invariants(s)
    assert s.schedule().finished_req_ids == {"run", "wait"}  # the runner drops them
    # An abort that lands between schedule() and update: the step's result is dropped.
    s.add_request(make_request("late", 4))
    so = s.schedule()
    s.finish_requests(["late"], RequestStatus.FINISHED_ABORTED)
    outs = s.update_from_output(so, ModelRunnerOutput(["late"], {"late": 0}, [[7]]))
    assert outs.outputs == []
    assert s.schedule().finished_req_ids == {"late"}
    check_block_invariants(s)


def test_aborted_ids_reach_the_runner():
    s = make_scheduler()
    s.add_request(make_request("a", 4))
    run_step(s)
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    assert s.schedule().finished_req_ids == {"a"}


def test_wait_reasons_no_kv_blocks_and_head_of_line():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(make_request("big", 12, max_tokens=1))  # 3 blocks
    s.add_request(make_request("x", 8))  # needs 2: does not fit now
    s.add_request(make_request("y", 1))  # would fit, but may not overtake x
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"big": 12}
    assert so.wait_reasons == {"x": WaitReason.NO_KV_BLOCKS, "y": WaitReason.HEAD_OF_LINE}
    so, _ = run_step(s)  # big finished last step: its blocks are back
    assert set(so.num_scheduled_tokens) == {"x", "y"} and so.wait_reasons == {}


def test_wait_reason_token_budget_for_running_and_waiting():
    s = make_scheduler(max_num_batched_tokens=4)
    s.add_request(make_request("a", 4))
    s.add_request(make_request("b", 4))
    s.add_request(make_request("c", 4))
    so, _ = run_step(s)
    assert so.wait_reasons == {"b": WaitReason.TOKEN_BUDGET, "c": WaitReason.HEAD_OF_LINE}
    # a decodes (1); b gets a 3-token chunk; c waits.
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"a": 1, "b": 3}
    # A running request can wait for budget too: under the priority policy a later, more
    # important request is served first and its prefill chunk takes the whole budget.
    s = make_scheduler(max_num_batched_tokens=4, scheduling_policy="priority")
    s.add_request(make_request("low", 1, priority=1, arrival_time=0.0))
    run_step(s)
    s.add_request(make_request("high", 10, priority=0, arrival_time=1.0))
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"low": 1, "high": 3}
    so, _ = run_step(s)
    assert so.num_scheduled_tokens == {"high": 4}
    assert so.wait_reasons == {"low": WaitReason.TOKEN_BUDGET}


def test_never_fitting_prompt_finishes_with_error():
    s = make_scheduler(num_blocks=3, block_size=4)
    s.add_request(make_request("huge", 13))
    s.add_request(make_request("ok", 5, max_tokens=1))
    assert s.has_unfinished_requests()
    so, outs = run_step(s)
    by_id = {o.request_id: o for o in outs.outputs}
    assert by_id["huge"].finish_reason == FinishReason.ERROR
    assert "needs 4 KV cache blocks" in by_id["huge"].error and by_id["huge"].new_token_ids == []
    assert by_id["ok"].finish_reason == FinishReason.LENGTH
    assert not s.has_unfinished_requests()
    # Alone, it still gets its output from one (empty) step.
    s.add_request(make_request("huge2", 100))
    so, outs = run_step(s)
    assert so.total_num_scheduled_tokens == 0 and [o.finish_reason for o in outs.outputs] == [FinishReason.ERROR]


def test_prompt_longer_than_max_model_len_is_rejected():
    s = make_scheduler(max_model_len=8)
    s.add_request(make_request("r", 9))
    _, outs = run_step(s)
    assert "max_model_len" in outs.outputs[0].error


def test_duplicate_request_id_is_refused():
    s = make_scheduler()
    s.add_request(make_request("r", 4))
    with pytest.raises(ValueError):
        s.add_request(make_request("r", 4))


def test_outputs_carry_logprobs_and_cached_tokens():
    s = make_scheduler(block_size=4)
    shared = list(range(100, 112))
    s.add_request(make_request("a", shared, max_tokens=1))
    drain(s)
    s.add_request(make_request("b", shared + [1], max_tokens=1))
    so = s.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 12
    lp = LogprobsLists(token_ids=[[7, 3]], logprobs=[[-0.1, -2.0]], ranks=[1])
    plp = LogprobsLists(token_ids=[[1]], logprobs=[[-1.0]], ranks=[1])
    runner = fake_runner_output(s, so)
    runner.logprobs["b"] = lp
    runner.prompt_logprobs["b"] = plp
    [out] = s.update_from_output(so, runner).outputs
    assert out.new_logprobs == lp and out.new_prompt_logprobs == plp and out.num_cached_tokens == 12


def test_scheduler_stats():
    s = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=32)
    shared = list(range(100, 109))
    s.add_request(make_request("a", shared, max_tokens=3))
    s.add_request(make_request("b", shared, max_tokens=3))
    _, outs = run_step(s)
    st = outs.scheduler_stats
    assert st.step == 1 and st.token_budget == 32
    # b is admitted behind a in the same step and already shares a's two full prompt blocks:
    # it computes only its last token (9 + 1 prefill tokens).
    assert (st.num_prefill_tokens, st.num_decode_tokens) == (10, 0)
    assert (st.num_running_reqs, st.num_waiting_reqs) == (2, 0)
    assert st.num_total_blocks == 10 and st.num_free_blocks + st.num_used_blocks == 10
    assert st.num_used_blocks == 4 and st.kv_cache_usage == pytest.approx(0.4)
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (18, 8)
    s.add_request(make_request("c", shared, max_tokens=1))
    _, outs = run_step(s)
    st = outs.scheduler_stats
    assert (st.num_prefill_tokens, st.num_decode_tokens) == (1, 2)  # c hit 8 of its 9 tokens
    assert (st.prefix_cache_queries, st.prefix_cache_hits) == (27, 16)  # cumulative
    drain(s)
    st = s.make_stats()
    assert st.num_used_blocks == 0 and st.num_cached_free_blocks > 0 and st.num_preemptions == 0


def test_prompt_logprobs_request_computes_its_whole_prompt():
    # A cached prefix would skip positions whose prompt logprobs were asked for.
    s = make_scheduler(num_blocks=16, block_size=4)
    shared = list(range(100, 113))
    s.add_request(make_request("a", shared, max_tokens=1))
    run_step(s)
    s.add_request(make_request("b", shared, max_tokens=1, prompt_logprobs=2))
    s.add_request(make_request("c", shared, max_tokens=1))
    so, _ = run_step(s)
    new = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    assert new == {"b": 0, "c": 12}
    assert so.num_scheduled_tokens["b"] == 13


def _pooling_step(s):
    """One step of a pooling engine: nothing sampled; a request whose prompt ends is pooled."""
    so = s.schedule()
    out = fake_runner_output(s, so)
    for i, req_id in enumerate(out.req_ids):
        out.sampled_token_ids[i] = []
        request = s.requests[req_id]
        if request.num_computed_tokens >= request.num_tokens:
            out.pooler_output[req_id] = PooledData(shape=[1], data=req_id.encode().ljust(4, b"_"))
    return so, s.update_from_output(so, out)


@pytest.mark.parametrize("pooling_type, task, cached", [("LAST", "embed", 12), ("MEAN", "embed", 0),
                                                        ("CLS", "embed", 0), ("LAST", "token_embed", 0)])
def test_pooling_request_ends_with_its_prompt(pooling_type, task, cached):
    s = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=8, pooling_type=pooling_type)
    shared = list(range(100, 113))
    finals = {}
    for name in ("a", "b"):  # b's prompt is a's: a prefix-cache hit only where the pooling allows it
        request = make_request(name, shared, max_tokens=1)
        request.pooling_params = PoolingParams(task=task, normalize=True)
        s.add_request(request)
        chunks = []
        while s.has_unfinished_requests():
            so, outs = _pooling_step(s)
            check_block_invariants(s)
            if so.scheduled_new_reqs:
                assert so.scheduled_new_reqs[0].num_computed_tokens == (cached if name == "b" else 0)
                assert so.scheduled_new_reqs[0].pooling_params.task == task
            chunks.append(so.num_scheduled_tokens[name])
            for out in outs.outputs:
                assert out.request_id == name and out.new_token_ids == [] and out.finished
                finals[name] = out
        assert sum(chunks) == 13 - (cached if name == "b" else 0) and max(chunks) <= 8
        assert finals[name].finish_reason == FinishReason.STOP
        assert finals[name].pooling_output.data.startswith(name.encode())
        assert finals[name].num_cached_tokens == (cached if name == "b" else 0)
    assert s.kv_cache_manager.block_pool.num_free_blocks == 16  # every block back


# ---- speculative decoding ----------------------------------------------------------------------


def _spec_step(s, drafts_out: dict[str, list[int]], sampled: dict[str, list[int]] | None = None):
    """One step where the runner returns `sampled[req]` (default: one token 7 for every request
    that samples) and proposes `drafts_out` for the next step."""
    so = s.schedule()
    out = fake_runner_output(s, so)
    for req_id, tokens in (sampled or {}).items():
        out.sampled_token_ids[out.req_id_to_index[req_id]] = tokens
    out.spec_token_ids = drafts_out
    return so, s.update_from_output(so, out)


def test_draft_tokens_are_scheduled_verified_and_rejected_positions_taken_back():
    s = make_scheduler(num_speculative_tokens=4, block_size=4)
    s.add_request(make_request("a", 6, max_tokens=50))
    so, _ = _spec_step(s, {"a": [11, 12, 13]})  # the prefill, then 3 drafts proposed
    a = s.requests["a"]
    assert a.num_tokens == 7 and a.num_computed_tokens == 6 and a.spec_token_ids == [11, 12, 13]
    so = s.schedule()
    # The decode token and its 3 drafts, all decode tokens; room for 7 + 3 tokens.
    assert so.num_scheduled_tokens == {"a": 4} and so.scheduled_spec_decode_tokens == {"a": [11, 12, 13]}
    assert so.num_decode_tokens == 4 and so.num_prefill_tokens == 0 and so.decode_req_ids == {"a"}
    assert a.num_computed_tokens == 10
    assert sum(len(b) for b in s.kv_cache_manager.get_blocks("a")) * 4 >= 10
    out = fake_runner_output(s, so)
    out.sampled_token_ids[0] = [11, 12, 99]  # two drafts accepted, the third rejected
    out.spec_token_ids = {"a": [5]}
    outputs = s.update_from_output(so, out)
    assert outputs.outputs[0].new_token_ids == [11, 12, 99]
    # 7 + 3 tokens known, the last (99) not computed yet: the rejected draft's slot is given back.
    assert a.num_tokens == 10 and a.num_computed_tokens == 9 and a.spec_token_ids == [5]
    stats = outputs.scheduler_stats
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 3, 2)
    assert stats.spec_accepted_per_pos == [1, 1, 0, 0]
    check_block_invariants(s)


def test_drafts_never_pass_max_tokens_or_the_budget():
    s = make_scheduler(num_speculative_tokens=4, max_num_batched_tokens=64)
    s.add_request(make_request("a", 6, max_tokens=3))
    _spec_step(s, {"a": [11, 12, 13, 14]})
    # 1 output so far, max_tokens 3: the decode token's sample and 1 accepted draft are the most.
    assert s.requests["a"].spec_token_ids == [11]
    s2 = make_scheduler(num_speculative_tokens=4, max_num_batched_tokens=8)
    s2.add_request(make_request("a", 6, max_tokens=50))
    s2.add_request(make_request("b", 6, max_tokens=50))
    _spec_step(s2, {})  # a's prefill (6 of the 8 tokens)
    _spec_step(s2, {"a": [11, 12, 13, 14]})  # b's prefill (a's decode: 1 + the first 6 of b)
    _spec_step(s2, {"a": [11, 12, 13, 14], "b": [21, 22, 23, 24]})
    so = s2.schedule()
    # 8 tokens of budget: a takes its decode and 4 drafts, b its decode and what is left (2).
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12, 13, 14], "b": [21, 22]}


def test_drafts_cut_by_the_budget_without_chunked_prefill():
    """With chunked prefill off a prefill runs whole or waits; a decode's drafts are cut to the
    budget instead (the decode itself never waits for its drafts)."""
    s = make_scheduler(num_speculative_tokens=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    s.add_request(make_request("a", 6, max_tokens=50))
    _spec_step(s, {"a": [11, 12, 13, 14]})
    s.add_request(make_request("b", 5, max_tokens=50))
    so = s.schedule()
    # b's whole prompt (5) fits beside a's decode only with 2 of a's drafts; b is admitted after
    # the running requests took their share, so a takes 1 + 4 and b waits for budget.
    assert so.num_scheduled_tokens == {"a": 5} and so.wait_reasons == {"b": WaitReason.TOKEN_BUDGET}
    s2 = make_scheduler(num_speculative_tokens=4, max_num_batched_tokens=8, enable_chunked_prefill=False)
    s2.add_request(make_request("a", 3, max_tokens=50))
    s2.add_request(make_request("b", 3, max_tokens=50))
    _spec_step(s2, {"a": [11, 12, 13, 14], "b": [21, 22, 23, 24]})  # both prefilled in one step
    so = s2.schedule()
    assert so.num_scheduled_tokens == {"a": 5, "b": 3}
    assert so.scheduled_spec_decode_tokens == {"a": [11, 12, 13, 14], "b": [21, 22]}


def test_drafts_never_preempt_anyone():
    """No free block for a request's drafts: it decodes without them this step, and nobody is
    preempted for a bet."""
    s = make_scheduler(num_speculative_tokens=2, num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(make_request("a", 7, max_tokens=50))
    s.add_request(make_request("b", 7, max_tokens=50))
    _spec_step(s, {"a": [1, 2], "b": [3, 4]})  # both prefilled: 8 tokens each, all 4 blocks held
    so = s.schedule()
    assert so.num_scheduled_tokens == {"a": 1, "b": 1} and so.scheduled_spec_decode_tokens == {}
    assert s.num_preemptions == 0 and not so.wait_reasons
    check_block_invariants(s)


def test_a_preempted_request_drops_its_drafts():
    s = make_scheduler(num_speculative_tokens=2, num_blocks=4, block_size=4, max_num_batched_tokens=64)
    s.add_request(make_request("a", 8, max_tokens=50))
    s.add_request(make_request("b", 8, max_tokens=50))
    _spec_step(s, {"a": [1, 2], "b": [3, 4]})
    assert s.requests["b"].spec_token_ids == [3, 4]
    so = s.schedule()  # a's decode token needs a fifth block: b, the last admitted, is preempted
    assert so.wait_reasons == {"b": WaitReason.PREEMPTED} and so.num_scheduled_tokens == {"a": 1}
    assert s.requests["b"].status == RequestStatus.PREEMPTED and s.requests["b"].spec_token_ids == []
    check_block_invariants(s)


def test_disable_by_batch_size_schedules_no_drafts_for_a_large_batch():
    """vLLM's speculative_config.disable_by_batch_size: from that many running requests on, a
    step has no draft tokens (they come back when the batch shrinks)."""
    from tokenloom.config import SpeculativeConfig

    s = make_scheduler(num_speculative_tokens=2, disable_by_batch_size=2)
    s.add_request(make_request("a", 6, max_tokens=50))
    _spec_step(s, {"a": [1, 2]})
    assert s.schedule().scheduled_spec_decode_tokens == {"a": [1, 2]}  # one running: drafts
    s2 = make_scheduler(num_speculative_tokens=2, disable_by_batch_size=2)
    s2.add_request(make_request("a", 6, max_tokens=50))
    s2.add_request(make_request("b", 6, max_tokens=50))
    _spec_step(s2, {"a": [1, 2], "b": [3, 4]})
    so = s2.schedule()
    assert so.scheduled_spec_decode_tokens == {} and so.num_scheduled_tokens == {"a": 1, "b": 1}
    with pytest.raises(ValueError, match="disable_by_batch_size must be a positive integer"):
        SpeculativeConfig.from_any({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0})
