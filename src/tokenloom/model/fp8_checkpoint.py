"""FP8 checkpoints: compressed-tensors `float-quantized` (FP8 e4m3 weights with per-tensor,
per-channel or block scales) and quant_method `fp8` (a per-tensor `weight_scale`, or a
`weight_scale_inv` per 128x128 block as DeepSeek and Qwen ship them).

The weights are dequantized once, at load, into the model's dtype (weight * scale in float32,
rounded once: compressed-tensors' and FP8BlockDequantizer's own arithmetic) and then computed on
the float path: only that copy stays resident (2 bytes per weight in bfloat16, twice the file's),
the FP8 bytes are not kept. Activation scales (FP8 W8A8 checkpoints, static or dynamic) are not
used: the activations stay in the model's dtype, as vLLM's weight-only FP8 fallback on GPUs
without FP8 arithmetic computes them.
"""
from __future__ import annotations

import math
from collections.abc import Iterator

import torch
from torch import nn

from tokenloom.model.errors import ModelLoadError
from tokenloom.model.hf_loader import CheckpointTensors
from tokenloom.model.quant_spec import QuantSpec
from tokenloom.model.quant_linear import QuantSummary

# safetensors' names of the FP8 dtypes.
FP8_DTYPES = {"F8_E4M3": torch.float8_e4m3fn}


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, name: str,
                   block: tuple[int, int] | None = None) -> torch.Tensor:
    """FP8 weight [N, K] * scale -> `dtype`: `scale` per tensor ([] or [1]), per channel ([N, 1]
    or [N]) or, with `block` (rows, cols), one per block [ceil(N/rows), ceil(K/cols)]."""
    N, K = weight.shape
    s = scale.float()
    if block is not None:
        br, bc = block
        want = (math.ceil(N / br), math.ceil(K / bc))
        if tuple(s.shape) != want:
            raise ModelLoadError(f"{name}: block scales of shape {list(s.shape)}, expected {list(want)} for "
                                 f"{br}x{bc} blocks of a [{N}, {K}] weight")
        s = s.repeat_interleave(br, 0)[:N].repeat_interleave(bc, 1)[:, :K]
    elif s.numel() == 1:
        s = s.reshape(1, 1)
    elif s.numel() == N and (s.dim() == 1 or s.shape[-1] == 1):
        s = s.reshape(N, 1)
    else:
        raise ModelLoadError(f"{name}: scale of shape {list(s.shape)} is neither per tensor nor per channel "
                             f"[{N}, 1] of a [{N}, {K}] weight")
    return (weight.float() * s).to(dtype)


def _block(spec: QuantSpec) -> tuple[int, int] | None:
    """The checkpoint's block shape, None for per-tensor or per-channel scales."""
    raw = spec.raw
    if spec.method == "fp8":
        size = raw.get("weight_block_size")
    else:  # compressed-tensors: every group is checked to share one scheme (quant_config)
        weights = next(iter(raw["config_groups"].values()))["weights"]
        size = weights.get("block_structure") if weights.get("strategy") == "block" else None
    return None if size is None else (int(size[0]), int(size[1]))


def install_checkpoint(model: nn.Module, spec: QuantSpec, directory: str) -> tuple[set[str], QuantSummary]:
    """Fills every weight the checkpoint stores in FP8 with its dequantized values (in the model's
    dtype); returns the HF names consumed (the float loader skips them) and the summary."""
    ckpt = CheckpointTensors(directory)
    expected = model.checkpoint_shapes()
    block = _block(spec)
    dtype = model.norm.weight.dtype
    fp8 = [n for n in expected if n in ckpt and ckpt.dtype(n) in FP8_DTYPES]
    if not fp8:
        raise ModelLoadError(f"{directory}: quantization_config says FP8, but no weight is stored as float8_e4m3")

    def weights() -> Iterator[tuple[str, torch.Tensor]]:
        for n in fp8:
            if ckpt.shape(n) != expected[n]:
                raise ModelLoadError(f"{n}: expected shape {expected[n]}, got {ckpt.shape(n)} in {directory}")
            scale = f"{n}_scale_inv" if block is not None and spec.method == "fp8" else f"{n}_scale"
            yield n, dequantize_fp8(ckpt.get(n), ckpt.get(scale), dtype, scale, block)

    consumed = model.load_weights(weights())
    method = spec.method if spec.method == spec.format else f"{spec.method} {spec.format}"
    summary = QuantSummary(method + (f" {block[0]}x{block[1]} blocks" if block else ""),
                           dequantized_to=str(dtype).removeprefix("torch."))
    summary.formats["F8_E4M3"] = len(consumed)
    return consumed, summary
