"""Quantized linear layers and embedding lookups, installed in place of the float ones.

Two ways in:
- `install_gguf_quantized`: a GGUF's quantized tensors are computed as shipped (Q4_0, Q4_1,
  Q5_0, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K; see ops/quant.py). The float `Linear` /
  `Embedding` modules are swapped out before any weight is copied, so their (never touched)
  float32 storage is freed without being written and no float copy of a quantized weight exists.
  A tensor of a type with no kernel (or of a shape its kernel cannot take) is dequantized for that
  layer alone, with a warning naming the tensor and its type.
- `quantize_int8_`: a float model's matrices become Q8 codes with a scale per 32 weights of a row
  (int8 weights, int8 activations: the W8A8 of vLLM's CPU backend, with llama.cpp's block scales).

The decoder code does not change: a `QuantLinear` is called like `Linear`, a `QuantEmbedding`
like `Embedding`, and the LM head is `LlamaForCausalLM.quant_lm_head`.
"""
from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.gguf_file import GGUFFile, GGUFTensorInfo
from tokenloom.model.gguf_loader import PERMUTED_QK, _to_torch, _undo_llama_permute
from tokenloom.model.hf_loader import CheckpointTensors
from tokenloom.model.packed_linear import packed_nbytes
from tokenloom.model.rope import interleaved_to_rotate_half
from tokenloom.ops import amx, lowp, quant
from tokenloom.ops.ggml_types import Q
from tokenloom.ops.lowp import LowpWeight
from tokenloom.ops.quant import TiledQuantWeight

logger = logging.getLogger(__name__)

_FLOAT_TYPES = frozenset(int(t) for t in (Q.F32, Q.F16, Q.BF16))


class QuantLinear(nn.Module):
    """y = x W^T (+ bias) with W held as quantized row blocks (`parts`, stacked along the
    outputs: q|k|v or gate|up, one part when all share a format). A part may be a float tensor:
    a tensor the file stores unquantized, or one of a type without a kernel (logged at load); or
    an FP8 or bfloat16 weight kept as stored (ops/lowp: FP8 checkpoints, a quantized checkpoint's
    bfloat16 LM head)."""

    def __init__(self, parts: list[TiledQuantWeight | LowpWeight | torch.Tensor],
                 bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.parts = parts
        self.out_features = sum(p.shape[0] if isinstance(p, torch.Tensor) else p.out_features for p in parts)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        # In a bfloat16 model (AMX-BF16 CPUs): sum every row as a one-row matmul does whatever
        # the row count (the LM head, as the float path's), else as oneDNN would (ops/amx).
        self.one_row_order = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kchunk = 0
        if x.dtype == torch.bfloat16 and not self.one_row_order:
            kchunk = amx.onednn_k_chunk(x.numel() // x.shape[-1], x.shape[-1])
        if len(self.parts) == 1 and isinstance(self.parts[0], TiledQuantWeight):
            return quant.qlinear(x, self.parts[0], self.bias, kchunk=kchunk)
        if len(self.parts) == 1 and isinstance(self.parts[0], LowpWeight):
            return lowp.linear(x, self.parts[0], self.bias).to(x.dtype)
        outs = [quant.qlinear(x, p, kchunk=kchunk) if isinstance(p, TiledQuantWeight)
                else lowp.linear(x, p).to(x.dtype) if isinstance(p, LowpWeight)
                else nn.functional.linear(x.to(p.dtype), p).to(x.dtype) for p in self.parts]
        y = torch.cat(outs, dim=-1)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """For a gate|up layer: silu(gate) * up from one fused matmul (ops/quant
        .qlinear_silu_and_mul; the same bits as `ops.silu_and_mul(self(x))`), or None where it
        does not apply (parts kept apart, bfloat16, fewer rows than the bf16 tiles take)."""
        if len(self.parts) != 1 or not isinstance(self.parts[0], TiledQuantWeight):
            return None
        return quant.qlinear_silu_and_mul(x, self.parts[0], self.bias)

    def extra_repr(self) -> str:
        kinds = "+".join(str(p.dtype).removeprefix("torch.") if isinstance(p, torch.Tensor) else p.format_name
                         for p in self.parts)
        return f"out_features={self.out_features}, parts={kinds}"


class PermutedQuantLinear(QuantLinear):
    """A QuantLinear whose weight holds its input columns in another order (`in_perm`: input
    feature of each stored column): GPTQ's act-order checkpoints, whose quantization groups are
    columns scattered over the inputs (`g_idx`), stored with each group's columns side by side so
    that a group is whole blocks. The activations are gathered into that order, one pass over
    them per call. (The fused decode step takes plain QuantLinears only: such layers run eagerly.)"""

    def __init__(self, parts: list[TiledQuantWeight | torch.Tensor], in_perm: torch.Tensor,
                 bias: torch.Tensor | None = None) -> None:
        super().__init__(parts, bias)
        self.in_perm = in_perm.to(torch.int64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.index_select(-1, self.in_perm))

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        return super().silu_and_mul(x.index_select(-1, self.in_perm))


class QuantEmbedding(nn.Module):
    """Embedding lookup that dequantizes only the looked-up rows, into the model's dtype."""

    def __init__(self, weight: TiledQuantWeight, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.qweight = weight
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return quant.dequant_rows(self.qweight, ids).to(self.dtype)


@dataclass
class QuantSummary:
    """What a load computed with: tensor count per format, and what was left in float."""

    method: str  # "gguf" | "int8" | a checkpoint's, e.g. "compressed-tensors W8A8"
    formats: Counter = field(default_factory=Counter)
    fallbacks: list[str] = field(default_factory=list)  # "tensor (TYPE)"
    # Set where the checkpoint's weights were dequantized at load (FP8): the dtype they run in.
    dequantized_to: str | None = None

    def describe(self) -> str:
        """e.g. "gguf Q4_1x210+Q8_0x1 avx512_vnni+amx_bf16" (bf16 tiles from 16 rows, AMX int8
        from 8, VNNI below), "gguf Q4_1x210+Q8_0x1 avx512_vnni+amx_int8" (AMX int8 from 8 rows),
        "gguf Q4_Kx120+Q6_Kx49+Q8_0x1 avx512_vnni+amx_int8 (Q6_K: avx512_vnni)", "... avx2,
        float32 panels from 16 rows": the formats in use and the kernel that runs them (named per
        format where they differ)."""
        if self.dequantized_to is not None:
            fmts = "+".join(f"{k}x{n}" for k, n in sorted(self.formats.items()))
            return f"{self.method} {fmts} dequantized to {self.dequantized_to} at load (float path)"
        if not self.formats:
            return f"{self.method} (no quantized tensors: float path)"
        names = sorted(self.formats)
        fmts = "+".join(f"{k}x{self.formats[k]}" for k in names)
        codes = {v: k for k, v in quant.FORMAT_NAMES.items()}
        # FP8 weights kept as stored run on ops/lowp's kernels, the rest on ops/quant's
        isas = {k: quant.kernel_isa(codes[k]) if k in codes else lowp.kernel_level() for k in names}
        main = Counter(isas.values()).most_common(1)[0][0]
        odd = ", ".join(f"{k}: {v}" for k, v in isas.items() if v != main)
        text = f"{self.method} {fmts} {main}" + (f" ({odd})" if odd else "")
        if panel_rows := max((quant.f32_panel_rows(codes[k]) for k in names if k in codes), default=0):
            text += f", float32 panels from {panel_rows} rows"
        if self.fallbacks:
            text += f"; dequantized: {len(self.fallbacks)} tensors"
        return text


def _permute_rows(raw: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row interleave (see gguf_loader._undo_llama_permute) on whole rows
    of quantized bytes: a block never spans rows, so the rows move as they are."""
    rows = raw.shape[0]
    half = rows // n_heads // 2
    return raw.reshape(n_heads, half, 2, -1).transpose(0, 2, 1, 3).reshape(rows, -1)


# Families whose q/k rows the float loader reorders from adjacent-pair RoPE to rotate-half
# (cohere.rotate_half_qk): their quantized rows move the same way (whole rows, as above).
_INTERLEAVED_ROPE = frozenset({"cohere", "glm4"})


def _rotate_half_order(c: ModelArchConfig, rows: int, n_heads: int) -> np.ndarray:
    return interleaved_to_rotate_half(torch.arange(rows), n_heads, c.rotary_dim or c.head_dim).numpy()


class _GGUFParts:
    def __init__(self, g: GGUFFile, config: ModelArchConfig, summary: QuantSummary) -> None:
        self.g, self.config, self.summary = g, config, summary

    def part(self, info: GGUFTensorInfo) -> TiledQuantWeight | torch.Tensor:
        c = self.config
        heads = None
        if c.architecture in PERMUTED_QK and info.name.endswith(("attn_q.weight", "attn_k.weight")):
            heads = c.num_attention_heads if "attn_q" in info.name else c.num_key_value_heads
        order = None
        if c.architecture in _INTERLEAVED_ROPE and info.name.endswith(("attn_q.weight", "attn_k.weight")):
            n = c.num_attention_heads if "attn_q" in info.name else c.num_key_value_heads
            order = _rotate_half_order(c, info.shape[0], n)
        reason = f"no quantized kernel for {info.type_name}"
        if info.ggml_type in quant.GGML_FORMATS:
            raw = self.g.raw(info)
            if heads is not None:
                raw = _permute_rows(raw, heads)
            if order is not None:
                raw = raw[order]
            try:
                w = quant.tile_gguf(raw, info.ggml_type, info.name)
            except ValueError as exc:  # a shape the kernel cannot take
                reason = str(exc).removeprefix(f"{info.name}: ")
            else:
                self.g.release(info)
                self.summary.formats[w.format_name] += 1
                return w
        if info.ggml_type not in _FLOAT_TYPES:
            logger.warning("%s: %s; this tensor is dequantized to float32 (%.1f MB)", info.name,
                           reason, np.prod(info.shape) * 4 / 1e6)
            self.summary.fallbacks.append(f"{info.name} ({info.type_name})")
        t = _to_torch(self.g, info).float()
        self.g.release(info)
        if heads is not None:
            t = _undo_llama_permute(t, heads)
        if order is not None:
            t = t[torch.from_numpy(order)]
        return t.contiguous()

    def linear(self, infos: list[GGUFTensorInfo]) -> QuantLinear:
        parts = [self.part(i) for i in infos]
        if all(isinstance(p, TiledQuantWeight) for p in parts):
            fused = quant.concat_rows(parts)  # type: ignore[arg-type]
            if fused is not None:
                parts = [fused]
        return QuantLinear(parts)


def linear_groups(model: nn.Module) -> Iterator[tuple[nn.Module, str, list[str], str]]:
    """Each decoder layer's matmuls as (parent module, attribute, the HF names of the checkpoint
    matrices it fuses (no ".weight"), the HF name of the fused one a checkpoint may store instead):
    q|k|v, o, gate|up, down."""
    for i, layer in enumerate(model.layers):
        p = f"model.layers.{i}."
        yield layer.self_attn, "qkv_proj", [f"{p}self_attn.{n}_proj" for n in "qkv"], f"{p}self_attn.qkv_proj"
        yield layer.self_attn, "o_proj", [f"{p}self_attn.o_proj"], f"{p}self_attn.o_proj"
        if hasattr(layer.mlp, "experts"):  # a sparse MoE block (model/moe.py): router, shared expert
            for (parent, attr), suffixes in layer.mlp.linear_groups().items():
                yield parent, attr, [p + s for s in suffixes], f"{p}{suffixes[0].split('.')[0]}.{attr}"
            continue
        yield layer.mlp, "gate_up_proj", [f"{p}mlp.gate_proj", f"{p}mlp.up_proj"], f"{p}mlp.gate_up_proj"
        yield layer.mlp, "down_proj", [f"{p}mlp.down_proj"], f"{p}mlp.down_proj"


def replace_linear(parent: nn.Module, attr: str, new: QuantLinear) -> None:
    """Puts `new` in place of `parent.attr`, with an (unfilled) bias where the float layer has one:
    Qwen2's q/k/v bias, which load_weights then fills (fused rows)."""
    old = getattr(parent, attr)
    if old.bias is not None:
        new.bias = nn.Parameter(torch.empty_like(old.bias), requires_grad=False)
    setattr(parent, attr, new)


def keep_bf16_lm_head(model: nn.Module, ckpt: CheckpointTensors) -> set[str]:
    """A pre-quantized checkpoint's untied LM head that its quantizer left in bfloat16 (llm-
    compressor's and AutoAWQ's `ignore: [lm_head]`), in a float32 model: kept in bfloat16 as
    stored (ops/lowp) instead of widened to float32, which halves what every step reads of the
    largest matrix. Its values are the checkpoint's; the logits are float32 sums of the same
    products (bf16 activations from the kernel plan's bf16-tile rows, as the quantized layers
    there). Returns the names consumed: none where it does not apply (no C kernels, a tied or
    quantized head, another dtype)."""
    name = "lm_head.weight"
    if (getattr(model, "lm_head", None) is None or model.norm.weight.dtype != torch.float32
            or ckpt.dtype(name) != "BF16" or len(ckpt.shape(name)) != 2 or ckpt.shape(name)[1] % 2
            or not lowp.available()):
        return set()
    model.quant_lm_head = QuantLinear([lowp.pack_bf16(ckpt.get(name))])
    model.quant_lm_head.one_row_order = True
    model.lm_head = None
    return {name}


@torch.no_grad()
def quantize_lm_head_q8_(model: nn.Module, summary: QuantSummary) -> None:
    """A pre-quantized checkpoint's LM head that its quantizer left in float (held as such, or in
    bfloat16 by `keep_bf16_lm_head`) -> Q8_0 codes, as the int8 path's (EngineConfig
    .quantize_lm_head: asked for, never by default, since it changes the checkpoint's logits). A
    head the checkpoint quantized stays as it is; a tied one gets its own codes, the embedding
    stays float."""
    head = getattr(model, "quant_lm_head", None)
    if not getattr(model, "computes_logits", True) or (
            head is not None and not all(isinstance(p, LowpWeight) for p in head.parts)):
        return
    weight = head.parts[0].dequantize() if head is not None else model.lm_head_weight.detach().float()
    model.quant_lm_head = QuantLinear([quant.quantize_q8(weight)])
    model.quant_lm_head.one_row_order = True
    model.lm_head = None
    summary.formats["Q8_0"] += 1


def _install_quantized_experts(parts: _GGUFParts, block: nn.Module, prefix: str,
                               found: dict[str, GGUFTensorInfo]) -> set[str]:
    """An MoE block's experts as one quantized gate|up and one down per expert, tiled from the
    file's bytes (each expert's slice of the stacked tensors); returns the names consumed, none
    where the file holds the experts in float."""
    names = [[prefix + n for n in block.expert_weight_names(e)] for e in range(block.experts.num_experts)]
    if any(n not in found for expert in names for n in expert):
        return set()  # a family that loads its experts stacked (gpt-oss: MXFP4 kept packed, or float)
    if all(found[n].ggml_type in _FLOAT_TYPES for expert in names for n in expert):
        return set()
    w13 = [parts.linear([found[gate], found[up]]) for gate, up, _ in names]
    w2 = [parts.linear([found[down]]) for _, _, down in names]
    block.experts.install_quantized(w13, w2)
    return {n for expert in names for n in expert}


def install_gguf_quantized(model: nn.Module, g: GGUFFile, found: dict[str, GGUFTensorInfo]) -> tuple[set[str], QuantSummary]:
    """Swap the model's linear layers, LM head and embedding for quantized ones over the GGUF's
    quantized tensors (`found`: HF name -> tensor, from `check_gguf_tensors`). Returns the HF
    names consumed (the float loader skips them) and a summary. Modules whose tensors are all
    float in the file are left as they are."""
    config: ModelArchConfig = model.config
    summary = QuantSummary("gguf")
    parts = _GGUFParts(g, config, summary)
    consumed: set[str] = set()

    def quantized(names: list[str]) -> bool:
        return any(found[n].ggml_type not in _FLOAT_TYPES for n in names)

    for i, layer in enumerate(model.layers):
        if hasattr(layer.mlp, "experts"):
            consumed |= _install_quantized_experts(parts, layer.mlp, f"model.layers.{i}.", found)
    for parent, attr, prefixes, fused in linear_groups(model):
        names = [f"{n}.weight" for n in prefixes]
        if f"{fused}.weight" in found:  # stored fused (Phi-3's attn_qkv, gate|up in ffn_up)
            names = [f"{fused}.weight"]
        if not quantized(names):
            continue
        replace_linear(parent, attr, parts.linear([found[n] for n in names]))
        consumed.update(names)

    embed = "model.embed_tokens.weight"
    if quantized([embed]):
        info = found[embed]
        w = parts.part(info)
        if isinstance(w, TiledQuantWeight):
            model.embed_tokens = QuantEmbedding(w, model.norm.weight.dtype)
            if config.tie_word_embeddings:
                model.quant_lm_head = QuantLinear([w])
        else:  # dequantized fallback: a float embedding, as on the float path
            model.embed_tokens.weight.data = w
        consumed.add(embed)
    if not config.tie_word_embeddings and quantized(["lm_head.weight"]):
        model.quant_lm_head = parts.linear([found["lm_head.weight"]])
        model.lm_head = None
        consumed.add("lm_head.weight")
    if model.quant_lm_head is not None:
        model.quant_lm_head.one_row_order = True
    return consumed, summary


@torch.no_grad()
def quantize_int8_(model: nn.Module) -> QuantSummary:
    """Every linear layer, the LM head and the embedding of a loaded float model -> Q8 codes
    (int8 with a float16 scale per 32 weights of a row), in place."""
    from tokenloom.model.llama import Linear

    summary = QuantSummary("int8")
    # An MoE block's router stays float (as vLLM's quantized MoE models keep it): a few rows,
    # whose rounding would move the choice of experts.
    routers = {id(m.gate) for m in model.modules() if hasattr(m, "experts")}
    for parent in list(model.modules()):
        experts = getattr(parent, "experts", None)
        if experts is not None and experts.quant_w13 is None and experts.w13_bias is None:
            _quantize_experts_int8_(experts)
            summary.formats["Q8_0"] += 2 * experts.num_experts
        for name, child in list(parent.named_children()):
            # (a classifier's score head stays float: a few rows, read once per request)
            if isinstance(child, Linear) and child is not getattr(model, "lm_head", None) \
                    and child is not getattr(model, "score", None) and id(child) not in routers:
                new = QuantLinear([quant.quantize_q8(child.weight)],
                                  None if child.bias is None else child.bias.detach().float().clone())
                setattr(parent, name, new)
                summary.formats["Q8_0"] += 1
    emb = quant.quantize_q8(model.embed_tokens.weight)
    head_weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    model.quant_lm_head = QuantLinear([emb if model.lm_head is None else quant.quantize_q8(head_weight)])
    model.embed_tokens = QuantEmbedding(emb)
    model.lm_head = None
    summary.formats["Q8_0"] += 1 if model.config.tie_word_embeddings else 2
    return summary

def _quantize_experts_int8_(experts: nn.Module) -> None:
    """model/moe.FusedMoE's stacked float experts -> one Q8 gate|up and down per expert."""
    w13 = [QuantLinear([quant.quantize_q8(w)]) for w in experts.w13_weight]
    w2 = [QuantLinear([quant.quantize_q8(w)]) for w in experts.w2_weight]
    experts.install_quantized(w13, w2)


def _nbytes(m: nn.Module) -> int:
    from tokenloom.model.llama import Linear

    if isinstance(m, QuantLinear):
        return sum(p.numel() * p.element_size() if isinstance(p, torch.Tensor) else p.nbytes for p in m.parts)
    if isinstance(m, Linear):
        # the plain weight, or the packed copy where the runner released it
        packed = getattr(m, "packed_weight", None)
        return (packed_nbytes(packed) if m.weight.numel() == 0 and packed is not None
                else m.weight.numel() * m.weight.element_size())
    return 0


def weight_bytes_per_token(model: nn.Module) -> int:
    """Bytes of matrix weights one decode step of one token reads: every linear layer and the LM
    head as held in memory (quantized blocks or float), of an MoE layer's experts the top_k a
    token chose (an average expert's bytes each); the embedding lookup reads only its rows."""
    total = 0
    experts = [m for m in model.modules() if hasattr(m, "quant_w13")]  # model/moe.FusedMoE
    inside = {id(q) for x in experts if x.quant_w13 is not None for q in (*x.quant_w13, *x.quant_w2)}
    for m in model.modules():
        if id(m) not in inside:
            total += _nbytes(m)
    for x in experts:  # a token reads top_k of its experts
        if x.quant_w13 is not None:
            per_expert = sum(_nbytes(q) for q in (*x.quant_w13, *x.quant_w2)) / x.num_experts
        elif x.w13_weight is None:  # packed as shipped (gpt-oss's MXFP4, model/gpt_oss.py)
            per_expert = x.packed_bytes_per_expert()
        else:
            per_expert = (x.w13_weight[0].numel() + x.w2_weight[0].numel()) * x.w13_weight.element_size()
        total += int(per_expert * x.top_k)
    if (getattr(model, "quant_lm_head", None) is None and getattr(model, "lm_head", None) is None
            and getattr(model, "computes_logits", True)):
        # a tied float head: its packed copy, else the embedding's table (none: a pooling model)
        if (packed := getattr(model, "packed_lm_head", None)) is not None:
            total += packed_nbytes(packed)
        else:
            embed = model.embed_tokens.weight
            total += embed.numel() * embed.element_size()
    return total
