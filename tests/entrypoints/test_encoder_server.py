"""Encoder models behind the real HTTP server (`tokenloom serve`): a BERT embedder's
/v1/embeddings against SentenceTransformer.encode, a BERT cross-encoder's /rerank and /score
against CrossEncoder.predict, on the same files (tests/model/encoder_helpers.py)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest
import torch
import torch.nn.functional as F

from conftest import ServerProcess

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from encoder_helpers import (DOCS, QUERY, TEXTS, ce_scores, env_offline, save_cross_encoder,  # noqa: E402
                             save_sentence_transformer, st_embeddings)


@pytest.fixture(scope="module", autouse=True)
def _offline():
    with env_offline():
        yield


def _serve(path: str, name: str):
    srv = ServerProcess(["--model", path, "--dtype", "float32", "--served-model-name", name], None)
    try:
        yield srv
    finally:
        srv.stop()
        os.unlink(srv.log.name)


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    path = save_sentence_transformer("bert", str(tmp_path_factory.mktemp("bert") / "st"), pooling="mean")
    for srv in _serve(path, "embedder"):  # runner auto: a BertModel pools
        yield path, srv


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    path = save_cross_encoder("bert", str(tmp_path_factory.mktemp("bert") / "ce"))
    for srv in _serve(path, "reranker"):
        yield path, srv


def test_embeddings_route_matches_sentence_transformers(embedder):
    path, srv = embedder
    r = srv.client().embeddings.create(model="embedder", input=TEXTS, encoding_format="float")
    got = torch.tensor([d.embedding for d in r.data])
    want = st_embeddings(path, TEXTS)
    assert F.cosine_similarity(got, want).min() >= 0.99999
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_rerank_and_score_routes_match_cross_encoder(reranker):
    path, srv = reranker
    want = ce_scores(path, QUERY, DOCS)
    r = httpx.post(srv.url("/rerank"), json={"model": "reranker", "query": QUERY, "documents": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(DOCS)), key=lambda i: -want[i])
    assert [x["relevance_score"] for x in results] == pytest.approx(sorted(want, reverse=True), abs=1e-4)
    r = httpx.post(srv.url("/score"), json={"model": "reranker", "text_1": QUERY, "text_2": DOCS}, timeout=60)
    assert r.status_code == 200, r.text
    assert [d["score"] for d in r.json()["data"]] == pytest.approx(want, abs=1e-4)
