"""Offline runs are reproducible: one `LLM.generate` call's prompts reach the engine core as one
message, so its first step's batch (and so every later one, and the greedy tokens) does not
depend on how the caller's tokenization raced the core's first steps."""
from __future__ import annotations

import json
import random

import pytest

from tokenloom import LLM, SamplingParams

NUM_PROMPTS = 64
PROMPT_LEN = 16
MAX_TOKENS = 16
REPEATS = 3


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Three repeats of one 64 x 16 x 16 greedy generate() on the embedded model as shipped (the
    default path), the prefix cache reset in between as in a fresh process; and the trace."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40_000) for _ in range(PROMPT_LEN)]}
               for _ in range(NUM_PROMPTS)]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    trace = tmp_path_factory.mktemp("trace") / "trace.json"
    tokens = []
    with LLM(max_model_len=128, trace_path=str(trace)) as llm:
        for _ in range(REPEATS):
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens.append([list(o.outputs[0].token_ids) for o in outs])
            llm.reset_prefix_cache()
        path = llm.flush_trace()
    events = json.load(open(path))["traceEvents"]
    steps = sorted((e["args"] for e in events if e.get("cat") == "step" and e.get("ph") == "X"),
                   key=lambda s: s["step"])
    return tokens, steps


def test_greedy_tokens_identical_across_repeats(runs):
    tokens, _ = runs
    assert all(len(t) == MAX_TOKENS for t in tokens[0])
    for i in range(1, REPEATS):
        differing = [j for j, (a, b) in enumerate(zip(tokens[0], tokens[i])) if a != b]
        assert not differing, f"repeat {i} differs from the first in prompts {differing}"


def test_each_runs_first_step_holds_every_prompt(runs):
    """The core got the whole call before it stepped: each run's prompts are prefilled in one
    step (they fit the token budget), with all 64 requests running."""
    _, steps = runs
    prefills = [s for s in steps if s["prefill"] > 0]
    assert len(prefills) == REPEATS, [(s["step"], s["prefill"], s["running"]) for s in prefills]
    for s in prefills:
        assert NUM_PROMPTS * PROMPT_LEN <= s["budget"]
        assert s["prefill"] == NUM_PROMPTS * PROMPT_LEN and s["running"] == NUM_PROMPTS, s
    assert steps[0]["prefill"] == NUM_PROMPTS * PROMPT_LEN
