"""BERT and XLM-RoBERTa encoders (embedding models such as bge and e5, cross-encoder rerankers
such as the ms-marco MiniLM and bge-reranker ones), run with runner="pooling".

A post-norm transformer with bidirectional attention (attention/encoder_only.py) over a flat
batch of whole prompts: the embedding is word + absolute position + token type, then LayerNorm;
each layer is attention -> dense -> LayerNorm(+ residual), GELU MLP -> LayerNorm(+ residual).
XLM-RoBERTa is BERT with its positions counted from padding_idx + 1 (`position_offset`) and one
token type. A cross-encoder's pair reads its second text with token type 1 (the model runner
passes `token_type_ids`). The final hidden states are the pooler's (CLS, mean, ...); a
`*ForSequenceClassification` checkpoint's head is the `score` the pooler calls on the pooled
row: BERT's pooler (dense, tanh) and classifier, RoBERTa's classifier.dense, tanh, out_proj.

q, k and v are one fused matmul: checkpoints store them apart and `load_weights` copies each
into its rows. Names are read with or without the classifier's `bert.` / `roberta.` prefix
(hf_loader's strip_prefix).
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.attention import encoder_only
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import Embedding, LayerNorm, Linear

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
    "silu": F.silu,
    "tanh": torch.tanh,
}


class EncoderModel(nn.Module):
    """What every encoder shares: no LM head, no KV cache, nothing for the fused decode step,
    and checkpoint names read with or without the classifier's prefix."""

    fused_decode_ok = False
    computes_logits = False  # no LM head (what the runner and the memory accounting read)
    # The model runner leaves the weights as loaded: an encoder's matmuls have a whole batch of
    # prompts' rows, where oneDNN's GEMM on the plain weight (bf16: AMX) is the fast one; the
    # packed copies pay at a decode step's few rows, which an encoder never has.
    plain_weights = True
    lm_head = None
    # The prefix a *ForSequenceClassification checkpoint puts before the encoder's tensors.
    checkpoint_prefix = ""
    # The model runner passes the step's token types (model/bert.py's segments).
    takes_token_types = False

    def drop_lm_head(self) -> None:
        """Nothing to drop: an encoder pools (the runner calls this on every pooling model)."""

    def _names(self) -> dict[str, tuple[str, int | None]]:
        """HF name (a classifier's prefix removed) -> (our parameter, which third of its rows
        for a q/k/v part of the fused projection, else None)."""
        raise NotImplementedError

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor a checkpoint must give, under its HF name, with its shape."""
        shapes = {}
        for hf, (ours, part) in self._names().items():
            shape = tuple(self.get_parameter(ours).shape)
            shapes[hf] = shape if part is None else (shape[0] // 3, *shape[1:])
        return shapes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Checkpoint tensors (shapes checked by the loader against `checkpoint_shapes`) into
        our parameters, q/k/v parts into their rows of the fused one; returns the names consumed."""
        names = self._names()
        loaded: set[str] = set()
        for name, tensor in weights:
            if name not in names:
                continue
            ours, part = names[name]
            param = self.get_parameter(ours)
            if part is not None:
                rows = param.shape[0] // 3
                param = param[part * rows:(part + 1) * rows]
            param.copy_(tensor)
            loaded.add(name)
        return loaded


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        H = cfg.hidden_size
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv = Linear(H, 3 * H, bias=True)
        self.attn_out = Linear(H, H, bias=True)
        self.attn_norm = LayerNorm(H, cfg.rms_norm_eps)
        self.intermediate = Linear(H, cfg.intermediate_size, bias=True)
        self.output = Linear(cfg.intermediate_size, H, bias=True)
        self.out_norm = LayerNorm(H, cfg.rms_norm_eps)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor, plan: encoder_only.EncoderPlan) -> torch.Tensor:
        T = x.shape[0]
        q, k, v = self.qkv(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)
        attn = encoder_only.attend(q, k, v, plan, self.scale).reshape(T, -1)
        x = self.attn_norm(self.attn_out(attn), x)[0]
        return self.out_norm(self.output(self.act(self.intermediate(x))), x)[0]


class BertModel(EncoderModel):
    """BERT (and, with `position_offset`, XLM-RoBERTa) over a flat batch of whole prompts."""

    checkpoint_prefix = "bert."
    takes_token_types = True

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__()
        self.config = config
        H = config.hidden_size
        self.word_embeddings = Embedding(config.vocab_size, H)
        # XLM-R's table holds padding_idx + 1 unused rows before position 0.
        self.position_embeddings = Embedding(config.max_position_embeddings + config.position_offset, H)
        self.token_type_embeddings = Embedding(config.type_vocab_size, H) if config.type_vocab_size else None
        self.embed_norm = LayerNorm(H, config.rms_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.score = self._classifier_head() if config.classifier_labels is not None else None

    def _classifier_head(self) -> nn.Module:
        return BertClassifierHead(self.config)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_backend: Any, attn_plans: list[Any], token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions: [T] (whole prompts, see attention/encoder_only.py) -> the last
        layer's hidden states [T, hidden_size]. The KV cache and its backend are not used."""
        c = self.config
        if positions.numel() and int(positions.max()) >= c.max_position_embeddings:
            raise IndexError(f"position {int(positions.max())} is past the model's "
                             f"{c.max_position_embeddings} positions (max_position_embeddings)")
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions + c.position_offset)
        if self.token_type_embeddings is not None:
            types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
            h = h + self.token_type_embeddings(types)
        h = self.embed_norm(h)
        plan = encoder_only.plan(positions)
        for layer in self.layers:
            h = layer(h, plan)
        return h

    def _names(self) -> dict[str, tuple[str, int | None]]:
        names: dict[str, tuple[str, int | None]] = {
            "embeddings.word_embeddings.weight": ("word_embeddings.weight", None),
            "embeddings.position_embeddings.weight": ("position_embeddings.weight", None),
            "embeddings.LayerNorm.weight": ("embed_norm.weight", None),
            "embeddings.LayerNorm.bias": ("embed_norm.bias", None)}
        if self.token_type_embeddings is not None:
            names["embeddings.token_type_embeddings.weight"] = ("token_type_embeddings.weight", None)
        parts = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                 "intermediate.dense": "intermediate", "output.dense": "output", "output.LayerNorm": "out_norm"}
        for i in range(self.config.num_hidden_layers):
            for w in ("weight", "bias"):
                for hf, ours in parts.items():
                    names[f"encoder.layer.{i}.{hf}.{w}"] = (f"layers.{i}.{ours}.{w}", None)
                for k, p in enumerate(("query", "key", "value")):
                    names[f"encoder.layer.{i}.attention.self.{p}.{w}"] = (f"layers.{i}.qkv.{w}", k)
        if self.score is not None:
            names |= {hf: (f"score.{ours}", None) for hf, ours in self.score.names.items()}
        return names


class BertClassifierHead(nn.Module):
    """BertForSequenceClassification's head on the CLS row: the pooler (dense, tanh), then the
    classifier."""

    # HF name -> ours (under `score.`)
    names = {"pooler.dense.weight": "dense.weight", "pooler.dense.bias": "dense.bias",
             "classifier.weight": "out_proj.weight", "classifier.bias": "out_proj.bias"}

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        assert cfg.classifier_labels is not None
        self.dense = Linear(cfg.hidden_size, cfg.hidden_size, bias=True)
        self.out_proj = Linear(cfg.hidden_size, len(cfg.classifier_labels), bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(x)))


class RobertaClassifierHead(BertClassifierHead):
    """RobertaForSequenceClassification's head (XLM-R's): classifier.dense, tanh, out_proj."""

    names = {"classifier.dense.weight": "dense.weight", "classifier.dense.bias": "dense.bias",
             "classifier.out_proj.weight": "out_proj.weight", "classifier.out_proj.bias": "out_proj.bias"}


class XLMRobertaModel(BertModel):
    """BERT with positions from padding_idx + 1 (the config's `position_offset`) and the RoBERTa
    classifier head."""

    checkpoint_prefix = "roberta."

    def _classifier_head(self) -> nn.Module:
        return RobertaClassifierHead(self.config)
