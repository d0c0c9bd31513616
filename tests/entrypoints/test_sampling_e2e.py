"""Sampling on the real engine: seeds that survive batching, chunking and preemption; logprobs
equal to transformers' log_softmax; stop strings; n > 1 sharing the prompt's blocks."""
from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, RequestOutputKind, SamplingParams

STORY = "Once upon a time, in a village by the sea,"


@pytest.fixture(scope="module")
def llm(float_llm):
    return float_llm  # tests/entrypoints/conftest.py: the float path, shared with test_llm


def _seeded(seed: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, top_p=0.95, seed=seed, max_tokens=16, **kw)


def _crowd(n: int) -> list[tuple[str, SamplingParams]]:
    """Unrelated traffic: greedy and unseeded random requests of different lengths."""
    crowd = []
    for i in range(n):
        prompt = f"Request {i}: write a list of {i + 2} animals" + " and plants" * (i % 5)
        params = SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=4 + i % 5)
        crowd.append((prompt, params))
    return crowd


def _with_crowd(llm: LLM, params: SamplingParams, crowd: list) -> list[int]:
    prompts = [p for p, _ in crowd]
    plist = [q for _, q in crowd]
    prompts.insert(17, STORY)
    plist.insert(17, params)
    return llm.generate(prompts, plist, use_tqdm=False)[17].outputs[0].token_ids


@pytest.mark.slow
def test_same_seed_same_tokens_alone_in_a_crowd_chunked_and_preempted(llm):
    alone = llm.generate(STORY, _seeded(1234), use_tqdm=False)[0].outputs[0].token_ids
    assert len(alone) == 16
    assert llm.generate(STORY, _seeded(1234), use_tqdm=False)[0].outputs[0].token_ids == alone
    assert _with_crowd(llm, _seeded(1234), _crowd(32)) == alone
    # Different seeds: different samples (16 tokens at temperature 1 never collide in practice).
    others = {tuple(llm.generate(STORY, _seeded(s), use_tqdm=False)[0].outputs[0].token_ids) for s in (1, 2, 3)}
    assert len(others | {tuple(alone)}) == 4
    # A 16-token budget chunks every prompt; 8 blocks of 16 tokens cannot hold the requests that
    # run together, so some are preempted and recomputed.
    with LLM(dtype="float32", max_num_batched_tokens=16, num_kv_blocks=8,
             enable_prefix_caching=False, quantization=None) as small:
        assert _with_crowd(small, _seeded(1234), _crowd(32)) == alone
        assert small.llm_engine.engine_core.call_utility("get_state")["num_preemptions"] > 0


def test_logprobs_equal_transformers_log_softmax(llm, hf_smollm2):
    params = SamplingParams(temperature=0.0, max_tokens=5, logprobs=4, prompt_logprobs=3)
    out = llm.generate("The capital of France is", params, use_tqdm=False)[0]
    comp = out.outputs[0]
    ids = out.prompt_token_ids + comp.token_ids
    with torch.inference_mode():
        ref = torch.log_softmax(hf_smollm2(torch.tensor([ids])).logits[0].float(), dim=-1)
    n_prompt = len(out.prompt_token_ids)
    assert len(comp.logprobs) == len(comp.token_ids)
    cumulative = 0.0
    for j, (tok, entry) in enumerate(zip(comp.token_ids, comp.logprobs)):
        row = ref[n_prompt - 1 + j]
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=2e-3)
        assert entry[tok].rank == 1  # greedy picks the most likely token
        top = torch.topk(row, 4).indices.tolist()
        assert set(top) <= set(entry), (top, list(entry))
        for t in top:
            assert entry[t].logprob == pytest.approx(row[t].item(), abs=2e-3)
            assert entry[t].decoded_token == llm.get_tokenizer().decode([t])
        cumulative += entry[tok].logprob
    assert comp.cumulative_logprob == pytest.approx(cumulative, abs=1e-4)
    # Prompt logprobs: none for the first token, then each prompt token under the model.
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n_prompt
    for p in range(1, n_prompt):
        tok = ids[p]
        assert out.prompt_logprobs[p][tok].logprob == pytest.approx(ref[p - 1, tok].item(), abs=2e-3)


def test_stop_string_truncates_and_streams_consistently(llm):
    base = llm.generate("Count: 1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    assert " 7" in base.outputs[0].text
    stop = SamplingParams(temperature=0, max_tokens=24, stop=[" 7", "never-appears"])
    out = llm.generate("Count: 1, 2, 3, 4,", stop, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == " 7"
    assert out.text == base.outputs[0].text.split(" 7")[0]
    # Streaming (DELTA outputs through the engine): the deltas add up to the final text, and the
    # held-back partial match never leaks.
    engine = llm.llm_engine
    rid = engine.next_request_id()
    engine.add_request(rid, "Count: 1, 2, 3, 4,", stop.clone(output_kind=RequestOutputKind.DELTA))
    deltas, final = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            deltas.append(o.outputs[0].text)
            final = o
    assert final.finished and "".join(deltas) == out.text
    assert not any(" 7" in d for d in deltas)


def test_n_completions_share_the_prompt_blocks(llm):
    core = llm.llm_engine.engine_core
    prompt = "Write a short poem about the moon and the stars and the quiet night sky above the hills. " * 3
    before = core.call_utility("get_state")
    out = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)
    after = core.call_utility("get_state")
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) == 3
    # The 2nd and 3rd child reuse the first child's full prompt blocks.
    n_prompt_blocks = len(out[0].prompt_token_ids) // 16
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] >= 2 * (n_prompt_blocks - 1) * 16
    again = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12), use_tqdm=False)
    assert [c.token_ids for c in again[0].outputs] == [c.token_ids for c in out[0].outputs]
