"""The n-gram proposer against a plain-Python statement of its rule (hypothesis), and the
drafts it gives on the text patterns it is for."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.spec_decode.ngram_proposer import NgramProposer


def reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The longest n in [min_n, max_n] whose last-n-token suffix occurs earlier (ending before
    the last token); of its occurrences, the latest with k tokens after it, else the earliest."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        ends = [i + n for i in range(0, length - n) if tokens[i:i + n] == suffix]
        if ends:
            full = [e for e in ends if e + k <= length]
            start = full[-1] if full else ends[0]
            return tokens[start:start + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=0, max_size=40), k=st.integers(1, 6),
       min_n=st.integers(1, 3), extra=st.integers(0, 3))
def test_matches_the_rule(tokens, k, min_n, extra):
    proposer = NgramProposer(k, min_n, min_n + extra)
    got = proposer.propose(np.asarray(tokens, dtype=np.int64)).tolist()
    assert got == reference(tokens, k, min_n, min_n + extra)


def test_proposes_what_followed_the_last_occurrence():
    p = NgramProposer(3, 2, 3)
    # "1 2 3 4 ... 1 2" -> what followed "1 2": "3 4 5"
    assert p.propose(np.array([1, 2, 3, 4, 5, 9, 1, 2])).tolist() == [3, 4, 5]
    # The longest match wins: "7 1 2" occurred before "8 1 2".
    assert p.propose(np.array([8, 1, 2, 6, 6, 6, 7, 1, 2, 5, 5, 5, 9, 7, 1, 2])).tolist() == [5, 5, 5]
    # A suffix that occurs nowhere else, or shorter than prompt_lookup_min: nothing.
    assert p.propose(np.array([1, 2, 3, 4])).size == 0
    assert p.propose(np.array([5, 1, 9, 1])).size == 0
    # k caps the drafts; fewer when the text ends first.
    assert p.propose(np.array([1, 2, 3, 1, 2]), k=1).tolist() == [3]
    assert p.propose(np.array([1, 2, 3, 1, 2]), k=8).tolist() == [3, 1, 2]


def test_refuses_a_bad_range():
    with pytest.raises(ValueError, match="prompt_lookup_min"):
        NgramProposer(4, 3, 2)
