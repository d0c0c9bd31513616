"""Fixtures of the LoRA tests (lora_helpers.py builds the model and adapters)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lora_helpers import make_model_and_adapters, reference  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    """(the base model's directory, {name: adapter directory}, the tokenizer)."""
    return make_model_and_adapters(tmp_path_factory.mktemp("lora"), smollm2_path)


@pytest.fixture(scope="module")
def references(tiny):
    base_dir, adapters, tokenizer = tiny
    return {name: reference(base_dir, path, tokenizer) for name, path in [("base", None), *adapters.items()]}


