"""Fixtures of the caller-side tests (no engine needed)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tokenizer(hf_smollm2_tokenizer):
    """SmolLM2's tokenizer as transformers builds it from the GGUF (read once per session)."""
    return hf_smollm2_tokenizer
