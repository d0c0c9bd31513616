"""bfloat16 matmuls on AMX tiles (csrc/amx_gemm.c), the weight packed once at load.

On CPUs with AMX-BF16 (Sapphire Rapids and later) this replaces oneDNN's packed bf16 matmul on
the float path: the same one packed copy per weight, no PyTorch op per call, so the fused
decode step (csrc/decode_step.c) can call it from C as well. Elsewhere `available()` is False
and the float path keeps oneDNN. Figures in benchmarks/README.md ("Fused decode step and the
AMX bf16 matmul").
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import torch

from tokenloom.ops import cpu_kernels

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
        _bound.add(id(lib))
    return lib


def available() -> bool:
    """True where the kernels were built with AMX-BF16 and the OS granted this process AMX, unless
    `TOKENLOOM_AMX_BF16=0` (then bf16 weights go to oneDNN, as on CPUs without AMX)."""
    if os.environ.get("TOKENLOOM_AMX_BF16", "1") == "0":
        return False
    lib = _lib()
    return lib is not None and bool(lib.tl_amx_bf16_available())


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
    data = torch.empty(lib.tl_amx_bf16_packed_elems(N, K), dtype=torch.bfloat16)
    lib.tl_amx_bf16_pack(w.data_ptr(), N, K, data.data_ptr())
    return AmxPackedWeight(data, N, K)


# oneDNN's bf16 matmul (what a bf16 `F.linear` runs, transformers' bf16 path included) sums
# these K in chunks of this many, each from zero, added in order, from 33 rows on; up to 32 rows
# it sums K in one go, as we do. The N does not matter (192 to 3072 tried), so our fused q|k|v
# and gate|up round as transformers' separate projections. Measured with torch 2.13's oneDNN on
# the Xeon with AMX, 2 threads, 33 to ~200 rows (a chat prompt's prefill); from ~256 rows it
# splits K between its threads instead, from ~400 it sums in one go again, and K = 1024 or 2048
# follow other splits (not modelled: one sum). Our matmul follows it for calls of more than 32
# rows (prefills; decode steps keep one sum, as transformers' one-row decode matmuls do), so a
# prefill rounds as transformers' does (benchmarks/README.md, "bf16 parity, the prefill made
# bit-identical").
_ONEDNN_K_CHUNK = {576: 288, 768: 384, 1536: 384}
_ONEDNN_CHUNK_FROM_ROWS = 33


def onednn_k_chunk(M: int, K: int) -> int:
    """The K chunk (0: none) our matmul sums in for M rows of K, following oneDNN's (above)."""
    return _ONEDNN_K_CHUNK.get(K, 0) if M >= _ONEDNN_CHUNK_FROM_ROWS else 0


def linear(x: torch.Tensor, w: AmxPackedWeight, bias: torch.Tensor | None = None,
           kchunk: int | None = None) -> torch.Tensor:
    """x [..., K] bfloat16 -> x W^T (+ bias), bfloat16 [..., N], rounded once per element.
    `kchunk`: sum K in chunks of this many, added in order (csrc/amx_gemm.c); None: as oneDNN
    would for this many rows (`onednn_k_chunk`)."""
    lib = _lib()
    K, N = w.in_features, w.out_features
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    if kchunk is None:
        kchunk = onednn_k_chunk(M, K)
    y = torch.empty(M, N, dtype=torch.bfloat16)
    scratch = torch.empty(lib.tl_amx_bf16_scratch_bytes(M, K), dtype=torch.uint8)
    b = None if bias is None else bias.float().contiguous()
    rc = lib.tl_amx_bf16_linear(x2.data_ptr(), x2.stride(0), M, w.data.data_ptr(), N, K,
                                None if b is None else b.data_ptr(), y.data_ptr(), N,
                                scratch.data_ptr(), kchunk)
    if rc != 0:
        raise RuntimeError("AMX bf16 matmul unavailable in this process")
    return y.reshape(*lead, N)
