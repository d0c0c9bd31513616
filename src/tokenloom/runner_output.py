"""What the model runner returns to the scheduler for one step (no torch here: the scheduler's
tests build these by hand)."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenloom.messages import LogprobsLists, PooledData


@dataclass(slots=True)
class ModelRunnerOutput:
    # In the order the runner computed them; req_id_to_index maps into the lists below.
    req_ids: list[str]
    req_id_to_index: dict[str, int]
    # One list per request: [token] when a token was sampled, [] for a prefill chunk that did not
    # reach the end of the prompt (its logits are not sampled); with draft tokens, the drafts
    # the sampler agreed with and its own next token (1 to 1 + drafts tokens).
    sampled_token_ids: list[list[int]]
    # Per request that sampled: the logprobs of its new token(s), when it asked for them.
    logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    prompt_logprobs: dict[str, LogprobsLists] = field(default_factory=dict)
    # Seconds spent in each phase of execute_model, for the step profile.
    prepare_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    # Under tensor parallelism with the ledger on (executor/multiproc_executor.py): the ranks'
    # compute threads' CPU seconds over the step (summed) and the largest run_delay of any rank
    # (ops/schedstat.py). 0 where the runner runs in the engine core, whose own meter sees it.
    cpu_time: float = 0.0
    run_delay: float = 0.0
    # Requests this step failed on their own (admitting them to the sampler, or sampling them,
    # raised), with the reason; the scheduler finishes them with ERROR. Nothing else is affected.
    failed_req_ids: dict[str, str] = field(default_factory=dict)
    # Speculative decoding: the drafts proposed for each request's next step (absent: none).
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    # Pooling requests whose prompt ended in this step: their pooled result (they finish).
    pooler_output: dict[str, PooledData] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])
