"""The whole engine on the decode-attention kernel of an earlier commit against the working
tree's, in one process by CPU time (benchmarks/README.md, "Decode attention at batch 64").

    PYTHONPATH=src .venv/bin/python benchmarks/decode_kernel_engine_ab.py --rev 5d46a92 \
        [--quantization none] [--batch-size 64 --input-len 128 --output-len 128] [--rounds 3]

Two in-process `EngineCore`s on the same model, one built while `ops/cpu_kernels` held the C
library compiled from commit `rev`'s `ops/csrc`, the other on the working tree's (the attention
backend and the fused decode step keep the library they were built with), one thread, alternating
rounds (A B B A) on the same random prompts; the figure is the process CPU seconds per round, which a
shared machine's other processes barely move (wall times there measure the neighbours: `bench
throughput` got 0.5 of a core at load 7). Only ratios of the same run are figures.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tokenloom.ops import cpu_features, cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode_kernel_ab import _build, _sources_at  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rev", required=True)
    p.add_argument("--quantization", default="none")
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)

    from tokenloom.config import EngineConfig
    from tokenloom.core.engine_core import EngineCore
    from tokenloom.bench.common import random_prompt_ids
    from tokenloom.messages import EngineCoreRequest
    from tokenloom.model.loader import load_tokenizer
    from tokenloom.sampling_params import SamplingParams

    isa = cpu_features.detect().isa
    new_lib = cpu_kernels.load()
    with tempfile.TemporaryDirectory() as tmp:
        old_lib = cpu_kernels._bind(_build(_sources_at(args.rev, Path(tmp)), isa))
    B, IN, OUT = args.batch_size, args.input_len, args.output_len
    tokenizer = load_tokenizer(None)
    blocks = B * (-(-(IN + OUT) // args.block_size) + 1) + 8
    cores = {}
    for name, lib in ((args.rev, old_lib), ("new", new_lib)):
        cpu_kernels._lib = lib  # what the engine's components take at construction
        cores[name] = EngineCore(EngineConfig(
            num_kv_blocks=blocks, max_num_seqs=B, quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype, block_size=args.block_size))
    cpu_kernels._lib = new_lib
    params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)

    def run(name: str, prompts: list[list[int]], tag: str) -> tuple[float, list[list[int]]]:
        core = cores[name]
        for i, ids in enumerate(prompts):
            core.add_request(EngineCoreRequest(
                request_id=f"{tag}-{i}", prompt_token_ids=ids, sampling_params=params,
                eos_token_id=tokenizer.eos_token_id, arrival_time=time.monotonic()))
        out: dict[str, list[int]] = {}
        start = time.process_time()
        while core.has_unfinished_requests():
            for o in core.step().outputs:
                out.setdefault(o.request_id.rsplit("-", 1)[1], []).extend(o.new_token_ids)
        return time.process_time() - start, [out[k] for k in sorted(out, key=int)]

    warm = random_prompt_ids(tokenizer, 49152, B, IN, seed=1000)
    for name in cores:
        run(name, warm, f"warm-{name}")
    times: dict[str, list[float]] = {name: [] for name in cores}
    for r in range(args.rounds):
        prompts = random_prompt_ids(tokenizer, 49152, B, IN, seed=r)
        # A B B A: the second run of a pair was often slower (the neighbours' load drifts)
        names = list(cores)
        tokens, spent = {}, dict.fromkeys(names, 0.0)
        for k, name in enumerate(names + names[::-1]):
            t, tokens[name] = run(name, prompts, f"r{r}-{k}")
            spent[name] += t
        for name in names:
            times[name].append(spent[name] / 2)
        same = tokens[args.rev] == tokens["new"]
        print(f"round {r}: {args.rev} {times[args.rev][-1]:.2f} s CPU, new {times['new'][-1]:.2f} s, "
              f"ratio {times[args.rev][-1] / times['new'][-1]:.2f}x, same tokens: {same}", flush=True)
    med = {name: statistics.median(ts) for name, ts in times.items()}
    print(f"median ({B} x {IN} in x {OUT} out, quantization {args.quantization}, 1 thread): "
          f"{args.rev} {med[args.rev]:.2f} s, new {med['new']:.2f} s, "
          f"{args.rev} / new = {med[args.rev] / med['new']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
