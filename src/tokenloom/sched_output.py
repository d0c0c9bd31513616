"""What `Scheduler.schedule()` hands to the model runner for one step.

New requests (and requests resumed after preemption) are sent in full once; requests that were
already running are sent as diffs (new blocks, new num_computed_tokens). The runner keeps its own
persistent copy of each request's tokens and appends sampled tokens itself, so decode steps carry
no token ids at all.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from tokenloom.lora_request import LoRARequest
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


class WaitReason(enum.IntEnum):
    """Why a request that wanted to run in a step did not (or was preempted)."""

    TOKEN_BUDGET = 0  # max_num_batched_tokens already spent this step
    MAX_NUM_SEQS = 1  # max_num_seqs requests already running
    NO_KV_BLOCKS = 2  # the KV cache manager could not allocate its blocks
    HEAD_OF_LINE = 3  # queued behind a waiting request that itself could not be admitted
    PREEMPTED = 4  # was running, lost its blocks to make room for another request
    GRAMMAR_COMPILE = 5  # its structured-output grammar is still compiling

    def __str__(self) -> str:
        return self.name.lower()


@dataclass(slots=True)
class NewRequestData:
    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # One list per KV cache group (kv_cache_spec.py), in token order; a sliding-window group's
    # blocks the request's first query does not read are the null block (id 0).
    block_ids: tuple[list[int], ...]
    num_computed_tokens: int  # > 0 on a prefix-cache hit
    # Non-empty when the request resumes after preemption: its tokens so far are recomputed.
    output_token_ids: list[int] = field(default_factory=list)
    lora_request: LoRARequest | None = None  # the adapter it runs with
    pooling_params: PoolingParams | None = None  # a pooling request: pooled, never sampled


@dataclass(slots=True)
class CachedRequestData:
    """Requests the runner already holds, in the order they were scheduled."""

    req_ids: list[str] = field(default_factory=list)
    # Per request, per KV cache group: the blocks appended this step. Blocks a sliding window
    # gave back are not announced: the runner's table keeps their stale ids, which no query
    # reads (they are wholly outside every window).
    new_block_ids: list[tuple[list[int], ...]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    # req_id -> tokens to compute this step (a prefill chunk, or 1 for a decode, plus its draft
    # tokens when it speculates)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must drop before this step: finished, aborted or preempted since the
    # previous step. A preempted request comes back later as a NewRequestData.
    finished_req_ids: set[str]
    # The ledger: requests that wanted to run this step and did not, with the reason.
    wait_reasons: dict[str, WaitReason] = field(default_factory=dict)
    # The requests whose first scheduled token is a decode (the latest sampled token; any draft
    # tokens after it are decode tokens too); every other scheduled token is prefill, including
    # a preempted request's recompute.
    decode_req_ids: set[str] = field(default_factory=set)
    # Speculative decoding: req_id -> the draft tokens scheduled after its decode token (vLLM's
    # scheduled_spec_decode_tokens). The runner verifies them: it samples every position and
    # keeps the drafts up to the first its sampler disagrees with, plus its own token there.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    step: int = 0
    # Why the head of the waiting queue was not admitted (None: nobody was left waiting). The
    # requests behind it wait with HEAD_OF_LINE; this says what they are really waiting for.
    blocked_reason: WaitReason | None = None
    # Structured outputs: row i of `grammar_bitmask` (an int32 torch tensor [k, ceil(V/32)],
    # xgrammar's layout: bit t of a row allows token t) constrains the next token of
    # `structured_output_req_ids[i]`. Only for scheduled requests that sample in this step;
    # None (and []) in a step without any, which then costs the runner nothing.
    structured_output_req_ids: list[str] = field(default_factory=list)
    grammar_bitmask: Any = None

    @property
    def num_spec_tokens(self) -> int:
        return sum(map(len, self.scheduled_spec_decode_tokens.values()))

    @property
    def num_decode_tokens(self) -> int:
        return len(self.decode_req_ids) + self.num_spec_tokens

    @property
    def num_prefill_tokens(self) -> int:
        return self.total_num_scheduled_tokens - self.num_decode_tokens
