"""Weight-only int4 checkpoints (compressed-tensors `pack-quantized` W4A16, AutoAWQ GEMM, GPTQ)
computed with their packed weights on the GGUF path's kernels (ops/quant).

All three store w = scale * (code - zero) with 4-bit codes and a scale (and zero) per group of
input columns; only the packing differs, so each reader turns one layer's tensors into the same
`Int4Weight` (codes [N, K], scales and zeros [N, groups]), which ops/quant.tile_int4_groups
repacks into Q4_0 (every zero 8: the symmetric formats) or Q4_1 blocks of 32 weights. The
packings, from each format's own packer:
- compressed-tensors: `weight_packed` int32 [N, K/8], code k at bits 4k of its word, stored as
  the signed value + 8; `weight_scale` [N, G]; `weight_zero_point` (asymmetric) int32 [N/8, G]
  packed the same way along the outputs; `weight_g_idx` [K] with actorder "group".
- AutoAWQ GEMM: `qweight` int32 [K, N/8], the 8 outputs of a word in the order 0 2 4 6 1 3 5 7
  (nibble i holds output AWQ_ORDER[i]); `qzeros` int32 [G, N/8] likewise; `scales` [G, N].
- GPTQ: `qweight` int32 [K/8, N] packed along the inputs; `qzeros` int32 [G, N/8] along the
  outputs, each zero stored minus 1 (v1, `checkpoint_format` "gptq"; v2 stores it as is);
  `scales` [G, N]; `g_idx` [K], each input's group: with `desc_act` the groups are scattered
  columns, gathered here into whole blocks (`PermutedQuantLinear` gathers the activations).
No float copy of a weight is made: codes are unpacked a layer at a time, as bytes.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from tokenloom.model.errors import ModelLoadError
from tokenloom.model.hf_loader import CheckpointTensors
from tokenloom.model.quant_linear import (
    _INTERLEAVED_ROPE,
    PermutedQuantLinear,
    QuantLinear,
    QuantSummary,
    _rotate_half_order,
    keep_bf16_lm_head,
    linear_groups,
    replace_linear,
)
from tokenloom.model.quant_spec import QuantSpec
from tokenloom.ops import quant
from tokenloom.ops.quant import TiledQuantWeight

# AutoAWQ's GEMM packing: nibble i of a word holds output column AWQ_ORDER[i] of its 8.
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass
class Int4Weight:
    """One layer's int4 weight, unpacked: w[n, perm[j]] = scales[n, g] * (codes[n, j] - zeros[n, g])
    for the stored column j of group g = j // (K / G)."""

    codes: np.ndarray  # uint8 [N, K], 0..15
    scales: np.ndarray  # float32 [N, G]
    zeros: np.ndarray | None  # [N, G] (0..16: GPTQ v1's zero 0 reads as 16), None: 8 everywhere
    perm: np.ndarray | None = None  # input feature of each stored column; None: in order

    def rows(self, order: np.ndarray) -> Int4Weight:
        return Int4Weight(self.codes[order], self.scales[order],
                          None if self.zeros is None else self.zeros[order], self.perm)

    def dequantize(self) -> torch.Tensor:
        """The float32 [N, K] weight in input order (for a layer the kernels cannot take)."""
        per = self.codes.shape[1] // self.scales.shape[1]
        zeros = 8 if self.zeros is None else np.repeat(self.zeros, per, axis=1)
        w = np.repeat(self.scales, per, axis=1) * (self.codes.astype(np.float32) - zeros)
        if self.perm is not None:
            w[:, self.perm] = w.copy()
        return torch.from_numpy(np.ascontiguousarray(w, np.float32))


def unpack_nibbles(words: np.ndarray) -> np.ndarray:
    """int32 [..., W] -> uint8 [..., 8W]: element j of a word at bits 4j (little-endian words)."""
    b = np.ascontiguousarray(words).astype("<i4", copy=False).view(np.uint8)
    return np.stack([b & 15, b >> 4], axis=-1).reshape(*words.shape[:-1], words.shape[-1] * 8)


def _float(t: torch.Tensor) -> np.ndarray:
    return t.float().numpy()


def _int32(t: torch.Tensor, name: str) -> np.ndarray:
    if t.dtype != torch.int32:
        raise ModelLoadError(f"{name}: expected int32 packed codes, got {str(t.dtype).removeprefix('torch.')}")
    return t.numpy()


def _group_order(g_idx: np.ndarray, groups: int, name: str) -> np.ndarray | None:
    """The stored-column order that makes each group whole and in sequence (None: already so)."""
    K = g_idx.shape[0]
    if K % groups:
        raise ModelLoadError(f"{name}: g_idx has {K} inputs for {groups} groups")
    contiguous = np.arange(K) // (K // groups)
    if np.array_equal(g_idx, contiguous):
        return None
    order = np.argsort(g_idx, kind="stable")
    if not np.array_equal(g_idx[order], contiguous):
        raise ModelLoadError(f"{name}: g_idx does not give every group {K // groups} inputs; such act-order "
                             "checkpoints are not supported")
    return order


def _apply_g_idx(w: Int4Weight, g_idx: np.ndarray | None, name: str) -> Int4Weight:
    if g_idx is None:
        return w
    order = _group_order(g_idx.astype(np.int64), w.scales.shape[1], name)
    if order is None:
        return w
    return Int4Weight(np.ascontiguousarray(w.codes[:, order]), w.scales, w.zeros, order)


Reader = Callable[[Callable[[str], torch.Tensor | None], str, QuantSpec], Int4Weight]


def read_compressed_tensors(get: Callable[[str], torch.Tensor | None], prefix: str, spec: QuantSpec) -> Int4Weight:
    packed = _int32(get(f"{prefix}.weight_packed"), f"{prefix}.weight_packed")
    shape = get(f"{prefix}.weight_shape")
    N, K = (int(v) for v in shape.tolist()) if shape is not None else (packed.shape[0], packed.shape[1] * 8)
    codes = unpack_nibbles(packed)[:, :K]
    scales = _float(get(f"{prefix}.weight_scale"))
    zp = get(f"{prefix}.weight_zero_point")
    zeros = None
    if zp is not None and not spec.symmetric:  # packed along the outputs, + 8 as the codes
        zeros = unpack_nibbles(_int32(zp, f"{prefix}.weight_zero_point").T)[:, :N].T
    g_idx = get(f"{prefix}.weight_g_idx")
    w = Int4Weight(codes, scales.reshape(N, -1), zeros)
    return _apply_g_idx(w, None if g_idx is None else g_idx.numpy(), prefix)


def read_awq(get: Callable[[str], torch.Tensor | None], prefix: str, spec: QuantSpec) -> Int4Weight:
    inverse = np.argsort(AWQ_ORDER)  # the nibble that holds each output of a word

    def columns(name: str) -> np.ndarray:
        t = get(f"{prefix}.{name}")
        if t is None:
            raise ModelLoadError(f"{prefix}.{name}: missing tensor (AWQ layers have qweight, qzeros, scales)")
        n = unpack_nibbles(_int32(t, f"{prefix}.{name}"))
        return n.reshape(n.shape[0], -1, 8)[:, :, inverse].reshape(n.shape[0], -1)

    codes = np.ascontiguousarray(columns("qweight").T)
    zeros = np.ascontiguousarray(columns("qzeros").T)
    scales = np.ascontiguousarray(_float(get(f"{prefix}.scales")).T)
    return Int4Weight(codes, scales, zeros)


def read_gptq(get: Callable[[str], torch.Tensor | None], prefix: str, spec: QuantSpec) -> Int4Weight:
    qweight = get(f"{prefix}.qweight")
    if qweight is None:
        raise ModelLoadError(f"{prefix}.qweight: missing tensor (GPTQ layers have qweight, qzeros, scales)")
    q = unpack_nibbles(_int32(qweight, f"{prefix}.qweight").T)  # [N, K]: inputs along the words
    zeros = unpack_nibbles(_int32(get(f"{prefix}.qzeros"), f"{prefix}.qzeros"))  # [G, N]
    zeros = np.ascontiguousarray(zeros[:, : q.shape[0]].T) + (1 if spec.zeros_minus_one else 0)
    scales = np.ascontiguousarray(_float(get(f"{prefix}.scales")).T)
    g_idx = get(f"{prefix}.g_idx")
    w = Int4Weight(np.ascontiguousarray(q), scales, zeros)
    return _apply_g_idx(w, None if g_idx is None else g_idx.numpy(), prefix)


# method -> (reader, the tensor that marks a quantized layer)
READERS: dict[str, tuple[Reader, str]] = {
    "compressed-tensors": (read_compressed_tensors, "weight_packed"),
    "awq": (read_awq, "qweight"),
    "gptq": (read_gptq, "qweight"),
}


def _tiled(w: Int4Weight, name: str, summary: QuantSummary) -> TiledQuantWeight | torch.Tensor:
    """The kernels' tiles, else (a shape they cannot take) the float weight in stored column order."""
    try:
        t = quant.tile_int4_groups(w.codes, w.scales, w.zeros, name)
    except ValueError as exc:  # e.g. a layer whose inputs are not whole 32-weight blocks
        summary.fallbacks.append(f"{name} ({exc})")
        return Int4Weight(w.codes, w.scales, w.zeros).dequantize()
    summary.formats[t.format_name] += 1
    return t


def _linear(weights: list[Int4Weight], names: list[str], summary: QuantSummary) -> QuantLinear:
    """One QuantLinear over the parts (q|k|v or gate|up; fused where they share a format and an
    input order)."""
    perm = weights[0].perm
    if any((w.perm is None) != (perm is None) or (perm is not None and not np.array_equal(w.perm, perm))
           for w in weights):
        # act-order parts with different g_idx (GPTQ orders each layer's inputs by its own
        # statistics, which q|k|v and gate|up share in practice): the odd ones in float
        parts: list[TiledQuantWeight | torch.Tensor] = []
        for w, n in zip(weights, names):
            if w.perm is None:
                parts.append(_tiled(w, n, summary))
            else:
                summary.fallbacks.append(f"{n} (its g_idx differs from its fused neighbours')")
                parts.append(w.dequantize())
        return QuantLinear(parts)
    parts = [_tiled(w, n, summary) for w, n in zip(weights, names)]
    if all(isinstance(p, TiledQuantWeight) for p in parts):
        fused = quant.concat_rows(parts)  # type: ignore[arg-type]
        parts = parts if fused is None else [fused]
    return QuantLinear(parts) if perm is None else PermutedQuantLinear(parts, torch.from_numpy(perm))


def install_checkpoint(model: nn.Module, spec: QuantSpec, directory: str) -> tuple[set[str], QuantSummary]:
    """Swaps every linear layer the checkpoint stores in int4 for a QuantLinear over its packed
    codes (quant_config.LOADERS' entry point). Returns the HF weight names that are not to be read
    as float (the float loader reads the rest: embeddings, norms, an unquantized LM head) and
    the summary."""
    reader, marker = READERS[spec.method]
    ckpt = CheckpointTensors(directory)
    files = ckpt.files

    def get(name: str) -> torch.Tensor | None:  # the readers take optional tensors as None
        return ckpt.get(name) if name in ckpt else None
    summary = QuantSummary(spec.method)
    config = model.config
    consumed: set[str] = set()
    for parent, attr, prefixes, fused in linear_groups(model):
        if f"{fused}.{marker}" in files:
            prefixes = [fused]
        stored = [f"{p}.{marker}" in files for p in prefixes]
        if not any(stored):
            continue  # left in float by the quantizer (its `ignore` list)
        if not all(stored):
            missing = next(p for p, s in zip(prefixes, stored) if not s)
            raise ModelLoadError(f"{missing}.{marker}: missing tensor ({directory} quantizes its fused neighbours)")
        weights = [reader(get, p, spec) for p in prefixes]
        if config.architecture in _INTERLEAVED_ROPE and attr == "qkv_proj":
            weights = _rotate_qk_rows(weights, config)
        replace_linear(parent, attr, _linear(weights, prefixes, summary))
        consumed.update(f"{p}.weight" for p in prefixes)
    if "lm_head." + marker in files and getattr(model, "lm_head", None) is not None:
        model.quant_lm_head = _linear([reader(get, "lm_head", spec)], ["lm_head"], summary)
        model.quant_lm_head.one_row_order = True
        model.lm_head = None
        consumed.add("lm_head.weight")
    if not summary.formats and not summary.fallbacks:
        raise ModelLoadError(f"{directory}: config.json declares {spec.describe()}, but no layer stores "
                             f"{marker} tensors")
    consumed |= keep_bf16_lm_head(model, ckpt)
    return consumed, summary


def _rotate_qk_rows(weights: list[Int4Weight], config: Any) -> list[Int4Weight]:
    """q and k rows reordered to rotate-half pairs, as the float loader does (cohere.rotate_half_qk)."""
    if len(weights) != 3:
        raise ModelLoadError(f"{config.architecture}: a fused qkv_proj in int4 is not supported")
    q, k, v = weights
    return [q.rows(_rotate_half_order(config, q.codes.shape[0], config.num_attention_heads)),
            k.rows(_rotate_half_order(config, k.codes.shape[0], config.num_key_value_heads)), v]
