"""Extreme but accepted SamplingParams never raise inside the engine core (issue 21: a
repetition_penalty of 1e39 passed validation and crashed the sampler, killing every request).

Hypothesis draws parameters at the edges of what SamplingParams accepts (sampling_fuzz.py). What
construction or the input processor refuses is the door doing its job; everything else must run:
- through the real batched sampler, next to an ordinary request, over logits as a model makes
  them and logits at float32's extremes;
- through a real engine (the in-process core and the SmolLM2 model), to a final output that is
  not an error.
The long run (2,000+ examples through the engine) is benchmarks/fuzz_sampling_params.py.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from sampling_fuzz import F32_MAX, VOCAB_SIZE, sampling_kwargs

from tokenloom.sample.sampler import Sampler
from tokenloom.sampling_params import SamplingParams


def _accepted(kwargs: dict) -> SamplingParams | None:
    """The params if the door accepts them (construction and the vocabulary check), else None."""
    try:
        params = SamplingParams(**kwargs)
        params.verify_against_vocab(VOCAB_SIZE)
    except ValueError:
        return None
    return params


@pytest.fixture(scope="module")
def sampler() -> Sampler:
    return Sampler(max_num_reqs=4, vocab_size=VOCAB_SIZE, seed=0)


def _logits(kind: str, n: int, rng: np.random.Generator) -> torch.Tensor:
    if kind == "model":
        return torch.from_numpy(rng.normal(0.0, 4.0, (n, VOCAB_SIZE)).astype(np.float32))
    if kind == "huge":  # float32's largest values, both signs
        return torch.from_numpy(rng.choice([F32_MAX, -F32_MAX, 0.0], (n, VOCAB_SIZE)).astype(np.float32))
    logits = torch.full((n, VOCAB_SIZE), float("-inf"))
    logits[:, ::997] = torch.from_numpy(rng.normal(0.0, 30.0, (n, logits[:, ::997].shape[1])).astype(np.float32))
    return logits  # mostly masked


# The issue's cases, always run: past float32's maximum (the crash), and just below it.
ISSUE_CASES = [{"repetition_penalty": 1e39}, {"repetition_penalty": 3.5e38, "temperature": 0.0}, {"frequency_penalty": 2.0, "repetition_penalty": 3e38}]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kwargs=sampling_kwargs(), kind=st.sampled_from(["model", "huge", "sparse"]), seed=st.integers(0, 2**32 - 1))
@example(kwargs=ISSUE_CASES[0], kind="model", seed=0)
@example(kwargs=ISSUE_CASES[1], kind="model", seed=0)
@example(kwargs=ISSUE_CASES[2], kind="huge", seed=0)
def test_extreme_accepted_params_never_raise_in_the_sampler(sampler, kwargs, kind, seed):
    params = _accepted(kwargs)
    if params is None:
        return
    rng = np.random.default_rng(seed)
    prompt = rng.integers(0, VOCAB_SIZE, 12).tolist()
    sampler.add_request(0, params, prompt, [])
    sampler.add_request(1, SamplingParams(temperature=0.7, top_p=0.9, repetition_penalty=1.1), prompt, [])
    for _ in range(3):
        out = sampler.sample(_logits(kind, 2, rng), [0, 1])
        tokens = out.sampled_token_ids.tolist()
        assert all(0 <= t < VOCAB_SIZE for t in tokens), tokens
        if params.logprobs is not None:
            assert out.logprobs is not None and out.logprobs[0] is not None
    sampler.remove_request(0)
    sampler.remove_request(1)


@pytest.fixture(scope="module")
def inproc_llm():
    from tokenloom import LLM

    llm = LLM(multiprocess=False, max_model_len=256, num_kv_blocks=64, max_num_seqs=8, enable_ledger=False)
    yield llm
    llm.shutdown()


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(kwargs=sampling_kwargs())
@example(kwargs={**ISSUE_CASES[0], "max_tokens": 2})
def test_extreme_accepted_params_run_through_the_engine(inproc_llm, kwargs):
    params = _accepted(kwargs)
    if params is None:
        return
    ordinary = SamplingParams(temperature=0.0, max_tokens=2)
    try:
        outs = inproc_llm.generate(["The capital of France is", "Hello"], [params, ordinary], use_tqdm=False)
    except ValueError:
        return  # refused by the input processor (e.g. a bad word that tokenizes to nothing usable)
    for out in outs:
        reasons = [c.finish_reason for c in out.outputs]
        assert out.finished and "error" not in reasons, (kwargs, out.error, reasons)
    assert len(outs[0].outputs) == params.n
