"""What a caller gets back: vLLM's `RequestOutput` and `CompletionOutput`, field for field.

These are built by the output processor in the caller process and never cross the IPC boundary,
so they are plain dataclasses, not msgspec Structs.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Logprob:
    """The log probability of one token at one position, as vLLM reports it.

    `rank` is the token's rank in the full distribution (1 = most likely); `decoded_token` is the
    token's own text (None when the request asked for `detokenize=False`).
    """

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: the sampled token first, then the top-k (a token in both appears once).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing precedes it to condition on).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass(slots=True)
class RequestMetrics:
    """A request's timeline as the caller sees it, on the ledger's clock (`messages.now()`).

    Only what the caller can observe is here: when the request arrived and when its tokens came
    back. The core-side stamps (queued, scheduled, preempted) join later, from the ledger.
    """

    arrival_time: float
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0

    def record_tokens(self, num_new_tokens: int, now: float) -> None:
        if num_new_tokens <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.num_generation_tokens += num_new_tokens

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time


@dataclass(slots=True)
class CompletionOutput:
    """One of a request's n completions. With `RequestOutputKind.DELTA`, `text`, `token_ids` and
    `logprobs` hold only what is new since the previous output of the same request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int] | None
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # Why the request failed, when a completion finished with finish_reason "error".
    error: str | None = None

    def add(self, next_output: "RequestOutput", aggregate: bool) -> None:
        """Folds a later output of the same request into this one (a consumer that fell behind).

        aggregate=True (DELTA outputs): texts, token ids and logprobs are concatenated per
        completion index, so nothing is lost. aggregate=False: a completion is replaced by its
        newer, cumulative self.
        """
        self.finished = self.finished or next_output.finished
        self.metrics = next_output.metrics
        self.num_cached_tokens = next_output.num_cached_tokens
        if next_output.error is not None:
            self.error = next_output.error
        if self.prompt_logprobs is None:
            self.prompt_logprobs = next_output.prompt_logprobs
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = by_index.get(new.index)
            if i is None:
                by_index[new.index] = len(self.outputs)
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[i] = new
            else:
                old = self.outputs[i]
                old.text += new.text
                old.token_ids = old.token_ids + new.token_ids
                if old.logprobs is not None and new.logprobs is not None:
                    old.logprobs = old.logprobs + new.logprobs
                old.cumulative_logprob = new.cumulative_logprob
                old.finish_reason = new.finish_reason
                old.stop_reason = new.stop_reason
        self.outputs.sort(key=lambda c: c.index)
