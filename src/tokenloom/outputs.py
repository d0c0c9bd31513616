"""What a caller gets back: vLLM's `RequestOutput` and `CompletionOutput`, field for field.

These are built by the output processor in the caller process and never cross the IPC boundary,
so they are plain dataclasses, not msgspec Structs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from tokenloom.messages import PooledData, RequestTiming


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

    The caller's stamps: arrival, tokenized, each message of tokens received (first/last token,
    inter-token latencies), final output received (`finished_time`), detokenized, returned.
    With the ledger on, the engine core's account of the request (`core`: received, queued,
    scheduled, seconds per step bucket) arrives with its final output, and `parts` decomposes
    the end-to-end latency into named parts that add up to it (tokenloom.metrics.timeline).
    """

    arrival_time: float
    num_prompt_tokens: int = 0
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0
    tokenized_time: float | None = None
    detokenized_time: float | None = None  # its final output was built (text and all)
    returned_time: float | None = None  # handed to the caller (LLMEngine.step, AsyncLLM stream)
    core: RequestTiming | None = None
    # One per generated token after the first (0.0 for tokens that arrived in the same message).
    inter_token_latencies: list[float] = field(default_factory=list)
    output_sent_time: float | None = None  # the core's output thread sent its final output
    # Set when the request finishes, and again when it is returned (metrics.timeline.settle):
    # the end-to-end latency in named parts that add up to it, the seconds it waited in the core
    # by root cause (head-of-line waits go to what blocked the head: token_budget, max_num_seqs,
    # no_kv_blocks, preempted), and the cause it waited longest for (None: it never waited).
    parts: dict[str, float] = field(default_factory=dict)
    wait_by_cause: dict[str, float] = field(default_factory=dict)
    dominant_wait: str | None = None
    # Its n and max_tokens, and the tokens each finished completion generated, in the order
    # they finished: vLLM's request-size metrics (metrics/prometheus.py).
    n: int = 1
    max_tokens: int | None = None
    completion_tokens: list[int] = field(default_factory=list)
    # Its sampling temperature and top_p, and the W3C trace-context headers it came with
    # (traceparent, tracestate): the OpenTelemetry span's (metrics/otel.py).
    temperature: float | None = None
    top_p: float | None = None
    trace_headers: dict[str, str] | None = None

    def record_tokens(self, num_new_tokens: int, now: float) -> None:
        if num_new_tokens <= 0:
            return
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_latencies.append(now - self.last_token_time)  # type: ignore[operator]
        if num_new_tokens > 1:
            self.inter_token_latencies.extend([0.0] * (num_new_tokens - 1))
        self.last_token_time = now
        self.num_generation_tokens += num_new_tokens

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def time_per_output_token(self) -> float | None:
        """Mean time between output tokens after the first (TPOT)."""
        n = self.num_generation_tokens
        if n < 2 or self.first_token_time is None or self.last_token_time is None:
            return None
        return (self.last_token_time - self.first_token_time) / (n - 1)

    @property
    def e2e_latency(self) -> float | None:
        """Returned minus arrival (final output received minus arrival until it is returned, and
        when the ledger is off)."""
        end = self.returned_time if self.returned_time is not None else self.finished_time
        return None if end is None else end - self.arrival_time


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

    def append_delta(self, later: "CompletionOutput") -> None:
        """Folds a later DELTA completion of the same index into this one: nothing is lost."""
        self.text += later.text
        self.token_ids = self.token_ids + later.token_ids
        if self.logprobs is not None and later.logprobs is not None:
            self.logprobs = self.logprobs + later.logprobs
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason


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
    # A pooling request's result (runner="pooling"), on its final output; see PoolingRequestOutput.
    pooling_output: "PooledData | None" = None

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
        if next_output.pooling_output is not None:
            self.pooling_output = next_output.pooling_output
        by_index = {c.index: i for i, c in enumerate(self.outputs)}
        for new in next_output.outputs:
            i = by_index.get(new.index)
            if i is None:
                by_index[new.index] = len(self.outputs)
                self.outputs.append(new)
            elif not aggregate:
                self.outputs[i] = new
            else:
                self.outputs[i].append_delta(new)
        self.outputs.sort(key=lambda c: c.index)


def pooled_array(pooled: "PooledData") -> np.ndarray:
    """A pooling result as a float32 numpy array (a read-only view of the received bytes)."""
    return np.frombuffer(pooled.data, dtype="<f4").reshape(pooled.shape)


@dataclass(slots=True)
class PoolingOutput:
    """vLLM's: `data` is the pooled tensor (torch, float32): [hidden] for embed, [tokens, hidden]
    for token_embed."""

    data: Any


@dataclass(slots=True)
class PoolingRequestOutput:
    """vLLM's output of a pooling request (`LLM.encode`, `AsyncLLM.encode`)."""

    request_id: str
    outputs: Any  # PoolingOutput; EmbeddingOutput in an EmbeddingRequestOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> "PoolingRequestOutput":
        """From the engine's own output of a finished pooling request. A request that failed (the
        engine died, it was aborted) has no pooled result: a RuntimeError naming why."""
        if out.pooling_output is None:
            reason = out.error or (out.outputs[0].finish_reason if out.outputs else None) or "no result"
            raise RuntimeError(f"pooling request {out.request_id} produced no result: {reason}")
        import torch  # here, not at module level: the server's front end never imports torch

        data = torch.from_numpy(pooled_array(out.pooling_output).copy())
        return cls(out.request_id, PoolingOutput(data), out.prompt_token_ids or [], out.finished,
                   out.num_cached_tokens, out.metrics)


@dataclass(slots=True)
class EmbeddingOutput:
    """vLLM's: one embedding as a list of floats."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass(slots=True)
class EmbeddingRequestOutput(PoolingRequestOutput):
    """vLLM's output of `LLM.embed`: `outputs.embedding` is the vector."""

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> "EmbeddingRequestOutput":
        base = PoolingRequestOutput.from_request_output(out)
        return cls(base.request_id, EmbeddingOutput(base.outputs.data.tolist()), base.prompt_token_ids,
                   base.finished, base.num_cached_tokens, base.metrics)


@dataclass(slots=True)
class ClassificationOutput:
    """vLLM's: a classifier's probability per label (softmax; a one-label model's sigmoid), or
    its logits when the request turned the activation off."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass(slots=True)
class ClassificationRequestOutput(PoolingRequestOutput):
    """vLLM's output of `LLM.classify`: `outputs.probs`."""

    @classmethod
    def from_request_output(cls, out: RequestOutput) -> "ClassificationRequestOutput":
        base = PoolingRequestOutput.from_request_output(out)
        return cls(base.request_id, ClassificationOutput(base.outputs.data.tolist()), base.prompt_token_ids,
                   base.finished, base.num_cached_tokens, base.metrics)


@dataclass(slots=True)
class ScoringOutput:
    """vLLM's: the similarity of a pair: the cosine of the two embeddings (an embedding model), or
    a cross-encoder's probability that the second text answers the first (a one-label classifier)."""

    score: float


@dataclass(slots=True)
class ScoringRequestOutput:
    """vLLM's output of `LLM.score`: one per pair, `outputs.score`; `prompt_token_ids` are the
    two inputs' tokens one after the other."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
