"""What tensor parallelism's collectives cost per step on this machine: gloo all_reduce of a
[B, hidden] float32 tensor (two per decoder layer, one for the embedding) and all_gather of the
LM head's [B, vocab / N] logits (one per step), at N ranks of one process each on 127.0.0.1.

    python benchmarks/tp_allreduce.py [--ranks 2] [--hidden 576] [--layers 30] [--vocab 49152]

Prints the median microseconds per collective and the per-step total for a model of that shape
(2 * layers + 1 all-reduces and one all-gather), per batch size B (decode: B running requests).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

BATCHES = (1, 8, 32, 64, 256)


def _time(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    dist.barrier()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e6


def _rank(rank: int, args: argparse.Namespace, port: int, q) -> None:
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.ranks))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    rows = []
    for b in BATCHES:
        x = torch.randn(b, args.hidden)
        ar = _time(lambda: dist.all_reduce(x), args.reps)
        logits = torch.randn(b, args.vocab // args.ranks)
        parts = [torch.empty_like(logits) for _ in range(args.ranks)]
        ag = _time(lambda: dist.all_gather(parts, logits), max(20, args.reps // 5))
        rows.append((b, ar, ag))
    if rank == 0:
        q.put(rows)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--reps", type=int, default=200)
    args = p.parse_args()
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, args, port, q)) for r in range(args.ranks)]
    for proc in procs:
        proc.start()
    rows = q.get()
    for proc in procs:
        proc.join()
    n_ar = 2 * args.layers + 1
    print(f"gloo, {args.ranks} ranks on 127.0.0.1, hidden {args.hidden}, vocab {args.vocab}, "
          f"{args.layers} layers ({n_ar} all-reduces + 1 all-gather per step)")
    print(f"{'B':>5} {'all_reduce us':>14} {'all_gather us':>14} {'per step ms':>12}")
    for b, ar, ag in rows:
        print(f"{b:>5} {ar:>14.1f} {ag:>14.1f} {(n_ar * ar + ag) / 1e3:>12.2f}")


if __name__ == "__main__":
    main()
