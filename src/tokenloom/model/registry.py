"""Which architectures we run, under the names each file format uses for them."""
from __future__ import annotations

from torch import nn

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import LlamaForCausalLM

# Our architecture name -> model class. All three share one decoder (see llama.py).
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
}

# config.json `architectures[0]` -> our architecture name.
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}

# GGUF `general.architecture` -> our architecture name.
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def build_model(config: ModelArchConfig) -> nn.Module:
    return MODEL_CLASSES[config.architecture](config)
