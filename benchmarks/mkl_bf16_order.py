"""Reads the summation order of MKL's bf16 GEMM (cblas_gemm_bf16bf16f32, float32 sums) as torch's
CPU flash-attention kernel calls it for one decode query, on this CPU, and checks the order the
C decode kernel's AVX2 build follows (src/tokenloom/ops/csrc/paged_decode_chunk.inc) against MKL.

    .venv/bin/python benchmarks/mkl_bf16_order.py            # probe tables and the check
    .venv/bin/python benchmarks/mkl_bf16_order.py --check    # the check only

Probe: a row with 2^24 at position a and 1 at b and c sums to 2^24 + 2 only where b and c meet
before either meets a (2^24 + 1 rounds back to 2^24). "X" marks such pairs.
MKL picks its kernel by the CPU, so the tables describe this machine's MKL path only.
"""
from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np
import torch

_lib = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"))
_gemm = _lib.cblas_gemm_bf16bf16f32
_gemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p,
                                       ctypes.c_int, ctypes.c_float, ctypes.c_void_p, ctypes.c_int]
_COL_MAJOR, _NO_TRANS, _TRANS = 102, 111, 112


def mkl_kq(keys: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """Scores [n] of bf16 keys [n, d] against q [d], as torch's kernel calls MKL (K^T q)."""
    n, d = keys.shape
    keys, q, out = keys.contiguous(), q.contiguous(), torch.zeros(n)
    _gemm(_COL_MAJOR, _TRANS, _NO_TRANS, n, 1, d, 1.0, keys.data_ptr(), d, q.data_ptr(), d, 0.0,
          out.data_ptr(), n)
    return out.numpy()


def mkl_pv(values: torch.Tensor, p: torch.Tensor) -> np.ndarray:
    """Output [d] of bf16 probabilities p [n] times values [n, d] (V p, beta 0)."""
    n, d = values.shape
    values, p, out = values.contiguous(), p.contiguous(), torch.zeros(d)
    _gemm(_COL_MAJOR, _NO_TRANS, _NO_TRANS, d, 1, n, 1.0, values.data_ptr(), d, p.data_ptr(), n,
          0.0, out.data_ptr(), d)
    return out.numpy()


def avx2_kq(keys: torch.Tensor, q: torch.Tensor) -> np.ndarray:
    """The kernel's AVX2 order: sums of elements i = 0..3 mod 4, each in order, then
    (s0 + s2) + (s1 + s3). (bf16 products are exact in float32.)"""
    prod = keys.float().numpy() * q.float().numpy()
    s = [np.zeros(prod.shape[0], np.float32) for _ in range(4)]
    for i in range(prod.shape[1]):
        s[i % 4] = s[i % 4] + prod[:, i]
    return (s[0] + s[2]) + (s[1] + s[3])


def avx2_pv(values: torch.Tensor, p: torch.Tensor) -> np.ndarray:
    """The kernel's AVX2 order: groups of 4 keys, each (0 + 2) + (1 + 3), added to the total.
    MKL's own for 8 columns; with more it groups later keys otherwise (see the probe tables),
    so float32 sums differ in their last bit, which the bf16 output rounding mostly hides."""
    x = values.float().numpy() * p.float().numpy()[:, None]
    x = np.concatenate([x, np.zeros((3, x.shape[1]), np.float32)])
    total = np.zeros(x.shape[1], np.float32)
    for g in range(0, values.shape[0], 4):
        total = total + ((x[g] + x[g + 2]) + (x[g + 1] + x[g + 3]))
    return total


def probe(kind: str, n: int, a: int) -> None:
    pairs = [(b, c) for b in range(n) for c in range(b + 1, n) if a not in (b, c)]
    rows = torch.zeros(len(pairs), n)
    for i, (b, c) in enumerate(pairs):
        rows[i, a], rows[i, b], rows[i, c] = 2.0 ** 24, 1, 1
    if kind == "kq":
        sums = mkl_kq(rows.bfloat16(), torch.ones(n).bfloat16())
    else:  # one output column per probe: the keys are the rows
        sums = np.concatenate([mkl_pv(rows[i:i + 64].t().contiguous().bfloat16(), torch.ones(n).bfloat16())
                               [:len(pairs[i:i + 64])] for i in range(0, len(pairs), 64)])
    meet = {pc: s == 2.0 ** 24 + 2 for pc, s in zip(pairs, sums)}
    print(f"{kind}: which of {n} elements meet before element {a} joins them")
    for b in range(n):
        print(f"{b:3d} " + "".join("." if a in (b, c) or b == c else "X" if meet[min(b, c), max(b, c)]
                                   else "-" for c in range(n)))


def check(seed: int = 0) -> bool:
    g = torch.Generator().manual_seed(seed)
    ok = True
    for d in (32, 64, 128, 256):
        for n in (1, 3, 8, 13, 16, 100, 512):
            keys = (torch.randn(n, d, generator=g) * 2).bfloat16()
            q = torch.randn(d, generator=g).bfloat16()
            vals, p = torch.randn(n, d, generator=g).bfloat16(), torch.rand(n, generator=g).bfloat16()
            bad_kq = int((avx2_kq(keys, q) != mkl_kq(keys, q)).sum())
            bad_pv = int((avx2_pv(vals, p) != mkl_pv(vals, p)).sum())
            ok &= bad_kq == 0
            print(f"d {d:3d} keys {n:3d}: K q differs in {bad_kq}/{n}, P V in {bad_pv}/{d}")
    return ok


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare the AVX2 order with MKL")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    if not args.check:
        probe("kq", 32, 0)
        probe("kq", 32, 1)
        probe("pv", 16, 0)
        probe("pv", 16, 5)
    print("K q in the AVX2 order agrees with MKL everywhere:", check())


if __name__ == "__main__":
    main()
