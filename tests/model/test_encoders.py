"""Encoder models (BERT, XLM-RoBERTa, ModernBERT) through LLM.embed and LLM.score, against
sentence-transformers on the same files: SentenceTransformer.encode for embeddings (its
modules.json and Pooling config read as vLLM reads them), CrossEncoder.predict for rerank
scores. Tiny random models with tokenizers trained here (WordPiece, Unigram, BPE)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenloom import LLM, PoolingParams
from tokenloom.attention import encoder_only

sys.path.insert(0, str(Path(__file__).resolve().parent))
from encoder_helpers import (DOCS, QUERY, TEXTS, ce_scores, env_offline, save_cross_encoder,  # noqa: E402
                             save_sentence_transformer, st_embeddings)


@pytest.fixture(scope="module", autouse=True)
def _offline():
    with env_offline():
        yield

# kind -> the sentence-transformers Pooling mode its test model is saved with.
EMBEDDERS = {"bert": "cls", "xlm_roberta": "mean", "modernbert": "mean"}


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, runner="pooling", dtype="float32", **kwargs)


@pytest.fixture(scope="module", params=list(EMBEDDERS))
def embedder(request, tmp_path_factory):
    kind = request.param
    path = save_sentence_transformer(kind, str(tmp_path_factory.mktemp(kind) / "st"), pooling=EMBEDDERS[kind])
    llm = _llm(path)
    yield kind, path, llm
    llm.shutdown()


@pytest.fixture(scope="module")
def bert_reranker(tmp_path_factory):
    path = save_cross_encoder("bert", str(tmp_path_factory.mktemp("bert") / "ce"))
    llm = _llm(path)
    yield path, llm
    llm.shutdown()


def test_embeddings_match_sentence_transformers(embedder):
    kind, path, llm = embedder
    want = st_embeddings(path, TEXTS)
    outs = llm.embed(TEXTS, use_tqdm=False)
    got = torch.tensor([o.outputs.embedding for o in outs])
    assert got.shape == want.shape
    assert F.cosine_similarity(got, want).min() >= 0.99999, kind
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # One text alone pools as it did inside the batch (the padding-free batch keeps prompts apart).
    alone = torch.tensor(llm.embed([TEXTS[7]], use_tqdm=False)[0].outputs.embedding)
    torch.testing.assert_close(alone, got[7], atol=1e-6, rtol=0)


@pytest.mark.parametrize("kind", ["bert", pytest.param("xlm_roberta", marks=pytest.mark.slow),
                                  pytest.param("modernbert", marks=pytest.mark.slow)])
def test_rerank_scores_match_cross_encoder(kind, tmp_path_factory, request):
    if kind == "bert":
        path, llm = request.getfixturevalue("bert_reranker")
        owned = None
    else:
        # ModernBERT's classifier pools the mean of the prompt's rows (classifier_pooling).
        extra = {"classifier_pooling": "mean"} if kind == "modernbert" else {}
        path = save_cross_encoder(kind, str(tmp_path_factory.mktemp(kind) / "ce"), **extra)
        llm = owned = _llm(path)
    try:
        want = ce_scores(path, QUERY, DOCS)
        got = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
        assert got == pytest.approx(want, abs=1e-4)
    finally:
        if owned is not None:
            owned.shutdown()


def test_a_pair_reads_its_second_text_as_token_type_1(bert_reranker):
    path, llm = bert_reranker
    enc = llm.get_tokenizer()(QUERY, text_pair=DOCS[0])
    ids, types = enc["input_ids"], enc["token_type_ids"]
    assert 0 < sum(types) < len(types)
    score = llm.score(QUERY, DOCS[0], use_tqdm=False)[0].outputs.score
    with_types = llm.classify([{"prompt_token_ids": ids, "token_type_ids": types}], use_tqdm=False)[0].outputs.probs[0]
    without = llm.classify([{"prompt_token_ids": ids}], use_tqdm=False)[0].outputs.probs[0]
    assert with_types == pytest.approx(score, abs=1e-6)
    assert abs(without - score) > 1e-4  # the types change the score: they reach the embedding
    with pytest.raises(ValueError, match="token_type_ids must be 0s followed by 1s"):
        llm.classify([{"prompt_token_ids": ids, "token_type_ids": [1] + types[1:]}], use_tqdm=False)


def test_max_positions_bound_the_prompt_and_truncation_keeps_the_last(bert_reranker):
    _, llm = bert_reranker
    assert llm.llm_engine.max_model_len == 512  # as long as the model's positions, not one less
    ids = [5 + i % 50 for i in range(512)]
    assert len(llm.classify([ids], use_tqdm=False)[0].outputs.probs) == 1
    with pytest.raises(ValueError, match="max_model_len is 512: a prompt may be at most 512 tokens"):
        llm.classify([ids + [5]], use_tqdm=False)
    cut = llm.classify([ids + [6, 7]], PoolingParams(truncate_prompt_tokens=-1), use_tqdm=False)[0]
    assert cut.prompt_token_ids == (ids + [6, 7])[-512:]


def test_encoder_engine_runs_each_prompt_whole(embedder):
    kind, _, llm = embedder
    config = llm.llm_engine.config
    # Bidirectional attention needs the whole prompt in one step, and the cache holds no hidden states.
    assert not config.enable_chunked_prefill and not config.enable_prefix_caching
    assert config.max_num_batched_tokens >= llm.llm_engine.max_model_len
    assert config.pooler_config.pooling_type == EMBEDDERS[kind].upper()


@pytest.mark.parametrize("window", [None, 3])
def test_padding_free_attention_is_each_prompt_alone(window):
    torch.manual_seed(0)
    lens = [5, 1, 9, 4]
    positions = torch.cat([torch.arange(n) for n in lens])
    q, k, v = (torch.randn(len(positions), 2, 8) for _ in range(3))
    got = encoder_only.attend(q, k, v, encoder_only.plan(positions), 0.3, window)
    start = 0
    for n in lens:
        s = slice(start, start + n)
        mask = None
        if window is not None:
            p = torch.arange(n)
            mask = (p[:, None] - p[None, :]).abs() <= window
        want = F.scaled_dot_product_attention(q[s].transpose(0, 1), k[s].transpose(0, 1), v[s].transpose(0, 1),
                                              attn_mask=mask, scale=0.3).transpose(0, 1)
        torch.testing.assert_close(got[s], want, atol=1e-6, rtol=0)
        start += n
