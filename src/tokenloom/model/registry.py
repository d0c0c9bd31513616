"""Which architectures we run, under the names each file format uses for them."""
from __future__ import annotations

from torch import nn

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.gemma3 import Gemma3ForCausalLM
from tokenloom.model.llama import LlamaForCausalLM

# Our architecture name -> model class. Llama, Qwen2 and Qwen3 share one decoder (see llama.py);
# Gemma 3 changes its layers (gemma3.py).
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": LlamaForCausalLM,
    "qwen3": LlamaForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}


def build_model(config: ModelArchConfig) -> nn.Module:
    return MODEL_CLASSES[config.architecture](config)
