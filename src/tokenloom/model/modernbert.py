"""ModernBERT (gte-modernbert, nomic-modernbert, ModernBERT rerankers), run with runner="pooling".

The differences from BERT (model/bert.py): pre-norm layers (none before the first layer's
attention) and a final norm, LayerNorms with or without bias (`norm_bias`), no position
embedding but RoPE on q and k, with one base for the global layers and another for the local
ones, which see only keys within local_attention // 2 of the query in either direction (every
`global_attn_every_n_layers`-th layer is global), a GeGLU MLP (Wi makes input and gate), and no
token types. The classifier head is dense -> activation -> norm -> classifier over the CLS row or
the mean of the prompt's rows (config.json's classifier_pooling: the engine's pooling type).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tokenloom.attention import encoder_only
from tokenloom.model.bert import ACTIVATIONS, EncoderModel
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import Embedding, LayerNorm, Linear
from tokenloom.model.rope import cos_sin_cache
from tokenloom.ops import elementwise as ops


class ModernBertLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig, layer_id: int) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.local = layer_id in cfg.local_layers
        self.window = cfg.local_attention // 2 if self.local and cfg.local_attention else None
        self.attn_norm = LayerNorm(H, cfg.rms_norm_eps, cfg.norm_bias) if layer_id else None
        self.Wqkv = Linear(H, 3 * H, bias=cfg.attention_bias)
        self.Wo = Linear(H, H, bias=cfg.attention_bias)
        self.mlp_norm = LayerNorm(H, cfg.rms_norm_eps, cfg.norm_bias)
        self.Wi = Linear(H, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.mlp_Wo = Linear(cfg.intermediate_size, H, bias=cfg.mlp_bias)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                plan: encoder_only.EncoderPlan) -> torch.Tensor:
        T = x.shape[0]
        h = x if self.attn_norm is None else self.attn_norm(x)
        q, k, v = self.Wqkv(h).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        q, k = ops.rope(q, positions, cos_sin), ops.rope(k, positions, cos_sin)
        x = x + self.Wo(encoder_only.attend(q, k, v, plan, self.scale, self.window).reshape(T, -1))
        inp, gate = self.Wi(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.mlp_Wo(self.act(inp) * gate)


class ModernBertHead(nn.Module):
    """ModernBertForSequenceClassification's head on the pooled row."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        assert cfg.classifier_labels is not None
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, bias=cfg.classifier_bias)
        self.act = ACTIVATIONS[cfg.classifier_activation]
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_bias)
        self.classifier = Linear(cfg.hidden_size, len(cfg.classifier_labels), bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.norm(self.act(self.dense(x))))


class ModernBertModel(EncoderModel):
    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_embeddings = Embedding(config.vocab_size, config.hidden_size)
        self.embed_norm = LayerNorm(config.hidden_size, config.rms_norm_eps, config.norm_bias)
        self.layers = nn.ModuleList(ModernBertLayer(config, i) for i in range(config.num_hidden_layers))
        self.final_norm = LayerNorm(config.hidden_size, config.rms_norm_eps, config.norm_bias)
        self.score = ModernBertHead(config) if config.classifier_labels is not None else None
        # float32 RoPE tables (plain attributes: `.to()` leaves them as they are), global and local.
        self.rope_tables = {theta: cos_sin_cache(config.head_dim, config.max_position_embeddings, theta, None)
                            for theta in {config.rope_theta, config.rope_local_theta or config.rope_theta}}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_backend: Any, attn_plans: list[Any]) -> torch.Tensor:
        """input_ids, positions: [T] (whole prompts) -> the final norm's hidden states [T, hidden_size]."""
        c = self.config
        if positions.numel() and int(positions.max()) >= c.max_position_embeddings:
            raise IndexError(f"position {int(positions.max())} is past the model's "
                             f"{c.max_position_embeddings} positions (max_position_embeddings)")
        h = self.embed_norm(self.tok_embeddings(input_ids))
        plan = encoder_only.plan(positions)
        local_theta = c.rope_local_theta or c.rope_theta
        for layer in self.layers:
            table = self.rope_tables[local_theta if layer.local else c.rope_theta]
            if table.device != h.device:
                table = self.rope_tables[local_theta if layer.local else c.rope_theta] = table.to(h.device)
            h = layer(h, positions, table, plan)
        return self.final_norm(h)

    def _names(self) -> dict[str, tuple[str, int | None]]:
        """HF names: `model.` before the encoder's (a bare ModernBertModel's are read under them,
        hf_loader), the classifier's head and classifier without."""
        c = self.config
        ws = ("weight", "bias")
        norm_ws = ws if c.norm_bias else ("weight",)
        names: dict[str, tuple[str, int | None]] = {"model.embeddings.tok_embeddings.weight": ("tok_embeddings.weight", None)}
        names |= {f"model.embeddings.norm.{w}": (f"embed_norm.{w}", None) for w in norm_ws}
        names |= {f"model.final_norm.{w}": (f"final_norm.{w}", None) for w in norm_ws}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            norms = (["attn_norm"] if i else []) + ["mlp_norm"]
            names |= {f"{p}{n}.{w}": (f"layers.{i}.{n}.{w}", None) for n in norms for w in norm_ws}
            names |= {f"{p}attn.{n}.{w}": (f"layers.{i}.{n}.{w}", None) for n in ("Wqkv", "Wo")
                      for w in (ws if c.attention_bias else ("weight",))}
            names |= {f"{p}mlp.{n}.{w}": (f"layers.{i}.{ours}.{w}", None) for n, ours in (("Wi", "Wi"), ("Wo", "mlp_Wo"))
                      for w in (ws if c.mlp_bias else ("weight",))}
        if self.score is not None:
            names |= {f"head.dense.{w}": (f"score.dense.{w}", None) for w in (ws if c.classifier_bias else ("weight",))}
            names |= {f"head.norm.{w}": (f"score.norm.{w}", None) for w in norm_ws}
            names |= {f"classifier.{w}": (f"score.classifier.{w}", None) for w in ws}
        return names
