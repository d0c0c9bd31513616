"""Random workloads against the scheduler's invariants (hypothesis, a fake model, no torch).

The fake model's next token is a function of the request's whole token sequence, like a greedy
model: so besides the block and budget invariants, the outputs must not depend on how requests
were batched, chunked, cached or preempted.
"""
from __future__ import annotations

import zlib
from array import array
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_helpers import EOS, check_block_invariants, hybrid_groups, make_scheduler

from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import Scheduler
from tokenloom.messages import FinishReason
from tokenloom.sampling_params import SamplingParams
from tokenloom.runner_output import ModelRunnerOutput

STOP_TOKEN = 42
VOCAB = [3, 4, 5, 6] * 5 + [EOS, STOP_TOKEN]
MAX_STEPS = 3000


def greedy_token(tokens: list[int]) -> int:
    return VOCAB[zlib.crc32(array("q", tokens).tobytes()) % len(VOCAB)]


@dataclass
class Spec:
    arrival_step: int
    prompt: list[int]
    max_tokens: int | None
    min_tokens: int
    priority: int
    stop: bool


specs_strategy = st.lists(
    st.builds(
        Spec,
        arrival_step=st.integers(0, 12),
        # A two-letter alphabet: prompts share prefixes (and whole blocks) often.
        prompt=st.lists(st.sampled_from([3, 4]), min_size=1, max_size=24),
        max_tokens=st.one_of(st.none(), st.integers(1, 20)),
        min_tokens=st.integers(0, 3),
        priority=st.integers(0, 2),
        stop=st.booleans(),
    ),
    min_size=1,
    max_size=10,
)

config_strategy = st.fixed_dictionaries(
    {
        "num_blocks": st.integers(2, 24),
        "block_size": st.sampled_from([1, 2, 4, 8]),
        "max_num_batched_tokens": st.integers(1, 48),
        "max_num_seqs": st.integers(1, 6),
        "enable_chunked_prefill": st.booleans(),
        "enable_prefix_caching": st.booleans(),
        "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
    }
)


def to_request(i: int, spec: Spec) -> Request:
    params = SamplingParams(
        max_tokens=spec.max_tokens,
        min_tokens=min(spec.min_tokens, spec.max_tokens or 99),
        stop_token_ids=[STOP_TOKEN] if spec.stop else None,
    )
    return Request(f"r{i}", list(spec.prompt), params, EOS, arrival_time=float(i), priority=spec.priority)


def check_schedule(s: Scheduler, so) -> None:
    kv = s.kv_cache_manager
    assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values())
    assert so.total_num_scheduled_tokens <= s.max_num_batched_tokens
    assert so.num_prefill_tokens + so.num_decode_tokens == so.total_num_scheduled_tokens
    assert len(s.running) <= s.max_num_seqs
    running_ids = {r.request_id for r in s.running}
    assert set(so.num_scheduled_tokens) <= running_ids
    assert all(n > 0 for n in so.num_scheduled_tokens.values())
    # Every live request that did not run has a reason, and only those.
    assert set(so.wait_reasons) == set(s.requests) - set(so.num_scheduled_tokens)
    for new in so.scheduled_new_reqs:
        assert new.block_ids == kv.get_block_ids(new.req_id)
    # Every block written this step has exactly one writer. It may already be shared read-only
    # (a request admitted behind its writer in the same step hit it in the prefix cache), but
    # then it is full and cached, and the sharer does not write it. In a sliding-window group,
    # every block the step's queries read (the window before its first query on) is real.
    writers: dict[int, str] = {}
    null = kv.block_pool.null_block
    for req_id, n in so.num_scheduled_tokens.items():
        request = s.requests[req_id]
        start = request.num_computed_tokens - n  # already advanced by schedule()
        assert request.num_computed_tokens <= request.num_tokens + len(so.scheduled_spec_decode_tokens.get(req_id, ()))
        for spec, blocks in zip(kv.kv_cache_groups, kv.get_blocks(req_id)):
            assert len(blocks) * kv.block_size >= request.num_computed_tokens
            first_read = 0 if spec.sliding_window is None else max(0, start - spec.sliding_window + 1)
            assert all(b is not null for b in blocks[first_read // kv.block_size:]), (req_id, spec)
            for i in range(start // kv.block_size, (request.num_computed_tokens - 1) // kv.block_size + 1):
                block = blocks[i]
                assert writers.setdefault(block.block_id, req_id) == req_id, (req_id, writers[block.block_id], block)
                if block.ref_cnt > 1:
                    assert block.block_hash is not None and (i + 1) * kv.block_size <= request.num_computed_tokens, (req_id, block)
    check_block_invariants(s)


def verify_drafts(tokens: list[int], drafts: list[int]) -> list[int]:
    """What a greedy runner returns for a request with draft tokens: its tokens for each
    position up to the first that differs from the draft, that one included."""
    seq, out = list(tokens), []
    for draft in [*drafts, None]:
        token = greedy_token(seq)
        out.append(token)
        if token != draft:
            break
        seq.append(token)
    return out


def propose_drafts(tokens: list[int], k: int) -> list[int]:
    """Drafts of 0 to k tokens: the greedy continuation, wrong from a position that depends on
    the tokens (often right, often wrong, sometimes none at all)."""
    h = zlib.crc32(array("q", tokens).tobytes())
    seq, drafts = list(tokens), []
    for i in range(h % (k + 1)):
        token = greedy_token(seq) if i < (h >> 8) % (k + 2) else 5 + (h >> 16) % 3
        drafts.append(token)
        seq.append(token)
    return drafts


def run_workload(s: Scheduler, specs: list[Spec], aborts: list[tuple[int, int]]) -> dict[str, tuple]:
    """Returns {req_id: (tokens, finish_reason)} for every request, aborted ones included. With
    speculative decoding on, the fake runner verifies the drafts and proposes new ones."""
    requests = [to_request(i, spec) for i, spec in enumerate(specs)]
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    final: dict[str, FinishReason] = {}
    pending = sorted(range(len(requests)), key=lambda i: specs[i].arrival_step)
    abort_at = {}
    for step, idx in aborts:
        abort_at.setdefault(step, []).append(f"r{idx % len(requests)}")
    step = 0
    while pending or s.has_unfinished_requests():
        assert step < MAX_STEPS, "no progress"
        while pending and specs[pending[0]].arrival_step <= step:
            s.add_request(requests[pending.pop(0)])
        for req_id in abort_at.get(step, []):
            if req_id in s.requests:
                final[req_id] = FinishReason.ABORT
            s.finish_requests([req_id], RequestStatus.FINISHED_ABORTED)
            check_block_invariants(s)

        so = s.schedule()
        check_schedule(s, so)
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        drafts: dict[str, list[int]] = {}
        for req_id in req_ids:
            r = s.requests[req_id]
            scheduled_drafts = so.scheduled_spec_decode_tokens.get(req_id, [])
            if r.num_computed_tokens == r.num_tokens + len(scheduled_drafts):
                sampled.append(verify_drafts(r.all_token_ids, scheduled_drafts))
                if s.num_spec_tokens:
                    drafts[req_id] = propose_drafts(r.all_token_ids + sampled[-1], s.num_spec_tokens)
            else:
                sampled.append([])
        out = s.update_from_output(
            so, ModelRunnerOutput(req_ids, {r: i for i, r in enumerate(req_ids)}, sampled, spec_token_ids=drafts)
        )
        for o in out.outputs:
            assert o.request_id not in final, f"{o.request_id} got an output after finishing"
            tokens[o.request_id].extend(o.new_token_ids)
            if o.finished:
                assert o.finish_reason != FinishReason.ABORT
                final[o.request_id] = o.finish_reason
                assert o.request_id not in s.requests
                assert not any(s.kv_cache_manager.get_blocks(o.request_id))
        check_block_invariants(s)
        stats = out.scheduler_stats
        assert stats.num_free_blocks + stats.num_used_blocks == stats.num_total_blocks
        step += 1

    # Everyone finished exactly once, and every block is back.
    assert set(final) == set(tokens)
    pool = s.kv_cache_manager.block_pool
    assert pool.num_free_blocks == pool.num_usable_blocks and all(b.ref_cnt == 0 for b in pool.blocks)
    assert not s.running and not s.waiting and not s.requests
    return {req_id: (tokens[req_id], final[req_id]) for req_id in tokens}


def assert_same_tokens(outputs: dict[str, tuple], reference: dict[str, tuple]) -> None:
    """The greedy tokens of a run are the reference run's: all of them with the same finish
    reason, or a prefix when the run's smaller cache capped the request (LENGTH). Requests the
    run's configuration rejected (a prompt larger than its cache or budget) are skipped."""
    for req_id, (toks, reason) in outputs.items():
        ref_toks, ref_reason = reference[req_id]
        if reason == FinishReason.ERROR:
            continue
        assert toks == ref_toks[: len(toks)]
        if len(toks) == len(ref_toks):
            assert reason == ref_reason
        else:
            assert reason == FinishReason.LENGTH


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=config_strategy,
    specs=specs_strategy,
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=4),
)
def test_random_workloads_keep_invariants(config, specs, aborts):
    run_workload(make_scheduler(**config), specs, aborts)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=config_strategy, specs=specs_strategy)
def test_outputs_do_not_depend_on_scheduling(config, specs):
    """Same greedy tokens with a roomy reference scheduler and with a cramped random one
    (chunking, preemption, prefix hits, budgets). A request capped by the small cache's
    capacity stops early: its tokens are then a prefix of the reference's."""
    reference = run_workload(
        make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=512, enable_prefix_caching=False),
        specs,
        [],
    )
    cramped = run_workload(make_scheduler(**config), specs, [])
    assert_same_tokens(cramped, reference)


hybrid_config_strategy = config_strategy.map(dict).flatmap(
    lambda c: st.builds(lambda w, n: {**c, "num_blocks": c["num_blocks"] + 8,
                                      "kv_cache_groups": hybrid_groups(w, n)},
                        st.integers(1, 12), st.integers(1, 3)))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=hybrid_config_strategy,
    specs=specs_strategy,
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=4),
)
def test_hybrid_random_workloads_keep_invariants(config, specs, aborts):
    """The same invariants with a full-attention group and sliding-window groups sharing the
    pool: per step, every block a query reads is real (not the null block), each block id in one
    group; at the end every block is back."""
    run_workload(make_scheduler(**config), specs, aborts)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=hybrid_config_strategy, specs=specs_strategy)
def test_hybrid_outputs_do_not_depend_on_scheduling(config, specs):
    reference = run_workload(
        make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=512, enable_prefix_caching=False),
        specs,
        [],
    )
    cramped = run_workload(make_scheduler(**config), specs, [])
    assert_same_tokens(cramped, reference)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    config=config_strategy,
    specs=specs_strategy,
    aborts=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 9)), max_size=4),
    k=st.integers(1, 4),
)
def test_speculative_decoding_keeps_invariants_and_outputs(config, specs, aborts, k):
    """Draft tokens (right, wrong or cut by the budget) change neither the invariants (block
    accounting, one writer per block, budgets) nor a request's greedy tokens, also with stop
    tokens, max_tokens, preemption and prefix hits; rejected positions are taken back."""
    run_workload(make_scheduler(**config, num_speculative_tokens=k), specs, aborts)
    reference = run_workload(
        make_scheduler(num_blocks=256, block_size=4, max_num_batched_tokens=512, enable_prefix_caching=False),
        specs, [])
    s = make_scheduler(**config, num_speculative_tokens=k)
    speculated = run_workload(s, specs, [])
    assert_same_tokens(speculated, reference)
    assert s.spec_num_accepted_tokens <= s.spec_num_draft_tokens
    assert sum(s.spec_accepted_per_pos) == s.spec_num_accepted_tokens
