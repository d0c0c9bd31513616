"""OLMo 2 (`Olmo2ForCausalLM`): Llama's decoder with two differences of the layer.

- No norm before attention or the MLP; each one's output is normed before its residual add
  (`post_attention_layernorm`, `post_feedforward_layernorm`).
- q and k get an RMSNorm over the whole projection (all heads at once, weights of q_size and
  kv_size), before RoPE, where Qwen3 norms each head. Under tensor parallelism a rank holds only
  its heads, so the registry says no to it.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.attention.backend import AttentionBackend
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelArchConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_cache: torch.Tensor, backend: AttentionBackend, plan: Any) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        q = self.q_norm(qkv[:, :self.q_size]).view(T, self.num_heads, self.head_dim)
        k = self.k_norm(qkv[:, self.q_size:self.q_size + self.kv_size]).view(T, self.num_kv_heads, self.head_dim)
        v = qkv[:, self.q_size + self.kv_size:].reshape(T, self.num_kv_heads, self.head_dim)
        q, k = self.rope(q, positions, cos_sin), self.rope(k, positions, cos_sin)
        out = backend.forward(q, k, v.contiguous(), kv_cache, plan, self.scale)
        return self.o_proj(out.reshape(T, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_id: int) -> None:
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, layer_id)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, kv_cache: torch.Tensor, backend: AttentionBackend,
                plan: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's output, the residual stream before it); the caller adds the two."""
        stream = x if residual is None else x + residual
        stream = stream + self.post_attention_layernorm(self.self_attn(stream, positions, cos_sin, kv_cache,
                                                                       backend, plan))
        return self.post_feedforward_layernorm(self.mlp(stream)), stream


class Olmo2ForCausalLM(LlamaForCausalLM):
    decoder_layer_cls = Olmo2DecoderLayer
    fused_decode_ok = False  # its own layers

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        shapes = super().checkpoint_shapes()
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            del shapes[p + "input_layernorm.weight"]
            shapes |= {p + "post_feedforward_layernorm.weight": (c.hidden_size,),
                       p + "self_attn.q_norm.weight": (q,), p + "self_attn.k_norm.weight": (kv,)}
        return shapes
