"""float32 matmuls of a few rows on SmolLM2-135M's shapes: the C GEMV (csrc/f32_gemv.c, on the
plain row-major weight) against oneDNN's packed matmul (what the model runner used for every
decode step before) and `F.linear` (MKL on the plain weight), side by side in one process,
alternating, over the 30 layers' four matmuls and the LM head (538 MB of float32 weights, far
beyond the caches, so each pass streams them from memory as a decode step does).

    .venv/bin/python benchmarks/f32_gemv.py                 # rows 1 2 4 8 12 16 32
    .venv/bin/python benchmarks/f32_gemv.py --rows 1 16 --rounds 5

Prints, per row count, the best pass of each path (ms and GB/s of weights) and the ratio to the
C GEMV; `model/packed_linear.GEMV_BELOW_ROWS` is where oneDNN catches up on this CPU.
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
import torch.nn.functional as F

from tokenloom.model.packed_linear import _linear_packed, onednn_pack_weight
from tokenloom.ops import cpu_features, cpu_kernels

# SmolLM2-135M: hidden 576, 9 q heads and 3 kv heads of 64, intermediate 1536, vocab 49152
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # q|k|v, o, gate|up, down
LM_HEAD = (49152, 576)


def best_passes(paths: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """The best timed pass (s) of each path over `rounds` alternating rounds, each timed pass right
    after a warm one (which also evicts the previous path's data)."""
    best = {name: float("inf") for name in paths}
    for _ in range(rounds):
        for name, run in paths.items():
            run()
            t0 = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 12, 16, 32])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best pass counts")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    lib = cpu_kernels.load()
    if lib is None:
        raise SystemExit("the C kernels are not available here (no compiler?)")
    f = cpu_features.detect()
    print(f"machine: {f.model_name}, {f.num_cores} usable cores, kernels {cpu_kernels.isa()}, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{torch.get_num_threads()} threads")
    g = torch.Generator().manual_seed(0)
    shapes = LAYER_SHAPES * args.layers + [LM_HEAD]
    weights = [torch.randn(n, k, generator=g) for n, k in shapes]
    packed = [onednn_pack_weight(w) for w in weights]
    mb = sum(w.numel() for w in weights) * 4 / 1e6
    print(f"{len(weights)} matmuls, {mb:.0f} MB of float32 weights per pass")
    for m in args.rows:
        xs = [torch.randn(m, k, generator=g) for _, k in shapes]
        paths = {
            "C GEMV": lambda: [cpu_kernels.f32_linear(lib, x, w, None) for x, w in zip(xs, weights)],
            "oneDNN packed": lambda: [_linear_packed(x, p, None) for x, p in zip(xs, packed)],
            "F.linear (MKL)": lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
        }
        best = best_passes(paths, args.rounds)
        base = best["C GEMV"]
        cells = "  ".join(f"{name} {dt * 1e3:6.1f} ms {mb / dt / 1e3:5.1f} GB/s ({dt / base:.2f}x)"
                          for name, dt in best.items())
        print(f"rows {m:3d}: {cells}")


if __name__ == "__main__":
    main()
