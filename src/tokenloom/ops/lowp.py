"""Matmuls on float weights narrower than the activations, kept as stored: FP8 e4m3 with
float32 scales (per tensor, per channel or per block of K) and bfloat16, with float32 activations
and outputs (csrc/lowp_gemm.c).

An FP8 checkpoint's linear layers hold one byte per weight this way (the float path would hold
two or four), and a bfloat16 LM head of a quantized checkpoint two (the float32 model would hold
four). Each weight is widened in a register, an FP8 one times its scale in float32, which is the
weight a float32 dequantization holds, bit for bit; the sums are float32. From the kernel plan's
`quant_bf16_rows` rows on a CPU with AMX-BF16 the weight is widened to bfloat16 panels and the
activations rounded to bfloat16 on the AMX tiles, as the quantized kernels do there.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokenloom.ops import cpu_kernels, kernel_plan, quant

BF16, E4M3 = 0, 1  # csrc/lowp_gemm.c's kinds
TILE = 16  # output columns per column tile
# tl_lp_level's levels -> the kernel names of the plan (kernel_plan._lowp_points)
LEVEL_KERNELS = {0: "lp_portable", 1: "lp_avx2", 2: "lp_avx512", 3: "lp_amx_bf16"}
_c_i32, _c_i64, _c_p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_bound: set[int] = set()


def _lib() -> ctypes.CDLL | None:
    lib = cpu_kernels.load()
    if lib is not None and id(lib) not in _bound:
        lib.tl_lp_linear.restype = _c_i32
        lib.tl_lp_linear.argtypes = [_c_i32, _c_p, _c_p, _c_i64, _c_i64, _c_i64, _c_i64, _c_p, _c_i64, _c_i64,
                                     _c_p, _c_i64, _c_p, _c_p]
        lib.tl_lp_scratch_bytes.restype = _c_i64
        lib.tl_lp_scratch_bytes.argtypes = [_c_i64, _c_i64]
        for name in ("tl_lp_level", "tl_lp_last_kernel"):
            getattr(lib, name).restype = _c_i32
            getattr(lib, name).argtypes = []
        for name in ("tl_lp_limit_level", "tl_lp_set_amx_rows"):
            getattr(lib, name).restype = _c_i32
            getattr(lib, name).argtypes = [_c_i32]
        _bound.add(id(lib))
        plan = kernel_plan.current()
        lib.tl_lp_set_amx_rows(plan.quant_bf16_rows)
        lib.tl_lp_limit_level(plan.lowp_force_level)
    return lib


def available() -> bool:
    """True where the C kernels are built (the FP8 and bf16 weights are kept as stored)."""
    return _lib() is not None


def limit_level(level: str | None) -> str:
    """Use at most kernel `level` (a LEVEL_KERNELS name; None: the best the CPU has), for tests
    and benchmarks; returns the kernel now in use."""
    by_name = {v: k for k, v in LEVEL_KERNELS.items()}
    lib = _lib()
    want = kernel_plan.current().lowp_force_level if level is None else by_name[level]
    return LEVEL_KERNELS[lib.tl_lp_limit_level(want)]


def set_amx_rows(rows: int) -> int:
    """Matmuls of at least `rows` rows run on the AMX bf16 tiles where the CPU has them (0:
    never); returns the previous threshold. For tests (float32 results at every row count) and
    A/B measurements."""
    return int(_lib().tl_lp_set_amx_rows(rows))


def kernel_level() -> str:
    """The best kernel in use here (lp_amx_bf16 runs from `quant_bf16_rows` rows, lp_avx512 below)."""
    return LEVEL_KERNELS[_lib().tl_lp_level()]


def last_kernel() -> str:
    """The kernel the last matmul ran ("" before any)."""
    return LEVEL_KERNELS.get(_lib().tl_lp_last_kernel(), "")


@dataclass(eq=False)
class LowpWeight:
    """An [out_features, in_features] weight in csrc/lowp_gemm.c's layout (amx_gemm.c's packed
    bf16 layout, in the stored width): [tiles of 16 columns, in_features padded to 32 / 2, 16, 2]."""

    data: torch.Tensor  # uint8 (e4m3 codes) or bfloat16
    scales: torch.Tensor | None  # float32 [tiles, groups, 32] times 2^8 (e4m3); None for bf16
    group_k: int  # inputs per scale group
    out_features: int
    in_features: int

    @property
    def kind(self) -> int:
        return BF16 if self.data.dtype == torch.bfloat16 else E4M3

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * 4
        return self.data.numel() * self.data.element_size() + extra

    @property
    def format_name(self) -> str:
        return "BF16" if self.kind == BF16 else "F8_E4M3"

    def unpack(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(weight [N, K] as stored (bfloat16 or float8_e4m3fn), scales [N, groups] or None)."""
        N, K = self.out_features, self.in_features
        tiles, half = self.data.shape[:2]
        w = self.data.permute(0, 2, 1, 3).reshape(tiles * TILE, 2 * half)[:N, :K]
        if self.scales is None:
            return w.contiguous(), None
        s = self.scales[:, :, 0::2].transpose(1, 2).reshape(tiles * TILE, -1)[:N] / 256
        return w.contiguous().view(torch.float8_e4m3fn), s.contiguous()

    def take_rows(self, a: int, b: int) -> LowpWeight:
        """Output rows [a, b) (a tensor-parallel rank's share)."""
        w, s = self.unpack()
        if s is None:
            return pack_bf16(w[a:b])
        return pack_e4m3(w[a:b], s[a:b], self.group_k)

    def take_cols(self, a: int, b: int, name: str) -> LowpWeight:
        """Input columns [a, b); `name` for the error where the cut splits a scale group."""
        w, s = self.unpack()
        if s is None:
            return pack_bf16(w[:, a:b])
        if s.shape[1] == 1:
            return pack_e4m3(w[:, a:b], s, b - a)
        if a % self.group_k or (b % self.group_k and b != self.in_features):
            raise ValueError(f"{name}: columns {a}:{b} cut a scale block of {self.group_k} inputs; use a "
                             "tensor_parallel_size that splits the layer at block boundaries")
        return pack_e4m3(w[:, a:b], s[:, a // self.group_k: -(-b // self.group_k)], self.group_k)

    def dequantize(self) -> torch.Tensor:
        """The float32 [out, in] weight the kernels multiply by (tests, and layers the model
        reads as plain weights)."""
        N, K = self.out_features, self.in_features
        tiles, half = self.data.shape[:2]
        if self.kind == BF16:
            w = self.data.float()
        else:
            groups = self.scales.shape[1]
            g = (torch.arange(2 * half) // self.group_k).clamp(max=groups - 1)
            s = self.scales[:, g, 0::2] / 256  # [tiles, k, column]
            w = self.data.view(torch.float8_e4m3fn).float() * s.reshape(tiles, half, 2, TILE).transpose(2, 3)
        return w.permute(0, 2, 1, 3).reshape(tiles * TILE, 2 * half)[:N, :K].contiguous()


def _tiles(w: torch.Tensor) -> torch.Tensor:
    """[N, K] -> [N'/16, K'/2, 16, 2] (N' and K' the next multiples of 32, zero-padded)."""
    N, K = w.shape
    padded = w.new_zeros(-(-N // 32) * 32, -(-K // 32) * 32)
    padded[:N, :K] = w
    return padded.reshape(-1, TILE, padded.shape[1] // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_bf16(weight: torch.Tensor) -> LowpWeight:
    """A bfloat16 [N, K] weight (kept exactly; K even)."""
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"pack_bf16 takes a 2-D bfloat16 weight of even width, got {weight.dtype} "
                         f"{list(weight.shape)}")
    return LowpWeight(_tiles(weight.detach()), None, weight.shape[1], *weight.shape)


def pack_e4m3(weight: torch.Tensor, scales: torch.Tensor, group_k: int) -> LowpWeight:
    """An FP8 e4m3 [N, K] weight (K even) with float scales [N, ceil(K / group_k)]: column n's
    inputs k are scaled by scales[n, k // group_k]; group_k a multiple of 32 or K (one group)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2 or weight.shape[1] % 2:
        raise ValueError(f"pack_e4m3 takes a 2-D float8_e4m3fn weight of even width, got {weight.dtype} "
                         f"{list(weight.shape)}")
    N, K = weight.shape
    groups = -(-K // group_k)
    if tuple(scales.shape) != (N, groups):
        raise ValueError(f"scales of shape {list(scales.shape)}, expected [{N}, {groups}] for groups of {group_k}")
    if groups > 1 and group_k % 32:
        raise ValueError(f"scale groups of {group_k} inputs: the kernels take multiples of 32")
    codes = _tiles(weight.detach().view(torch.uint8))
    s = scales.float() * 256  # 2^8 back (csrc/lowp_gemm.c: e4m3)
    s = torch.cat([s, s.new_zeros(codes.shape[0] * TILE - N, groups)])
    s = s.reshape(-1, TILE, groups).transpose(1, 2).repeat_interleave(2, dim=2).contiguous()  # [tiles, G, 32]
    return LowpWeight(codes, s, K if groups == 1 else group_k, N, K)


def linear(x: torch.Tensor, w: LowpWeight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] (float32; other dtypes are widened) -> x W^T (+ bias), float32 [..., N]."""
    lib = _lib()
    K, N = w.in_features, w.out_features
    lead = x.shape[:-1]
    x2 = quant.f32_rows(x, K)
    M = x2.shape[0]
    y = torch.empty(M, N)
    scratch = torch.empty(lib.tl_lp_scratch_bytes(M, K), dtype=torch.uint8)
    b = None if bias is None else bias.float().contiguous()
    s = w.scales
    rc = lib.tl_lp_linear(w.kind, w.data.data_ptr(), None if s is None else s.data_ptr(),
                          1 if s is None else s.shape[1], w.group_k, N, K, x2.data_ptr(), x2.stride(0), M,
                          y.data_ptr(), N, None if b is None else b.data_ptr(),
                          scratch.data_ptr() if scratch.numel() else None)
    if rc != 0:
        raise RuntimeError("tl_lp_linear refused its arguments")
    return y.reshape(*lead, N)
