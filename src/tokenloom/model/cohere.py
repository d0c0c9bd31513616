"""Command-R (`CohereForCausalLM`): the Llama decoder of llama.py with Cohere's changes:

- one LayerNorm (weight, no bias) per layer feeds attention and the MLP in parallel, and the
  block adds both to the residual stream (no post-attention norm); the final norm is a
  LayerNorm too;
- the logits are multiplied by `logit_scale` (the config's `logits_scaling` is its inverse, which
  llama.py divides by); the LM head is tied to the embedding;
- RoPE rotates adjacent pairs (2i, 2i + 1): `load_weights` reorders the q/k rows to the
  rotate-half pairs our RoPE uses (rope.interleaved_to_rotate_half), which leaves attention
  unchanged.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenloom.attention.backend import AttentionBackend
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import MLP, Attention, LayerNorm, LlamaForCausalLM
from tokenloom.model.rope import interleaved_to_rotate_half


class CohereDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, bias=False)
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_cache: torch.Tensor, backend: AttentionBackend,
                plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(attention + MLP of the one norm, the residual stream before them)."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        return self.self_attn(x, positions, cos_sin, kv_cache, backend, plan) + self.mlp(x), residual


class CohereForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = CohereDecoderLayer
    fused_decode_ok = False  # its own layers

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.norm = LayerNorm(config.hidden_size, config.rms_norm_eps, bias=False)

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, shape in super().checkpoint_shapes().items()
                if not name.endswith("post_attention_layernorm.weight")}

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(rotate_half_qk(weights, self.config))


def rotate_half_qk(weights: Iterable[tuple[str, torch.Tensor]], cfg: ModelArchConfig
                   ) -> Iterable[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, q/k projection rows (weights and biases) of a model whose RoPE
    rotates adjacent pairs reordered for rotate-half RoPE (see rope.interleaved_to_rotate_half)."""
    rot = cfg.rotary_dim or cfg.head_dim
    for name, t in weights:
        if name.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias")):
            t = interleaved_to_rotate_half(t, cfg.num_attention_heads, rot)
        elif name.endswith(("self_attn.k_proj.weight", "self_attn.k_proj.bias")):
            t = interleaved_to_rotate_half(t, cfg.num_key_value_heads, rot)
        yield name, t
