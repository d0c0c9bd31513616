"""The quantized matmul kernels per GGUF format, against torch float32 matmuls on the same
(dequantized) weights in the same run, and against the library kernels that could do the same
job. Median CPU time of the calling thread over many calls, one thread (torch and OpenMP, so all
the work runs on the calling thread): on a shared 2-core box two-thread wall-clock medians measure
the scheduler, not the kernel.

Shapes (`--model`):
- smollm2: SmolLM2-135M's four per-layer matmuls (qkv 960x576, o 576x576, gate_up 3072x576,
  down 576x1536), 30 layers. K = 576 is not a multiple of 256, so no K-quants here (llama.cpp
  itself falls back to other types for such tensors).
- qwen3: Qwen3-0.6B's (qkv 4096x1024, o 1024x2048, gate_up 6144x1024, down 1024x3072), 28 layers:
  every K a multiple of 256, so every format runs.

Rows per format, at 1 and 64 activation rows:
- ours <fmt>: ops/quant.py qlinear on the format's blocks as shipped (two int8 activation planes,
  the default; `--levels 1 2` adds llama.cpp's one plane)
- F.linear f32: torch's float32 matmul on the dequantized weight (what `quantization=None` would
  compute without the packed copy)
- f32 packed: the float path as the engine runs it (model/packed_linear.py: oneDNN's packed float32, panels on AVX2)
- bf16 oneDNN: the same in bfloat16 (`dtype="bfloat16"`), where the CPU multiplies bf16 natively
- ours <fmt> vnni (CPUs with AMX int8, 2 rows and more): the format on the AVX-512 VNNI kernel
  alone, beside the default that runs AMX tiles from 8 rows
With `--libraries`, also (Q4_1-shaped random data, as in the first measurements):
- int4pack bf16: torch.ops.aten._weight_int4pack_mm_for_cpu (group-wise int4, group 32)
- int8pack: torch.ops.aten._weight_int8pack_mm (int8 weights, per-channel scale, float input)
- _int_mm: torch._int_mm with per-token int8 activations and per-channel int8 weights (W8A8)

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quant_kernels.py --model qwen3
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/quant_kernels.py --model smollm2 --libraries
    TOKENLOOM_QUANT_ISA=avx2 ...   # pin the AVX2 (or c) kernels on a wider CPU
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenloom.model.packed_linear import linear, pack_weight, packed_linear_available
from tokenloom.ops import cpu_features, quant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
import kquants  # noqa: E402  (gguf.quants cannot quantize the K-quants)

MODELS = {
    "smollm2": ([(960, 576), (576, 576), (3072, 576), (576, 1536)], 30),
    "qwen3": ([(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)], 28),
}
ALL_FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]


def bench(f, reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.thread_time()
        f()
        ts.append(time.thread_time() - t)
    return float(np.median(ts))


def library_rows(x: torch.Tensor, N: int, K: int, reps: int) -> dict[str, float]:
    M = x.shape[0]
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

    return {
        "int4pack bf16": bench(lambda: torch.ops.aten._weight_int4pack_mm_for_cpu(xb, w4p, 32, sz), reps),
        "int8pack f32": bench(lambda: torch.ops.aten._weight_int8pack_mm(x, w8, s8), max(3, reps // 10)),
        "_int_mm W8A8": bench(int_mm, reps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(MODELS), default="qwen3")
    ap.add_argument("--formats", nargs="+", default=None, help=f"of {' '.join(ALL_FORMATS)}")
    ap.add_argument("--rows", nargs="+", type=int, default=[1, 64])
    ap.add_argument("--levels", nargs="+", type=int, default=[2], help="activation planes (1, 2)")
    ap.add_argument("--libraries", action="store_true", help="also the torch library kernels")
    ap.add_argument("--reps", type=int, default=None, help="calls per median (default 100 at 1 row, 15 else)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    shapes, layers = MODELS[args.model]
    fits_k = all(K % 256 == 0 for _, K in shapes)
    formats = args.formats or [f for f in ALL_FORMATS if fits_k or not f.endswith("_K")]
    print(f"machine: {cpu_features.detect().summary()}")
    print(f"kernels: " + ", ".join(f"{f} {quant.kernel_isa(quant.GGML_FORMATS[int(Q[f])])}" for f in formats))
    # With AMX the default kernel is AMX from 16 rows; the VNNI kernel is measured beside it.
    amx = quant.limit_isa(None) == "avx512_vnni+amx_int8"
    print(f"model shapes: {args.model} ({layers} layers x {shapes}); ms per step for all layers' "
          f"4 matmuls, one thread, median")
    for M in args.rows:
        total: dict[str, float] = {}
        for N, K in shapes:
            rng = np.random.default_rng(N + K)
            w = rng.standard_normal((N, K), dtype=np.float32) * 0.05
            x = torch.randn(M, K)
            reps = args.reps or (100 if M == 1 else 15)
            r: dict[str, float] = {}
            for name in formats:
                qtype = Q[name]
                raw = kquants.quantize(w, qtype)
                tw = quant.tile_gguf(raw, qtype)
                for lv in args.levels:
                    key = f"ours {name}" + ("" if lv == 2 else " L1")
                    r[key] = bench(lambda: quant.qlinear(x, tw, act_levels=lv), reps)
                    if amx and M >= 2:  # the same format on the VNNI kernel alone
                        quant.limit_isa("avx512_vnni")
                        r[key + " vnni"] = bench(lambda: quant.qlinear(x, tw, act_levels=lv), reps)
                        quant.limit_isa(None)
                del tw
            wt = torch.from_numpy(quants.dequantize(kquants.quantize(w, Q.Q4_K if fits_k else Q.Q4_1),
                                                    Q.Q4_K if fits_k else Q.Q4_1))
            packed = pack_weight(wt)
            r["F.linear f32"] = bench(lambda: torch.nn.functional.linear(x, wt), reps)
            r["f32 packed"] = bench(lambda: linear(x, wt, None, packed), reps)
            if packed_linear_available(torch.bfloat16):  # the float path in bfloat16 (AMX bf16 here)
                wb, xb = wt.bfloat16(), x.bfloat16()
                packed_b = pack_weight(wb)
                r["bf16 oneDNN"] = bench(lambda: linear(xb, wb, None, packed_b), reps)
            if args.libraries:
                r |= library_rows(x, N, K, reps)
            for k, v in r.items():
                total[k] = total.get(k, 0.0) + v
        base = total["F.linear f32"]
        deq = total["f32 packed"]
        print(f"M={M}:")
        for k, v in total.items():
            print(f"  {k:16s} {v * layers * 1e3:9.2f} ms   x{base / v:5.2f} vs F.linear f32   "
                  f"x{deq / v:5.2f} vs f32 packed (dequantized path)")


if __name__ == "__main__":
    main()
