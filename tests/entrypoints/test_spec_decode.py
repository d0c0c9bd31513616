"""Speculative decoding (n-gram prompt lookup, vLLM's `speculative_config`) on the real model:
offline and served, its tokens are those of the same engine without drafts.

Greedy requests must get exactly the tokens they get without drafts (the drafts are verified
by the same argmax), seeded random requests the same draws (a draft position draws with the
uniforms of the token it stands for), and stop strings, logprobs and structured outputs must
behave as without drafts, while the drafts are really used (the spec_decode counters move).
"""
from __future__ import annotations

import json

import pytest

from conftest import ServerProcess  # tests/entrypoints/conftest.py
from tokenloom import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 2}
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"
# Prompts whose answers repeat themselves or the prompt (drafts get accepted), and one that does not.
PROMPTS = [
    [{"role": "user", "content": "Repeat this code exactly, then stop:\n" + CODE}],
    [{"role": "user", "content": "Write the numbers from 1 to 40, separated by commas."}],
    [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
]
ENGINE = dict(quantization="none", dtype="float32", max_model_len=1024, kv_cache_memory_bytes=64 * 1024**2)


def spec_counters(llm: LLM) -> dict[str, float]:
    """The spec_decode counters, each summed over its labels (the per-position one has one
    series per draft position)."""
    totals: dict[str, float] = {}
    for m in llm.get_metrics():
        if m.name.startswith("tokenloom:spec_decode"):
            name = m.name.removeprefix("tokenloom:")
            totals[name] = totals.get(name, 0.0) + m.value
    return totals


@pytest.fixture(scope="module")
def llms():
    plain, spec = LLM(**ENGINE), LLM(**ENGINE, speculative_config=SPEC)
    try:
        yield plain, spec
    finally:
        plain.shutdown()
        spec.shutdown()


def _outputs(llm: LLM, params) -> list:
    return [o.outputs[0] for o in llm.chat(PROMPTS, params, use_tqdm=False)]


def test_greedy_tokens_are_those_without_drafts(llms):
    plain, spec = llms
    params = SamplingParams(temperature=0.0, max_tokens=96)
    before = spec_counters(spec)
    expected, got = _outputs(plain, params), _outputs(spec, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert [o.text for o in got] == [o.text for o in expected]
    after = spec_counters(spec)
    accepted = after["spec_decode_num_accepted_tokens"] - before["spec_decode_num_accepted_tokens"]
    drafted = after["spec_decode_num_draft_tokens"] - before["spec_decode_num_draft_tokens"]
    # The repeated code and the count are mostly drafted: fewer steps than tokens.
    assert accepted > 40 and drafted >= accepted
    assert after["spec_decode_num_accepted_tokens_per_pos"] - before.get("spec_decode_num_accepted_tokens_per_pos", 0) == accepted
    assert spec_counters(plain)["spec_decode_num_drafts"] == 0


@pytest.mark.slow
def test_seeded_sampling_draws_the_same_tokens_and_logprobs(llms):
    plain, spec = llms
    params = [SamplingParams(temperature=1.0, max_tokens=96, seed=seed, logprobs=2) for seed in (1, 2, 3)]
    before = spec_counters(spec)["spec_decode_num_accepted_tokens"]
    expected, got = _outputs(plain, params), _outputs(spec, params)
    assert spec_counters(spec)["spec_decode_num_accepted_tokens"] - before > 20
    for e, g in zip(expected, got):
        assert g.token_ids == e.token_ids
        assert len(g.logprobs) == len(g.token_ids)
        for le, lg, token in zip(e.logprobs, g.logprobs, g.token_ids):
            assert list(lg) == list(le)  # the same sampled token and top-2
            assert lg[token].logprob == pytest.approx(le[token].logprob, abs=1e-3)
        assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-2)


def test_a_stop_string_among_accepted_drafts_ends_the_output_there(llms):
    """Several tokens arrive in one step: the output must still end at the token that completed
    the stop string (text, token ids and logprobs as without drafts). One stop string: others
    ("with_zero", "0123456") end the same drafted outputs elsewhere, through the same check."""
    plain, spec = llms
    stop = ["return x * y"]
    params = SamplingParams(temperature=0.0, max_tokens=96, stop=stop, logprobs=0)
    expected, got = _outputs(plain, params), _outputs(spec, params)
    for e, g in zip(expected, got):
        assert (g.text, g.token_ids, g.finish_reason, g.stop_reason) == (e.text, e.token_ids, e.finish_reason, e.stop_reason)
        assert len(g.logprobs) == len(g.token_ids)
        assert g.cumulative_logprob == pytest.approx(e.cumulative_logprob, abs=1e-3)
    assert any(o.finish_reason == "stop" and o.stop_reason == stop[0] for o in got)


@pytest.mark.slow
def test_structured_outputs_and_penalties_run_without_drafts(llms):
    """Requests whose next token depends on the ones before it in ways a draft cannot know (a
    grammar's state, penalties) decode one token at a time, and answer as without drafts."""
    from tokenloom import StructuredOutputsParams

    plain, spec = llms
    schema = {"type": "object", "properties": {"numbers": {"type": "array", "items": {"type": "integer"}}},
              "required": ["numbers"]}
    params = [SamplingParams(temperature=0.0, max_tokens=32, structured_outputs=StructuredOutputsParams(json=schema)),
              SamplingParams(temperature=0.0, max_tokens=32, repetition_penalty=1.3),
              SamplingParams(temperature=0.0, max_tokens=32, presence_penalty=0.5)]
    before = spec_counters(spec)["spec_decode_num_drafts"]
    expected, got = _outputs(plain, params), _outputs(spec, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert spec_counters(spec)["spec_decode_num_drafts"] == before
    if got[0].finish_reason == "stop":
        json.loads(got[0].text)


@pytest.fixture(scope="module")
def spec_server():
    srv = ServerProcess(["--max-model-len", "1024", "--speculative-config", json.dumps(SPEC)], None)
    try:
        yield srv
    finally:
        srv.stop()


def test_served_with_drafts_streamed_or_not(spec_server):
    """`tokenloom serve --speculative-config JSON` (vLLM's flag) on the default GGUF path: the
    official client's streamed chunks join into the non-streamed answer, several tokens may come
    in one chunk, and /metrics counts the drafts under vLLM's names."""
    client = spec_server.client()
    messages = PROMPTS[1]
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=80)
    text = full.choices[0].message.content
    assert text.startswith("1234567890") and full.usage.completion_tokens == 80
    chunks = [c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=messages, temperature=0, max_tokens=80, stream=True) if c.choices]
    assert "".join(chunks) == text
    assert len([c for c in chunks if c]) < 80  # accepted drafts arrive together
    assert "speculative decoding ngram, up to 4 draft tokens from n-grams of 2-3 tokens" in spec_server.log_text()
    m = spec_server.metrics()
    assert m["tokenloom:spec_decode_num_accepted_tokens_total"] > 0
    assert m["tokenloom:spec_decode_num_draft_tokens_total"] >= m["tokenloom:spec_decode_num_accepted_tokens_total"]
    assert m["tokenloom:spec_decode_num_accepted_tokens_per_pos_total"] == m["tokenloom:spec_decode_num_accepted_tokens_total"]


@pytest.mark.slow
def test_sliding_window_model_same_tokens_with_drafts(gemma3_path):
    """Gemma 3 (five layers in six attend to the last 512 positions only): draft tokens shown
    to attention as decode queries of their own keep each one's window, past the window's end
    too (a 948-token prompt), on its default quantized path."""
    block = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(60))
    prompts = [block + "def f30(x):\n"]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    tokens = []
    for spec in (None, SPEC):
        llm = LLM(gemma3_path, max_model_len=2048, kv_cache_memory_bytes=64 * 1024**2, speculative_config=spec)
        try:
            outs = llm.generate(prompts, params, use_tqdm=False)
            assert len(outs[0].prompt_token_ids) > 600
            tokens.append([o.outputs[0].token_ids for o in outs])
            accepted = spec_counters(llm)["spec_decode_num_accepted_tokens"]
        finally:
            llm.shutdown()
    assert tokens[1] == tokens[0]
    assert accepted > 20  # the continuation repeats the prompt's pattern: mostly drafted
