"""The quantized matmul on AMX-BF16 tiles (csrc/quant_gemm_amx_bf16.inc) against the kernels it
replaces, in one process, alternating: SmolLM2-135M's four per-layer matmuls for 30 distinct
layers (weights from memory, as in a decode step), random weights quantized by `gguf.quants`.

- int8 tiles: the AMX int8 kernel (per-32-block scales), what ran from 8 rows before
- bf16 tiles: the weight dequantized to bf16 panels, float32 activations (the GGUF default)
- bf16 tiles, bf16 x: the same with bfloat16 activations (a GGUF run with dtype="bfloat16")
- bf16 float path: ops/amx on the dequantized weight in bf16 (`--quantization none`)

Median of `--reps` rounds; with one thread (the default) CPU time of the calling thread, which a
shared machine distorts least; with more, wall time.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quant_bf16_tiles_ab.py --rows 1 16 64 128
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenloom.ops import amx, quant

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64, 128])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--format", default="Q4_1", choices=["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if quant.limit_isa(None) != "avx512_vnni+amx_bf16":
        raise SystemExit("this CPU (or process) has no AMX-BF16 tiles for the quantized kernels")
    qt = Q[args.format]
    rng = np.random.default_rng(0)
    tiled, packed = [], []
    for _ in range(args.layers):
        for N, K in SHAPES:
            raw = quants.quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float32), qt)
            tiled.append(quant.tile_gguf(raw.reshape(N, -1), qt))
            packed.append(amx.pack(torch.from_numpy(quants.dequantize(raw, qt).reshape(N, K))))
    clock = time.process_time if args.threads == 1 else time.perf_counter

    def step(M: int, kind: str) -> float:
        xs = {K: torch.randn(M, K) for K in (576, 1536)}
        if kind in ("bf16 tiles, bf16 x", "bf16 float path"):
            xs = {K: x.bfloat16() for K, x in xs.items()}
        quant.limit_isa("avx512_vnni+amx_int8" if kind == "int8 tiles" else None)
        start = clock()
        for w, p in zip(tiled, packed):
            if kind == "bf16 float path":
                amx.linear(xs[p.in_features], p, kchunk=0)
            else:
                quant.qlinear(xs[w.in_features], w)
        return 1e3 * (clock() - start)

    kinds = ["int8 tiles", "bf16 tiles", "bf16 tiles, bf16 x", "bf16 float path"]
    print(f"{args.format}, {args.layers} layers x 4 matmuls, {args.threads} thread(s), median of "
          f"{args.reps}, ms per step")
    for M in args.rows:
        times: dict[str, list[float]] = {k: [] for k in kinds}
        for _ in range(args.reps):
            for k in kinds:
                times[k].append(step(M, k))
        quant.limit_isa(None)
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"M={M:4d}: " + "  ".join(f"{k} {v:7.1f}" for k, v in med.items())
              + f"   int8/bf16 tiles {med['int8 tiles'] / med['bf16 tiles']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
