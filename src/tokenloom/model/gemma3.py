"""Gemma 3's text decoder (`Gemma3ForCausalLM`): the Llama decoder of llama.py with Gemma's
changes, each a small difference of layer or model:

- every block is wrapped in norms on both sides: input norm, attention, post-attention norm, then
  pre-feedforward norm, MLP, post-feedforward norm (as in llama.py, the residual add is folded into
  the next norm that follows it);
- q and k get a per-head RMSNorm before RoPE, as in Qwen3;
- the MLP is GeGLU: gelu(gate, tanh approximation) * up;
- the embedding is multiplied by sqrt(hidden_size), rounded to the model's dtype first as
  transformers does;
- Gemma's RMSNorm scales by (1 + weight). Checkpoints (HF, and GGUF once the loader has undone
  llama.cpp's +1) store `weight`; `load_weights` stores 1 + weight, so the shared `ops.rms_norm`
  serves unchanged;
- the attention scale is query_pre_attn_scalar ** -0.5;
- sliding-window layers (`layer_types`) use their own unscaled RoPE base (10,000) and
  full-attention layers the global one (1,000,000, with the config's rope scaling);
- the logits are optionally tanh-capped (`final_logit_softcapping`);
- the LM head is tied to the embedding.

Which layers see a window is the attention metadata's business: the runner prepares one plan per KV
cache group (`kv_cache_spec`), and layer i reads `attn_plans[kv_cache_group_of_layer[i]]`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.attention.backend import AttentionBackend
from tokenloom.kv_cache_spec import SLIDING_ATTENTION
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from tokenloom.model.rope import cos_sin_cache

_NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
          "post_feedforward_layernorm")


class Gemma3MLP(MLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_id: int) -> None:
        super().__init__()
        self.is_sliding = cfg.layer_types is not None and cfg.layer_types[layer_id] == SLIDING_ATTENTION
        self.self_attn = Attention(cfg)
        self.self_attn.scale = float(cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        self.mlp = Gemma3MLP(cfg)
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
        x = self.post_attention_layernorm(self.self_attn(x, positions, cos_sin, kv_cache, backend, plan))
        x, residual = self.pre_feedforward_layernorm(x, residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    """Gemma 3 text decoder over a flat batch (see the module docstring)."""

    decoder_layer_cls = Gemma3DecoderLayer
    fused_decode_ok = False  # its own forward and layers

    def __init__(self, config: ModelArchConfig) -> None:
        if not config.tie_word_embeddings:
            raise ValueError("Gemma 3 ties its LM head to the embedding (tie_word_embeddings=true)")
        super().__init__(config)
        # Index into the stacked RoPE tables: 0 global (full attention), 1 local (sliding).
        self.rope_of_layer = [int(layer.is_sliding) for layer in self.layers]

    def _rope_table(self, device: torch.device) -> torch.Tensor:
        """float32 [2, max_positions, head_dim]: the full-attention layers' table, then the
        sliding layers'."""
        c = self.config
        with torch.device("cpu"):
            tables = torch.stack([
                cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_theta, c.rope_scaling),
                cos_sin_cache(c.head_dim, c.max_position_embeddings, c.rope_local_theta or c.rope_theta, None),
            ])
        return tables.to(device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_backend: AttentionBackend, attn_plans: list[Any]) -> torch.Tensor:
        """input_ids, positions: [T] -> hidden states [T, hidden_size] (after the final norm)."""
        h = self.embed_tokens(input_ids)
        h = h * torch.tensor(self.config.hidden_size ** 0.5, dtype=h.dtype)
        if self.cos_sin.device != h.device:
            self.cos_sin = self._rope_table(h.device)
        tables = (self.cos_sin[0], self.cos_sin[1])
        # The C RoPE reads table rows unchecked (see LlamaForCausalLM.forward).
        if positions.device.type == "cpu" and positions.numel() and int(positions.max()) >= self.cos_sin.shape[1]:
            raise IndexError(f"position {int(positions.max())} is past the model's "
                             f"{self.cos_sin.shape[1]} RoPE positions")
        residual = None
        for layer, kv_cache, g, r in zip(self.layers, kv_caches, self.kv_cache_group_of_layer,
                                         self.rope_of_layer, strict=True):
            h, residual = layer(h, residual, positions, tables[r], kv_cache, attn_backend, attn_plans[g])
        return self.norm(h) if residual is None else self.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        H, D, I = c.hidden_size, c.head_dim, c.intermediate_size
        q, kv = c.num_attention_heads * D, c.num_key_value_heads * D
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, H),
                                              "model.norm.weight": (H,)}
        if c.classifier_labels is not None:  # Gemma3TextForSequenceClassification (the LM head is tied)
            shapes["score.weight"] = (len(c.classifier_labels), H)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            shapes |= {p + f"{n}.weight": (H,) for n in _NORMS}
            shapes |= {
                p + "self_attn.q_proj.weight": (q, H),
                p + "self_attn.k_proj.weight": (kv, H),
                p + "self_attn.v_proj.weight": (kv, H),
                p + "self_attn.o_proj.weight": (H, q),
                p + "self_attn.q_norm.weight": (D,),
                p + "self_attn.k_norm.weight": (D,),
                p + "mlp.gate_proj.weight": (I, H),
                p + "mlp.up_proj.weight": (I, H),
                p + "mlp.down_proj.weight": (H, I),
            }
        return shapes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """As LlamaForCausalLM's, with every norm weight stored as 1 + weight (computed in
        float32, as transformers computes the factor)."""
        def shifted() -> Iterable[tuple[str, torch.Tensor]]:
            for name, t in weights:
                if name.endswith("norm.weight"):
                    t = (t.float() + 1.0).to(t.dtype)
                yield name, t
        return super().load_weights(shifted())
