"""Time tokenloom's float32 CPU kernels (ops/csrc) against the PyTorch ops they replace.

    .venv/bin/python benchmarks/cpu_kernels.py [--layers 30] [--repeat 10] [--threads N]

Decode attention: the torch backend's `forward` (KV write included) with the C kernel and with
its SDPA path, over one cache per layer (so, as in a real step, each layer's K/V comes from
memory, not from cache), blocks in random order, SmolLM2's heads (9 query, 3 KV, head_dim 64).
Alongside, the time of one plain `sum()` over the same K/V bytes (the memory floor), and the C
kernel over the same cache in bfloat16 (`kv_cache_dtype="bfloat16"`: half the bytes).
Element-wise: the norm with its residual add, RoPE and SiLU-and-mul, C against the eager ops,
at a decode batch (64 rows) and a prefill chunk (2048 rows), per call over all the layers.
Medians of `--repeat` rounds after one warm-up; every pair runs in the same process, alternating.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
import statistics
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "attention"))
from attn_helpers import make_batch  # noqa: E402
from tokenloom.attention.torch_backend import TorchAttentionBackend
from tokenloom.model.rope import cos_sin_cache
from tokenloom.ops.elementwise import apply_rope
from tokenloom.ops import cpu_kernels


def _median_ms(fns: dict, repeat: int) -> dict[str, float]:
    times: dict[str, list[float]] = {name: [] for name in fns}
    for name, fn in fns.items():
        fn()  # warm-up
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) * 1e3 for name, ts in times.items()}


def bench_decode(batch: int, context: int, layers: int, repeat: int) -> None:
    hq, hkv, d, bs = 9, 3, 64, 16
    batches = [make_batch([1] * batch, [context] * batch, hq, hkv, d, bs, seed=i)
               for i in range(layers)]
    kernel, sdpa = TorchAttentionBackend(), TorchAttentionBackend(use_cpu_kernel=False)
    kv_bytes = layers * batch * context * hkv * d * 4 * 2

    caches_bf16 = [b.kv_cache.to(torch.bfloat16) for b in batches]

    def run(backend, caches=None):
        plans = [backend.prepare(b.meta) for b in batches]  # once per step in the engine
        caches = caches or [b.kv_cache for b in batches]

        def step():
            for b, plan, cache in zip(batches, plans, caches):
                backend.forward(b.query, b.key, b.value, cache, plan, b.scale)
        return step

    flat = [b.kv_cache.reshape(-1) for b in batches]

    def read():
        for x in flat:
            x.sum()
    ms = _median_ms({"C kernel": run(kernel), "SDPA": run(sdpa), "read": read,
                     "bf16": run(kernel, caches_bf16)}, repeat)
    print(f"decode B={batch:3d} L={context:4d}: C kernel {ms['C kernel']:7.2f} ms  "
          f"SDPA path {ms['SDPA']:7.2f} ms  ({ms['SDPA'] / ms['C kernel']:.2f}x)  "
          f"K/V {kv_bytes / 1e6:.0f} MB, one plain read of the caches {ms['read']:.2f} ms "
          f"(kernel = {ms['C kernel'] / ms['read']:.2f}x the read); bfloat16 cache "
          f"{ms['bf16']:.2f} ms ({ms['C kernel'] / ms['bf16']:.2f}x)")


def bench_elementwise(rows: int, layers: int, repeat: int, lib) -> None:
    H, I, hq, hkv, D = 576, 1536, 9, 3, 64
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, H, generator=g)
    residual = torch.randn(rows, H, generator=g)
    w = torch.randn(H, generator=g)
    gate_up = torch.randn(rows, 2 * I, generator=g)
    qkv = torch.randn(rows, (hq + 2 * hkv) * D, generator=g)
    table = cos_sin_cache(D, 8192, 100000.0, None)
    positions = torch.randint(0, 8192, (rows,), generator=g)

    def eager_norm():
        r = x + residual
        return w * (r * torch.rsqrt(r.pow(2).mean(-1, keepdim=True) + 1e-5))

    def eager_rope():
        qk = qkv[:, :(hq + hkv) * D].view(rows, hq + hkv, D)
        cos, sin = table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
        return apply_rope(qk, cos, sin)

    def eager_silu():
        gate, up = gate_up.split(I, dim=-1)
        return F.silu(gate) * up

    res = residual.clone()  # the C norm updates it in place; the values only drift, harmlessly
    qk_view = qkv[:, :(hq + hkv) * D].view(rows, hq + hkv, D)
    cases = {
        "add+norm": (eager_norm, lambda: cpu_kernels.add_rms_norm(lib, x, res, w, 1e-5), 2),
        "rope": (eager_rope, lambda: cpu_kernels.rope_(lib, qk_view, positions, table), 1),
        "silu*mul": (eager_silu, lambda: cpu_kernels.silu_and_mul(lib, gate_up), 1),
    }
    for name, (eager, c, per_layer) in cases.items():
        n = layers * per_layer

        def many(fn, n=n):
            def run():
                for _ in range(n):
                    fn()
            return run
        ms = _median_ms({"eager": many(eager), "C": many(c)}, repeat)
        print(f"{name:9s} T={rows:5d}, {n} calls: eager {ms['eager']:7.2f} ms  C {ms['C']:7.2f} ms"
              f"  ({ms['eager'] / ms['C']:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    lib = cpu_kernels.load()
    if lib is None:
        print("benchmarks/cpu_kernels.py: the C kernels are unavailable here (no compiler, or "
              "TOKENLOOM_CPU_KERNELS=0); nothing to time.")
        return 0
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; per-step figures over "
          f"{args.layers} layers, median of {args.repeat}")
    with torch.no_grad():
        for batch, context in ((64, 192), (64, 256), (8, 400), (1, 160)):
            bench_decode(batch, context, args.layers, args.repeat)
        for rows in (64, 2048):
            bench_elementwise(rows, args.layers, args.repeat, lib)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
