"""Tiny random-weight models whose head counts allow two ranks (4 query heads, 2 KV heads,
intermediate 96), saved once per session as HF directories with SmolLM2's tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # tiny_hf_model, save_hf_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_path):
    """kind ("llama" | "qwen2" | "qwen3") -> its directory, built on first use."""
    from model_helpers import save_hf_dir, tiny_hf_model

    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    # Qwen2 with tied embeddings and its q/k/v bias (a bias on the column-parallel cut, a tied
    # vocab-parallel head); Qwen3 with q/k norms and head_dim != hidden / heads.
    overrides = {"llama": {}, "qwen2": {"tie_word_embeddings": True}, "qwen3": {"head_dim": 32}}
    made: dict[str, str] = {}

    def get(kind: str) -> str:
        if kind not in made:
            model = tiny_hf_model(kind, vocab_size=len(tokenizer), seed=5, **overrides[kind])
            made[kind] = save_hf_dir(model, tokenizer, str(tmp_path_factory.mktemp(f"tiny-{kind}")))
        return made[kind]

    return get
