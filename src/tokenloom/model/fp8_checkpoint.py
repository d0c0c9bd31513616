"""FP8 checkpoints: compressed-tensors `float-quantized` (FP8 e4m3 weights with per-tensor,
per-channel or block scales) and quant_method `fp8` (a per-tensor `weight_scale`, or a
`weight_scale_inv` per 128x128 block as DeepSeek and Qwen ship them).

On the CPU with the C kernels, every linear layer stored in FP8 stays in its bytes, one per
weight, with its scales expanded to one per row and block of K (ops/lowp: `QuantLinear` over an
e4m3 `LowpWeight`, q|k|v and gate|up fused): each weight is widened in a register times its
scale, which is the float32 dequantization's value bit for bit, so a float32 model computes what
a float32 model on the dequantized weights computes, but for the summation order (and the
bf16 tiles' rounding from the kernel plan's bf16 rows on AMX CPUs, as quantized models).
Elsewhere (no C kernels, another device, the interleaved-RoPE families whose q/k rows move,
scale blocks the kernels cannot take, MoE experts) the weights are dequantized once, at load,
into the model's dtype (weight * scale in float32, rounded once: compressed-tensors' and
FP8BlockDequantizer's own arithmetic) and computed on the float path. Activation scales (FP8
W8A8 checkpoints, static or dynamic) are not used: the activations stay in the model's dtype,
as vLLM's weight-only FP8 fallback on GPUs without FP8 arithmetic computes them.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from tokenloom.model.errors import ModelLoadError
from tokenloom.model.hf_loader import CheckpointTensors
from tokenloom.model.quant_spec import QuantSpec
from tokenloom.model.quant_linear import (
    _INTERLEAVED_ROPE,
    QuantLinear,
    QuantSummary,
    keep_bf16_lm_head,
    linear_groups,
    replace_linear,
)
from tokenloom.ops import lowp

# safetensors' names of the FP8 dtypes.
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, name: str,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """FP8 weight [N, K] * scale -> `dtype`: `scale` per tensor ([] or [1]), per channel ([N, 1]
    or [N]) or, with `block` (rows, cols), one per block [ceil(N/rows), ceil(K/cols)]."""
    N, K = weight.shape
    s, group_k = row_scales(scale, N, K, name, block)
    if s.shape[1] > 1:
        s = s.repeat_interleave(group_k, 1)[:, :K]
    return (weight.float() * s).to(dtype)


def row_scales(scale: torch.Tensor, rows: int, cols: int, name: str,
               block: tuple[int, int] | None) -> tuple[torch.Tensor, int]:
    """A stored scale as (float32 [rows, groups], inputs per group): one scale per row and block
    of K (ops/lowp.pack_e4m3's form)."""
    s = scale.float()
    if block is not None:
        br, bc = block
        want = (math.ceil(rows / br), math.ceil(cols / bc))
        if tuple(s.shape) != want:
            raise ModelLoadError(f"{name}: block scales of shape {list(s.shape)}, expected {list(want)} for "
                                 f"{br}x{bc} blocks of a [{rows}, {cols}] weight")
        return s.repeat_interleave(br, 0)[:rows].contiguous(), bc if s.shape[1] > 1 else cols
    if s.numel() == 1:
        return s.reshape(1, 1).expand(rows, 1).contiguous(), cols
    if s.numel() == rows and (s.dim() == 1 or s.shape[-1] == 1):
        return s.reshape(rows, 1).contiguous(), cols
    raise ModelLoadError(f"{name}: scale of shape {list(s.shape)} is neither per tensor nor per channel "
                         f"[{rows}, 1] of a [{rows}, {cols}] weight")


def _block(spec: QuantSpec) -> tuple[int, int] | None:
    """The checkpoint's block shape, None for per-tensor or per-channel scales."""
    raw = spec.raw
    if spec.method == "fp8":
        size = raw.get("weight_block_size")
    else:  # compressed-tensors: every group is checked to share one scheme (quant_config)
        weights = next(iter(raw["config_groups"].values()))["weights"]
        size = weights.get("block_structure") if weights.get("strategy") == "block" else None
    return None if size is None else (int(size[0]), int(size[1]))


def _scale_name(n: str, spec: QuantSpec, block: tuple[int, int] | None) -> str:
    return f"{n}_scale_inv" if block is not None and spec.method == "fp8" else f"{n}_scale"


def _keep_fp8(model: nn.Module, ckpt: CheckpointTensors, spec: QuantSpec, block: tuple[int, int] | None,
              fp8: set[str], expected: dict[str, tuple[int, ...]]) -> set[str]:
    """Every linear layer whose parts are all stored in FP8 as one QuantLinear over their bytes
    (ops/lowp); returns the names consumed. Nothing where the kernels do not apply."""
    if (not lowp.available() or model.norm.weight.device.type != "cpu"
            or model.config.architecture in _INTERLEAVED_ROPE):
        return set()
    consumed: set[str] = set()
    for parent, attr, prefixes, fused in linear_groups(model):
        names = [f"{fused}.weight"] if f"{fused}.weight" in ckpt else [f"{p}.weight" for p in prefixes]
        if not all(n in fp8 for n in names) or any(ckpt.shape(n)[1] % 2 for n in names):
            continue
        codes, scales = [], []
        for n in names:
            if ckpt.shape(n) != expected[n]:
                raise ModelLoadError(f"{n}: expected shape {expected[n]}, got {ckpt.shape(n)} in {ckpt.directory}")
            rows, cols = expected[n]
            got = row_scales(ckpt.get(_scale_name(n, spec, block)), rows, cols, _scale_name(n, spec, block), block)
            if got[0].shape[1] > 1 and got[1] % 32:
                break  # scale blocks narrower than the kernels' 32 inputs
            codes.append(ckpt.get(n))
            scales.append(got)
        if len(codes) != len(names) or len({gk for _, gk in scales}) != 1:
            continue  # blocks the kernels cannot take, or parts scaled differently along K
        weight = codes[0] if len(codes) == 1 else torch.cat(codes)
        s = scales[0][0] if len(scales) == 1 else torch.cat([t for t, _ in scales])
        replace_linear(parent, attr, QuantLinear([lowp.pack_e4m3(weight, s, scales[0][1])]))
        consumed.update(names)
    return consumed


def install_checkpoint(model: nn.Module, spec: QuantSpec, directory: str) -> tuple[set[str], QuantSummary]:
    """Keeps every linear layer the checkpoint stores in FP8 in its bytes where the kernels apply,
    and fills the other FP8 weights with their dequantized values (in the model's dtype); returns
    the HF names consumed (the float loader skips them) and the summary."""
    ckpt = CheckpointTensors(directory)
    expected = model.checkpoint_shapes()
    block = _block(spec)
    dtype = model.norm.weight.dtype
    fp8 = [n for n in expected if n in ckpt and ckpt.dtype(n) in FP8_DTYPES]
    if not fp8:
        raise ModelLoadError(f"{directory}: quantization_config says FP8, but no weight is stored as float8_e4m3")
    kept = _keep_fp8(model, ckpt, spec, block, set(fp8), expected)

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for n in fp8:
            if n in kept:
                continue
            if ckpt.shape(n) != expected[n]:
                raise ModelLoadError(f"{n}: expected shape {expected[n]}, got {ckpt.shape(n)} in {directory}")
            scale = _scale_name(n, spec, block)
            yield n, dequantize_fp8(ckpt.get(n), ckpt.get(scale), dtype, scale, block)

    dequantized = model.load_weights(weights())
    method = spec.method if spec.method == spec.format else f"{spec.method} {spec.format}"
    method += f" {block[0]}x{block[1]} blocks" if block else ""
    if kept:
        summary = QuantSummary(method)
        summary.formats["F8_E4M3"] = len(kept)
        summary.fallbacks = sorted(dequantized)
    else:
        summary = QuantSummary(method, dequantized_to=str(dtype).removeprefix("torch."))
        summary.formats["F8_E4M3"] = len(dequantized)
    # a bfloat16 LM head of a float32 model: kept in bfloat16 where the layers are kept as stored
    return kept | dequantized | (keep_bf16_lm_head(model, ckpt) if kept else set()), summary
