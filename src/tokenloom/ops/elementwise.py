"""The decoder's element-wise steps, one entry point each: `rms_norm` (with the residual add
folded in), `rope` and `silu_and_mul`; and the greedy sampler's row `argmax`.

Each runs the C kernel of `cpu_kernels` when it applies -- a float32 or bfloat16 tensor on the
CPU, laid out as the kernel reads it, and a kernel library that was built -- and the PyTorch ops
otherwise (other dtypes and devices, no compiler, `TOKENLOOM_CPU_KERNELS=0`). Whether the library is there is
decided once per process (`cpu_kernels.load()` caches it); `torch_ops_only()` switches the C
kernels off for a block, so tests can compare the two paths on one model. The two agree within
float32 rounding; in bfloat16 the kernels round where the PyTorch ops do, so they agree bit for
bit on most elements and within two bf16 roundings elsewhere (tests/ops/test_elementwise.py).
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from tokenloom.ops import cpu_kernels

_disabled = False
# The dtypes the library has entry points for (`cpu_kernels._fn` picks the _f32 or _bf16 one).
_C_DTYPES = (torch.float32, torch.bfloat16)


def _lib_for(x: torch.Tensor) -> ctypes.CDLL | None:
    if _disabled or x.dtype not in _C_DTYPES or x.device.type != "cpu":
        return None
    return cpu_kernels.load()


@contextlib.contextmanager
def torch_ops_only() -> Iterator[None]:
    global _disabled
    previous, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = previous


def c_kernels_active(x: torch.Tensor) -> bool:
    """Whether `x`'s dtype and device would run the C kernels now."""
    return _lib_for(x) is not None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with `residual`: (norm(x + residual) * weight, x + residual). The C
    kernel updates `residual` in place. Normalizes in float32 and casts back before scaling by the
    weight, as transformers does; in bfloat16 this ordering keeps outputs within its rounding."""
    lib = _lib_for(x)
    if lib is not None and residual is None and x.dim() == 3 and x.stride(2) == 1:
        # per-head norms (Qwen3's q/k norm): one row per head, as the fused decode step runs them
        return cpu_kernels.add_rms_norm(lib, x.reshape(-1, x.shape[2]), None, weight, eps).view(x.shape)
    if lib is not None and x.dim() == 2 and x.stride(1) == 1 and (residual is None or residual.stride(1) == 1):
        out = cpu_kernels.add_rms_norm(lib, x, residual, weight, eps)
        return out if residual is None else (out, residual)
    if residual is not None:
        x = residual = x + residual
    x32 = x.to(torch.float32)
    out = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x` [T, heads, head_dim] at `positions` [T], from the float32
    [max_positions, head_dim] table `cos_sin` (cos | sin halves). The C kernel rotates in place
    and reads the table unchecked: the caller bounds `positions` first."""
    lib = _lib_for(x)
    if (lib is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and positions.dtype == torch.int64 and positions.is_contiguous()):
        return cpu_kernels.rope_(lib, x, positions, cos_sin)
    return apply_rope(x, *cos_sin.index_select(0, positions).to(x.dtype).unsqueeze(1).chunk(2, -1))


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The PyTorch RoPE: x [T, H, D]; cos/sin [T, 1, D/2]. Rotates (x[i], x[i + D/2]) by the
    pair's angle."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up, [T, I]."""
    lib = _lib_for(gate_up)
    if lib is not None and gate_up.dim() == 2 and gate_up.stride(1) == 1:
        return cpu_kernels.silu_and_mul(lib, gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, dim=-1) of [T, V] logits: the same indices (the first largest; a NaN
    counts as the largest). For float32 on the CPU one C pass, where torch's keeps an index beside
    every compared value."""
    lib = _lib_for(x)
    if lib is not None and x.dtype == torch.float32 and x.dim() == 2 and x.stride(1) == 1:
        return cpu_kernels.argmax_f32(lib, x)
    return x.argmax(dim=-1)

