"""Causal LMs run as classifiers, as vLLM runs Qwen3-Reranker: `hf_overrides` (architectures,
`classifier_from_token`, `method` / `is_original_qwen3_reranker`) and `convert="classify"` make
the score head from LM-head rows. Checked against transformers' causal LM on the same random
weights: a two-way reranker's probability is the softmax of its "no" and "yes" logits at the
last token, a no_post_processing head's logits are the LM's logits of its tokens."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

from conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import save_hf_dir, tiny_hf_model  # noqa: E402

from tokenloom import LLM, PoolingParams  # noqa: E402

# vLLM's documented launch of Qwen3-Reranker (its model card's "yes"/"no" judgement).
QWEN3_RERANKER = {"architectures": ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
                  "is_original_qwen3_reranker": True}
# One longer than the 16-token budget (scored in chunks), one of one token.
PROMPTS = ["<Query>: Which city is the capital of France, and what river runs through it?\n<Document>: Paris.",
           "yes", "<Query>: bananas\n<Document>: Bananas are yellow."]
QUERY = "<Query>: What is the capital of France? "  # joined to " <Document>", not " " + "<Document>"
DOCS = ["<Document>: Paris is the capital of France.", "<Document>: Bananas are yellow."]
# A score template in the shape of vLLM's qwen3_reranker.jinja: the pair comes as the messages
# "query" and "document" (the texts then carry no markup of their own).
SCORE_TEMPLATE = ("<|im_start|>system\nSay whether the Document answers the Query: \"yes\" or \"no\".<|im_end|>\n"
                  "<|im_start|>user\n<Query>: {{ messages | selectattr('role', 'eq', 'query') | map(attribute='content') "
                  "| first }}\n<Document>: {{ messages | selectattr('role', 'eq', 'document') | "
                  "map(attribute='content') | first }}<|im_end|>\n<|im_start|>assistant\n")
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256, num_kv_blocks=64, dtype="float32")


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_path):
    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    root = tmp_path_factory.mktemp("from_token")
    # Untied (its LM head is a tensor of its own, read row by row) and tied (rows of the embedding).
    untied = tiny_hf_model("qwen3", vocab_size=len(tokenizer), seed=11, tie_word_embeddings=False)
    tied = tiny_hf_model("llama", vocab_size=len(tokenizer), seed=12, tie_word_embeddings=True)
    return {"untied": (save_hf_dir(untied, tokenizer, str(root / "untied")), untied),
            "tied": (save_hf_dir(tied, tokenizer, str(root / "tied")), tied), "tokenizer": tokenizer}


def rendered_pair_ids(tokenizer, query: str, document: str) -> list[int]:
    """What SCORE_TEMPLATE makes of a pair, rendered here by jinja2 itself."""
    import jinja2

    messages = [{"role": "query", "content": query}, {"role": "document", "content": document}]
    return tokenizer(jinja2.Template(SCORE_TEMPLATE).render(messages=messages))["input_ids"]


def last_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' causal-LM logits at the last token of one input: [vocab]."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1].float()


def test_qwen3_reranker_overrides_classify_and_score_like_the_lm(models):
    directory, model = models["untied"]
    tokenizer = models["tokenizer"]
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    llm = LLM(directory, hf_overrides=QWEN3_RERANKER, **ENGINE)  # runner auto: a classifier pools
    try:
        assert llm.llm_engine.config.runner == "pooling"
        outs = llm.classify(PROMPTS, use_tqdm=False)
        raw = llm.classify(PROMPTS[0], PoolingParams(use_activation=False), use_tqdm=False)[0]
        scores = llm.score(QUERY, DOCS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(tokenizer.encode(PROMPTS[0])) > 16
    for out, prompt in zip(outs, PROMPTS):
        logits = last_logits(model, tokenizer.encode(prompt))
        # The model card's probability: softmax over ("no", "yes"), the "yes" entry.
        want = torch.softmax(logits[[no, yes]], -1)[1].item()
        assert out.outputs.num_classes == 1
        assert out.outputs.probs[0] == pytest.approx(want, abs=1e-5)
    logits = last_logits(model, tokenizer.encode(PROMPTS[0]))
    assert raw.outputs.probs[0] == pytest.approx((logits[yes] - logits[no]).item(), abs=1e-4)
    # A one-label classifier is a cross-encoder: each pair read as one input, for a language
    # model the two texts joined (vLLM's use_sep_token false), not the tokenizer's pair encoding.
    for out, doc in zip(scores, DOCS):
        ids = tokenizer(QUERY + doc)["input_ids"]
        assert out.prompt_token_ids == ids != tokenizer(QUERY, text_pair=doc)["input_ids"]
        want = torch.softmax(last_logits(model, ids)[[no, yes]], -1)[1].item()
        assert out.outputs.score == pytest.approx(want, abs=1e-5)
    assert len({round(o.outputs.probs[0], 4) for o in outs}) == len(PROMPTS)  # the inputs are told apart


def test_convert_classify_takes_the_lm_logits_of_its_tokens(models):
    """convert="classify" with method no_post_processing: one label per token, the LM's own logits
    of those tokens (a tied model's rows are its embedding's)."""
    directory, model = models["tied"]
    tokenizer = models["tokenizer"]
    tokens = ["yes", "no", "maybe"]
    ids = tokenizer.convert_tokens_to_ids(tokens)
    llm = LLM(directory, convert="classify", hf_overrides={"classifier_from_token": tokens,
                                                           "method": "no_post_processing"}, **ENGINE)
    try:
        outs = llm.classify(PROMPTS, use_tqdm=False)
        raw = llm.classify(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    finally:
        llm.shutdown()
    for out, logit_out, prompt in zip(outs, raw, PROMPTS):
        logits = last_logits(model, tokenizer.encode(prompt))[ids]
        assert out.outputs.num_classes == 3
        torch.testing.assert_close(torch.tensor(logit_out.outputs.probs), logits, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), torch.softmax(logits, -1), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("overrides, convert, message", [
    (QWEN3_RERANKER | {"classifier_from_token": ["no", "nope-token"]}, "auto",
     r"classifier_from_token \['nope-token'\] not in the tokenizer's vocabulary"),
    (QWEN3_RERANKER | {"classifier_from_token": ["no", "yes", "maybe"]}, "auto",
     "method from_2_way_softmax takes two classifier_from_token"),
    ({"classifier_from_token": ["no", "yes"]}, "classify", "method must be one of from_2_way_softmax, no_post_processing"),
    ({"classifier_from_token": ["no", "yes"], "method": "from_2_way_softmax"}, "auto",
     "also set architectures to \\*ForSequenceClassification in hf_overrides, or convert='classify'"),
    ({"classifier_from_token": "yes", "method": "no_post_processing"}, "classify",
     "classifier_from_token must be a list of vocabulary tokens"),
    ({"num_hidden_layers": 2, "hidden_act": "gelu"}, "auto", "unsupported hidden_act 'gelu'"),
])
def test_bad_overrides_are_named_before_the_engine_starts(models, overrides, convert, message):
    with pytest.raises(ValueError, match=message):
        LLM(models["untied"][0], hf_overrides=overrides, convert=convert, runner="pooling", **ENGINE)


def test_what_cannot_be_overridden(models, smollm2_path):
    with pytest.raises(ValueError, match="hf_overrides replaces keys of an HF directory's config.json, and a GGUF"):
        LLM(smollm2_path, hf_overrides={"num_hidden_layers": 2}, **ENGINE)
    with pytest.raises(ValueError, match="convert='classify' needs an HF directory"):
        LLM(smollm2_path, convert="classify", **ENGINE)
    with pytest.raises(ValueError, match="hf_overrides must be a dict of config.json keys .a function cannot"):
        LLM(models["untied"][0], hf_overrides=lambda cfg: cfg, **ENGINE)
    with pytest.raises(ValueError, match="convert='classify' makes a pooling model"):
        LLM(models["untied"][0], convert="classify", runner="generate", **ENGINE)
    # Without classifier_from_token a converted model reads its score head from the checkpoint,
    # which a causal LM does not have: the engine's start-up error names the tensor.
    with pytest.raises(RuntimeError, match="score.weight: missing tensor"):
        LLM(models["untied"][0], convert="classify", **ENGINE)


@pytest.mark.slow
def test_served_reranker_with_vllms_launch_flags(models, tmp_path):
    """`tokenloom serve DIR --hf_overrides JSON --chat-template FILE` (vLLM's launch of
    Qwen3-Reranker, its underscore spelling too): /rerank and /score render each pair with the
    score template and give transformers' probabilities; the converted model does not generate."""
    directory, model = models["untied"]
    tokenizer = models["tokenizer"]
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])

    def p_yes(ids: list[int]) -> float:
        return torch.softmax(last_logits(model, ids)[[no, yes]], -1)[1].item()

    template = tmp_path / "reranker.jinja"
    template.write_text(SCORE_TEMPLATE)
    query, docs = "capital of France?", ["Paris.", "Bananas.", "Lyon is in France."]
    want = [p_yes(rendered_pair_ids(tokenizer, query, d)) for d in docs]
    srv = ServerProcess(["--model", directory, "--hf_overrides", json.dumps(QWEN3_RERANKER), "--chat-template",
                         str(template), "--dtype", "float32", "--max-model-len", "256", "--num-kv-blocks", "64",
                         "--served-model-name", "reranker"], None)
    try:
        r = httpx.post(srv.url("/v1/rerank"), json={"model": "reranker", "query": query, "documents": docs}, timeout=60)
        assert r.status_code == 200, r.text
        results = r.json()["results"]
        assert [x["index"] for x in results] == sorted(range(len(docs)), key=lambda i: -want[i])
        assert [x["relevance_score"] for x in results] == pytest.approx(sorted(want, reverse=True), abs=1e-5)
        r = httpx.post(srv.url("/score"), json={"text_1": query, "text_2": docs}, timeout=60)
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-5)
        assert r.json()["usage"]["prompt_tokens"] == sum(len(rendered_pair_ids(tokenizer, query, d)) for d in docs)
        r = httpx.post(srv.url("/v1/completions"), json={"prompt": "hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 400 and "does not generate" in r.json()["error"]["message"]
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def test_score_template_offline(models):
    """LLM.score(..., chat_template=...) renders each pair with the score template; an embedding
    model refuses one."""
    directory, model = models["untied"]
    tokenizer = models["tokenizer"]
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    llm = LLM(directory, hf_overrides=QWEN3_RERANKER, **ENGINE)
    try:
        outs = llm.score("capital of France?", ["Paris.", "Bananas."], chat_template=SCORE_TEMPLATE, use_tqdm=False)
        with pytest.raises(ValueError, match="chat_template is the score template, and it could not render"):
            llm.score("a", "b", chat_template="{{ messages[5].content }}", use_tqdm=False)
    finally:
        llm.shutdown()
    for out, doc in zip(outs, ["Paris.", "Bananas."]):
        ids = rendered_pair_ids(tokenizer, "capital of France?", doc)
        assert out.prompt_token_ids == ids
        assert out.outputs.score == pytest.approx(torch.softmax(last_logits(model, ids)[[no, yes]], -1)[1].item(),
                                                  abs=1e-5)
