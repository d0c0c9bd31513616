"""SamplingParams: vLLM's names and defaults.

A msgspec Struct so it crosses the process boundary inside `EngineCoreRequest` without pickle.
Validation runs at construction (`__post_init__`) so a bad value fails in the caller, naming the
field and the allowed range, before anything is queued. msgspec also runs `__post_init__` when it
decodes the struct, so the engine core never sees an unchecked value; a failure there surfaces as
`msgspec.ValidationError`, which is a `ValueError` too.

msgspec does not type-check keyword arguments at construction, so `_verify()` checks types as well
as ranges: `SamplingParams(temperature="hot")` raises `ValueError`, never `TypeError`.

Where tokenloom departs from vLLM, or picks one of its settings, the constant below says so:

- `MAX_N` (128): vLLM's cap comes from `VLLM_MAX_N_SEQUENCES` (16384). Each of the n samples is a
  child request holding a row of the persistent batch and its own KV blocks, so a single request
  must not be able to claim more rows than a batch has.
- `MAX_LOGPROBS` (20): vLLM's default `max_logprobs`. vLLM's `-1` ("the whole vocabulary") is
  rejected: vLLM rejects it too unless the server sets `max_logprobs=-1`, which tokenloom lacks.
- temperature: in [0, 2] as in current vLLM (and OpenAI). Below `_SAMPLING_EPS` it is greedy and
  stored as exactly 0.0; in [`_SAMPLING_EPS`, `_MIN_TEMP`) it is raised to `_MIN_TEMP`, because
  dividing logits by a tinier value overflows float32. (vLLM raises everything in (0, 0.01) to
  0.01; tokenloom treats the vanishing ones as the greedy request they almost surely are.)
- logit_bias values are clamped to [-100, 100] like OpenAI's API (vLLM's OpenAI server does the
  same); keys must be token ids (ints, or strings of ASCII digits as JSON clients send them: not
  " 1 ", "1_0" or "٣", which Python's int() would read).

Every number must also survive the sampler's storage: its per-row parameters are float32 tensors,
so a float that is finite in Python can overflow float32 (repetition_penalty=1e39 crashed the
engine core) or round to 0 (repetition_penalty=1e-300 divides by 0). The ranges below are the
ones where a value both fits and still means something:

- repetition_penalty in [`MIN_REPETITION_PENALTY`, `MAX_REPETITION_PENALTY`] = [1e-4, 1e4]
  (vLLM: any value > 0). A seen token's logit is divided or multiplied by it; at 1e4 a positive
  logit of any real model is already pushed below every unseen one, so larger values change
  nothing, and within the range no finite float32 logit under 3e34 overflows.
- top_p in [`MIN_TOP_P`, 1]: the smallest normal float32, so it never rounds to 0.
- seed: any 64-bit value (the sampler hashes it as uint64); token ids below 2**31 (int32
  tensors) and then below the vocabulary size; integer counts (max_tokens, min_tokens,
  priority) within int64, what msgpack and the numpy/torch counters carry.
"""
from __future__ import annotations

import enum
import logging
import math
import numbers
import operator
from typing import Any

import msgspec
import numpy as np

logger = logging.getLogger(__name__)


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


_SAMPLING_EPS = 1e-5  # temperatures below this are greedy
_MIN_TEMP = 1e-2  # smallest temperature that is sampled (see the module docstring)
MAX_TEMPERATURE = 2.0
MAX_N = 128
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
MIN_REPETITION_PENALTY = 1e-4
MAX_REPETITION_PENALTY = 1e4
MIN_TOP_P = float(np.finfo(np.float32).tiny)  # 1.18e-38: the smallest normal float32
MAX_PENALTY = 2.0  # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]


def _fail(name: str, requirement: str, value: Any) -> ValueError:
    return ValueError(f"{name} must be {requirement}, got {value!r}.")


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
INT64_MIN, INT64_MAX = _INT64_MIN, _INT64_MAX
UINT64_MAX = (1 << 64) - 1
# Token ids: a vocabulary is far smaller; the bound keeps ids inside int32 tensors.
_MAX_TOKEN_ID = (1 << 31) - 1
MAX_TOKEN_ID = _MAX_TOKEN_ID


def _int(name: str, value: Any, requirement: str, lo: int = _INT64_MIN, hi: int = _INT64_MAX) -> int:
    """An integer (Python or numpy), not a bool and not a float, in [lo, hi] (by default int64,
    what msgpack and torch carry)."""
    if isinstance(value, bool):
        raise _fail(name, requirement, value)
    try:
        result = operator.index(value)
    except TypeError:
        raise _fail(name, requirement, value) from None
    if not lo <= result <= hi:
        raise _fail(name, requirement, value)
    return result


def _float(name: str, value: Any, requirement: str, *, allow_inf: bool = False) -> float:
    """A finite real number (ints and numpy scalars accepted), not a bool or a string."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise _fail(name, requirement, value)
    try:
        result = float(value)
    except (OverflowError, TypeError, ValueError):  # e.g. an int beyond float range
        raise _fail(name, requirement, value) from None
    if math.isnan(result) or (math.isinf(result) and not allow_inf):
        raise _fail(name, requirement, value)
    return result


def _bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail(name, "a bool", value)
    return value


def _token_ids(name: str, value: Any, *, non_empty: bool = False) -> list[int]:
    requirement = "a non-empty list of token ids (ints >= 0)" if non_empty else "a list of token ids (ints >= 0)"
    if not isinstance(value, (list, tuple)) or (non_empty and not value):
        raise _fail(name, requirement, value)
    return [_int(name, t, requirement, 0, _MAX_TOKEN_ID) for t in value]


def _strings(name: str, value: Any) -> list[str]:
    requirement = "a list of non-empty strings"
    if not isinstance(value, (list, tuple)) or not all(isinstance(s, str) and s for s in value):
        raise _fail(name, requirement, value)
    return list(dict.fromkeys(value))  # de-duplicated, order kept (as vLLM)


class StructuredOutputsParams(msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    """Constrains a request's output to a structure (vLLM's names): a JSON schema (`json`, a dict
    or its JSON text), any JSON object (`json_object`), a regular expression (`regex`), one of
    several strings (`choice`) or an EBNF grammar (`grammar`, xgrammar's GBNF dialect). Exactly
    one kind per request. The engine core enforces it with a token bitmask at every step.

    Only the shape is checked here (this module knows no grammar compiler): whether the schema,
    regex or grammar compiles is checked by the caller's input processor, before anything is
    queued, with the compiler's own message."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    # vLLM's option: JSON without free whitespace (xgrammar's separators ", " and ": " only, no
    # newlines or runs of spaces). Free whitespace lets a small model pad forever; see the
    # engine's cap in structured_output/.
    disable_any_whitespace: bool = False
    # Set by the server under --reasoning-parser, not by requests: (the `<think>` token id, the
    # `</think>` token id, whether the prompt left the reply inside `<think>`). The grammar then
    # waits for the reasoning to end, as vLLM's does: unconstrained inside it, allowed to open
    # it as the first token (structured_output/manager.StructuredOutputRequest).
    _reasoning: tuple[int, int, bool] | None = None

    def __post_init__(self) -> None:
        self._verify()

    def _verify(self) -> None:
        p = "structured_outputs"
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _fail(f"{p}.json", "a JSON schema (a dict or its JSON text)", self.json)
        if isinstance(self.json, str) and not self.json.strip():
            raise _fail(f"{p}.json", "a JSON schema (a dict or its JSON text)", self.json)
        if isinstance(self.json, dict):
            # The schema crosses to the engine core as msgpack: a value that cannot (an integer
            # beyond 64 bits, a Python object) is the caller's error, not the server's.
            try:
                msgspec.msgpack.encode(self.json)
            except (OverflowError, TypeError, msgspec.EncodeError) as e:
                raise ValueError(
                    f"{p}.json must be a JSON schema of JSON values with integers within 64 bits "
                    f"({e})."
                ) from None
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _fail(f"{p}.{name}", "a non-empty string", value)
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise _fail(f"{p}.choice", "a non-empty list of non-empty strings", self.choice)
            self.choice = list(dict.fromkeys(self.choice))
        if self.json_object is not None:
            _bool(f"{p}.json_object", self.json_object)
        _bool(f"{p}.disable_any_whitespace", self.disable_any_whitespace)
        r = self._reasoning
        if r is not None and not (isinstance(r, (tuple, list)) and len(r) == 3
                                  and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in r[:2])
                                  and isinstance(r[2], bool)):
            raise _fail(f"{p}._reasoning", "(the <think> token id, the </think> token id, a bool)", r)
        kinds = self.kinds()
        if not kinds:
            raise ValueError(
                f"{p} must set one of json, regex, choice, grammar or json_object, got none."
            )
        if len(kinds) > 1:
            raise ValueError(
                f"{p} must set exactly one kind of constraint, got {len(kinds)}: {', '.join(kinds)}."
            )

    def kinds(self) -> list[str]:
        """The constraint kinds that are set (exactly one once verified)."""
        return [
            name
            for name in ("json", "regex", "choice", "grammar", "json_object")
            if getattr(self, name) not in (None, False)
        ]

    @property
    def kind(self) -> str:
        return self.kinds()[0]


class SamplingParams(
    msgspec.Struct, omit_defaults=True, dict=True  # dict=True: caches set by the engine
):  # type: ignore[call-arg]
    n: int = 1  # in [1, MAX_N]; must be 1 when greedy
    presence_penalty: float = 0.0  # in [-2, 2]; output tokens only
    frequency_penalty: float = 0.0  # in [-2, 2]; output tokens only
    repetition_penalty: float = 1.0  # in [1e-4, 1e4]; prompt and output tokens; 1 = off
    temperature: float = 1.0  # in [0, 2]; 0 = greedy
    top_p: float = 1.0  # in [MIN_TOP_P, 1]
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0  # in [0, 1]
    seed: int | None = None  # any 64-bit int (signed or not); -1 means None (as vLLM)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # in [0, MAX_LOGPROBS]
    prompt_logprobs: int | None = None  # in [0, MAX_LOGPROBS]
    # Keep only the prompt's last k tokens (vLLM's left truncation); -1: as many as the model
    # takes. Applied by the caller's input processor, which knows max_model_len.
    truncate_prompt_tokens: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    # Filled by the caller's input processor, not by users: token ids of `bad_words` (each word
    # tokenized with and without a leading space), and the union of EOS and stop_token_ids that
    # must stay suppressed until `min_tokens`.
    _bad_words_token_ids: list[list[int]] | None = None
    _all_stop_token_ids: list[int] | None = None

    def __post_init__(self) -> None:
        self._verify()

    @classmethod
    def from_optional(cls, **kwargs: Any) -> "SamplingParams":
        """vLLM's constructor for callers holding optional values: a None means the default."""
        return cls(**{name: value for name, value in kwargs.items() if value is not None})

    def _verify(self) -> None:
        """Checks the type and range of every field, normalising where vLLM does (stop str ->
        [str], top_k -1 -> 0, seed -1 -> None, logprobs True -> 1, string logit_bias keys ->
        int). Idempotent: it runs again when the struct is decoded in the engine core."""
        self.n = _int("n", self.n, f"an integer in [1, {MAX_N}]")
        if not 1 <= self.n <= MAX_N:
            raise _fail("n", f"an integer in [1, {MAX_N}]", self.n)

        for name in ("presence_penalty", "frequency_penalty"):
            value = _float(name, getattr(self, name), f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
            if not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise _fail(name, f"a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]", value)
            setattr(self, name, value)
        requirement = f"a number in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1 = off)"
        self.repetition_penalty = _float("repetition_penalty", self.repetition_penalty, requirement)
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise _fail("repetition_penalty", requirement, self.repetition_penalty)

        self._verify_temperature()

        requirement = f"a number in (0, 1], at least {MIN_TOP_P:.3g} (it must not round to 0 in float32)"
        self.top_p = _float("top_p", self.top_p, requirement)
        if not MIN_TOP_P <= self.top_p <= 1.0:
            raise _fail("top_p", requirement, self.top_p)
        self.top_k = _int("top_k", self.top_k, "0 or -1 (disabled) or an integer >= 1")
        if self.top_k < -1:
            raise _fail("top_k", "0 or -1 (disabled) or an integer >= 1", self.top_k)
        if self.top_k == -1:
            self.top_k = 0
        self.min_p = _float("min_p", self.min_p, "a number in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", "a number in [0, 1]", self.min_p)

        if self.seed is not None:
            # Any 64-bit value, signed or not (what msgpack carries and torch.manual_seed takes).
            self.seed = _int("seed", self.seed, "an integer in [-2**63, 2**64) or None", hi=(1 << 64) - 1)
            if self.seed == -1:
                self.seed = None

        self._verify_stops_and_lengths()
        self._verify_logprobs()

        for name in (
            "ignore_eos",
            "detokenize",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "include_stop_str_in_output",
        ):
            _bool(name, getattr(self, name))
        kind = _int("output_kind", self.output_kind, "a RequestOutputKind (0, 1 or 2)")
        if kind not in RequestOutputKind.__members__.values():
            raise _fail("output_kind", "a RequestOutputKind (0, 1 or 2)", self.output_kind)
        self.output_kind = RequestOutputKind(kind)
        if self.stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True (stop is matched on the text).")

        self._verify_token_constraints()
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise _fail("structured_outputs", "a StructuredOutputsParams or None", self.structured_outputs)

        if self.temperature < _SAMPLING_EPS:
            # Greedy: the truncation knobs mean nothing, and n copies would all be the same.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
            if self.n > 1:
                raise ValueError(f"n must be 1 when temperature is 0 (greedy sampling), got {self.n}.")

    def _verify_temperature(self) -> None:
        requirement = f"a number in [0, {MAX_TEMPERATURE:g}] (0 = greedy)"
        t = _float("temperature", self.temperature, requirement)
        if not 0.0 <= t <= MAX_TEMPERATURE:
            raise _fail("temperature", requirement, t)
        if t < _SAMPLING_EPS:
            t = 0.0
        elif t < _MIN_TEMP:
            logger.warning("temperature %g is below %g, which overflows float32 logits; using %g.", t, _MIN_TEMP, _MIN_TEMP)
            t = _MIN_TEMP
        self.temperature = t

    def _verify_stops_and_lengths(self) -> None:
        if self.stop is not None:
            self.stop = [self.stop] if isinstance(self.stop, str) else self.stop
            self.stop = _strings("stop", self.stop)
        if self.stop_token_ids is not None:
            self.stop_token_ids = list(dict.fromkeys(_token_ids("stop_token_ids", self.stop_token_ids)))
        if self.max_tokens is not None:
            self.max_tokens = _int("max_tokens", self.max_tokens, "an integer >= 1 or None")
            if self.max_tokens < 1:
                raise _fail("max_tokens", "an integer >= 1 or None", self.max_tokens)
        self.min_tokens = _int("min_tokens", self.min_tokens, "an integer >= 0")
        if self.min_tokens < 0:
            raise _fail("min_tokens", "an integer >= 0", self.min_tokens)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _fail("min_tokens", f"<= max_tokens ({self.max_tokens})", self.min_tokens)
        if self.truncate_prompt_tokens is not None:
            requirement = "None, -1 (the longest prompt the model takes) or an integer >= 1"
            self.truncate_prompt_tokens = _int("truncate_prompt_tokens", self.truncate_prompt_tokens, requirement)
            if self.truncate_prompt_tokens == 0 or self.truncate_prompt_tokens < -1:
                raise _fail("truncate_prompt_tokens", requirement, self.truncate_prompt_tokens)

    def _verify_logprobs(self) -> None:
        requirement = f"None or an integer in [0, {MAX_LOGPROBS}] (-1, the whole vocabulary, is not supported)"
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, bool):  # as vLLM: True means 1, False means 0
                value = int(value)
            value = _int(name, value, requirement)
            if not 0 <= value <= MAX_LOGPROBS:
                raise _fail(name, requirement, value)
            setattr(self, name, value)

    def _verify_token_constraints(self) -> None:
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _token_ids("allowed_token_ids", self.allowed_token_ids, non_empty=True)
        if self.bad_words is not None:
            self.bad_words = _strings("bad_words", self.bad_words)
        if self._bad_words_token_ids is not None:
            requirement = "a list of non-empty lists of token ids (ints >= 0)"
            if not isinstance(self._bad_words_token_ids, (list, tuple)):
                raise _fail("_bad_words_token_ids", requirement, self._bad_words_token_ids)
            self._bad_words_token_ids = [
                _token_ids("_bad_words_token_ids", ids, non_empty=True) for ids in self._bad_words_token_ids
            ]
        if self._all_stop_token_ids is not None:
            ids = self._all_stop_token_ids
            if isinstance(ids, (set, frozenset)):  # vLLM keeps a set; a list crosses msgpack
                ids = sorted(_token_ids("_all_stop_token_ids", list(ids)))
            self._all_stop_token_ids = _token_ids("_all_stop_token_ids", ids)

    def verify_against_vocab(self, vocab_size: int) -> None:
        """Every token id this request names must be < vocab_size (the model's logits width).
        Called by the input processor once the model is known, and by the sampler at add time."""
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids),
            ("logit_bias", None if self.logit_bias is None else list(self.logit_bias)),
            ("_all_stop_token_ids", self._all_stop_token_ids),
            ("_bad_words_token_ids", [t for w in self._bad_words_token_ids or () for t in w]),
            ("structured_outputs._reasoning", list((self.structured_outputs._reasoning or ())[:2])
             if self.structured_outputs is not None else None),
        ):
            bad = [t for t in ids or () if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(
                    f"{name} must hold token ids in [0, {vocab_size}) (vocab_size={vocab_size}), "
                    f"got out-of-vocabulary id(s) {bad[:8]!r}."
                )

    @property
    def sampling_type_greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS

    @property
    def all_stop_token_ids(self) -> set[int]:
        return set(self._all_stop_token_ids or ()) | set(self.stop_token_ids or ())

    def clone(self, **changes: Any) -> "SamplingParams":
        return msgspec.structs.replace(self, **changes)  # runs __post_init__: changes are checked


def _logit_bias(value: Any) -> dict[int, float]:
    requirement = (
        f"a dict mapping token ids (ints >= 0, or strings of digits) to numbers "
        f"(clamped to [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}])"
    )
    if not isinstance(value, dict):
        raise _fail("logit_bias", requirement, value)
    result: dict[int, float] = {}
    for key, bias in value.items():
        token: int | None
        if isinstance(key, str):
            # JSON object keys arrive as strings (OpenAI clients). Only plain ASCII digits: int()
            # also reads " 1 ", "1_0" and other scripts' digits ("٣"), which no client means.
            token = int(key) if key.isascii() and key.isdigit() and len(key) <= 10 else None
        else:
            token = None if isinstance(key, bool) else _index_or_none(key)
        if token is None or not 0 <= token <= _MAX_TOKEN_ID:
            raise _fail("logit_bias", requirement, {key: bias})
        b = _float("logit_bias", bias, requirement, allow_inf=True)
        result[token] = min(MAX_LOGIT_BIAS, max(-MAX_LOGIT_BIAS, b))
    return result


def _index_or_none(value: Any) -> int | None:
    try:
        return operator.index(value)
    except TypeError:
        return None


# Beam search asks the engine for each beam's 2 * beam_width most likely next tokens (as vLLM and
# transformers do), which the logprobs cap bounds.
MAX_BEAM_WIDTH = MAX_LOGPROBS // 2
# A score divides by length ** length_penalty: beyond this a long sequence's power overflows a
# float (transformers' and vLLM's usual values lie in [0, 2]).
MAX_LENGTH_PENALTY = 10.0


class BeamSearchParams(msgspec.Struct, omit_defaults=True):  # type: ignore[call-arg]
    """vLLM's beam search parameters (`LLM.beam_search`, the server's `use_beam_search`): the
    `beam_width` most likely sequences by cumulative log probability, over `max_tokens` tokens.
    `length_penalty` divides a finished sequence's score by its length (prompt included, as
    vLLM's and transformers' scores do) to that power; `temperature` 0 ranks each step's
    candidates by the raw logits' log probabilities alone."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.beam_width = _int("beam_width", self.beam_width, f"an integer in [1, {MAX_BEAM_WIDTH}]", 1, MAX_BEAM_WIDTH)
        self.max_tokens = _int("max_tokens", self.max_tokens, "an integer >= 1", 1)
        self.temperature = _float("temperature", self.temperature, f"a number in [0, {MAX_TEMPERATURE:g}]")
        if not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise _fail("temperature", f"a number in [0, {MAX_TEMPERATURE:g}]", self.temperature)
        requirement = f"a number in [-{MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}]"
        self.length_penalty = _float("length_penalty", self.length_penalty, requirement)
        if not -MAX_LENGTH_PENALTY <= self.length_penalty <= MAX_LENGTH_PENALTY:
            raise _fail("length_penalty", requirement, self.length_penalty)
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            setattr(self, name, _bool(name, getattr(self, name)))
