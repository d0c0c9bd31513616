"""GLM-4 (`Glm4ForCausalLM`, llama.cpp's `glm4`): the Llama decoder of llama.py with GLM's changes:

- a norm after attention and one after the MLP, besides the two before them (the residual add
  folded into the next norm, as in llama.py);
- q/k/v biases (`attention_bias`, on by default); the checkpoint stores gate/up fused as
  `gate_up_proj`, our layout;
- RoPE on the first half of each head (`partial_rotary_factor`) in adjacent pairs: the q/k rows
  are reordered at load to the rotate-half pairs we run (cohere.rotate_half_qk).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from tokenloom.attention.backend import AttentionBackend
from tokenloom.model.cohere import rotate_half_qk
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm

_NORMS = ("input_layernorm", "post_self_attn_layernorm", "post_attention_layernorm", "post_mlp_layernorm")


class Glm4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_id: int = 0) -> None:
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        for name in _NORMS:
            setattr(self, name, RMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_cache: torch.Tensor, backend: AttentionBackend,
                plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's output, the residual stream before it); the caller adds the two."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.post_self_attn_layernorm(self.self_attn(x, positions, cos_sin, kv_cache, backend, plan))
        x, residual = self.post_attention_layernorm(x, residual)  # GLM's name for the pre-MLP norm
        return self.post_mlp_layernorm(self.mlp(x)), residual


class Glm4ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Glm4DecoderLayer
    fused_decode_ok = False  # its own layers

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Llama's, with gate/up fused and the two extra norms of each layer."""
        c = self.config
        shapes = super().checkpoint_shapes()
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            del shapes[p + "mlp.gate_proj.weight"], shapes[p + "mlp.up_proj.weight"]
            shapes[p + "mlp.gate_up_proj.weight"] = (2 * c.intermediate_size, c.hidden_size)
            shapes |= {p + "post_self_attn_layernorm.weight": (c.hidden_size,),
                       p + "post_mlp_layernorm.weight": (c.hidden_size,)}
        return shapes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(rotate_half_qk(weights, self.config))
