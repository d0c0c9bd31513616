"""SiLU-and-mul in the quantized gate|up matmul's epilogue (csrc/quant_gemm_amx_bf16.h,
`quant.qlinear_silu_and_mul`) against the two passes it replaces (`qlinear` writing [M, 2I],
then `silu_and_mul` reading it back), in one process, alternating: SmolLM2-135M's MLP (gate|up
3072 x 576, down 576 x 1536) for 30 distinct layers, random weights quantized by `gguf.quants`.

- fused: down(qlinear_silu_and_mul(x))
- two passes: down(silu_and_mul(qlinear(x)))

The two give the same bits (tests/ops/test_quant.py); this shows the time. Each round times
both, in turn; printed: the medians over `--reps` rounds and the median of the rounds' ratios
(a shared machine's noise moves both of a round together). Wall time with `--threads` (2: as the
engine runs a prefill on two cores), CPU time of the calling thread with 1.

    PYTHONPATH=src nice -n 19 python benchmarks/quant_silu_epilogue_ab.py --rows 64 2048
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenloom.ops import elementwise, quant

HIDDEN, INTER = 576, 1536


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 2048])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--format", default="Q4_1", choices=["Q4_0", "Q4_1", "Q5_0", "Q8_0"])
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if quant.silu_epilogue_rows(quant.FMT_Q8) == 0:
        raise SystemExit("no SiLU epilogue here: it runs on the AMX-BF16 tiles")
    qt = Q[args.format]
    rng = np.random.default_rng(0)

    def tiled(N: int, K: int) -> quant.TiledQuantWeight:
        raw = quants.quantize((rng.standard_normal((N, K)) * 0.05).astype(np.float32), qt)
        return quant.tile_gguf(raw.reshape(N, -1), qt)

    layers = [(tiled(2 * INTER, HIDDEN), tiled(HIDDEN, INTER)) for _ in range(args.layers)]
    clock = time.process_time if args.threads == 1 else time.perf_counter

    def step(x: torch.Tensor, fused: bool) -> float:
        start = clock()
        for gate_up, down in layers:
            act = quant.qlinear_silu_and_mul(x, gate_up) if fused else \
                elementwise.silu_and_mul(quant.qlinear(x, gate_up))
            quant.qlinear(act, down)
        return 1e3 * (clock() - start)

    print(f"{args.format}, {args.layers} layers' MLP, {args.threads} thread(s), median of "
          f"{args.reps} alternating rounds, ms per step")
    for M in args.rows:
        x = torch.randn(M, HIDDEN)
        step(x, True), step(x, False)  # warm: panel buffers, first-touch of the outputs
        fused, two = [], []
        for r in range(args.reps):
            order = (True, False) if r % 2 == 0 else (False, True)
            t = {f: step(x, f) for f in order}
            fused.append(t[True])
            two.append(t[False])
        ratio = statistics.median(b / a for a, b in zip(fused, two))
        print(f"M={M:5d}: fused {statistics.median(fused):8.1f}  two passes "
              f"{statistics.median(two):8.1f}   two passes / fused {ratio:.2f}x", flush=True)


if __name__ == "__main__":
    main()
