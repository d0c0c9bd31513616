"""gpt-oss's MXFP4 expert matmuls: the C kernel (csrc/mxfp4_gemm.c, `cpu_kernels.mxfp4_linear`)
at each ISA level this CPU runs, against the torch path it replaces for decode (model/mxfp4.py:
the expert's matrix unpacked to float, then F.linear), in float32 and bfloat16 activations, on
the same random MXFP4 bytes in the same run. Median CPU time of the calling thread over many
calls, one thread (torch and OpenMP), so a shared machine's scheduler stays out of it.

Shapes: gpt-oss-20b's expert matrices (hidden 2880, expert width 2880): gate|up 5760 x 2880 and
down 2880 x 2880; rows of x 1, 4, 16 (a decode step's tokens on one expert) and 64.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/mxfp4_experts.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/mxfp4_experts.py --rows 1 16 --reps 20
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from quant_kernels import bench  # the median thread CPU time of calls (this folder's script)

from tokenloom.model import mxfp4
from tokenloom.ops import cpu_features, cpu_kernels

SHAPES = {"gate_up": (5760, 2880), "down": (2880, 2880)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(1)
    feats = cpu_features.detect()
    levels = ("avx512", "avx2", "scalar")[("avx512", "avx2", "scalar").index(feats.isa):]
    libs = {lvl: cpu_kernels.load_isa(lvl) for lvl in levels}
    print(f"# {feats.summary()}; torch threads {torch.get_num_threads()}")
    print("| matrix | rows | path | ms | vs torch f32 unpack |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in SHAPES.items():
        blocks = torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 124, (N, K // 32), dtype=torch.uint8, generator=g)
        bias = torch.randn(N, generator=g)
        for M in args.rows:
            x = torch.randn(M, K, generator=g)
            xb = x.bfloat16()
            rows = {
                "torch f32 unpack": lambda: F.linear(x, mxfp4.dequantize(blocks, scales, torch.float32), bias),
                "torch bf16 unpack": lambda: F.linear(xb, mxfp4.dequantize(blocks, scales, torch.bfloat16),
                                                      bias.bfloat16()),
            }
            for lvl, lib in libs.items():
                rows[f"C {lvl}"] = lambda lib=lib: cpu_kernels.mxfp4_linear(lib, x, blocks, scales, bias)
            base = None
            for path, f in rows.items():
                t = bench(f, args.reps)
                base = base or t
                print(f"| {name} {N}x{K} | {M} | {path} | {t * 1e3:.2f} | {base / t:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
