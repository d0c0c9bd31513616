"""bfloat16 matmuls on weights packed once at load in AMX tile order: on AMX tiles
(csrc/amx_gemm.c), or with AVX512-BF16 dot products where the CPU has no AMX
(csrc/bf16_dp_gemm.c).

On CPUs with either this replaces oneDNN's packed bf16 matmul on the float path: the same one
packed copy per weight, no PyTorch op per call, so the fused decode step (csrc/decode_step.c)
can call it from C as well. Elsewhere `available()` is False and the float path keeps oneDNN
(or F.linear). Measured by benchmarks/amx_matmul.py (the matmul) and benchmarks/amx_bf16_ab.py
(the engine).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokenloom import envs
from tokenloom.ops import cpu_kernels, cpu_memory, kernel_plan

_c_i32, _c_i64, _c_p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_bound: set[int] = set()


def _lib() -> ctypes.CDLL | None:
    lib = cpu_kernels.load()
    if lib is not None and id(lib) not in _bound:
        lib.tl_amx_bf16_available.restype = _c_i32
        lib.tl_amx_bf16_available.argtypes = []
        lib.tl_amx_bf16_packed_elems.restype = _c_i64
        lib.tl_amx_bf16_packed_elems.argtypes = [_c_i64, _c_i64]
        lib.tl_amx_bf16_scratch_bytes.restype = _c_i64
        lib.tl_amx_bf16_scratch_bytes.argtypes = [_c_i64, _c_i64]
        lib.tl_amx_bf16_pack.restype = None
        lib.tl_amx_bf16_pack.argtypes = [_c_p, _c_i64, _c_i64, _c_p]
        lib.tl_amx_bf16_linear.restype = _c_i32
        lib.tl_amx_bf16_linear.argtypes = [_c_p, _c_i64, _c_i64, _c_p, _c_i64, _c_i64, _c_p, _c_p,
                                           _c_i64, _c_p, _c_i64]
        lib.tl_amx_bf16_set_stores.restype = None
        lib.tl_amx_bf16_set_stores.argtypes = [_c_i64, _c_i32]
        lib.tl_amx_bf16_set_weight_prefetch.restype = None
        lib.tl_amx_bf16_set_weight_prefetch.argtypes = [_c_i32]
        lib.tl_bf16dp_available.restype = _c_i32
        lib.tl_bf16dp_available.argtypes = []
        lib.tl_bf16_set_kernel.restype = None
        lib.tl_bf16_set_kernel.argtypes = [_c_i32]
        lib.tl_bf16_kernel.restype = _c_i32
        lib.tl_bf16_kernel.argtypes = []
        lib.tl_bf16_one_row_kchunk.restype = _c_i64
        lib.tl_bf16_one_row_kchunk.argtypes = [_c_i64]
        lib.tl_bf16_packed_linear.restype = _c_i32
        lib.tl_bf16_packed_linear.argtypes = lib.tl_amx_bf16_linear.argtypes
        _bound.add(id(lib))
        lib.tl_bf16_set_kernel(_kernel_wanted(lib))
    return lib


_TILES, _DOT_PRODUCTS = 1, 2  # csrc/bf16_dp_gemm.c's tl_bf16_kernel


def _kernel_wanted(lib: ctypes.CDLL) -> int:
    """The kernel this process runs (0: none), as the kernel plan says (`bf16_matmul`): AMX
    tiles (unless `TOKENLOOM_AMX_BF16=0`), else AVX512-BF16 dot products (unless
    `TOKENLOOM_BF16_DP=0`); otherwise bf16 weights go to oneDNN. Whether the library has the
    kernel (compiler macros, Linux granting the tile state) is the C side's answer, which
    tests/ops/test_kernel_plan.py checks against the plan."""
    planned = kernel_plan.current().bf16_matmul
    if planned == "tiles" and lib.tl_amx_bf16_available():
        return _TILES
    if (planned == "dot_products" or (planned == "tiles" and envs.TOKENLOOM_BF16_DP)) and lib.tl_bf16dp_available():
        return _DOT_PRODUCTS
    return 0


def set_kernel(kind: str | None) -> None:
    """Pins the kernel, for tests and benchmarks: "tiles", "dot_products", or None for the
    default choice (`_kernel_wanted`). A kernel this build or CPU lacks leaves none in use."""
    lib = _lib()
    lib.tl_bf16_set_kernel({"tiles": _TILES, "dot_products": _DOT_PRODUCTS}[kind] if kind
                           else _kernel_wanted(lib))


def dot_products_built() -> bool:
    """True where the library has the AVX512-BF16 kernel (an AVX-512 build on such a CPU)."""
    lib = _lib()
    return lib is not None and bool(lib.tl_bf16dp_available())


def available() -> bool:
    """True where bf16 weights are packed in tile order for one of the two kernels (above)."""
    lib = _lib()
    return lib is not None and lib.tl_bf16_kernel() != 0


def tiles() -> bool:
    """True where the packed matmul runs on AMX tiles (not the dot products)."""
    lib = _lib()
    return lib is not None and lib.tl_bf16_kernel() == _TILES


def kernel_name() -> str | None:
    """What the packed bf16 matmul runs on here, for the start-up line (None: not in use)."""
    lib = _lib()
    kind = 0 if lib is None else lib.tl_bf16_kernel()
    return {_TILES: "AMX tiles", _DOT_PRODUCTS: "AVX512-BF16 dot products"}.get(kind)


STREAM_MIN_BYTES = 4 << 20  # the kernel's default (csrc/amx_gemm.c, g_stream_min)


def set_stores(stream_min_bytes: int | None = STREAM_MIN_BYTES, prefetch_for_write: bool = True) -> None:
    """How the kernel writes outputs, for benchmarks and tests: outputs of at least
    `stream_min_bytes` (None: never) with streaming stores, smaller ones through the caches with
    the next block's lines requested ahead when `prefetch_for_write`. Results are the same bits."""
    _lib().tl_amx_bf16_set_stores(2**62 if stream_min_bytes is None else stream_min_bytes,
                                  int(prefetch_for_write))


def set_weight_prefetch(on: bool = True) -> None:
    """Whether the kernel requests the next column pair's weight tiles while a pair's tiles work
    (the default; off only to measure it, benchmarks/amx_matmul.py). Results are the same bits."""
    _lib().tl_amx_bf16_set_weight_prefetch(int(on))


@dataclass(eq=False)
class AmxPackedWeight:
    """A bfloat16 [out_features, in_features] weight in AMX tile order (see csrc/amx_gemm.c)."""

    data: torch.Tensor  # bfloat16, flat
    out_features: int
    in_features: int
    dtype: torch.dtype = torch.bfloat16  # what `packed_linear.linear` compares with the input's


def pack(weight: torch.Tensor) -> AmxPackedWeight:
    """An [out, in] weight (cast to bfloat16) in tile order, zero-padded to whole tiles."""
    lib = _lib()
    w = weight.detach().to(torch.bfloat16).contiguous()
    N, K = w.shape
    data = cpu_memory.empty_huge((lib.tl_amx_bf16_packed_elems(N, K),), torch.bfloat16)
    lib.tl_amx_bf16_pack(w.data_ptr(), N, K, data.data_ptr())
    return AmxPackedWeight(data, N, K)


# oneDNN's bf16 matmul on AMX (what a bf16 `F.linear` runs, transformers' bf16 path included)
# sums these K in chunks of this many, each from zero, added in order, from 33 rows on; up to 32
# rows it sums K in one go, as we do. The N does not matter (192 to 3072 tried), so our fused
# q|k|v and gate|up round as transformers' separate projections. Read off torch 2.13's oneDNN
# on an AMX CPU, 2 threads, 33 to ~200 rows (a chat prompt's prefill); from ~256
# rows it splits K between its threads instead, from ~400 it sums in one go again, and K = 1024
# or 2048 follow other splits (not modelled: one sum). Our matmul follows it for calls of more
# than 32 rows (prefills; decode steps keep one sum, as transformers' one-row decode matmuls do),
# so a prefill rounds as transformers' does (benchmarks/CHANGELOG.md, "bf16 parity, the prefill made
# bit-identical"). With AVX512-BF16 and no AMX (the dot products' CPUs) oneDNN sums K > 512 in
# chunks of 512 for one row, and from two rows in chunks of 512 up to K = 1024 and of 1024 above
# (read off torch 2.13's oneDNN on such a CPU, K 576 to 3072, 1 to 1024 rows, 2 threads;
# csrc/bf16_dp_gemm.c's tl_bf16_one_row_kchunk has the one-row rule).
_ONEDNN_K_CHUNK = {576: 288, 768: 384, 1536: 384}
_ONEDNN_CHUNK_FROM_ROWS = 33


def onednn_k_chunk(M: int, K: int, on_tiles: bool | None = None) -> int:
    """The K chunk (0: none) our matmul sums in for M rows of K, following oneDNN's (above);
    `on_tiles`: the kernel in use, when the caller has already asked (`tiles()`)."""
    if not (tiles() if on_tiles is None else on_tiles):
        if M == 1 or K <= 1024:
            return one_row_k_chunk(K)
        return 1024
    return _ONEDNN_K_CHUNK.get(K, 0) if M >= _ONEDNN_CHUNK_FROM_ROWS else 0


def one_row_k_chunk(K: int) -> int:
    """The K chunk (0: none) a one-row bf16 `F.linear` sums K in on this CPU's kernel."""
    return int(_lib().tl_bf16_one_row_kchunk(K))


def linear(x: torch.Tensor, w: AmxPackedWeight, bias: torch.Tensor | None = None,
           kchunk: int | None = None, one_row: bool = False) -> torch.Tensor:
    """x [..., K] bfloat16 -> x W^T (+ bias), bfloat16 [..., N], rounded once per element.
    `kchunk`: sum K in chunks of this many, added in order (csrc/amx_gemm.c); None: as oneDNN
    would for this many rows (`onednn_k_chunk`), or with `one_row` as it would for one row."""
    lib = _lib()
    K, N = w.in_features, w.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    on_tiles = lib.tl_bf16_kernel() == _TILES  # asked once per call (a ctypes call each)
    if kchunk is None:
        kchunk = one_row_k_chunk(K) if one_row else onednn_k_chunk(M, K, on_tiles)
    y = torch.empty(M, N, dtype=torch.bfloat16)
    scratch = torch.empty(lib.tl_amx_bf16_scratch_bytes(M, K) if on_tiles else 0, dtype=torch.uint8)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.tl_bf16_packed_linear(x2.data_ptr(), x2.stride(0), M, w.data.data_ptr(), N, K,
                                   None if b is None else b.data_ptr(), y.data_ptr(), N,
                                   scratch.data_ptr(), kchunk)
    if rc != 0:
        raise RuntimeError("packed bf16 matmul unavailable in this process")
    return y.reshape(*lead, N)
