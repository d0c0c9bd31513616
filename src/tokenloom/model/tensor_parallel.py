"""Tensor parallelism for the decoder: one rank's shard of a loaded model, cut in place.

The split is Megatron's, as vLLM lays it out:
- column-parallel q/k/v and gate/up: each rank keeps the output rows of its heads (of its slice
  of the intermediate size), so attention and SiLU-and-mul run on local data with no exchange;
- row-parallel o_proj and down_proj: each rank keeps the matching input columns, computes a
  partial sum of the full output, and an all-reduce adds the partials (two per layer);
- vocab-parallel embedding and LM head: each rank keeps a slice of the vocabulary's rows; an
  embedding lookup outside the slice gives zeros and an all-reduce fills them in, and the LM
  head's logit slices are all-gathered so that every rank samples from the full vocabulary.

KV heads are split like the query heads while there are at least as many as ranks; with more
ranks than KV heads each KV head is replicated on `N / num_key_value_heads` ranks (every rank
keeps the one its query heads read). Each rank's KV cache then holds only its heads.

The model is loaded whole, then cut: loading stays one code path for every format, and the
transient full copy is the size of the checkpoint. Quantized GGUF weights (model/quant_linear)
are cut in whole tiles of 16 output rows and whole quant blocks of 32 (256 for K-quants) inputs;
a part whose cut falls inside a tile or block is dequantized to float32 for that layer, with a
log line naming it.
"""
from __future__ import annotations

import dataclasses
import logging

import torch
from torch import nn

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import Embedding
from tokenloom.model.quant_linear import PermutedQuantLinear, QuantEmbedding, QuantLinear
from tokenloom.model.registry import ARCHITECTURE_ENTRIES
from tokenloom.ops import quant
from tokenloom.ops.distributed import tp_all_gather, tp_all_reduce
from tokenloom.ops.quant import TiledQuantWeight
from tokenloom.ops.lowp import LowpWeight

logger = logging.getLogger(__name__)

# Rows of each rank's vocabulary slice are a multiple of this (a quantized tile is 16 rows; vLLM
# pads to 64 for its kernels' sake): the slices all-gather at one size.
_VOCAB_ALIGN = 16


def check_tensor_parallel(cfg: ModelArchConfig, tp: int) -> None:
    """A ValueError naming the field that `tp` does not split evenly."""
    if tp == 1:
        return
    entry = ARCHITECTURE_ENTRIES.get(cfg.architecture)
    if entry is not None and not entry.tensor_parallel:
        raise ValueError(f"tensor_parallel_size={tp}: {entry.class_name} ({cfg.architecture}) does not run under "
                         "tensor parallelism (see docs/models.md); use tensor_parallel_size=1")
    # The sizes that pass every check below: what each error offers instead.
    kv = cfg.num_key_value_heads
    fits = [d for d in _divisors(cfg.num_attention_heads)
            if (d % kv == 0 or kv % d == 0) and cfg.intermediate_size % d == 0]
    if cfg.num_attention_heads % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide num_attention_heads="
                         f"{cfg.num_attention_heads} of this {cfg.architecture} model; use one of {fits}.")
    if (kv % tp) if tp <= kv else (tp % kv):
        raise ValueError(f"tensor_parallel_size={tp} must divide num_key_value_heads={kv} (or be a "
                         f"multiple of it, to replicate KV heads) of this {cfg.architecture} model; "
                         f"use one of {fits}.")
    if cfg.intermediate_size % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide intermediate_size="
                         f"{cfg.intermediate_size} of this {cfg.architecture} model; use one of {fits}.")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_heads_of_rank(cfg: ModelArchConfig, rank: int, tp: int) -> tuple[int, int]:
    """(first KV head, count) kept by `rank`. Query head h reads KV head h // (heads per group),
    so a rank's contiguous query heads read a contiguous run of KV heads, or one replicated head."""
    kv = cfg.num_key_value_heads
    if tp <= kv:
        n = kv // tp
        return rank * n, n
    return rank // (tp // kv), 1


def vocab_range(vocab_size: int, rank: int, tp: int) -> tuple[int, int, int]:
    """(start, end, padded rows per rank) of `rank`'s vocabulary slice."""
    per = -(-vocab_size // tp)
    per = -(-per // _VOCAB_ALIGN) * _VOCAB_ALIGN
    start = min(rank * per, vocab_size)
    return start, min(start + per, vocab_size), per


# ---------------------------------------------------------------------------- the parallel layers
class RowParallel(nn.Module):
    """A linear layer holding its input columns of this rank: a partial product, summed over the
    ranks. The bias (if any) is added by rank 0 alone, so it is counted once."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_all_reduce(self.inner(x))


class VocabParallelEmbedding(nn.Module):
    """The embedding rows [start, end) of this rank; other ids look up zeros, and the all-reduce
    gives every rank every row."""

    def __init__(self, inner: nn.Module, start: int, end: int) -> None:
        super().__init__()
        self.inner = inner
        self.start, self.end = start, end

    @property
    def weight(self) -> torch.Tensor:
        """The float slice (padded), which a tied LM head multiplies by."""
        return self.inner.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.end - self.start)
        out = self.inner(local.masked_fill(outside, 0))
        return tp_all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


@dataclasses.dataclass(frozen=True, slots=True)
class VocabGather:
    """How the LM head's logit slices become the full vocabulary (LlamaForCausalLM.vocab_gather)."""

    vocab_size: int
    rows_per_rank: int

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        short = self.rows_per_rank - logits.shape[-1]  # the last rank's slice may be short
        if short:
            logits = nn.functional.pad(logits, (0, short))
        return tp_all_gather(logits, dim=-1)[..., :self.vocab_size]


# ---------------------------------------------------------------------------- cutting weights
def _dequantized(w: TiledQuantWeight, why: str, name: str) -> torch.Tensor:
    logger.warning("%s: %s; this tensor is dequantized to float32 for tensor parallelism (%.1f MB)",
                   name, why, w.out_features * w.in_features * 4 / 1e6)
    return quant.dequant_rows(w, torch.arange(w.out_features))


def _take_rows_of(part: TiledQuantWeight | LowpWeight | torch.Tensor, a: int, b: int,
                  name: str) -> TiledQuantWeight | LowpWeight | torch.Tensor:
    if isinstance(part, torch.Tensor):
        return part[a:b]
    if isinstance(part, LowpWeight):
        return part.take_rows(a, b)
    tile = quant.TILE_N
    if a % tile == 0 and (b % tile == 0 or b == part.out_features):
        data = part.data[a // tile: -(-b // tile)].contiguous()
        return TiledQuantWeight(part.fmt, data, b - a, part.in_features)
    return _dequantized(part, f"rows {a}:{b} cut a tile of {tile}", name)[a:b]


def _take_cols_of(part: TiledQuantWeight | LowpWeight | torch.Tensor, a: int, b: int,
                  name: str) -> TiledQuantWeight | LowpWeight | torch.Tensor:
    if isinstance(part, torch.Tensor):
        return part[:, a:b].contiguous()
    if isinstance(part, LowpWeight):
        return part.take_cols(a, b, name)
    unit = quant.QK_K if part.fmt in quant._K_QUANTS else quant.QK
    if a % unit == 0 and b % unit == 0 and part.data.shape[1] * unit == part.in_features:
        data = part.data[:, a // unit: b // unit].contiguous()
        return TiledQuantWeight(part.fmt, data, part.out_features, b - a)
    return _dequantized(part, f"columns {a}:{b} cut a block of {unit}", name)[:, a:b].contiguous()


def _part_rows(part: TiledQuantWeight | LowpWeight | torch.Tensor) -> int:
    return part.shape[0] if isinstance(part, torch.Tensor) else part.out_features


def _refuse_permuted(module: nn.Module, name: str) -> None:
    if isinstance(module, PermutedQuantLinear):
        raise ValueError(f"{name}: a GPTQ act-order (desc_act / g_idx) layer cannot be split across tensor-parallel "
                         "ranks; use tensor_parallel_size=1 for this checkpoint")


def take_rows(module: nn.Module, ranges: list[tuple[int, int]], name: str) -> nn.Module:
    """The module with only output rows `ranges` (in order): the column-parallel cut."""
    _refuse_permuted(module, name)
    if isinstance(module, QuantLinear):
        parts, offset = [], 0
        for part in module.parts:
            n = _part_rows(part)
            for s, e in ranges:
                a, b = max(s, offset) - offset, min(e, offset + n) - offset
                if a < b:
                    parts.append(_take_rows_of(part, a, b, name))
            offset += n
        if all(isinstance(p, TiledQuantWeight) for p in parts):
            fused = quant.concat_rows(parts)  # type: ignore[arg-type]
            parts = parts if fused is None else [fused]
        bias = None if module.bias is None else torch.cat([module.bias[s:e] for s, e in ranges])
        return QuantLinear(parts, bias)
    weight = torch.cat([module.weight[s:e] for s, e in ranges]).contiguous()
    module.weight = nn.Parameter(weight, requires_grad=False)
    if module.bias is not None:
        module.bias = nn.Parameter(torch.cat([module.bias[s:e] for s, e in ranges]), requires_grad=False)
    return module


def take_cols(module: nn.Module, a: int, b: int, keep_bias: bool, name: str) -> nn.Module:
    """The module with only input columns [a, b): the row-parallel cut."""
    _refuse_permuted(module, name)
    if isinstance(module, QuantLinear):
        bias = module.bias.detach() if module.bias is not None and keep_bias else None
        return QuantLinear([_take_cols_of(p, a, b, name) for p in module.parts], bias)
    module.weight = nn.Parameter(module.weight[:, a:b].contiguous(), requires_grad=False)
    if module.bias is not None and not keep_bias:
        module.bias = None
    return module


def _pad_rows(w: torch.Tensor, rows: int) -> torch.Tensor:
    return w if w.shape[0] == rows else nn.functional.pad(w, (0, 0, 0, rows - w.shape[0]))


# ---------------------------------------------------------------------------- the whole model
@torch.no_grad()
def shard_model_(model: nn.Module, rank: int, tp: int) -> ModelArchConfig:
    """Cuts a loaded `LlamaForCausalLM` (float or GGUF-quantized, before the runner packs its
    weights) down to `rank`'s shard of `tp`, in place. Returns the rank's view of the config: its
    query and KV heads and intermediate size (what its KV cache and runner are sized by); the
    model keeps the full config."""
    cfg: ModelArchConfig = model.config
    check_tensor_parallel(cfg, tp)
    if tp == 1:
        return cfg
    D = cfg.head_dim
    nq = cfg.num_attention_heads // tp
    kv0, nkv = kv_heads_of_rank(cfg, rank, tp)
    q_full, kv_full = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    inter = cfg.intermediate_size // tp
    qkv_rows = [(rank * nq * D, (rank + 1) * nq * D),
                (q_full + kv0 * D, q_full + (kv0 + nkv) * D),
                (q_full + kv_full + kv0 * D, q_full + kv_full + (kv0 + nkv) * D)]
    gate_up_rows = [(rank * inter, (rank + 1) * inter),
                    (cfg.intermediate_size + rank * inter, cfg.intermediate_size + (rank + 1) * inter)]
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        p = f"model.layers.{i}."
        attn.qkv_proj = take_rows(attn.qkv_proj, qkv_rows, p + "self_attn.qkv_proj")
        attn.o_proj = RowParallel(take_cols(attn.o_proj, rank * nq * D, (rank + 1) * nq * D,
                                            rank == 0, p + "self_attn.o_proj"))
        attn.num_heads, attn.num_kv_heads = nq, nkv
        attn.q_size, attn.kv_size = nq * D, nkv * D
        mlp.gate_up_proj = take_rows(mlp.gate_up_proj, gate_up_rows, p + "mlp.gate_up_proj")
        mlp.down_proj = RowParallel(take_cols(mlp.down_proj, rank * inter, (rank + 1) * inter,
                                              rank == 0, p + "mlp.down_proj"))
        mlp.intermediate_size = inter
    _shard_vocab_(model, cfg, rank, tp)
    return dataclasses.replace(cfg, num_attention_heads=nq, num_key_value_heads=nkv,
                               intermediate_size=inter, eos_token_ids=list(cfg.eos_token_ids))


def _shard_vocab_(model: nn.Module, cfg: ModelArchConfig, rank: int, tp: int) -> None:
    V = cfg.vocab_size
    start, end, per = vocab_range(V, rank, tp)
    embed = model.embed_tokens
    if isinstance(embed, QuantEmbedding):
        w = _take_rows_of(embed.qweight, start, end, "model.embed_tokens.weight")
        if isinstance(w, TiledQuantWeight):
            inner: nn.Module = QuantEmbedding(w, embed.dtype)
            if model.quant_lm_head is not None and cfg.tie_word_embeddings:
                model.quant_lm_head = QuantLinear([w])
        else:  # a float slice (see _take_rows_of): a float embedding, as on the float path
            embed = Embedding(0, 0)
            embed.weight = nn.Parameter(_pad_rows(w, per), requires_grad=False)
            inner = embed
            if model.quant_lm_head is not None and cfg.tie_word_embeddings:
                model.quant_lm_head = None  # compute_logits multiplies by the float slice
    else:
        embed.weight = nn.Parameter(_pad_rows(embed.weight[start:end], per).contiguous(), requires_grad=False)
        inner = embed
    model.embed_tokens = VocabParallelEmbedding(inner, start, end)
    if not cfg.tie_word_embeddings:
        if model.quant_lm_head is not None:
            model.quant_lm_head = take_rows(model.quant_lm_head, [(start, end)], "lm_head.weight")
        elif model.lm_head is not None:  # (a classifier has none: it never computes logits)
            head = model.lm_head
            head.weight = nn.Parameter(_pad_rows(head.weight[start:end], per).contiguous(), requires_grad=False)
    model.vocab_gather = VocabGather(V, per)
