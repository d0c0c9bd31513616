"""Hypothesis strategies for SamplingParams at the edges of what it accepts, shared by
test_sampling_fuzz.py and benchmarks/fuzz_sampling_params.py (the long run).

Each field draws from its boundaries (the limits themselves, their float neighbours, values that
overflow or underflow float32, int64 and uint64 ends) mixed with ordinary values, so most
examples construct and reach the sampler with extreme values, and some are refused at the door.
"""
from __future__ import annotations

import math

import numpy as np
from hypothesis import strategies as st

from tokenloom.sampling_params import (
    MAX_LOGPROBS,
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MIN_TOP_P,
)

F32_MAX = float(np.finfo(np.float32).max)
VOCAB_SIZE = 49152  # SmolLM2


def _around(*values: float) -> list[float]:
    """Each value and its two float64 neighbours."""
    out: list[float] = []
    for v in values:
        out += [v, math.nextafter(v, -math.inf), math.nextafter(v, math.inf)]
    return out


_EXTREME_FLOATS = _around(0.0, 1e-300, 5e-324, 1e-45, MIN_TOP_P, 1e-5, 1e-2, 0.5, 1.0, 2.0, 100.0, 3e38, F32_MAX, 1e39, 1e308)
_EXTREME_FLOATS += [-v for v in _EXTREME_FLOATS] + [math.inf, -math.inf]


def floats(lo: float, hi: float) -> st.SearchStrategy[float]:
    """Ordinary values in [lo, hi] or its ends (3 in 4), or an extreme one anywhere (in range or
    not): most examples construct, and carry an extreme value into the engine."""
    return st.one_of(st.floats(lo, hi), st.floats(lo, hi), st.sampled_from([lo, hi]), st.sampled_from(_EXTREME_FLOATS))


_INT_EDGES = [0, 1, 2, -1, -2, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, -(2**63), 2**64 - 1, 2**64, VOCAB_SIZE - 1, VOCAB_SIZE]


def ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi]), st.sampled_from(_INT_EDGES))


def token_ids() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, VOCAB_SIZE - 1), st.sampled_from([0, 1, 2, VOCAB_SIZE - 1]))


def sampling_kwargs(max_new_tokens: int = 3) -> st.SearchStrategy[dict]:
    """Keyword arguments for SamplingParams. The generation stays short: max_tokens is at most
    `max_new_tokens` (its large values are drawn through min_tokens' and seed's edges instead)."""
    fields = {
        "n": st.sampled_from([1, 1, 2, 3]),
        "temperature": floats(0.0, 2.0),
        "top_p": floats(0.0, 1.0),
        "top_k": ints(-1, VOCAB_SIZE + 10),
        "min_p": floats(0.0, 1.0),
        "presence_penalty": floats(-2.0, 2.0),
        "frequency_penalty": floats(-2.0, 2.0),
        "repetition_penalty": floats(MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY),
        "seed": st.one_of(st.none(), ints(-(2**63), 2**64 - 1)),
        "max_tokens": st.integers(1, max_new_tokens),
        "min_tokens": st.one_of(st.integers(0, max_new_tokens), st.sampled_from([2**63 - 1, 2**62])),
        "logprobs": st.one_of(st.none(), st.integers(0, MAX_LOGPROBS), st.just(MAX_LOGPROBS + 1)),
        "prompt_logprobs": st.one_of(st.none(), st.integers(0, MAX_LOGPROBS)),
        "ignore_eos": st.booleans(),
        "logit_bias": st.one_of(
            st.none(), st.dictionaries(token_ids(), floats(-100.0, 100.0), min_size=1, max_size=6)
        ),
        "allowed_token_ids": st.one_of(st.none(), st.lists(token_ids(), min_size=1, max_size=8)),
        "stop_token_ids": st.one_of(st.none(), st.lists(token_ids(), max_size=4)),
        "bad_words": st.one_of(st.none(), st.lists(st.sampled_from(["the", "a", "Hello world", "!"]), min_size=1, max_size=3)),
        "stop": st.one_of(st.none(), st.lists(st.sampled_from([".", "\n", "the"]), min_size=1, max_size=2)),
    }
    return st.fixed_dictionaries({}, optional=fields)
