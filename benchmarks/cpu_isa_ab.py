"""The C kernels built for each ISA level this CPU has (AVX-512, AVX2, plain), side by side in one
process: which variant wins, per kernel and dtype (benchmarks/README.md, "ISA variants").

    .venv/bin/python benchmarks/cpu_isa_ab.py [--layers 30] [--repeat 10] [--threads 1]

Decode attention (the torch backend's forward, KV write included, one cache per layer so K/V
come from memory) at batch 64 with 192 tokens of context and at batch 1 with 512, SmolLM2's heads
(9 query, 3 KV, head_dim 64), for a float32 model and for a bfloat16 one (bf16 queries and
cache); and the element-wise kernels (norm with its residual add, RoPE, SiLU-and-mul) at 64 and
2048 rows, float32 and bfloat16, each call over all the layers. Medians of `--repeat` rounds
after one warm-up, the levels alternating within each round. With one thread (the default) the
figure is the thread's CPU time, which other processes on a shared machine barely move; with
more, wall time.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

from tokenloom.attention.torch_backend import TorchAttentionBackend
from tokenloom.model.rope import cos_sin_cache
from tokenloom.ops import cpu_features, cpu_kernels

# The tests' batch builder (a paged cache, block tables and slot mappings for given lengths).
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "attention"))
from attn_helpers import make_batch  # noqa: E402


def _median_ms(fns: dict, repeat: int) -> dict[str, float]:
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter
    times: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeat):
        for name, fn in fns.items():
            t = clock()
            fn()
            times[name].append(clock() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def _report(label: str, ms: dict[str, float]) -> None:
    best = min(ms, key=ms.get)
    cells = "  ".join(f"{lvl} {t:8.3f} ms" for lvl, t in ms.items())
    ref = ms.get("avx2")
    ratio = f"  avx512/avx2 {ms['avx512'] / ref:.2f}" if ref and "avx512" in ms else ""
    print(f"{label:<34} {cells}  best {best}{ratio}", flush=True)


def bench_decode(libs: dict, batch: int, context: int, dtype: torch.dtype, layers: int,
                 repeat: int) -> None:
    batches = [make_batch([1] * batch, [context] * batch, 9, 3, 64, 16, seed=i) for i in range(layers)]
    for b in batches:
        b.query, b.key, b.value = (t.to(dtype) for t in (b.query, b.key, b.value))
        b.kv_cache = b.kv_cache.to(dtype)
    backends = {}
    for level, lib in libs.items():
        be = TorchAttentionBackend()
        be._cpu_kernel = lib
        backends[level] = be
    plans = {lvl: [be.prepare(b.meta) for b in batches] for lvl, be in backends.items()}

    def run(level):
        be = backends[level]
        for b, plan in zip(batches, plans[level]):
            be.forward(b.query, b.key, b.value, b.kv_cache, plan, b.scale)

    ms = _median_ms({lvl: (lambda lvl=lvl: run(lvl)) for lvl in libs}, repeat)
    _report(f"decode B={batch} ctx={context} {str(dtype)[6:]}", ms)


def bench_elementwise(libs: dict, rows: int, dtype: torch.dtype, layers: int, repeat: int) -> None:
    H, inter, heads, D = 576, 1536, 12, 64
    x = [torch.randn(rows, H).to(dtype) for _ in range(layers)]
    res = [torch.randn(rows, H).to(dtype) for _ in range(layers)]
    w = torch.randn(H).to(dtype)
    gu = [torch.randn(rows, 2 * inter).to(dtype) for _ in range(layers)]
    qk = [torch.randn(rows, heads, D).to(dtype) for _ in range(layers)]
    table = cos_sin_cache(D, 4096, 10000.0, None)
    pos = torch.randint(0, 4096, (rows,), dtype=torch.int64)
    for name, fn in (
        ("add+norm", lambda lib: [cpu_kernels.add_rms_norm(lib, a, r, w, 1e-5) for a, r in zip(x, res)]),
        ("rope", lambda lib: [cpu_kernels.rope_(lib, q, pos, table) for q in qk]),
        ("silu*mul", lambda lib: [cpu_kernels.silu_and_mul(lib, g) for g in gu]),
    ):
        ms = _median_ms({lvl: (lambda lib=lib, fn=fn: fn(lib)) for lvl, lib in libs.items()}, repeat)
        _report(f"{name} {rows} rows {str(dtype)[6:]}", ms)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    f = cpu_features.detect()
    print(f"{f.summary()}; torch threads {torch.get_num_threads()}")
    levels = cpu_features.ISA_LEVELS[cpu_features.ISA_LEVELS.index(f.isa):]
    libs = {lvl: cpu_kernels.load_isa(lvl) for lvl in levels}
    for dtype in (torch.float32, torch.bfloat16):
        bench_decode(libs, 64, 192, dtype, args.layers, args.repeat)
        bench_decode(libs, 1, 512, dtype, args.layers, args.repeat)
        for rows in (64, 2048):
            bench_elementwise(libs, rows, dtype, args.layers, args.repeat)


if __name__ == "__main__":
    main()
