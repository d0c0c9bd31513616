"""Block-quantized weights and their matmul on the CPU (csrc/quant_gemm.c).

A `TiledQuantWeight` holds an [N, K] weight as 4- to 8-bit codes with their scales, rearranged
from the GGUF's row-major blocks into tiles of 16 output columns so that one AVX-512 VNNI
instruction multiplies 4 inputs into 16 columns (the layout is described in the C source). The
rearrangement moves bits, never widens them: the tiled weight has exactly the GGUF's bytes per
weight (Q4_0 18, Q4_1 20, Q5_0 22, Q8_0 34 per 32 weights; Q4_K 144, Q5_K 176, Q6_K 210 per 256),
plus zero rows padding N to a multiple of 16.

Formats: the GGUF's Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K and Q6_K as shipped, and Q8 codes made
from a float weight at load (`quantize_q8`: the int8 path for float checkpoints; a scale per 32
weights of a row, which is Q8_0). The matmul quantizes the activations per 32-element block to
int8 (llama.cpp's Q8_0 activations) and runs integer dot products; see `qlinear`. The K-quants'
32-weight sub-blocks (16 for Q6_K's scales) line up with those activation blocks, so their
super-block scales are applied per block like any other format's.

On CPUs with AMX-BF16, matmuls of 16 rows and more instead dequantize the weight panel by panel
(32 columns x K, in a per-thread buffer, never resident) to bfloat16 and multiply on bf16 tiles
(csrc/quant_gemm_amx_bf16.inc): a bf16 matmul's rounding, faster than the AMX int8 kernel whose
per-block scales cost a tile store and reload (benchmarks/quant_bf16_tiles_ab.py). That is also how a GGUF runs with bfloat16 activations (`dtype="bfloat16"` there). With
float32 activations the MLP's gate|up matmul on these tiles also applies SiLU-and-mul in its
epilogue (`qlinear_silu_and_mul`), writing the [M, I] activation instead of the [M, 2I] product
that a second pass would read back.

On AVX2 CPUs (no AVX-512), matmuls of 16 rows and more dequantize each 16-column tile of the
weight to a float32 panel per thread and multiply it as the float path's panel matmul does
(csrc/quant_gemm_f32panel.inc, csrc/f32_panel.c): float32 activations and sums, faster than the
integer kernel there (benchmarks/quant_kernels.py).
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass

import numpy as np
import torch

from tokenloom.ops import cpu_kernels, cpu_memory, kernel_plan
from tokenloom.ops.ggml_types import GGML_QUANT_SIZES, Q

QK = 32  # weights per block
QK_K = 256  # weights per K-quant super-block
TILE_N = 16  # output columns per tile
# Format ids of csrc/quant_gemm.c.
FMT_Q4_0, FMT_Q4_1, FMT_Q8, FMT_Q5_0, FMT_Q4_K, FMT_Q5_K, FMT_Q6_K = range(7)
FORMAT_NAMES = {FMT_Q4_0: "Q4_0", FMT_Q4_1: "Q4_1", FMT_Q8: "Q8_0", FMT_Q5_0: "Q5_0",
                FMT_Q4_K: "Q4_K", FMT_Q5_K: "Q5_K", FMT_Q6_K: "Q6_K"}
# GGUF tensor types computed as shipped, and their kernel format.
GGML_FORMATS = {int(Q.Q4_0): FMT_Q4_0, int(Q.Q4_1): FMT_Q4_1, int(Q.Q8_0): FMT_Q8,
                int(Q.Q5_0): FMT_Q5_0, int(Q.Q4_K): FMT_Q4_K, int(Q.Q5_K): FMT_Q5_K,
                int(Q.Q6_K): FMT_Q6_K}
_K_QUANTS = frozenset({FMT_Q4_K, FMT_Q5_K, FMT_Q6_K})
# Kernel levels of csrc/quant_gemm.c. "avx512_vnni+amx_int8": AMX tiles from 8 activation rows
# (16 with one activation plane), the VNNI kernel below that (where the 16-row tiles would be
# mostly padding); Q6_K stays on VNNI. "avx512_vnni+amx_bf16": the same, and from 16 rows
# (`TOKENLOOM_QUANT_BF16_ROWS`, `set_amx_bf16_rows`) every format's weight dequantized to
# bfloat16 panels on AMX-BF16 tiles (csrc/quant_gemm_amx_bf16.inc: a bfloat16 matmul's rounding,
# faster than the int8 tiles). "avx2": VPMADDUBSW, and from 16 rows
# (`TOKENLOOM_QUANT_F32_ROWS`, `set_f32_panel_rows`) float32 panels (csrc/quant_gemm_f32panel.inc).
# The thresholds and TOKENLOOM_QUANT_ISA's cap come from the kernel plan (ops/kernel_plan.py),
# handed to the library when it is bound (`_lib`).
ISA_NAMES = dict(enumerate(kernel_plan.QUANT_LEVELS))

# int8 planes per activation block (see `qlinear`). One plane (llama.cpp's Q8_0 activations)
# rounds each activation to 1/254 of its block's largest: on SmolLM2-135M that kept perplexity
# close to the float path's but changed greedy chat answers (near ties flip). Two planes leave an
# error of 1/65024 of the block's largest for twice the integer work (benchmarks/quant_quality.py).
ACT_LEVELS = 2

logger = logging.getLogger(__name__)
_c_i32, _c_i64, _c_p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_bound: set[int] = set()


def _lib() -> ctypes.CDLL:
    lib = cpu_kernels.load()
    if lib is None:
        raise RuntimeError("quantized weights need the CPU kernels (ops/cpu_kernels), which could "
                           "not be built here (no C compiler, or TOKENLOOM_CPU_KERNELS=0); use "
                           "quantization='none'")
    if id(lib) not in _bound:
        lib.tl_q_linear.restype = _c_i32
        lib.tl_q_linear.argtypes = [_c_i32, _c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_i64, _c_p,
                                    _c_i64, _c_p, _c_p, _c_i32]
        lib.tl_q_scratch_bytes.restype = _c_i64
        lib.tl_q_scratch_bytes.argtypes = [_c_i64, _c_i64]
        lib.tl_q_record_bytes.restype = _c_i64
        lib.tl_q_record_bytes.argtypes = [_c_i32]
        lib.tl_q_isa.restype = _c_i32
        lib.tl_q_isa.argtypes = [_c_i32]
        lib.tl_q_limit_isa.restype = _c_i32
        lib.tl_q_limit_isa.argtypes = [_c_i32]
        lib.tl_q_amx_status.restype = _c_i32
        lib.tl_q_amx_status.argtypes = []
        lib.tl_q_linear_bf16.restype = _c_i32
        lib.tl_q_linear_bf16.argtypes = [_c_i32, _c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_i64, _c_p,
                                         _c_i64, _c_p, _c_p, _c_i32, _c_i64]
        lib.tl_q_bf16_scratch_bytes.restype = _c_i64
        lib.tl_q_bf16_scratch_bytes.argtypes = [_c_i64, _c_i64, _c_i64]
        lib.tl_q_set_amx_bf16_rows.restype = _c_i32
        lib.tl_q_set_amx_bf16_rows.argtypes = [_c_i32]
        lib.tl_q_linear_silu.restype = _c_i32
        lib.tl_q_linear_silu.argtypes = [_c_i32, _c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_i64, _c_p,
                                         _c_i64, _c_p, _c_p]
        lib.tl_q_set_f32_panel_rows.restype = _c_i32
        lib.tl_q_set_f32_panel_rows.argtypes = [_c_i32]
        lib.tl_q_f32_panel_rows.restype = _c_i32
        lib.tl_q_f32_panel_rows.argtypes = [_c_i32]
        lib.tl_q_silu_rows.restype = _c_i32
        lib.tl_q_silu_rows.argtypes = [_c_i32]
        lib.tl_q_set_silu_epilogue.restype = _c_i32
        lib.tl_q_set_silu_epilogue.argtypes = [_c_i32]
        lib.tl_q_set_amxb_l1_chunks.restype = _c_i32
        lib.tl_q_set_amxb_l1_chunks.argtypes = [_c_i32]
        lib.tl_q_dequant_rows.restype = None
        lib.tl_q_dequant_rows.argtypes = [_c_i32, _c_p, _c_i64, _c_p, _c_i64, _c_p]
        lib.tl_q_force_isa.restype = _c_i32
        lib.tl_q_force_isa.argtypes = [_c_i32]
        lib.tl_q_last_kernel.restype = _c_i32
        lib.tl_q_last_kernel.argtypes = []
        _bound.add(id(lib))
        _apply_plan(lib, kernel_plan.current())
        if lib.tl_q_amx_status() < 0:
            logger.warning("the CPU has AMX int8 but Linux refused its tile state (arch_prctl "
                           "ARCH_REQ_XCOMP_PERM): quantized matmuls use AVX-512 VNNI")
    return lib


def _apply_plan(lib: ctypes.CDLL, plan: kernel_plan.KernelPlan) -> None:
    """Hands the plan's decisions to csrc/quant_gemm.c: the level cap (TOKENLOOM_QUANT_ISA) and
    the rows from which the bf16 tiles and the AVX2 float32 panels run."""
    lib.tl_q_force_isa(plan.quant_force_level)
    lib.tl_q_set_amx_bf16_rows(plan.quant_bf16_rows)
    lib.tl_q_set_f32_panel_rows(plan.quant_f32_rows)


def last_kernel() -> str:
    """The kernel the last quantized matmul ran (csrc/quant_gemm.c's probe): a prefix of the
    kernel names in the plan (kernel_plan.QUANT_PROBE), "" before any."""
    return kernel_plan.QUANT_PROBE.get(_lib().tl_q_last_kernel(), "")


def kernel_isa(fmt: int) -> str:
    """Which kernel runs `fmt` on this CPU: avx512_vnni+amx_int8, avx512_vnni, avx2 or c
    (portable)."""
    return ISA_NAMES[_lib().tl_q_isa(fmt)]


def limit_isa(name: str | None) -> str:
    """Use at most kernel `name` (avx512_vnni+amx_int8, avx512_vnni, avx2, c; None: the best this
    CPU has), for tests and benchmarks; returns the kernel level now in use."""
    levels = {v: k for k, v in ISA_NAMES.items()}
    _tile_rows.clear()
    return ISA_NAMES[_lib().tl_q_limit_isa(-1 if name is None else levels[name])]


def set_amx_bf16_rows(rows: int) -> int:
    """Matmuls of at least `rows` activation rows run on the bf16 tiles where the kernel level
    is avx512_vnni+amx_bf16 (0: never); returns the previous threshold (0 where this CPU or
    process has no AMX-BF16). For tests and A/B measurements."""
    _tile_rows.clear()
    return _lib().tl_q_set_amx_bf16_rows(rows)


def set_f32_panel_rows(rows: int) -> int:
    """Matmuls of at least `rows` activation rows run on float32 panels dequantized per thread
    where the kernel level is avx2 (csrc/quant_gemm_f32panel.inc; 0: never); returns the previous
    threshold, whatever the level. For tests and A/B measurements (TOKENLOOM_QUANT_F32_ROWS sets
    it for a process)."""
    return _lib().tl_q_set_f32_panel_rows(rows)


def f32_panel_rows(fmt: int) -> int:
    """Rows from which `qlinear` multiplies format `fmt` on dequantized float32 panels here
    (0: never)."""
    return _lib().tl_q_f32_panel_rows(fmt)


def set_silu_epilogue(on: bool) -> bool:
    """Whether `qlinear_silu_and_mul` (and the fused decode step) may fuse SiLU-and-mul into
    the gate|up matmul (default on); returns the previous setting. For tests and A/B runs."""
    _tile_rows.clear()
    return bool(_lib().tl_q_set_silu_epilogue(int(on)))


def set_bf16_tiles_l1_chunks(on: bool) -> bool:
    """Whether a bf16-tile matmul of a few row pairs (decode steps) dequantizes its weight panels
    a K chunk at a time into L1 (default on) or each panel whole into L2; the results are the
    same bits either way. Returns the previous setting. For tests and A/B runs."""
    return bool(_lib().tl_q_set_amxb_l1_chunks(int(on)))


_tile_rows: dict[int, int] = {}  # format -> silu_epilogue_rows(format), until a setting changes


def silu_epilogue_rows(fmt: int) -> int:
    """Rows from which `qlinear_silu_and_mul` fuses for format `fmt` here (those of the bf16
    tiles; 0: never). Asked of the C library once per format and kept, so that a step below it
    pays a dict lookup."""
    rows = _tile_rows.get(fmt)
    if rows is None:
        rows = _tile_rows[fmt] = _lib().tl_q_silu_rows(fmt)
    return rows


@dataclass(eq=False)
class TiledQuantWeight:
    """An [N, K] weight in the tiled layout; `data` is uint8 [ceil(N/16), units, unit bytes], a
    unit being a 32-weight block (a 256-weight super-block for the K-quants) of 16 columns."""

    fmt: int
    data: torch.Tensor
    out_features: int
    in_features: int

    @property
    def format_name(self) -> str:
        return FORMAT_NAMES[self.fmt]

    @property
    def nbytes(self) -> int:
        return self.data.numel()


def _tile_codes(codes: np.ndarray, n_pad: int) -> np.ndarray:
    """codes uint8 [N, nb, 32 or 16] (per block: Q8's 32 codes, or Q4's 16 nibble bytes in GGUF
    order) -> [tiles, nb, groups, 16 columns, 4 bytes] flattened to [tiles, nb, bytes]."""
    N, nb, width = codes.shape
    if n_pad != N:
        codes = np.concatenate([codes, np.zeros((n_pad - N, nb, width), np.uint8)])
    t = codes.reshape(n_pad // TILE_N, TILE_N, nb, width // 4, 4).transpose(0, 2, 3, 1, 4)
    return t.reshape(n_pad // TILE_N, nb, width * TILE_N)


def _tile_halves(h: np.ndarray, n_pad: int) -> np.ndarray:
    """fp16 [N, nb] -> bytes [tiles, nb, 32] (one fp16 per column of the tile)."""
    N, nb = h.shape
    if n_pad != N:
        h = np.concatenate([h, np.zeros((n_pad - N, nb), np.float16)])
    t = np.ascontiguousarray(h.reshape(n_pad // TILE_N, TILE_N, nb).transpose(0, 2, 1))
    return t.view(np.uint8).reshape(n_pad // TILE_N, nb, 2 * TILE_N)


def _tile_planes(a: np.ndarray, n_pad: int) -> np.ndarray:
    """bytes [N, units, P] (P per-column parameter bytes) -> [tiles, units, P * 16], byte plane p
    holding the 16 columns' byte p (so one 16-byte load gives a parameter for every column)."""
    N, nu, P = a.shape
    if n_pad != N:
        a = np.concatenate([a, np.zeros((n_pad - N, nu, P), np.uint8)])
    t = a.reshape(n_pad // TILE_N, TILE_N, nu, P).transpose(0, 2, 3, 1)
    return np.ascontiguousarray(t).reshape(n_pad // TILE_N, nu, P * TILE_N)


def _halves(b: np.ndarray) -> np.ndarray:
    """uint8 [..., 2] little-endian fp16 bytes -> float16 [...]."""
    return np.ascontiguousarray(b).view(np.float16)[..., 0]


def _block_codes(q: np.ndarray, fmt: int, n_pad: int) -> np.ndarray:
    """Unsigned codes uint8 [N, nb, 32] of 4 to 6 bits -> the tiled code bytes [tiles, nb, code
    bytes]: the low nibbles in Q4_0's byte order, then Q5's fifth bits (byte b, bit g = k 4g+b)
    or Q6_K's top two bits (word g >> 2, byte b, bits 2(g & 3) for k = 4g + b)."""
    N, nb, _ = q.shape
    low = (q[..., :16] & 15) | ((q[..., 16:] & 15) << 4)
    parts = [_tile_codes(low, n_pad)]
    # (the bits are gathered by ORs of shifted slices: numpy's sum over a short axis is a slow
    # strided reduction, most of a K-quant file's load)
    if fmt in (FMT_Q5_0, FMT_Q5_K):
        h = (q >> 4).reshape(N, nb, 8, 4)
        bits = h[:, :, 0].copy()
        for g in range(1, 8):
            bits |= h[:, :, g] << g
        parts.append(_tile_codes(bits, n_pad))
    elif fmt == FMT_Q6_K:
        h = (q >> 4).reshape(N, nb, 2, 4, 4)
        bits = h[:, :, :, 0].copy()
        for g in range(1, 4):
            bits |= h[:, :, :, g] << (2 * g)
        parts.append(_tile_codes(bits.reshape(N, nb, 8), n_pad))
    return np.concatenate(parts, axis=2)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """Bytes [..., 32 * c] of K-quant nibbles (chunk of 32 bytes: one sub-block in the low, the
    next in the high nibbles) -> codes [..., 2c, 32]."""
    *lead, n = qs.shape
    qs = qs.reshape(*lead, n // 32, 1, 32)
    return np.concatenate([qs & 15, qs >> 4], axis=-2).reshape(*lead, 2 * (n // 32), 32)


def _k_scales(sc12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 scale bytes [..., 12] -> 6-bit scales and mins, each [..., 8]: bytes 0-3
    hold scales 0-3 (low 6 bits) and the top bits of scales 4-7, bytes 4-7 the same for the
    mins, bytes 8-11 the low nibbles of scales 4-7 (low) and mins 4-7 (high)."""
    a, b, c = sc12[..., 0:4], sc12[..., 4:8], sc12[..., 8:12]
    scales = np.concatenate([a & 63, (c & 15) | ((a >> 6) << 4)], axis=-1)
    mins = np.concatenate([b & 63, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return scales, mins


def _k_scale_planes(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """6-bit scales and mins [N, units, 8] -> the 12 per-column bytes the kernels read: byte s <
    8 = scale s low nibble | min s low nibble << 4; byte 8 + i = the top two bits of scale i,
    scale i + 4, min i, min i + 4 (bits 0-1, 2-3, 4-5, 6-7)."""
    low = (scales & 15) | ((mins & 15) << 4)
    hs, hm = scales >> 4, mins >> 4
    high = hs[..., :4] | (hs[..., 4:] << 2) | (hm[..., :4] << 4) | (hm[..., 4:] << 6)
    return np.concatenate([low, high], axis=-1).astype(np.uint8)


# Source bytes tiled at a time: the rearrangement's numpy temporaries come to several times their
# input (codes widened to a byte per weight, shifted copies), which over a whole LM head or
# embedding table (a 1B model's: 50-80 MB as stored) held the load's peak resident memory far above
# the model's size. Row chunks are whole tiles, so chunking moves no byte differently.
_TILE_CHUNK_BYTES = 2 << 20


def tile_gguf(raw: np.ndarray, ggml_type: int, name: str = "tensor") -> TiledQuantWeight:
    """A GGUF tensor's bytes, uint8 [N, K/32 * block bytes] (`GGUFFile.raw`), -> tiled weight.
    `name` is the tensor's, for errors. Tiled a chunk of rows at a time into the result, so that
    the temporaries stay a few MB whatever the tensor's size."""
    fmt = GGML_FORMATS.get(int(ggml_type))
    if fmt is None:
        raise ValueError(f"{name}: no quantized kernel for {Q(ggml_type).name}")
    block, type_size = GGML_QUANT_SIZES[Q(ggml_type)]
    N = raw.shape[0]
    if raw.ndim != 2 or raw.shape[1] % type_size:
        raise ValueError(f"{name}: {Q(ggml_type).name} rows must be whole {block}-weight blocks of "
                         f"{type_size} bytes, got {raw.shape[-1]} bytes per row")
    nu = raw.shape[1] // type_size  # units: blocks, or super-blocks for the K-quants
    step = max(1, _TILE_CHUNK_BYTES // max(1, raw.shape[1] * TILE_N)) * TILE_N
    first = _tile_chunk(raw[:step], fmt, nu, type_size)
    if N <= step:
        data = first
    else:
        # On 2 MiB pages where granted: a decode streams every byte once (ops/cpu_memory).
        data = cpu_memory.empty_huge((-(-N // TILE_N), nu, first.shape[2]), torch.uint8).numpy()
        data[:step // TILE_N] = first
        del first
        for r in range(step, N, step):
            data[r // TILE_N:(r + step) // TILE_N] = _tile_chunk(raw[r:r + step], fmt, nu, type_size)
    return TiledQuantWeight(fmt, torch.from_numpy(data), N, nu * block)


def _tile_chunk(raw: np.ndarray, fmt: int, nu: int, type_size: int) -> np.ndarray:
    """`tile_gguf` of some rows: uint8 [ceil(rows/16), nu, unit bytes] (the last tile padded)."""
    N = raw.shape[0]
    blocks = np.ascontiguousarray(raw).reshape(N, nu, type_size)
    n_pad = -(-N // TILE_N) * TILE_N
    parts = []
    if fmt in (FMT_Q4_0, FMT_Q4_1, FMT_Q8):
        d = _halves(blocks[:, :, 0:2])
        if fmt == FMT_Q8:
            parts.append(_tile_codes(blocks[:, :, 2:] ^ np.uint8(0x80), n_pad))
        elif fmt == FMT_Q4_0:
            parts.append(_tile_codes(blocks[:, :, 2:], n_pad))
        else:
            parts.append(_tile_codes(blocks[:, :, 4:], n_pad))
        parts.append(_tile_halves(d, n_pad))
        if fmt == FMT_Q4_1:
            parts.append(_tile_halves(_halves(blocks[:, :, 2:4]), n_pad))
    elif fmt == FMT_Q5_0:  # d, 32 fifth bits (bit i = element i), 16 bytes of nibbles
        qh = np.ascontiguousarray(blocks[:, :, 2:6]).view("<u4")
        high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        qs = blocks[:, :, 6:]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1) | (high << 4)
        parts += [_block_codes(q, fmt, n_pad), _tile_halves(_halves(blocks[:, :, 0:2]), n_pad)]
    else:
        if fmt == FMT_Q6_K:  # 128 B low nibbles, 64 B top bit pairs, 16 int8 scales, d
            ql, qh = blocks[:, :, :128], blocks[:, :, 128:192]
            # 128-weight halves: nibbles of bytes 0-63 low/high are weights 0-63 / 64-127; bit
            # pair r of qh bytes 0-31 is weights 32r .. 32r + 31.
            low = np.concatenate([ql.reshape(N, nu, 2, 1, 64) & 15, ql.reshape(N, nu, 2, 1, 64) >> 4], axis=3)
            top = (qh.reshape(N, nu, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3
            q = low.reshape(N, nu * 8, 32) | (top.reshape(N, nu * 8, 32) << 4)
            params = [_tile_planes(blocks[:, :, 192:208], n_pad),
                      _tile_halves(_halves(blocks[:, :, 208:210]), n_pad)]
        else:  # Q4_K / Q5_K: d, dmin, 12 scale bytes, (Q5_K: 32 B fifth bits), 128 B nibbles
            scales, mins = _k_scales(blocks[:, :, 4:16])
            q = _nibbles(blocks[:, :, -128:]).reshape(N, nu * 8, 32)
            if fmt == FMT_Q5_K:  # bit s of byte i: weight i of sub-block s
                qh = blocks[:, :, 16:48]
                high = (qh[:, :, None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
                q = q | (high.reshape(N, nu * 8, 32) << 4)
            params = [_tile_halves(_halves(blocks[:, :, 0:2]), n_pad),
                      _tile_halves(_halves(blocks[:, :, 2:4]), n_pad),
                      _tile_planes(_k_scale_planes(scales, mins), n_pad)]
        codes = _block_codes(q, fmt, n_pad).reshape(n_pad // TILE_N, nu, -1)
        parts += [codes, *params]
    return np.concatenate(parts, axis=2)


def tile_int4_groups(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None = None,
                     name: str = "tensor") -> TiledQuantWeight:
    """Group-wise int4 weights w = scale * (code - zero), codes uint8 [N, K] in 0..15, scales
    [N, G] and zeros [N, G] (None: 8 everywhere) with K / G weights per group, a multiple of 32:
    the weight-only int4 of compressed-tensors, AWQ and GPTQ. Each group is K / G / 32 blocks of
    32 with its scale: Q4_0 where every zero is 8 (d * (q - 8), exact), else Q4_1 with the block's
    min = -scale * zero (d * q + m). The kernels read d and m as float16: a scale that is float16
    or bfloat16 in a normal range is kept exactly, m is rounded to float16 (an error below 1/128 of
    one quantization step)."""
    N, K = codes.shape
    G = scales.shape[1]
    if scales.shape[0] != N or K % G or (K // G) % QK:
        raise ValueError(f"{name}: {K} inputs in {G} groups of scales; int4 groups must be whole "
                         f"multiples of {QK} weights")
    per = K // G // QK  # 32-weight blocks per group
    n_pad = -(-N // TILE_N) * TILE_N
    d = np.repeat(np.asarray(scales, np.float32), per, axis=1)
    q = _block_codes(np.ascontiguousarray(codes, np.uint8).reshape(N, K // QK, QK), FMT_Q4_0, n_pad)
    if zeros is None or np.all(zeros == 8):
        data = np.concatenate([q, _tile_halves(d.astype(np.float16), n_pad)], axis=2)
        return TiledQuantWeight(FMT_Q4_0, torch.from_numpy(data), N, K)
    m = -d * np.repeat(np.asarray(zeros, np.float32), per, axis=1)
    data = np.concatenate([q, _tile_halves(d.astype(np.float16), n_pad),
                           _tile_halves(m.astype(np.float16), n_pad)], axis=2)
    return TiledQuantWeight(FMT_Q4_1, torch.from_numpy(data), N, K)


def quantize_q8(weight: torch.Tensor) -> TiledQuantWeight:
    """A float [N, K] weight -> Q8 codes with one scale per 32 weights of a row (Q8_0), for
    computing a float checkpoint in int8. K must be a multiple of 32."""
    N, K = weight.shape
    if K % QK:
        raise ValueError(f"int8 weights need in_features divisible by {QK}, got {K}")
    w = weight.detach().to(torch.float32).reshape(N, K // QK, QK)
    amax = w.abs().amax(-1)
    d = (amax / 127).to(torch.float16)
    inv = torch.where(d > 0, 1 / d.float(), torch.zeros_like(amax))
    q = torch.round(w * inv.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8)
    return tile_q8(q.reshape(N, K), d)


def tile_q8(codes: torch.Tensor, scales: torch.Tensor) -> TiledQuantWeight:
    """int8 codes [N, K] and float16 scales [N, K/32] (weight = code * scale, one scale per 32
    weights of a row) -> the Q8 tiles: a checkpoint's own int8 weights computed as they are."""
    N, K = codes.shape
    if K % QK or tuple(scales.shape) != (N, K // QK):
        raise ValueError(f"Q8 codes [{N}, {K}] need K divisible by {QK} and scales [{N}, {K // QK}], "
                         f"got scales {list(scales.shape)}")
    n_pad = -(-N // TILE_N) * TILE_N
    q = codes.contiguous().numpy().view(np.uint8).reshape(N, K // QK, QK) ^ np.uint8(0x80)
    d = scales.to(torch.float16).contiguous().numpy()
    data = np.concatenate([_tile_codes(q, n_pad), _tile_halves(d, n_pad)], axis=2)
    return TiledQuantWeight(FMT_Q8, torch.from_numpy(data), N, K)


def concat_rows(parts: list[TiledQuantWeight]) -> TiledQuantWeight | None:
    """One tiled weight with the rows of `parts` stacked (q|k|v, gate|up), when they share a
    format and every part but the last fills whole tiles; else None (the caller keeps them
    apart)."""
    fmt, K = parts[0].fmt, parts[0].in_features
    if any(p.fmt != fmt or p.in_features != K for p in parts):
        return None
    if any(p.out_features % TILE_N for p in parts[:-1]):
        return None
    # numpy's concatenate: torch.cat of uint8 tensors takes a slow element-wise path here, a large
    # part of every engine start (benchmarks/CHANGELOG.md, "Server start-up")
    arrays = [p.data.numpy() for p in parts]
    out = cpu_memory.empty_huge((sum(a.shape[0] for a in arrays), *arrays[0].shape[1:]), torch.uint8)
    np.concatenate(arrays, out=out.numpy())
    return TiledQuantWeight(fmt, out, sum(p.out_features for p in parts), K)


def bf16_activations_pay() -> bool:
    """True where a quantized model may run in bfloat16 (`dtype="bfloat16"`): the CPU has the
    bf16 tiles, so its matmuls from 16 rows take bf16 activations as they are and the rest of the
    model (norms, attention, KV cache) runs in bf16 as the float path does there."""
    return _lib().tl_q_isa(FMT_Q8) == 4


def f32_rows(x: torch.Tensor, K: int) -> torch.Tensor:
    """x [..., K] as float32 rows [M, K] with unit stride, the C matmuls' input (a copy only where
    the dtype or layout needs one)."""
    x2 = x.reshape(-1, K)
    if x2.dtype != torch.float32:
        x2 = x2.float()
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def qlinear(x: torch.Tensor, w: TiledQuantWeight, bias: torch.Tensor | None = None,
            act_levels: int | None = None, kchunk: int = 0) -> torch.Tensor:
    """x [..., K] float32 -> x @ W^T (+ bias), float32 [..., N]. The activations are quantized
    per 32 elements to int8 inside the call, in `act_levels` planes (default ACT_LEVELS): 1 is
    llama.cpp's Q8_0 activations; 2 adds the rounding error as a second int8 plane, in steps of
    1/256 of the first's. From 16 rows on a CPU with AMX-BF16 the weight is dequantized to
    bfloat16 panels instead, on an AVX2 one to float32 panels (see ISA_NAMES). A bfloat16 x gives a bfloat16 result, rounded once;
    `kchunk` (bf16 on the tiles only): sum K in chunks of this many, as ops/amx.linear."""
    levels = ACT_LEVELS if act_levels is None else act_levels
    lib = _lib()
    K, N = w.in_features, w.out_features
    if x.shape[-1] != K:
        raise ValueError(f"input has {x.shape[-1]} features, the quantized weight takes {K}")
    lead = x.shape[:-1]
    if x.dtype == torch.bfloat16:
        return _qlinear_bf16(lib, x.reshape(-1, K), w, bias, levels, kchunk).reshape(*lead, N)
    x2 = f32_rows(x, K)
    M = x2.shape[0]
    y = torch.empty(M, N, dtype=torch.float32)
    if M:
        scratch = torch.empty(lib.tl_q_scratch_bytes(M, K), dtype=torch.uint8)
        b = None
        if bias is not None:
            b = bias.float().contiguous()
        rc = lib.tl_q_linear(w.fmt, w.data.data_ptr(), N, K, x2.data_ptr(), x2.stride(0), M,
                             y.data_ptr(), N, None if b is None else b.data_ptr(),
                             scratch.data_ptr(), levels)
        if rc != 0:
            raise ValueError(f"quantized matmul rejected the shapes: N={N}, K={K}")
    return y.reshape(*lead, N)


def qlinear_silu_and_mul(x: torch.Tensor, w: TiledQuantWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """silu(gate) * up, float32 [..., I], of [gate | up] = x @ W^T (+ bias) for a fused gate|up
    weight (its first I rows the gate's, the next I the up's), in one matmul whose epilogue
    applies the SiLU (csrc/quant_gemm_amx_bf16.inc): the [M, 2I] product is never written and
    read back. Bit for bit `elementwise.silu_and_mul(qlinear(x, w, bias))`. None where the
    fused kernel does not apply (x not float32, fewer rows than `silu_epilogue_rows`, no
    AMX-BF16, I not a multiple of 16): the caller then runs those two ops."""
    N, K = w.out_features, w.in_features
    if x.dtype != torch.float32 or N % (2 * TILE_N) or x.shape[-1] != K:
        return None
    rows = silu_epilogue_rows(w.fmt)
    M = x.numel() // K
    if rows <= 0 or M < rows:
        return None
    lib = _lib()
    lead = x.shape[:-1]
    x2 = x.reshape(M, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(M, N // 2, dtype=torch.float32)
    scratch = torch.empty(lib.tl_q_scratch_bytes(M, K), dtype=torch.uint8)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.tl_q_linear_silu(w.fmt, w.data.data_ptr(), N, K, x2.data_ptr(), x2.stride(0), M,
                              y.data_ptr(), N // 2, None if b is None else b.data_ptr(),
                              scratch.data_ptr())
    if rc == 1:
        return None
    if rc == -2:
        raise MemoryError("the bf16 tiles' per-thread panel buffer could not be allocated")
    if rc != 0:
        raise ValueError(f"quantized matmul rejected the shapes: N={N}, K={K}")
    return y.reshape(*lead, N // 2)


def _qlinear_bf16(lib: ctypes.CDLL, x2: torch.Tensor, w: TiledQuantWeight, bias: torch.Tensor | None,
                  levels: int, kchunk: int) -> torch.Tensor:
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M, K, N = x2.shape[0], w.in_features, w.out_features
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M:
        scratch = torch.empty(lib.tl_q_bf16_scratch_bytes(M, N, K), dtype=torch.uint8)
        b = None if bias is None else bias.float().contiguous()
        rc = lib.tl_q_linear_bf16(w.fmt, w.data.data_ptr(), N, K, x2.data_ptr(), x2.stride(0), M,
                                  y.data_ptr(), N, None if b is None else b.data_ptr(),
                                  scratch.data_ptr(), levels, kchunk)
        if rc == -2:
            raise MemoryError("the bf16 tiles' per-thread panel buffer could not be allocated")
        if rc != 0:
            raise ValueError(f"quantized matmul rejected the shapes: N={N}, K={K}")
    return y


def dequant_rows(w: TiledQuantWeight, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight as float32 [..., K]: an embedding lookup that widens only the
    looked-up rows."""
    lib = _lib()
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= w.out_features):
        raise IndexError(f"token id out of range [0, {w.out_features})")
    out = torch.empty(flat.numel(), w.in_features, dtype=torch.float32)
    if flat.numel():
        lib.tl_q_dequant_rows(w.fmt, w.data.data_ptr(), w.in_features, flat.data_ptr(),
                              flat.numel(), out.data_ptr())
    return out.reshape(*ids.shape, w.in_features)
