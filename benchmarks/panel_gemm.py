"""The float32 matmul on one panel-packed copy of each weight (csrc/f32_panel.c, the float path's
matmul on AVX2 CPUs) against the float path's earlier ones on SmolLM2-135M's shapes: the C GEMV
on the plain weight (below 16 rows), oneDNN's packed copy (16-511 rows) and MKL's `F.linear`
(from 512), side by side in one process, alternating, over the 30 layers' four matmuls and the
LM head (538 MB of float32 weights, streamed from memory as a decode step streams them).

    .venv/bin/python benchmarks/panel_gemm.py                            # rows 1 4 8 16 32 64
    .venv/bin/python benchmarks/panel_gemm.py --rows 512 2048 --layers 2

First checks the panel matmul: within float32 rounding of a float64 reference, and every row summed
alike alone or in a batch. Then prints, per row count, the best pass of each path (ms, GFLOP/s)
and its time over the panel matmul's.
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from f32_gemv import LAYER_SHAPES, LM_HEAD, best_passes  # benchmarks/, the script's folder

from tokenloom.model.packed_linear import _linear_packed, onednn_pack_weight
from tokenloom.ops import cpu_features, cpu_kernels


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64])
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; the best pass counts")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    kernels = cpu_kernels.load()
    if kernels is None:
        raise SystemExit("the C kernels are not available here (no compiler?)")
    f = cpu_features.detect()
    print(f"machine: {f.model_name}, {f.num_cores} usable cores, kernels {cpu_kernels.isa()}, "
          f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}), "
          f"{torch.get_num_threads()} threads")

    panel = cpu_kernels.f32_panel_pack

    def panel_linear(x: torch.Tensor, pw: torch.Tensor, n: int, bias: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_kernels.f32_panel_linear(kernels, x, pw, n, bias)

    g = torch.Generator().manual_seed(0)
    for n, k in [(67, 19), (576, 1536), (40, 576)]:
        w, x, b = torch.randn(n, k, generator=g), torch.randn(13, k, generator=g), torch.randn(n, generator=g)
        got, ref = panel_linear(x, panel(w), n, b), x.double() @ w.double().t() + b.double()
        err, mkl = (got.double() - ref).abs().max().item(), (F.linear(x, w, b).double() - ref).abs().max().item()
        alike = all(torch.equal(panel_linear(x[m:m + 1].contiguous(), panel(w), n, b)[0], got[m]) for m in range(13))
        print(f"check {n}x{k}: max error {err:.2e} (F.linear {mkl:.2e}), rows summed alike alone and in a batch: {alike}")
        assert err < 1e-3 and alike

    shapes = LAYER_SHAPES * args.layers + [LM_HEAD]
    weights = [torch.randn(n, k, generator=g) for n, k in shapes]
    packed, panels = [onednn_pack_weight(w) for w in weights], [panel(w) for w in weights]
    flops_per_row = 2 * sum(w.numel() for w in weights)
    print(f"{len(weights)} matmuls, {flops_per_row * 2 / 1e6:.0f} MB of float32 weights per pass")
    for m in args.rows:
        xs = [torch.randn(m, k, generator=g) for _, k in shapes]
        paths = {
            "panel": lambda: [panel_linear(x, p, w.shape[0]) for x, w, p in zip(xs, weights, panels)],
            "oneDNN packed": lambda: [_linear_packed(x, p, None) for x, p in zip(xs, packed)],
            "F.linear (MKL)": lambda: [F.linear(x, w) for x, w in zip(xs, weights)],
        }
        if m < 33:
            paths["C GEMV"] = lambda: [cpu_kernels.f32_linear(kernels, x, w, None) for x, w in zip(xs, weights)]
        best = best_passes(paths, args.rounds)
        base = best["panel"]
        print(f"rows {m:4d}: " + "  ".join(f"{name} {dt * 1e3:7.1f} ms {flops_per_row * m / dt / 1e9:4.0f} GF/s "
                                           f"({dt / base:.2f}x)" for name, dt in best.items()), flush=True)


if __name__ == "__main__":
    main()
