"""Embeddings offline (`LLM(runner="pooling").embed / .encode`), as vLLM's: tiny random models
whose final hidden states are checked against transformers', pooled LAST (a *ForCausalLM run as an
embedding model), MEAN (a sentence-transformers checkpoint of a bare Qwen3Model, found from its
files) and CLS (pooler_config), through chunked prefill and the prefix cache."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import (  # noqa: E402
    embedding_reference,
    save_hf_dir,
    save_sentence_transformer_dir,
    tiny_hf_model,
)

from tokenloom import LLM, PoolingParams  # noqa: E402

# Of different lengths, one longer than the 16-token budget (chunked prefill), one of one token.
PROMPTS = ["The capital of France is Paris, and the capital of Italy is Rome, as everyone knows.",
           "Hello", "Once upon a time there was", "x"]
ENGINE = dict(max_num_batched_tokens=16, max_num_seqs=8, max_model_len=256, num_kv_blocks=64, dtype="float32")


@pytest.fixture(scope="module")
def models(tmp_path_factory, smollm2_path):
    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    root = tmp_path_factory.mktemp("embed")
    causal = tiny_hf_model("llama", vocab_size=len(tokenizer), seed=5)
    causal_dir = save_hf_dir(causal, tokenizer, str(root / "causal"))
    bare = tiny_hf_model("qwen3", vocab_size=len(tokenizer), seed=6).model  # a Qwen3Model: no LM head
    st_dir = save_sentence_transformer_dir(bare, tokenizer, str(root / "st"), pooling="mean",
                                           matryoshka_dimensions=[16, 32, 64])
    return {"causal": (causal_dir, causal), "st": (st_dir, bare), "tokenizer": tokenizer}


@pytest.fixture(scope="module")
def last_llm(models):
    llm = LLM(models["causal"][0], runner="pooling", **ENGINE)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def mean_llm(models):
    llm = LLM(models["st"][0], **ENGINE)  # runner auto: a checkpoint without an LM head pools
    yield llm
    llm.shutdown()


def ids_of(llm: LLM, prompt: str) -> list[int]:
    return llm.llm_engine.input_processor.encode_prompt(prompt)


def close(got, want) -> None:
    got = torch.as_tensor(got, dtype=torch.float32)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)


def test_last_token_embeddings_match_transformers(models, last_llm):
    model = models["causal"][1]
    outs = last_llm.embed(PROMPTS, use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)  # input order
    for prompt, out in zip(PROMPTS, outs):
        ids = ids_of(last_llm, prompt)
        assert out.prompt_token_ids == ids and out.finished
        assert out.outputs.hidden_size == 64
        close(out.outputs.embedding, F.normalize(embedding_reference(model, ids)[-1], dim=-1))
    assert len(ids_of(last_llm, PROMPTS[0])) > ENGINE["max_num_batched_tokens"]  # it ran in chunks


def test_last_token_pooling_reads_the_prefix_cache(models, last_llm):
    # LAST needs only the final token's state, which is always computed: the prompt's cached
    # blocks are reused, and the embedding is the same.
    prompt = "Again and again: " + PROMPTS[0]
    first, second = last_llm.embed([prompt], use_tqdm=False), last_llm.embed([prompt], use_tqdm=False)
    assert first[0].num_cached_tokens == 0 and second[0].num_cached_tokens >= 16
    close(second[0].outputs.embedding, torch.tensor(first[0].outputs.embedding))


def test_normalize_off_truncation_and_token_embed(models, last_llm):
    model = models["causal"][1]
    ids = ids_of(last_llm, PROMPTS[0])
    hidden = embedding_reference(model, ids)
    raw = last_llm.embed(PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    close(raw.outputs.embedding, hidden[-1])
    # The prompt's last 5 tokens only, run as a prompt of their own.
    cut = last_llm.embed(PROMPTS[0], truncate_prompt_tokens=5, use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:]
    close(cut.outputs.embedding, F.normalize(embedding_reference(model, ids[-5:])[-1], dim=-1))
    # token_embed: every prompt token's state, normalized row by row, across the chunks.
    tok = last_llm.encode(PROMPTS[:2], pooling_task="token_embed", use_tqdm=False)
    assert isinstance(tok[0].outputs.data, torch.Tensor)
    close(tok[0].outputs.data, F.normalize(hidden, dim=-1))
    close(tok[1].outputs.data, F.normalize(embedding_reference(model, ids_of(last_llm, PROMPTS[1])), dim=-1))
    emb = last_llm.encode(PROMPTS[1], pooling_task="embed", use_tqdm=False)[0]
    close(emb.outputs.data, F.normalize(embedding_reference(model, ids_of(last_llm, PROMPTS[1]))[-1], dim=-1))


def test_mean_pooling_from_sentence_transformers_files(models, mean_llm):
    assert mean_llm.llm_engine.config.runner == "pooling"
    assert mean_llm.llm_engine.config.pooler_config.pooling_type == "MEAN"
    model = models["st"][1]
    outs = mean_llm.embed(PROMPTS, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        hidden = embedding_reference(model, ids_of(mean_llm, prompt))
        close(out.outputs.embedding, F.normalize(hidden.mean(0), dim=-1))
    # Unnormalized: the mean itself (the first prompt ran in two chunks).
    raw = mean_llm.embed(PROMPTS[0], PoolingParams(normalize=False), use_tqdm=False)[0]
    close(raw.outputs.embedding, embedding_reference(model, ids_of(mean_llm, PROMPTS[0])).mean(0))
    # Every token's state counts, so no prompt block may come from the cache: a repeat
    # recomputes them all and agrees.
    again = mean_llm.embed(PROMPTS[0], use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    close(again.outputs.embedding, torch.tensor(outs[0].outputs.embedding))


def test_matryoshka_dimensions(models, mean_llm):
    hidden = embedding_reference(models["st"][1], ids_of(mean_llm, PROMPTS[2])).mean(0)
    short = mean_llm.embed(PROMPTS[2], PoolingParams(dimensions=16), use_tqdm=False)[0]
    close(short.outputs.embedding, F.normalize(hidden[:16], dim=-1))
    with pytest.raises(ValueError, match=r"dimensions is 20.*\[16, 32, 64\]"):
        mean_llm.embed(PROMPTS[2], PoolingParams(dimensions=20), use_tqdm=False)


def test_cls_pooling_from_pooler_config(models):
    """Also: a *ForCausalLM with an untied LM head, run as an embedding model, holds no LM head
    (nor a packed copy of one): it never computes logits."""
    model = models["causal"][1]
    assert not model.config.tie_word_embeddings
    with LLM(models["causal"][0], runner="pooling", pooler_config={"pooling_type": "CLS", "normalize": False},
             multiprocess=False, **ENGINE) as llm:
        ours = llm.llm_engine.engine_core.engine_core.executor.driver_worker.model_runner.model
        assert ours.lm_head is None and ours.packed_lm_head is None and ours.quant_lm_head is None
        with pytest.raises(RuntimeError, match="pooling model"):
            ours.compute_logits(torch.zeros(1, model.config.hidden_size))
        outs = llm.embed(PROMPTS[:2], use_tqdm=False)
        for prompt, out in zip(PROMPTS, outs):
            close(out.outputs.embedding, embedding_reference(model, ids_of(llm, prompt))[0])


def test_each_kind_of_request_only_on_its_engine(models, last_llm):
    with pytest.raises(ValueError, match="runner='pooling'.*does not generate"):
        last_llm.generate("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="dimensions is 8.*Matryoshka"):
        last_llm.embed("Hello", PoolingParams(dimensions=8), use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_task is required"):
        last_llm.encode("Hello", use_tqdm=False)
    with pytest.raises(ValueError, match="task must be one of embed, token_embed, classify"):
        PoolingParams(task="reward")
    assert last_llm.embed("Hello", use_tqdm=False)  # the engine took none of them
    with pytest.raises(ValueError, match="no language-model head.*runner='pooling'"):
        LLM(models["st"][0], runner="generate", **ENGINE)
    with pytest.raises(ValueError, match="pooler_config applies to pooling models"):
        LLM(models["causal"][0], pooler_config={"pooling_type": "MEAN"}, **ENGINE)
    with pytest.raises(ValueError, match="pooling_type must be one of LAST, MEAN, CLS"):
        LLM(models["causal"][0], runner="pooling", pooler_config={"pooling_type": "MAX"}, **ENGINE)
    with LLM(models["causal"][0], **ENGINE) as generating:
        assert not generating.llm_engine.config.is_pooling
        with pytest.raises(ValueError, match="This model generates.*runner='pooling'"):
            generating.embed("Hello", use_tqdm=False)


def test_the_embedded_model_embeds_from_its_quantized_weights():
    """The default model (SmolLM2's Q4_1 GGUF, computed as shipped) as an embedding model: its
    vectors are the float path's (the dequantized weights, whose hidden states follow
    transformers': tests/model) up to the quantized matmuls."""
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell sharply today."]
    vectors = {}
    for quantization in ("auto", None):
        with LLM(runner="pooling", max_model_len=256, quantization=quantization) as llm:
            assert llm.llm_engine.info.quantization.startswith("gguf" if quantization else "none")
            vectors[quantization] = torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])
    assert (F.cosine_similarity(vectors["auto"], vectors[None], dim=1) > 0.999).all()
    sim = vectors["auto"] @ vectors["auto"].T
    assert sim[0, 1] > sim[0, 2] and sim[0, 1] > sim[1, 2]  # the two cats are closest


def test_score_is_the_cosine_of_the_embeddings(models, mean_llm):
    """vLLM's LLM.score with an embedding model (bi-encoder): 1:N and N:N pairs, each the cosine
    similarity of transformers' pooled states (normalization aside: MEAN here)."""
    model = models["st"][1]

    def ref(text: str) -> torch.Tensor:
        return embedding_reference(model, ids_of(mean_llm, text)).mean(0)

    one_to_n = mean_llm.score(PROMPTS[0], PROMPTS[1:], use_tqdm=False)
    assert len(one_to_n) == 3 and all(o.finished for o in one_to_n)
    for text, out in zip(PROMPTS[1:], one_to_n):
        want = F.cosine_similarity(ref(PROMPTS[0]), ref(text), dim=0).item()
        assert abs(out.outputs.score - want) < 1e-5
        assert out.prompt_token_ids == ids_of(mean_llm, PROMPTS[0]) + ids_of(mean_llm, text)
    # A cosine, also of vectors the engine does not normalize.
    pairwise = mean_llm.score(PROMPTS[:2], PROMPTS[2:], use_tqdm=False, pooling_params=PoolingParams(normalize=False))
    for a, b, out in zip(PROMPTS[:2], PROMPTS[2:], pairwise):
        assert abs(out.outputs.score - F.cosine_similarity(ref(a), ref(b), dim=0).item()) < 1e-5
    assert abs(mean_llm.score(PROMPTS[1], PROMPTS[1], use_tqdm=False)[0].outputs.score - 1.0) < 1e-6
    with pytest.raises(ValueError, match="data_1 has 2 inputs and data_2 3"):
        mean_llm.score(PROMPTS[:2], PROMPTS[1:], use_tqdm=False)
