"""SmolLM2's four matmuls for 30 distinct layers (weights streamed from memory, as in a decode
step) at several row counts: our AMX tile matmul (ops/amx) against oneDNN's packed bf16 matmul and
MKL's `cblas_gemm_bf16bf16f32` (exported by torch's CPU library), and ours without its weight
prefetch. Wall ms, min and median of alternating rounds.

    PYTHONPATH=src python benchmarks/amx_matmul.py [--threads 1] [--rows 1 16 64 512 2048] [--rounds 9]
"""
from __future__ import annotations

import argparse
import ctypes
import time
from pathlib import Path

import torch

from tokenloom.model.packed_linear import linear
from tokenloom.ops import amx

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate|up, down
LAYERS = 30


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 512, 2048])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not amx.available():
        raise SystemExit("no AMX-BF16 here")
    c_i64, c_p = ctypes.c_int64, ctypes.c_void_p
    mkl = ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")).cblas_gemm_bf16bf16f32
    mkl.argtypes = [ctypes.c_int] * 3 + [c_i64] * 3 + [ctypes.c_float, c_p, c_i64, c_p, c_i64,
                                                       ctypes.c_float, c_p, c_i64]
    weights = [[(torch.randn(n, k) * 0.05).bfloat16() for n, k in SHAPES] for _ in range(LAYERS)]
    ours = [[amx.pack(w) for w in layer] for layer in weights]
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in layer] for layer in weights]
    for M in args.rows:
        xs = {k: torch.randn(M, k).bfloat16() for k in (576, 1536)}
        yf = torch.empty(M, 3072)

        def run_ours() -> None:
            for layer in ours:
                for (n, k), w in zip(SHAPES, layer):
                    amx.linear(xs[k], w)

        def run_onednn() -> None:
            for layer, packed in zip(weights, onednn):
                for (n, k), w, p in zip(SHAPES, layer, packed):
                    linear(xs[k], w, None, p)

        def run_mkl() -> None:
            for layer in weights:
                for (n, k), w in zip(SHAPES, layer):
                    mkl(101, 111, 112, M, n, k, 1.0, xs[k].data_ptr(), k, w.data_ptr(), k, 0.0,
                        yf.data_ptr(), n)

        def run_ours_no_prefetch() -> None:
            amx.set_weight_prefetch(False)
            try:
                run_ours()
            finally:
                amx.set_weight_prefetch(True)

        # rounds alternate the kernels, so that a noisy host's slow minutes meet all of them
        times: dict[str, list[float]] = {}
        kernels = (("ours (AMX)", run_ours), ("ours without weight prefetch", run_ours_no_prefetch),
                   ("MKL bf16", run_mkl), ("oneDNN packed", run_onednn))
        for name, fn in kernels:
            fn()
        for _ in range(args.rounds):
            for name, fn in kernels:
                t = time.perf_counter()
                fn()
                times.setdefault(name, []).append(time.perf_counter() - t)
        med = {k: sorted(v)[len(v) // 2] for k, v in times.items()}
        print(f"{M:5d} rows, ms min/median of {args.rounds}: "
              + ", ".join(f"{k} {min(v) * 1e3:.1f}/{med[k] * 1e3:.1f}" for k, v in times.items())
              + f"; prefetch {med['ours without weight prefetch'] / med['ours (AMX)']:.2f}x")


if __name__ == "__main__":
    main()
