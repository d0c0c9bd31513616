"""Timings of the torch attention backend on CPU (not a test; run it directly).

    .venv/bin/python benchmarks/torch_backend.py [--threads N]

Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), block size 16, float32.
Prints the minimum and median wall time of many single-layer forwards, the minimum process CPU
time (steadier than wall time when other jobs share the cores), and what a 30-layer step would
spend in attention.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
import random
import time

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "attention"))
from attn_helpers import make_batch  # noqa: E402
from tokenloom.attention.torch_backend import TorchAttentionBackend


def time_case(label, query_lens, seq_lens, mode="auto", iters=30, dtype=torch.float32):
    batch = make_batch(query_lens, seq_lens, 9, 3, 64, 16, dtype=dtype, extra_blocks=64)
    backend = TorchAttentionBackend(prefill_mode=mode)
    t0 = time.perf_counter()
    plan = backend.prepare(batch.meta)
    prep = time.perf_counter() - t0

    def layer():
        backend.forward(batch.query, batch.key, batch.value, batch.kv_cache, plan, batch.scale)

    for _ in range(3):
        layer()
    ts, cpu = [], []
    for _ in range(iters):
        t0, c0 = time.perf_counter(), time.process_time()
        layer()
        ts.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    ts.sort()
    print(f"{label:<42} {mode:<11} prepare {prep * 1e3:6.2f} ms | layer wall min "
          f"{ts[0] * 1e3:7.2f} median {ts[len(ts) // 2] * 1e3:7.2f} cpu min {min(cpu) * 1e3:7.2f}"
          f" ms | x30 layers (wall min) {30 * ts[0] * 1e3:7.1f} ms")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rng = random.Random(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    for n, ctx in [(1, 200), (8, 200), (64, 200), (64, 1000)]:
        lens = [rng.randint(ctx * 3 // 4, ctx * 5 // 4) for _ in range(n)]
        time_case(f"decode {n} x ~{ctx}", [1] * n, lens)
    lens = [rng.randint(150, 250) for _ in range(64)]
    time_case("decode 64 x ~200 bf16", [1] * 64, lens, dtype=torch.bfloat16)
    for mode in ("padded", "per_request"):
        time_case("prefill 64 x 128", [128] * 64, [128] * 64, mode=mode, iters=10)
        qs = [rng.randint(16, 128) for _ in range(16)]
        time_case("prefill 16 x 16..128", qs, qs, mode=mode, iters=10)
        qs = [1] * 48 + [64] * 4
        ss = [rng.randint(100, 300) for _ in range(48)] + [64, 128, 200, 300]
        time_case("mixed 48 decodes + 4 chunks (3 with ctx)", qs, ss, mode=mode, iters=10)
        qs = [256, 256]
        time_case("prefill 2 x 256 chunks, ctx 0/512", qs, [256, 768], mode=mode, iters=10)


if __name__ == "__main__":
    main()
