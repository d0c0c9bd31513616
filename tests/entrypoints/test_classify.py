"""Sequence classifiers (`*ForSequenceClassification`, vLLM's classify task) offline and on the
server: tiny random transformers classifiers, their probabilities checked against transformers'
own logits. A three-label Llama classifies (`LLM.classify`, POST /classify); a one-label Qwen2 is
a cross-encoder (`LLM.score`, POST /score and /rerank read each pair together)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
import torch

from conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import GEMMA3_WINDOW, save_hf_dir, tiny_gemma3, tiny_hf_classifier, tiny_hf_model  # noqa: E402

from tokenloom import LLM, PoolingParams  # noqa: E402

LABELS = ["positive", "negative", "neutral"]  # id2label's order, not the alphabet's
# One longer than the 16-token budget (its classification runs in chunks), one of one token.
PROMPTS = ["The film was long, the plot was thin, and the actors seemed to be reading their lines off cards.",
           "Great!", "It rained on Tuesday", "x"]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "France borders Spain and Italy."]
SEP = "<|endoftext|>"  # the cross-encoder's tokenizer puts it between a pair's texts
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256, num_kv_blocks=64, dtype="float32")


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_path):
    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    root = tmp_path_factory.mktemp("classify")
    labeled = tiny_hf_classifier("llama", len(tokenizer), LABELS, seed=3)
    cross = tiny_hf_classifier("qwen2", len(tokenizer), ["relevant"], seed=4)
    embedder = tiny_hf_model("llama", vocab_size=len(tokenizer), seed=5)
    cross_dir = save_hf_dir(cross, tokenizer, str(root / "cross"))
    return {"labeled": (save_hf_dir(labeled, tokenizer, str(root / "labeled")), labeled),
            "cross": (cross_dir, cross, with_pair_template(cross_dir)),
            "embedder": save_hf_dir(embedder, tokenizer, str(root / "embedder")), "tokenizer": tokenizer}


def with_pair_template(directory: str):
    """Gives the checkpoint's tokenizer a pair template with a separator between the two texts (as
    cross-encoders' tokenizers have), and returns it as transformers loads it: a pair is read
    as the tokenizer encodes a pair, not as the two texts joined."""
    import transformers
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    path = os.path.join(directory, "tokenizer.json")
    backend = Tokenizer.from_file(path)
    backend.post_processor = TemplateProcessing(single="$A", pair=f"$A {SEP} $B:1",
                                                special_tokens=[(SEP, backend.token_to_id(SEP))])
    backend.save(path)
    return transformers.AutoTokenizer.from_pretrained(directory)


def hf_token_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' classifier logits at every token of one input: [tokens, labels]."""
    with torch.no_grad():
        return model.score(model.model(torch.tensor([ids])).last_hidden_state)[0].float()


def hf_logits(model, ids: list[int]) -> torch.Tensor:
    """transformers' classifier logits of one input (the last token's state through `score`)."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def pair_ids(tokenizer, a: str, b: str) -> list[int]:
    return tokenizer(a, text_pair=b)["input_ids"]


@pytest.fixture(scope="module")
def labeled_llm(models):
    llm = LLM(models["labeled"][0], **ENGINE)  # runner auto: a classifier has no LM head, so it pools
    yield llm
    llm.shutdown()


def test_classify_matches_transformers(labeled_llm, models):
    llm, model, tokenizer = labeled_llm, models["labeled"][1], models["tokenizer"]
    assert llm.llm_engine.config.runner == "pooling"
    outs = llm.classify(PROMPTS, use_tqdm=False)
    logits = [hf_logits(model, tokenizer.encode(p)) for p in PROMPTS]
    assert len(tokenizer.encode(PROMPTS[0])) > 16  # chunked: the last chunk's last row is pooled
    for out, want in zip(outs, logits):
        assert out.outputs.num_classes == 3 and out.finished
        torch.testing.assert_close(torch.tensor(out.outputs.probs), torch.softmax(want, -1), atol=1e-5, rtol=1e-4)
    assert len({int(torch.tensor(o.outputs.probs).argmax()) for o in outs}) > 1  # the inputs are told apart
    # use_activation=False: the logits themselves; LLM.encode(pooling_task="classify") as vLLM's.
    raw = llm.classify(PROMPTS[1], PoolingParams(use_activation=False), use_tqdm=False)[0]
    torch.testing.assert_close(torch.tensor(raw.outputs.probs), logits[1], atol=1e-5, rtol=1e-4)
    data = llm.encode(PROMPTS[2], pooling_task="classify", use_tqdm=False)[0].outputs.data
    torch.testing.assert_close(data, torch.softmax(logits[2], -1), atol=1e-5, rtol=1e-4)
    # A classification pools the last token, which is always computed: it reads the prefix cache.
    again = llm.classify(PROMPTS[0], use_tqdm=False)[0]
    assert again.num_cached_tokens >= 16 and again.outputs.probs == pytest.approx(outs[0].outputs.probs, abs=1e-6)
    # token_classify: every prompt token's probabilities (the long prompt in chunks; no cache read).
    ids = tokenizer.encode(PROMPTS[0])
    per_token = llm.encode(PROMPTS[0], pooling_task="token_classify", use_tqdm=False)[0]
    assert per_token.num_cached_tokens == 0
    torch.testing.assert_close(per_token.outputs.data, torch.softmax(hf_token_logits(model, ids), -1),
                               atol=1e-5, rtol=1e-4)
    # Truncated to its last 4 tokens, as vLLM's truncate_prompt_tokens.
    ids = tokenizer.encode(PROMPTS[0])
    cut = llm.classify(PROMPTS[0], truncate_prompt_tokens=4, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-4:]
    torch.testing.assert_close(torch.tensor(cut.outputs.probs), torch.softmax(hf_logits(model, ids[-4:]), -1),
                               atol=1e-5, rtol=1e-4)


def test_a_classifier_runs_only_what_it_can(labeled_llm, models):
    llm = labeled_llm
    with pytest.raises(ValueError, match="task is 'embed', but this model is a sequence classifier .3 labels.: it runs the classify"):
        llm.embed(PROMPTS[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="classifies into 3 labels: classify with it instead"):
        llm.score(QUERY, DOCS, use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions applies to the embed task only"):
        llm.classify(PROMPTS[:1], PoolingParams(dimensions=2), use_tqdm=False)
    from tokenloom import SamplingParams

    with pytest.raises(ValueError, match="does not generate text"):
        llm.generate(PROMPTS[:1], SamplingParams(max_tokens=2), use_tqdm=False)
    embedder = LLM(models["embedder"], runner="pooling", **ENGINE)
    try:
        with pytest.raises(ValueError, match="task is 'classify', which needs a sequence classification model"):
            embedder.classify(PROMPTS[:1], use_tqdm=False)
    finally:
        embedder.shutdown()
    with pytest.raises(ValueError, match="no language-model head .* embed or classify"):
        LLM(models["labeled"][0], runner="generate", **ENGINE)


def test_cross_encoder_scores_pairs_read_together(models):
    directory, model, tokenizer = models["cross"]
    llm = LLM(directory, **ENGINE)
    try:
        one_to_many = llm.score(QUERY, DOCS, use_tqdm=False)
        pairwise = llm.score([QUERY, DOCS[1]], [DOCS[0], QUERY], use_tqdm=False)
        with pytest.raises(ValueError, match="data_2: a cross-encoder scores texts read as pairs"):
            llm.score(QUERY, [[5, 6, 7]], use_tqdm=False)
    finally:
        llm.shutdown()
    for out, doc in zip(one_to_many, DOCS):
        ids = pair_ids(tokenizer, QUERY, doc)
        assert out.prompt_token_ids == ids and tokenizer.convert_tokens_to_ids(SEP) in ids
        assert out.outputs.score == pytest.approx(torch.sigmoid(hf_logits(model, ids))[0].item(), abs=1e-5)
    for out, (a, b) in zip(pairwise, [(QUERY, DOCS[0]), (DOCS[1], QUERY)]):
        ids = pair_ids(tokenizer, a, b)
        assert out.outputs.score == pytest.approx(torch.sigmoid(hf_logits(model, ids))[0].item(), abs=1e-5)
    assert pairwise[0].outputs.score == pytest.approx(one_to_many[0].outputs.score, abs=1e-6)
    # The order of a pair matters to a cross-encoder (it reads the two texts as one input).
    assert pairwise[1].outputs.score != pytest.approx(one_to_many[1].outputs.score, abs=1e-4)


@pytest.fixture(scope="module")
def servers(models):
    started = {}
    try:
        for name in ("labeled", "cross"):
            started[name] = ServerProcess(["--model", models[name][0], "--runner", "pooling", "--dtype", "float32",
                                           "--max-model-len", "256", "--num-kv-blocks", "64",
                                           "--max-num-batched-tokens", "16", "--served-model-name", name], None)
        yield started
    finally:
        for srv in started.values():
            srv.stop()
            os.unlink(srv.log.name)


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url(path), json=body, timeout=60)


def test_classify_route(servers, models):
    srv, model, tokenizer = servers["labeled"], models["labeled"][1], models["tokenizer"]
    r = post(srv, "/classify", {"model": "labeled", "input": PROMPTS[:3]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == "labeled" and body["id"].startswith("classify")
    for i, (d, prompt) in enumerate(zip(body["data"], PROMPTS)):
        want = torch.softmax(hf_logits(model, tokenizer.encode(prompt)), -1)
        assert d["index"] == i and d["num_classes"] == 3
        torch.testing.assert_close(torch.tensor(d["probs"]), want, atol=1e-5, rtol=1e-4)
        assert d["label"] == LABELS[int(want.argmax())]
    tokens = sum(len(tokenizer.encode(p)) for p in PROMPTS[:3])
    assert body["usage"]["prompt_tokens"] == tokens == body["usage"]["total_tokens"]
    invoked = post(srv, "/invocations", {"input": PROMPTS[:3]}).json()  # SageMaker's route: a classification
    torch.testing.assert_close(torch.tensor([d["probs"] for d in invoked["data"]]),
                               torch.tensor([d["probs"] for d in body["data"]]), atol=1e-6, rtol=1e-5)
    # Token ids, vLLM's /v1 alias, the logits with use_activation false.
    ids = tokenizer.encode(PROMPTS[1])
    raw = post(srv, "/v1/classify", {"input": ids, "use_activation": False}).json()["data"][0]["probs"]
    torch.testing.assert_close(torch.tensor(raw), hf_logits(model, ids), atol=1e-5, rtol=1e-4)
    # /pooling: by default every token's probabilities (token_classify); the task as asked.
    ids = tokenizer.encode(PROMPTS[0])
    pooled = post(srv, "/pooling", {"input": PROMPTS[0]}).json()
    assert pooled["data"][0]["object"] == "pooling" and pooled["id"].startswith("pool")
    torch.testing.assert_close(torch.tensor(pooled["data"][0]["data"]), torch.softmax(hf_token_logits(model, ids), -1),
                               atol=1e-5, rtol=1e-4)
    one = post(srv, "/pooling", {"input": PROMPTS[0], "task": "classify", "use_activation": False}).json()
    torch.testing.assert_close(torch.tensor(one["data"][0]["data"]), hf_logits(model, ids), atol=1e-5, rtol=1e-4)
    # Chat messages: rendered by the template into one input, as for embeddings.
    messages = [{"role": "user", "content": PROMPTS[0]}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, tokenize=False), add_special_tokens=False)
    chat = post(srv, "/classify", {"messages": messages}).json()
    assert chat["usage"]["prompt_tokens"] == len(ids)
    torch.testing.assert_close(torch.tensor(chat["data"][0]["probs"]), torch.softmax(hf_logits(model, ids), -1),
                               atol=1e-5, rtol=1e-4)
    # What a three-label classifier cannot do: a 400 naming the field.
    for path, req, param in [("/score", {"text_1": QUERY, "text_2": DOCS}, "model"),
                             ("/rerank", {"query": QUERY, "documents": DOCS}, "model"),
                             ("/v1/embeddings", {"input": "hi"}, "model"),
                             ("/classify", {"input": []}, "input"),
                             ("/pooling", {"input": "hi", "task": "reward"}, "task"),
                             ("/pooling", {"input": "hi", "task": "embed"}, "task"),
                             ("/classify", {"input": "hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens")]:
        r = post(srv, path, req)
        assert r.status_code == 400, (path, r.text)
        assert r.json()["error"]["param"] == param, (path, r.json())


def test_cross_encoder_routes(servers, models):
    srv, (_, model, tokenizer) = servers["cross"], models["cross"]
    want = [torch.sigmoid(hf_logits(model, pair_ids(tokenizer, QUERY, d)))[0].item() for d in DOCS]
    r = post(srv, "/score", {"model": "cross", "text_1": QUERY, "text_2": DOCS})
    assert r.status_code == 200, r.text
    body = r.json()
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    assert [d["score"] for d in body["data"]] == pytest.approx(want, abs=1e-5)
    assert body["usage"]["prompt_tokens"] == sum(len(pair_ids(tokenizer, QUERY, d)) for d in DOCS)
    r = post(srv, "/rerank", {"query": QUERY, "documents": DOCS, "top_n": 2})
    assert r.status_code == 200, r.text
    invoked = post(srv, "/invocations", {"query": QUERY, "documents": DOCS, "top_n": 2}).json()["results"]
    assert [(x["index"], x["document"]) for x in invoked] == [(x["index"], x["document"]) for x in r.json()["results"]]
    assert [x["relevance_score"] for x in invoked] == pytest.approx([x["relevance_score"] for x in r.json()["results"]])
    results = r.json()["results"]
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in results] == best
    assert [x["relevance_score"] for x in results] == pytest.approx([want[i] for i in best], abs=1e-5)
    assert results[0]["document"] == {"text": DOCS[best[0]]}


def test_classify_with_tensor_parallelism(models, labeled_llm):
    """Two tensor-parallel ranks give one rank's probabilities (the classifier has no LM head to
    shard: only the embedding's vocabulary is split)."""
    want = [o.outputs.probs for o in labeled_llm.classify(PROMPTS[:2], use_tqdm=False)]
    llm = LLM(models["labeled"][0], tensor_parallel_size=2, **ENGINE)
    try:
        got = [o.outputs.probs for o in llm.classify(PROMPTS[:2], use_tqdm=False)]
    finally:
        llm.shutdown()
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-5)


def test_gemma3_classifier_matches_transformers(models, tmp_path):
    """Gemma3TextForSequenceClassification (Gemma 3 270M is a common base for small classifiers):
    its sliding-window layers and norms, the score head without the LM's logit softcapping."""
    tokenizer = models["tokenizer"]
    model = tiny_gemma3(len(tokenizer), seed=7, labels=["spam", "ham"])
    assert model.config.final_logit_softcapping is not None  # the LM's, not applied to the score
    directory = save_hf_dir(model, tokenizer, str(tmp_path / "gemma3-classifier"))
    llm = LLM(directory, **ENGINE)
    try:
        outs = llm.classify(PROMPTS, use_tqdm=False)
    finally:
        llm.shutdown()
    assert len(tokenizer.encode(PROMPTS[0])) > 2 * GEMMA3_WINDOW  # read through the sliding windows
    for out, prompt in zip(outs, PROMPTS):
        want = torch.softmax(hf_logits(model, tokenizer.encode(prompt)), -1)
        torch.testing.assert_close(torch.tensor(out.outputs.probs), want, atol=1e-5, rtol=1e-4)
