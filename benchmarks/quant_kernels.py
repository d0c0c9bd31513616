"""The quantized matmul kernels against the library kernels that could do the same job, on
SmolLM2-135M's four per-layer matmuls (qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536),
at 1 and 64 rows. Median of many calls, one thread (torch and OpenMP): on a shared 2-core box
two-thread medians measure the scheduler, not the kernel.

- ours: ops/quant.py qlinear on Q4_1 / Q8_0 blocks (act_levels 1 = llama.cpp's int8
  activations, 2 = the default, with the rounding error as a second int8 plane)
- f32 oneDNN: the float path's packed float32 weights (model/packed_linear.py)
- int4pack bf16: torch.ops.aten._weight_int4pack_mm_for_cpu (group-wise int4, group 32; Q4_1
  maps onto it exactly; its float32 input path measured ~100x slower still)
- int8pack: torch.ops.aten._weight_int8pack_mm (int8 weights, per-channel scale, float input)
- _int_mm: torch._int_mm with per-token int8 activations and per-channel int8 weights (W8A8)

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quant_kernels.py
"""
from __future__ import annotations

import time

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenloom.model.packed_linear import linear, pack_weight
from tokenloom.ops import quant

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer
LAYERS = 30


def bench(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def main() -> None:
    torch.set_num_threads(1)
    print(f"kernel: {quant.kernel_isa(quant.FMT_Q4_1)}")
    for M in (1, 64):
        total: dict[str, float] = {}
        for N, K in SHAPES:
            rng = np.random.default_rng(N + K)
            w = rng.standard_normal((N, K), dtype=np.float32)
            x = torch.randn(M, K)
            q41 = quant.tile_gguf(quants.quantize(w, Q.Q4_1), Q.Q4_1)
            q80 = quant.tile_gguf(quants.quantize(w, Q.Q8_0), Q.Q8_0)
            wt = torch.from_numpy(w)
            packed = pack_weight(wt)
            w4 = torch.randint(0, 16, (N, K), dtype=torch.int32)
            w4p = torch.ops.aten._convert_weight_to_int4pack_for_cpu(w4, 1)
            sz = torch.randn(K // 32, N, 2, dtype=torch.bfloat16)
            xb = x.bfloat16()
            w8 = torch.randint(-127, 127, (N, K), dtype=torch.int8)
            s8 = torch.rand(N)
            w8t = w8.t()

            def int_mm():
                xs = x.abs().amax(1, keepdim=True) / 127
                q = (x / xs).round().to(torch.int8)
                if M < 17:  # _int_mm needs more than 16 rows
                    q = torch.cat([q, torch.zeros(17 - M, K, dtype=torch.int8)])
                return torch._int_mm(q, w8t)[:M].float() * xs * s8

            reps = 200 if M == 1 else 30
            r = {
                "Q4_1 ours L1": bench(lambda: quant.qlinear(x, q41, act_levels=1), reps),
                "Q4_1 ours L2": bench(lambda: quant.qlinear(x, q41, act_levels=2), reps),
                "Q8_0 ours L2": bench(lambda: quant.qlinear(x, q80, act_levels=2), reps),
                "f32 oneDNN": bench(lambda: linear(x, wt, None, packed), reps),
                "int4pack bf16": bench(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w4p, 32, sz), reps),
                "int8pack f32": bench(lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8), max(3, reps // 10)),
                "_int_mm W8A8": bench(int_mm, reps),
            }
            for k, v in r.items():
                total[k] = total.get(k, 0.0) + v
        print(f"M={M}: ms per step for the {LAYERS} layers' 4 matmuls: "
              + ", ".join(f"{k} {v * LAYERS * 1e3:.2f}" for k, v in total.items()))


if __name__ == "__main__":
    main()
