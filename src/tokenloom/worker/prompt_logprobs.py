"""Prompt logprobs (`SamplingParams.prompt_logprobs`): for each prompt token after the first, its
logprob and the top k, computed from the hidden states of the prefill chunks that run it.

Rare and per request, so a Python loop over just the requests that asked: each chunk's rows go
through the LM head and the sampler's logprob math, the chunks accumulate, and the whole list
leaves once the prefill ends (the first prompt token has none: nothing predicts it).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from tokenloom.messages import LogprobsLists


class PromptLogprobs:
    """The model runner's requests that want prompt logprobs, and their chunks so far."""

    def __init__(self) -> None:
        self._k: dict[str, int] = {}
        self._pending: dict[str, list[LogprobsLists]] = {}

    def __bool__(self) -> bool:
        return bool(self._k)

    def add_request(self, req_id: str, k: int) -> None:
        self._k[req_id] = k

    def remove_request(self, req_id: str) -> None:
        self._k.pop(req_id, None)
        self._pending.pop(req_id, None)

    def compute(self, req_ids: list[str], rows: np.ndarray, num_sched: np.ndarray, computed: np.ndarray,
                query_start_loc: np.ndarray, num_prompt_tokens: np.ndarray, token_ids: np.ndarray,
                hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
                logprobs_of: Callable[[torch.Tensor, torch.Tensor, int], LogprobsLists],
                fail: Callable[[str, int, BaseException], None]) -> dict[str, LogprobsLists]:
        """The prompt logprobs of the requests whose prefill ended in this step. Request i of the
        step (row rows[i]) ran num_sched[i] tokens from position computed[i], its hidden states
        at query_start_loc[i]:; a request whose k the sampler refuses is `fail`ed alone."""
        done: dict[str, LogprobsLists] = {}
        for i, req_id in enumerate(req_ids):
            k = self._k.get(req_id)
            if k is None:
                continue
            row = int(rows[i])
            n_prompt = int(num_prompt_tokens[row])
            start = int(computed[i])
            # The query token at position p predicts prompt token p + 1.
            end = min(start + int(num_sched[i]), n_prompt - 1)
            if end > start:
                flat = torch.arange(end - start, device=hidden.device) + int(query_start_loc[i])
                targets = torch.from_numpy(token_ids[row, start + 1 : end + 1].copy())
                try:
                    part = logprobs_of(compute_logits(hidden[flat]), targets, k)
                except Exception as e:  # noqa: BLE001 - this request's k: fail it alone
                    fail(req_id, row, e)
                    continue
                self._pending.setdefault(req_id, []).append(part)
            if start + int(num_sched[i]) >= n_prompt:
                del self._k[req_id]
                parts = self._pending.pop(req_id, [])
                done[req_id] = LogprobsLists(
                    token_ids=[t for p in parts for t in p.token_ids],
                    logprobs=[x for p in parts for x in p.logprobs],
                    ranks=[r for p in parts for r in p.ranks],
                )
        return done
