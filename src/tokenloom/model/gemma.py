"""Gemma 1 (`GemmaForCausalLM`) and Gemma 2 (`Gemma2ForCausalLM`), each as its difference from
Gemma 3 (gemma3.py), which keeps the embedding scale, the (1 + weight) norms, the tied LM head and
the final logit soft-capping:

- Gemma 1 has Llama's block (two norms, no q/k norm) with Gemma's GeGLU MLP, and one RoPE for
  every layer; no sliding window, no capping;
- Gemma 2 has Gemma 3's block (norms on both sides of attention and MLP) without the q/k norm,
  one RoPE for every layer (sliding and full layers alike), and caps the attention scores
  (`attn_logit_softcapping`, which only the torch attention backend does: the selector picks
  it for these models) besides the logits.
"""
from __future__ import annotations

import torch

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.gemma3 import Gemma3DecoderLayer, Gemma3ForCausalLM, Gemma3MLP
from tokenloom.model.llama import DecoderLayer, LlamaForCausalLM


class GemmaDecoderLayer(DecoderLayer):
    """Llama's block with the GeGLU MLP."""

    is_sliding = False

    def __init__(self, cfg: ModelArchConfig, layer_id: int = 0) -> None:
        super().__init__(cfg, layer_id)
        self.mlp = Gemma3MLP(cfg)


class GemmaForCausalLM(Gemma3ForCausalLM):
    decoder_layer_cls = GemmaDecoderLayer
    checkpoint_shapes = LlamaForCausalLM.checkpoint_shapes  # two norms a layer, no q/k norm

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        self.rope_of_layer = [0] * len(self.layers)  # one RoPE for all layers

    def _rope_table(self, device: torch.device) -> torch.Tensor:
        # Gemma 3's forward indexes two stacked tables; both are the one table here (a view).
        table = LlamaForCausalLM._rope_table(self, device)
        return table.unsqueeze(0).expand(2, *table.shape)


class Gemma2DecoderLayer(Gemma3DecoderLayer):
    """Gemma 3's block (its Attention has no q/k norm: the config says qk_norm=False), the
    attention scores capped."""

    def __init__(self, cfg: ModelArchConfig, layer_id: int) -> None:
        super().__init__(cfg, layer_id)
        self.self_attn.softcap = cfg.attn_logit_softcapping


class Gemma2ForCausalLM(GemmaForCausalLM):
    decoder_layer_cls = Gemma2DecoderLayer

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: shape for name, shape in Gemma3ForCausalLM.checkpoint_shapes(self).items()
                if not name.endswith(("q_norm.weight", "k_norm.weight"))}
