"""Per-step cost of Sampler.sample() for a decode batch (not a test; run it by hand):

    .venv/bin/python benchmarks/sampler.py [num_rows] [vocab_size] [torch_threads]

Wall-clock min and median over the steps, and the median process CPU time: on a shared machine
the wall clock includes waiting for a core; with one torch thread the CPU time does not.
"""
from __future__ import annotations

import sys
import time

import torch

from tokenloom.sample import Sampler
from tokenloom.sampling_params import SamplingParams

CASES = {
    "greedy": dict(temperature=0.0),
    "random": dict(temperature=0.8),
    "random+seed": dict(temperature=0.8, seed=1),
    "top_k=50": dict(temperature=0.8, top_k=50),
    "top_k=50+top_p=0.9": dict(temperature=0.8, top_k=50, top_p=0.9),
    "top_p=0.9 (no top_k)": dict(temperature=0.8, top_p=0.9),
    "min_p=0.05": dict(temperature=0.8, min_p=0.05),
    "penalties": dict(temperature=0.8, repetition_penalty=1.1, frequency_penalty=0.5, presence_penalty=0.5),
    "logprobs=5": dict(temperature=0.8, logprobs=5),
    "logit_bias(10)+min_tokens": dict(
        temperature=0.8, logit_bias={i: 1.0 for i in range(10)}, min_tokens=8, stop_token_ids=[2]
    ),
    "everything+seed": dict(
        temperature=0.8, top_k=50, top_p=0.9, min_p=0.05, repetition_penalty=1.1, presence_penalty=0.5,
        seed=1, logprobs=5, logit_bias={3: 1.0}, min_tokens=4, stop_token_ids=[2],
    ),
}


def bench(num_rows: int, vocab: int, steps: int = 20) -> None:
    torch.manual_seed(0)
    logits = torch.randn(num_rows, vocab) * 3
    rows = list(range(num_rows))
    print(f"{num_rows} rows x {vocab} vocab, torch threads={torch.get_num_threads()}")
    for name, kwargs in CASES.items():
        sampler = Sampler(num_rows, vocab)
        for r in rows:
            params = SamplingParams(max_tokens=1000, **kwargs)
            if params.seed is not None:
                params = params.clone(seed=r)
            sampler.add_request(r, params, list(range(100)), [])
        sampler.sample(logits, rows)  # warm-up
        wall, cpu = [], []
        for _ in range(steps):
            t0, c0 = time.perf_counter(), time.process_time()
            sampler.sample(logits, rows)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        wall.sort()
        cpu.sort()
        print(
            f"  {name:28s} wall min {wall[0] * 1e3:7.2f} median {wall[steps // 2] * 1e3:7.2f}"
            f" | cpu median {cpu[steps // 2] * 1e3:7.2f} ms/step"
        )


if __name__ == "__main__":
    if len(sys.argv) > 3:
        torch.set_num_threads(int(sys.argv[3]))
    bench(int(sys.argv[1]) if len(sys.argv) > 1 else 64, int(sys.argv[2]) if len(sys.argv) > 2 else 49152)
