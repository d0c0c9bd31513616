"""Helpers for the scheduler tests: requests, a scheduler, a fake model runner, invariants."""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from tokenloom.config import EngineConfig
from tokenloom.core.request import Request
from tokenloom.sched_output import SchedulerOutput
from tokenloom.core.scheduler import Scheduler
from tokenloom.messages import EngineCoreOutputs
from tokenloom.sampling_params import SamplingParams
from tokenloom.runner_output import ModelRunnerOutput

EOS = 2
_fresh_prompts = itertools.count(1)


def make_request(
    req_id: str,
    prompt: int | list[int],
    *,
    max_tokens: int | None = 16,
    arrival_time: float | None = None,
    priority: int = 0,
    eos_token_id: int | None = EOS,
    **params,
) -> Request:
    """`prompt` as a length gives fresh token ids (>= 10000: no accidental EOS, and no prefix
    shared with any other request); pass a list to share prefixes on purpose."""
    if isinstance(prompt, int):
        base = next(_fresh_prompts) * 10_000
        tokens = list(range(base, base + prompt))
    else:
        tokens = list(prompt)
    return Request(
        request_id=req_id,
        prompt_token_ids=tokens,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_id=eos_token_id,
        arrival_time=float(len(req_id)) if arrival_time is None else arrival_time,
        priority=priority,
    )


def make_scheduler(
    *,
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 16,
    max_model_len: int = 1024,
    enable_chunked_prefill: bool = True,
    enable_prefix_caching: bool = True,
    scheduling_policy: str = "fcfs",
) -> Scheduler:
    config = EngineConfig(
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
    )
    return Scheduler(config, num_kv_blocks=num_blocks, max_model_len=max_model_len)


def fake_runner_output(
    scheduler: Scheduler, so: SchedulerOutput, next_token: Callable[[str], int] | int = 7
) -> ModelRunnerOutput:
    """What a runner would return: one sampled token for every request whose scheduled tokens
    reach the end of its known tokens, [] for a prefill chunk that stops short of it. Call it
    after schedule() (which has already advanced num_computed_tokens)."""
    req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    sampled = []
    for req_id in req_ids:
        request = scheduler.requests[req_id]
        done = request.num_computed_tokens >= request.num_tokens
        token = next_token(req_id) if callable(next_token) else next_token
        sampled.append([token] if done else [])
    return ModelRunnerOutput(
        req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled
    )


def run_step(
    scheduler: Scheduler, next_token: Callable[[str], int] | int = 7
) -> tuple[SchedulerOutput, EngineCoreOutputs]:
    so = scheduler.schedule()
    return so, scheduler.update_from_output(so, fake_runner_output(scheduler, so, next_token))


def check_block_invariants(scheduler: Scheduler) -> None:
    """free + used == total; ref_cnt == number of owning live requests; a block owned by more
    than one request is a cached (read-only) prefix block; finished requests own nothing."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.num_free_blocks
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
    assert all(b.ref_cnt == 0 for b in free)
    assert pool.num_cached_free_blocks == sum(b.block_hash is not None for b in free)
    owners: Counter[int] = Counter()
    for req_id, blocks in kv.req_to_blocks.items():
        assert req_id in scheduler.requests, f"{req_id} is not live but holds blocks"
        assert len({b.block_id for b in blocks}) == len(blocks)
        owners.update(b.block_id for b in blocks)
    for block in pool.blocks:
        assert block.ref_cnt == owners[block.block_id], block
        if block.ref_cnt > 1:
            assert block.block_hash is not None, f"{block} shared but not a cached prefix block"
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    for request in scheduler.running:
        assert len(kv.get_blocks(request.request_id)) * kv.block_size >= request.num_computed_tokens
    for request in scheduler.waiting:
        assert not kv.get_blocks(request.request_id)
