"""Helpers for the scheduler tests: requests, a scheduler, a fake model runner, invariants."""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable

from tokenloom.config import EngineConfig, SpeculativeConfig
from tokenloom.core.request import Request
from tokenloom.sched_output import SchedulerOutput
from tokenloom.core.scheduler import Scheduler
from tokenloom.kv_cache_spec import KVCacheGroupSpec
from tokenloom.messages import EngineCoreOutputs
from tokenloom.pooling_params import PoolerConfig
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
    kv_cache_groups: list[KVCacheGroupSpec] | None = None,
    num_speculative_tokens: int = 0,
    disable_by_batch_size: int | None = None,
    pooling_type: str | None = None,
) -> Scheduler:
    """`pooling_type`: a pooling engine's scheduler (runner="pooling") with that pooler."""
    config = EngineConfig(
        runner="pooling" if pooling_type else "auto",
        pooler_config=PoolerConfig(pooling_type=pooling_type) if pooling_type else None,
        speculative_config=SpeculativeConfig.from_any(
            {"method": "ngram", "num_speculative_tokens": num_speculative_tokens,
             "disable_by_batch_size": disable_by_batch_size} if num_speculative_tokens else None),
        block_size=block_size,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs,
        enable_chunked_prefill=enable_chunked_prefill,
        enable_prefix_caching=enable_prefix_caching,
        scheduling_policy=scheduling_policy,  # type: ignore[arg-type]
    )
    return Scheduler(config, num_kv_blocks=num_blocks, max_model_len=max_model_len,
                     kv_cache_groups=kv_cache_groups)


def hybrid_groups(window: int, num_sliding_groups: int = 2) -> list[KVCacheGroupSpec]:
    """A Gemma-3-like grouping without a model: one full-attention group and sliding groups of
    the same size (layer ids only name the groups here)."""
    return [KVCacheGroupSpec((0,))] + [KVCacheGroupSpec((g + 1,), window) for g in range(num_sliding_groups)]


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
    """free + used == usable; ref_cnt == number of owning live requests; a block id belongs to one
    KV cache group at a time; a block owned by more than one request is a cached (read-only)
    prefix block; the null block is never handed out; finished requests own nothing."""
    kv = scheduler.kv_cache_manager
    pool = kv.block_pool
    null = pool.null_block
    free = pool.free_block_queue.get_all_free_blocks()
    assert len(free) == pool.num_free_blocks
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_usable_blocks
    assert all(b.ref_cnt == 0 for b in free) and null not in free
    assert pool.num_cached_free_blocks == sum(b.block_hash is not None for b in free)
    owners: Counter[int] = Counter()
    group_of: dict[int, int] = {}
    for g, manager in enumerate(kv.managers):
        for req_id, blocks in manager.req_to_blocks.items():
            assert req_id in scheduler.requests, f"{req_id} is not live but holds blocks"
            real = [b for b in blocks if b is not null]
            assert len({b.block_id for b in real}) == len(real)
            # Null entries (blocks out of a sliding window) are a prefix of the list.
            assert all(b is null for b in blocks[: len(blocks) - len(real)])
            owners.update(b.block_id for b in real)
            for b in real:
                assert group_of.setdefault(b.block_id, g) == g, f"{b} in groups {group_of[b.block_id]} and {g}"
                assert b.group_id == g
    for block in pool.blocks:
        if block is null:
            assert block.ref_cnt == 0 and block.block_hash is None
            continue
        assert block.ref_cnt == owners[block.block_id], block
        if block.ref_cnt > 1:
            assert block.block_hash is not None, f"{block} shared but not a cached prefix block"
    if kv.num_groups > 1:
        per_group = Counter(b.group_id for b in pool.blocks if b.ref_cnt > 0)
        assert kv.num_used_blocks_per_group == [per_group[g] for g in range(kv.num_groups)]
    for block_hash, block in pool.cached_block_hash_to_block.items():
        assert block.block_hash == block_hash
    for request in scheduler.running:
        for blocks in kv.get_blocks(request.request_id):
            assert len(blocks) * kv.block_size >= request.num_computed_tokens
    for request in scheduler.waiting:
        assert not any(kv.get_blocks(request.request_id))
