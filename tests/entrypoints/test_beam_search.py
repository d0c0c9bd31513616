"""vLLM's beam search: `LLM.beam_search(prompts, BeamSearchParams(...))` offline and
`use_beam_search` on both endpoints, on the embedded model (its quantized default path). That it
is transformers' beam search, sequence for sequence, is tests/entrypoints/test_llm.py's
`test_beam_search_is_transformers_beam_search` (the float path)."""
from __future__ import annotations

import math
import time

import httpx
import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.entrypoints.beam_search import beam_score
from tokenloom.sampling_params import BeamSearchParams

MAX_MODEL_LEN = 256
KV_BYTES = 64 * 1024**2
# One fixed compute thread, offline and served: the thread governor would give up a thread to
# other processes' load (another xdist worker, another suite on the machine), and on an AMX CPU
# a search's steps then round differently from another search's; at a fixed count the searches
# compare equal however busy the machine is.
SERVER_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", str(KV_BYTES), "--threads", "1"]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def llm():
    with LLM(kv_cache_memory_bytes=KV_BYTES, max_model_len=MAX_MODEL_LEN, enable_ledger=False, num_threads=1) as llm:
        yield llm


@pytest.fixture(scope="module")
def chat_prompt(llm) -> str:
    return llm.get_tokenizer().apply_chat_template([{"role": "user", "content": QUESTION}],
                                                   add_generation_prompt=True, tokenize=False)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def test_offline_sequences_are_ranked_scored_and_end_as_they_say(llm, chat_prompt):
    params = BeamSearchParams(beam_width=3, max_tokens=20)
    eos = frozenset(llm.llm_engine.input_processor.eos_token_ids)
    tokenizer = llm.get_tokenizer()
    [out] = llm.beam_search([chat_prompt], params)
    prompt_ids = llm.llm_engine.input_processor.tokenize_prompt(chat_prompt)[1]
    seqs = out.sequences
    assert len(seqs) == 3 and len({tuple(s.tokens) for s in seqs}) == 3
    scores = [beam_score(s.tokens, s.cum_logprob, eos, params.length_penalty) for s in seqs]
    assert scores == sorted(scores, reverse=True)
    for seq in seqs:
        generated = seq.tokens[len(prompt_ids):]
        assert seq.tokens[:len(prompt_ids)] == prompt_ids
        # Each step's candidates are the engine's logprobs of that beam's 2 * beam_width most
        # likely tokens (and the one it sampled); the score adds the chosen ones up.
        assert len(seq.logprobs) == len(generated)
        assert all(token in step and len(step) <= 2 * params.beam_width + 1 for token, step in zip(generated, seq.logprobs))
        assert math.isclose(seq.cum_logprob, sum(step[t].logprob for t, step in zip(generated, seq.logprobs)), abs_tol=1e-4)
        if seq.finish_reason == "stop":
            assert generated[-1] in eos and seq.stop_reason == generated[-1] and len(generated) <= 20
        else:
            assert seq.finish_reason == "length" and len(generated) == 20 and not eos & set(generated)
        # As vLLM's: the text is the whole sequence's, prompt included.
        assert seq.text == tokenizer.decode(seq.tokens, skip_special_tokens=True)
    # The short chat answer ends in EOS on every beam that found it.
    assert seqs[0].finish_reason == "stop"


# Not serial: the searches run at one fixed thread count (SERVER_ARGS), which other workers'
# load cannot change.
def test_one_beam_without_eos_is_greedy_and_groups_change_nothing(llm, chat_prompt):
    """beam_width=1 with ignore_eos keeps the most likely token at every step: greedy decoding.
    Searching one prompt at a time (concurrency_limit=1) finds what searching both together does."""
    prompts = [chat_prompt, "Once upon a time"]
    greedy = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    beams = llm.beam_search(prompts, BeamSearchParams(beam_width=1, max_tokens=12, ignore_eos=True))
    for g, b in zip(greedy, beams):
        assert b.sequences[0].tokens == g.prompt_token_ids + g.outputs[0].token_ids
    wide = BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=0.5)
    together = llm.beam_search(prompts, wide)
    alone = llm.beam_search(prompts, wide, concurrency_limit=1)
    assert [[s.tokens for s in o.sequences] for o in together] == [[s.tokens for s in o.sequences] for o in alone]


def test_offline_errors_name_the_field(llm):
    with pytest.raises(ValueError, match=r"beam_width must be an integer in \[1, 10\], got 11"):
        BeamSearchParams(beam_width=11, max_tokens=4)
    with pytest.raises(ValueError, match="length_penalty must be"):
        BeamSearchParams(beam_width=2, max_tokens=4, length_penalty=float("inf"))
    with pytest.raises(TypeError, match="must be a BeamSearchParams"):
        llm.beam_search(["hi"], SamplingParams())
    with pytest.raises(ValueError, match=f"max_tokens is too large: {MAX_MODEL_LEN}"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=MAX_MODEL_LEN))
    with pytest.raises(ValueError, match="concurrency_limit"):
        llm.beam_search(["hi"], BeamSearchParams(beam_width=2, max_tokens=2), concurrency_limit=0)
    assert not llm.llm_engine.has_unfinished_requests()


def test_served_chat_is_the_offline_search(server, client, llm, chat_prompt):
    """The server's search (its beams as concurrent requests of an AsyncLLM) finds the offline
    one's sequences; a choice is the generated text without the final EOS."""
    [offline] = llm.beam_search([chat_prompt], BeamSearchParams(beam_width=3, max_tokens=20, temperature=0.0))
    r = client.chat.completions.create(model=client.models.list().data[0].id, n=3, max_tokens=20, temperature=0,
                                       messages=[{"role": "user", "content": QUESTION}], logprobs=True,
                                       extra_body={"use_beam_search": True})
    prompt_len = r.usage.prompt_tokens
    tokenizer = llm.get_tokenizer()
    expected = [tokenizer.decode([t for t in s.tokens[prompt_len:] if t != s.stop_reason], skip_special_tokens=True)
                for s in offline.sequences]
    assert [c.message.content for c in r.choices] == expected
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.finish_reason for c in r.choices] == [s.finish_reason for s in offline.sequences]
    # Counted without the final EOS, as vLLM counts them.
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices) == sum(
        len(s.tokens) - prompt_len - (s.finish_reason == "stop") for s in offline.sequences)
    # Streamed: the same choices (they arrive when the search ends).
    text = {0: "", 1: "", 2: ""}
    for chunk in client.chat.completions.create(model=r.model, n=3, max_tokens=20, temperature=0, stream=True,
                                                messages=[{"role": "user", "content": QUESTION}],
                                                extra_body={"use_beam_search": True}):
        for c in chunk.choices:
            text[c.index] += c.delta.content or ""
    assert list(text.values()) == expected


def test_served_completions_search_every_prompt(client):
    r = client.completions.create(model=client.models.list().data[0].id, prompt=["The capital of France is", "One, two,"],
                                  n=2, max_tokens=8, temperature=0, extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.choices[0].text != r.choices[1].text and r.choices[2].text != r.choices[3].text
    assert r.usage.completion_tokens == 4 * 8


@pytest.mark.parametrize("body,param", [
    ({"top_p": 0.5}, "top_p"),
    ({"stop": ["."]}, "stop"),
    ({"n": 11}, "n"),
    ({"max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"length_penalty": 1e9}, "length_penalty"),
])
def test_served_400_names_what_beam_search_cannot_take(server, body, param):
    r = httpx.post(server.url("/v1/chat/completions"), timeout=60, json={
        "messages": [{"role": "user", "content": "Hi"}], "use_beam_search": True, "n": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_a_client_gone_mid_search_ends_it(server):
    """The search's steps are engine requests: a client that leaves ends the one in flight and
    starts no more."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url("/v1/completions"), timeout=1.0, json={
            "prompt": "Once upon a time", "max_tokens": 200, "n": 4, "use_beam_search": True, "ignore_eos": True})
    m = server.wait_idle()
    assert m["tokenloom:num_requests_running"] == m["tokenloom:num_kv_blocks_used"] == 0
    done = server.metrics()["tokenloom:request_success_total"]
    time.sleep(1.5)
    assert server.metrics()["tokenloom:request_success_total"] == done  # no step started after it
