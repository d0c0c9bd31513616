"""N-gram speculation (prompt lookup), as vLLM's `method: "ngram"`.

A request's next tokens often repeat earlier ones: code being edited, a document quoted back,
a list's structure, a JSON key. After each step, for every request that may speculate, find
the longest n-gram (n in [prompt_lookup_min, prompt_lookup_max]) that ends the request's tokens
and also occurs earlier in them, and propose the up to k tokens that followed that earlier
occurrence. A request whose suffix occurs nowhere gets no drafts, and its next step is a plain
decode (so a workload without repetition pays only the search).

The search is numpy over the request's token row: candidate positions are those holding the
last token, then each longer n keeps the candidates whose preceding token matches too. Among the
occurrences of the longest n-gram the most recent one with k tokens after it wins (recent text
predicts best), else the earliest (the longest continuation).
"""
from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max}).")
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, tokens: np.ndarray, k: int | None = None) -> np.ndarray:
        """Drafts (at most `k`, default num_speculative_tokens) to follow `tokens`, a 1-D array
        of a request's prompt and output ids; empty when its suffix occurs nowhere earlier."""
        k = self.k if k is None else k
        n_tokens = len(tokens)
        if k <= 0 or n_tokens <= self.min_n:
            return tokens[:0]
        # `ends[i]`: an index e < n_tokens such that tokens[e - n : e] equals the last n tokens.
        ends = np.flatnonzero(tokens[:-1] == tokens[-1]) + 1
        if ends.size == 0:
            return tokens[:0]
        best_n, best = 1, ends
        for n in range(2, min(self.max_n, n_tokens - 1) + 1):
            ends = ends[ends >= n]
            ends = ends[tokens[ends - n] == tokens[n_tokens - n]]
            if ends.size == 0:
                break
            best_n, best = n, ends
        if best_n < self.min_n:
            return tokens[:0]
        full = best[best + k <= n_tokens]
        start = int(full[-1]) if full.size else int(best[0])
        return tokens[start : start + k]
