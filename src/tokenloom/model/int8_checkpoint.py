"""compressed-tensors `int-quantized` checkpoints (W8A8: int8 weights, int8 activations; W8A16:
int8 weights alone), computed on the int8 path with the checkpoint's own codes.

Each int8 weight goes into the Q8 tiles of ops/quant as it is stored (`quant.tile_q8`), with its
scale repeated for every 32 weights of a row: a per-channel, per-tensor or per-group (groups of a
multiple of 32) scale is one Q8 block scale. Those are float16: a bfloat16 scale is exact there,
a float32 one rounds by at most 2^-11 of itself (as a GGUF Q8_0's). No float copy of a quantized
weight is made. The activations are quantized at run time as on the int8 path, per 32 elements
in two int8 planes (ops/quant.qlinear): finer than the per-token int8 the checkpoint was made
for, so the results are at least as close to the float model's as vLLM's per-token kernels'.
Layers the checkpoint keeps in float (its `ignore` list, usually the LM head) load as usual.
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from tokenloom.model.errors import ModelLoadError
from tokenloom.model.hf_loader import CheckpointTensors
from tokenloom.model.quant_spec import QuantSpec
from tokenloom.model.quant_linear import (
    _INTERLEAVED_ROPE,
    QuantLinear,
    QuantSummary,
    _rotate_half_order,
    keep_bf16_lm_head,
    linear_groups,
    replace_linear,
)
from tokenloom.ops import quant
from tokenloom.ops.quant import TiledQuantWeight


def block_scales(scale: torch.Tensor, rows: int, cols: int, name: str) -> torch.Tensor:
    """A stored int8 weight scale (per tensor [1] or [], per channel [N, 1] or [N], per group [N,
    K/g] with g a multiple of 32) -> float16 [N, K/32], one per 32 weights of a row."""
    blocks = cols // quant.QK
    s = scale.float()
    if s.numel() == 1:
        s = s.reshape(1, 1).expand(rows, blocks)
    elif s.reshape(-1).shape[0] == rows and s.dim() <= 2 and (s.dim() == 1 or s.shape[1] == 1):
        s = s.reshape(rows, 1).expand(rows, blocks)
    elif s.dim() == 2 and s.shape[0] == rows and cols % s.shape[1] == 0 and (cols // s.shape[1]) % quant.QK == 0:
        s = s.repeat_interleave(cols // s.shape[1] // quant.QK, dim=1)
    else:
        raise ModelLoadError(f"{name}_scale: shape {list(scale.shape)} is not a per-tensor, per-channel "
                             f"[{rows}, 1] or per-group [{rows}, {cols}/g] (g a multiple of {quant.QK}) scale")
    half = s.to(torch.float16)
    if not torch.isfinite(half).all() or ((half == 0) & (s != 0)).any():
        raise ModelLoadError(f"{name}_scale: a scale is outside float16's range (the int8 kernels' block scales)")
    return half


def int8_part(ckpt: CheckpointTensors, name: str, shape: tuple[int, ...],
              order: np.ndarray | None = None) -> TiledQuantWeight:
    """The checkpoint's int8 weight `name` ([N, K]) and its `_scale` as Q8 tiles, rows taken in
    `order` where given (q/k rows of the interleaved-RoPE families: codes and scales move
    together)."""
    if ckpt.shape(name) != shape:
        raise ModelLoadError(f"{name}: expected shape {shape}, got {ckpt.shape(name)} in {ckpt.directory}")
    rows, cols = shape
    if cols % quant.QK:
        raise ModelLoadError(f"{name}: int8 weights need in_features divisible by {quant.QK}, got {cols}")
    if f"{name}_zero_point" in ckpt and ckpt.get(f"{name}_zero_point").any():
        raise ModelLoadError(f"{name}_zero_point: asymmetric int8 weights are not supported (symmetric only)")
    codes, scales = ckpt.get(name), block_scales(ckpt.get(f"{name}_scale"), rows, cols, name)
    if order is not None:
        index = torch.from_numpy(order)
        codes, scales = codes[index], scales[index]
    return quant.tile_q8(codes, scales)


def install_checkpoint(model: nn.Module, spec: QuantSpec, directory: str) -> tuple[set[str], QuantSummary]:
    """Swap every linear layer whose checkpoint weights are int8 for a QuantLinear over them (and
    the LM head, where the checkpoint quantized it); returns the HF names consumed (the float
    loader skips them) and the summary. A fused layer (q|k|v, gate|up) with some parts in float
    keeps those parts float."""
    ckpt = CheckpointTensors(directory)
    expected = model.checkpoint_shapes()
    summary = QuantSummary(f"compressed-tensors {spec.scheme}")
    consumed: set[str] = set()

    def is_int8(name: str) -> bool:
        return ckpt.dtype(name) == "I8"

    config = model.config

    def order(name: str) -> np.ndarray | None:
        """The float loader's q/k row order for the interleaved-RoPE families (cohere.rotate_half_qk)."""
        if config.architecture not in _INTERLEAVED_ROPE or not name.endswith(("q_proj.weight", "k_proj.weight")):
            return None
        heads = config.num_attention_heads if name.endswith("q_proj.weight") else config.num_key_value_heads
        return _rotate_half_order(config, expected[name][0], heads)

    def linear(names: list[str]) -> QuantLinear:
        parts: list[TiledQuantWeight | torch.Tensor] = []
        for n in names:
            if config.architecture in _INTERLEAVED_ROPE and n.endswith("qkv_proj.weight"):
                raise ModelLoadError(f"{n}: a fused q|k|v in int8 is not supported for {config.architecture}")
            rows = order(n)
            if is_int8(n):
                parts.append(int8_part(ckpt, n, expected[n], rows))
                summary.formats["Q8_0"] += 1
            else:
                w = ckpt.get(n).float()
                parts.append((w if rows is None else w[torch.from_numpy(rows)]).contiguous())
        if all(isinstance(p, TiledQuantWeight) for p in parts):
            fused = quant.concat_rows(parts)  # type: ignore[arg-type]
            parts = parts if fused is None else [fused]
        return QuantLinear(parts)

    for parent, attr, prefixes, fused in linear_groups(model):
        names = [f"{fused}.weight"] if f"{fused}.weight" in ckpt else [f"{n}.weight" for n in prefixes]
        if any(is_int8(n) for n in names):
            replace_linear(parent, attr, linear(names))
            consumed.update(names)
    if not model.config.tie_word_embeddings and is_int8("lm_head.weight"):
        model.quant_lm_head = linear(["lm_head.weight"])
        model.quant_lm_head.one_row_order = True
        model.lm_head = None
        consumed.add("lm_head.weight")
    if not consumed:
        raise ModelLoadError(f"{directory}: quantization_config says int-quantized, but no linear layer's weight is "
                             "stored as int8")
    return consumed | keep_bf16_lm_head(model, ckpt), summary
