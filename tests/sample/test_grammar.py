"""The grammar bitmask in the sampler: applied first, so greedy, temperature, top-k and top-p all
choose among the allowed tokens; rows without a mask are untouched."""
from __future__ import annotations

import numpy as np
import torch
import xgrammar as xgr

from tokenloom.sample.grammar import GrammarMask
from tokenloom.sample.sampler import Sampler
from tokenloom.sampling_params import SamplingParams

V = 100


def bitmask_allowing(*token_sets: list[int]) -> torch.Tensor:
    rows = xgr.allocate_token_bitmask(len(token_sets), V)
    rows.zero_()
    for i, tokens in enumerate(token_sets):
        for t in tokens:
            rows[i, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    return rows


def test_greedy_rows_pick_the_best_allowed_token_and_free_rows_are_untouched():
    sampler = Sampler(4, V)
    for row in range(3):
        sampler.add_request(row, SamplingParams(temperature=0.0), [1], [])
    logits = torch.randn(3, V)
    logits[:, 42] = 50.0  # everyone's favourite
    mask = GrammarMask(bitmask_allowing([3, 7], [5]), np.array([2, 0]))  # rows 2 and 0, not in order
    tokens = sampler.sample(logits, [0, 1, 2], mask).sampled_token_ids.tolist()
    assert tokens[1] == 42
    assert tokens[0] == 5
    assert tokens[2] == (3 if logits[2, 3] > logits[2, 7] else 7)


def test_sampled_rows_never_leave_the_grammar_whatever_the_temperature_and_truncation():
    sampler = Sampler(3, V, seed=0)
    sampler.add_request(0, SamplingParams(temperature=2.0, seed=1), [1], [])
    sampler.add_request(1, SamplingParams(temperature=1.0, top_k=1), [1], [])
    sampler.add_request(2, SamplingParams(temperature=1.5, top_p=0.5, min_p=0.1), [1], [])
    allowed = [11, 12, 13]
    for _ in range(30):
        logits = torch.randn(3, V) * 5
        logits[:, 99] = 100.0  # the unconstrained favourite is forbidden
        mask = GrammarMask(bitmask_allowing(allowed, allowed, allowed), np.arange(3))
        assert set(sampler.sample(logits, [0, 1, 2], mask).sampled_token_ids.tolist()) <= set(allowed)


def test_the_mask_applies_to_the_logits_in_place_and_logprobs_see_it():
    """As vLLM: the grammar masks the model's logits, so a constrained row's logprobs are those
    of the allowed tokens (and the copy of a whole logits block is saved)."""
    sampler = Sampler(2, V)
    sampler.add_request(0, SamplingParams(temperature=0.0, logprobs=2), [1], [])
    sampler.add_request(1, SamplingParams(temperature=0.0), [1], [])
    logits = torch.randn(2, V)
    free_row = logits[1].clone()
    out = sampler.sample(logits, [0, 1], GrammarMask(bitmask_allowing([4, 9]), np.array([0])))
    assert torch.isinf(logits[0]).sum() == V - 2 and torch.equal(logits[1], free_row)
    lp = out.logprobs[0]
    assert set(lp.token_ids[0][1:]) == {4, 9} and abs(sum(np.exp(lp.logprobs[0][1:])) - 1) < 1e-5
