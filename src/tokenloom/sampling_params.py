"""SamplingParams: vLLM's names and defaults.

A msgspec Struct so it crosses the process boundary inside `EngineCoreRequest` without pickle.
Validation runs at construction (`__post_init__`) so a bad value fails in the caller, naming the
field and the allowed range, before anything is queued.
"""
from __future__ import annotations

import enum
from typing import Any

import msgspec


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


_SAMPLING_EPS = 1e-5


class SamplingParams(
    msgspec.Struct, omit_defaults=True, dict=True  # dict=True: caches set by the engine
):  # type: ignore[call-arg]
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Filled by the caller's input processor, not by users: token ids of `bad_words`, and the
    # union of EOS and stop_token_ids that must stay suppressed until `min_tokens`.
    _bad_words_token_ids: list[list[int]] | None = None
    _all_stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            # JSON object keys arrive as strings (OpenAI clients); normalise to int.
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        self._verify()

    def _verify(self) -> None:
        """Checks every field; the sampling issue extends this to the full vLLM set."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}.")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self._all_stop_token_ids or ()) | set(self.stop_token_ids or ())

    def clone(self, **changes: Any) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)
