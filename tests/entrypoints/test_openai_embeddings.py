"""POST /v1/embeddings on `tokenloom serve --runner pooling`, with the official `openai` client:
its default base64 encoding and floats, every input form, usage, vLLM's extras, and a 400 naming
the field for what an embedding server cannot do. The vectors are checked against transformers'."""
from __future__ import annotations

import base64
import os
import sys
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F

from conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import embedding_reference, save_hf_dir, tiny_hf_model  # noqa: E402

TEXTS = ["The capital of France is Paris, and the capital of Italy is Rome, as everyone knows.", "Hello", "A b c"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    model = tiny_hf_model("llama", vocab_size=len(tokenizer), seed=5)
    return save_hf_dir(model, tokenizer, str(tmp_path_factory.mktemp("embed_server") / "m")), model, tokenizer


@pytest.fixture(scope="module")
def server(tiny):
    srv = ServerProcess(["--model", tiny[0], "--runner", "pooling", "--dtype", "float32", "--max-model-len", "256",
                         "--num-kv-blocks", "64", "--max-num-batched-tokens", "16",
                         "--served-model-name", "embedder", "--trust-request-chat-template"], None)
    try:
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def reference(tiny, ids: list[int]) -> torch.Tensor:
    return F.normalize(embedding_reference(tiny[1], ids)[-1], dim=-1)


def text_ids(tiny, text: str) -> list[int]:
    return list(tiny[2].encode(text))


def test_official_client_embeddings(server, tiny):
    client = server.client()
    before = server.wait_idle()
    # The client asks for base64 unless told otherwise, and decodes it itself.
    r = client.embeddings.create(model="embedder", input=TEXTS)
    after = server.wait_idle()  # each input is a request of the engine's, counted as one
    stop = 'tokenloom:request_success_total{finished_reason="stop",model_name="embedder"}'
    assert after[stop] - before[stop] == 3
    assert after["tokenloom:prompt_tokens_total"] - before["tokenloom:prompt_tokens_total"] == r.usage.prompt_tokens
    assert r.object == "list" and r.model == "embedder" and [d.index for d in r.data] == [0, 1, 2]
    for text, d in zip(TEXTS, r.data):
        assert d.object == "embedding"
        torch.testing.assert_close(torch.tensor(d.embedding), reference(tiny, text_ids(tiny, text)), atol=2e-5, rtol=1e-4)
    # SageMaker's /invocations (vLLM's too): an `input` body on an embedding server embeds.
    invoked = httpx.post(server.url("/invocations"), json={"input": TEXTS[0]}, headers=server.headers, timeout=60).json()
    assert invoked["data"][0]["object"] == "embedding"
    torch.testing.assert_close(torch.tensor(invoked["data"][0]["embedding"]), torch.tensor(r.data[0].embedding),
                               atol=1e-6, rtol=1e-5)
    assert r.usage.prompt_tokens == sum(len(text_ids(tiny, t)) for t in TEXTS) == r.usage.total_tokens
    floats = client.embeddings.create(model="embedder", input=TEXTS[1], encoding_format="float")
    assert floats.data[0].embedding == r.data[1].embedding
    # Token ids, one prompt or several.
    ids = text_ids(tiny, TEXTS[2])
    one = client.embeddings.create(model="embedder", input=ids, encoding_format="float")
    many = client.embeddings.create(model="embedder", input=[ids, ids[:2]], encoding_format="float")
    # (Equal to float32 rounding: a step's batch changes the matmuls' summation order.)
    for got in (one.data[0].embedding, many.data[0].embedding):
        torch.testing.assert_close(torch.tensor(got), torch.tensor(r.data[2].embedding), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(many.data[1].embedding), reference(tiny, ids[:2]), atol=2e-5, rtol=1e-4)


def test_raw_base64_and_vllm_extras(server, tiny):
    body = {"model": "embedder", "input": TEXTS[0], "encoding_format": "base64", "normalize": False,
            "truncate_prompt_tokens": 6}
    r = httpx.post(server.url("/v1/embeddings"), json=body, timeout=60).json()
    vec = np.frombuffer(base64.b64decode(r["data"][0]["embedding"]), dtype="<f4")
    ids = text_ids(tiny, TEXTS[0])[-6:]
    torch.testing.assert_close(torch.from_numpy(vec.copy()), embedding_reference(tiny[1], ids)[-1], atol=2e-5, rtol=1e-4)
    assert r["usage"]["prompt_tokens"] == 6 and r["id"].startswith("embd-")
    # add_special_tokens=false: the text's own tokens (this tokenizer adds none: the same vector).
    plain = httpx.post(server.url("/v1/embeddings"), json={"input": TEXTS[1], "add_special_tokens": False,
                                                           "encoding_format": "float"}, timeout=60).json()
    torch.testing.assert_close(torch.tensor(plain["data"][0]["embedding"]), reference(tiny, text_ids(tiny, TEXTS[1])),
                               atol=2e-5, rtol=1e-4)


def test_chat_messages_are_one_input(server, tiny):
    """vLLM's chat form: `messages` rendered by the chat template (no generation prompt by default,
    no special tokens on top of the template's) and embedded as one input."""
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."},
                {"role": "assistant", "content": "Blue."}]
    tokenizer = tiny[2]
    for extra, generation_prompt in (({}, False), ({"add_generation_prompt": True}, True)):
        r = httpx.post(server.url("/v1/embeddings"), json={"messages": messages, "encoding_format": "float", **extra},
                       timeout=60)
        assert r.status_code == 200, r.text
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        ids = list(tokenizer.encode(text, add_special_tokens=False))
        assert len(r.json()["data"]) == 1 and r.json()["usage"]["prompt_tokens"] == len(ids)
        torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), reference(tiny, ids),
                                   atol=2e-5, rtol=1e-4)
    for body in ({"input": "hi", "messages": messages}, {}):  # exactly one of the two
        r = httpx.post(server.url("/v1/embeddings"), json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    bad = httpx.post(server.url("/v1/embeddings"), json={"messages": messages, "chat_template": "{{ nope( }}"}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "messages", bad.text


@pytest.mark.parametrize("body, param", [
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[1, 2], []]}, "input"),
    ({"input": "hi", "dimensions": 8}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "bytes"}, "encoding_format"),
    ({"input": [10**9]}, "input"),
    ({"input": "hi " * 400}, "input"),
    ({"input": "hi", "model": "nope"}, "model"),
])
def test_bad_requests_name_their_field(server, body, param):
    r = httpx.post(server.url("/v1/embeddings"), json=body, timeout=60)
    assert r.status_code == (404 if param == "model" else 400), r.text
    assert r.json()["error"]["param"] == param, r.text


def test_an_embedding_server_does_not_generate(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.chat.completions.create(model="embedder", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    with pytest.raises(openai.BadRequestError, match="does not generate"):
        client.completions.create(model="embedder", prompt="Hi", max_tokens=4)
    assert client.embeddings.create(model="embedder", input="still up").data  # nothing broke


def test_score_and_rerank(server, tiny):
    def vec(text: str) -> torch.Tensor:
        return reference(tiny, text_ids(tiny, text))

    query, docs = "capital of France", ["Paris is the capital of France.", "Bananas are yellow.", "Hello"]
    want = [F.cosine_similarity(vec(query), vec(d), dim=0).item() for d in docs]
    for path in ("/score", "/v1/score"):
        r = httpx.post(server.url(path), json={"model": "embedder", "text_1": query, "text_2": docs}, timeout=60)
        assert r.status_code == 200, r.text
        body = r.json()
        assert [d["index"] for d in body["data"]] == [0, 1, 2] and body["data"][0]["object"] == "score"
        assert max(abs(d["score"] - w) for d, w in zip(body["data"], want)) < 1e-5
        assert body["usage"]["prompt_tokens"] == sum(len(text_ids(tiny, t)) for t in [query, *docs])
    pairwise = httpx.post(server.url("/score"), json={"text_1": docs[:2], "text_2": docs[1:]}, timeout=60).json()
    assert abs(pairwise["data"][0]["score"] - F.cosine_similarity(vec(docs[0]), vec(docs[1]), dim=0).item()) < 1e-5
    order = sorted(range(3), key=lambda i: -want[i])
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        r = httpx.post(server.url(path), json={"query": query, "documents": docs, "top_n": 2}, timeout=60).json()
        assert [x["index"] for x in r["results"]] == order[:2]
        assert r["results"][0]["document"]["text"] == docs[order[0]]
        assert abs(r["results"][0]["relevance_score"] - want[order[0]]) < 1e-5
    bad = httpx.post(server.url("/score"), json={"text_1": docs[:2], "text_2": docs}, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "text_1", bad.text
    empty = httpx.post(server.url("/rerank"), json={"query": query, "documents": []}, timeout=60)
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "documents", empty.text
    # /pooling: every token's final state by default (token_embed), in base64 if asked.
    ids = text_ids(tiny, TEXTS[0])
    rows = F.normalize(embedding_reference(tiny[1], ids), dim=-1)
    pooled = httpx.post(server.url("/pooling"), json={"input": TEXTS[0]}, timeout=60).json()
    torch.testing.assert_close(torch.tensor(pooled["data"][0]["data"]), rows, atol=2e-5, rtol=1e-4)
    b64 = httpx.post(server.url("/pooling"), json={"input": TEXTS[0], "task": "embed", "encoding_format": "base64"},
                     timeout=60).json()["data"][0]["data"]
    torch.testing.assert_close(torch.from_numpy(np.frombuffer(base64.b64decode(b64), dtype="<f4").copy()), rows[-1],
                               atol=2e-5, rtol=1e-4)
    bad_task = httpx.post(server.url("/pooling"), json={"input": query, "task": "token_classify"}, timeout=60)
    assert bad_task.status_code == 400 and bad_task.json()["error"]["param"] == "task", bad_task.text
    # An embedding model does not classify: /classify is a 400 naming the model.
    cls = httpx.post(server.url("/classify"), json={"input": query}, timeout=60)
    assert cls.status_code == 400 and cls.json()["error"]["code"] == "model_not_classifier", cls.text
