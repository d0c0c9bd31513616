"""The engine core's view of one request: its tokens, its progress and its status.

The model runner never sees this object; it receives `NewRequestData` once and diffs afterwards.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenloom.core.kv_cache_utils import BlockHash, hash_block_tokens, root_block_hash
from tokenloom.lora_request import LoRARequest
from tokenloom.messages import EngineCoreRequest, FinishReason
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output import StructuredOutputRequest


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2  # back in the waiting queue after losing its blocks; recomputed on resume
    # Every status from here on is final; `is_finished` relies on this order.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5
    FINISHED_ERROR = 6

    def __str__(self) -> str:
        return self.name.lower()

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def get_finish_reason(status: "RequestStatus") -> FinishReason | None:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH_CAPPED: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


@dataclass(slots=True, eq=False)  # eq=False: identity semantics, so list.remove() is cheap and exact
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # prompt + outputs, kept as one list because block hashing and recompute read it as one.
    all_token_ids: list[int] = field(init=False)
    # Tokens whose K/V are in the cache, or are being computed by the step in flight: the
    # scheduler advances this in schedule(), not when the step returns.
    num_computed_tokens: int = 0
    # Prompt tokens served by the prefix cache at first admission (reported to the caller).
    num_cached_tokens: int = 0
    # Hash chain of the full blocks of all_token_ids; maintained only while block_size > 0.
    block_hashes: list[BlockHash] = field(default_factory=list)
    block_size: int = 0
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    error: str | None = None  # set with FINISHED_ERROR
    # Its grammar and matcher, when it asked for structured outputs (set by the scheduler).
    structured_output: StructuredOutputRequest | None = None
    # Speculative decoding: the draft tokens the runner proposed to follow its tokens, to be
    # verified in its next step (never part of all_token_ids; cleared when it is preempted).
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with: its blocks hash from the adapter's own root, so the prefix
    # cache never hands one adapter's K/V to another (or to the base model).
    lora_request: LoRARequest | None = None
    # A pooling request (runner="pooling"): it finishes when its prompt has run, with the pooled
    # vector instead of a sampled token.
    pooling_params: PoolingParams | None = None
    # Computes its whole prompt even where the prefix cache holds it (the blocks it fills are
    # still published for others): prompt logprobs and pooling need every position's output.
    skip_reading_prefix_cache: bool = False

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.skip_reading_prefix_cache = True
        self.all_token_ids.extend(self.output_token_ids)
        self._update_block_hashes()

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> "Request":
        return cls(
            request_id=request.request_id,
            prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            arrival_time=request.arrival_time,
            priority=request.priority,
            lora_request=request.lora_request,
            pooling_params=request.pooling_params,
        )

    # ---- tokens ---------------------------------------------------------------------------

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_output_token_ids(self, token_ids: int | list[int]) -> None:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        self.output_token_ids.extend(token_ids)
        self.all_token_ids.extend(token_ids)
        self._update_block_hashes()

    # ---- prefix-cache hash chain -----------------------------------------------------------

    def enable_block_hashing(self, block_size: int) -> None:
        """Start (idempotently) keeping `block_hashes` up to date for blocks of `block_size`."""
        if self.block_size not in (0, block_size):
            raise ValueError(f"request {self.request_id} already hashes blocks of {self.block_size}")
        self.block_size = block_size
        self._update_block_hashes()

    def _update_block_hashes(self) -> None:
        # Incremental: a block is hashed once, when its last token is appended.
        size = self.block_size
        if size == 0:
            return
        hashes, tokens = self.block_hashes, self.all_token_ids
        for i in range(len(hashes), len(tokens) // size):
            parent = hashes[-1] if hashes else root_block_hash(self.lora_request)
            hashes.append(hash_block_tokens(parent, tokens[i * size : (i + 1) * size]))

    # ---- status ----------------------------------------------------------------------------

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def get_finish_reason(self) -> FinishReason | None:
        return RequestStatus.get_finish_reason(self.status)
