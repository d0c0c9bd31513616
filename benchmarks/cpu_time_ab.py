"""tokenloom vs transformers by CPU time: the comparison a shared machine cannot distort.

Wall times on a box where other processes compete for the cores measure the contention more
than the engines (two OpenMP threads wait for each other whenever one is descheduled). This
script runs both engines in this one process, one thread each, alternating rounds on the same
random prompts, and reports the CPU seconds each spends per output token (prefill included):

    .venv/bin/python benchmarks/cpu_time_ab.py --batch-size 1 --rounds 4
    .venv/bin/python benchmarks/cpu_time_ab.py --batch-size 64 --input-len 32 --output-len 16 --rounds 2
    # tokenloom's quantized GGUF path against its own float path (--baseline none) or int8
    .venv/bin/python benchmarks/cpu_time_ab.py --quantization auto --baseline none
    # the GGUF path against itself on a narrower quantized kernel (AMX vs the VNNI kernel alone)
    .venv/bin/python benchmarks/cpu_time_ab.py --baseline auto --baseline-kernel avx512_vnni

tokenloom's `EngineCore` runs in-process here (no IPC: the step profile shows IPC is <0.1 % of a
step anyway); transformers runs `generate()` on the same GGUF, greedy, `min_new_tokens` = output
length, exactly as `tokenloom bench latency --baseline hf` does.
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quantization", default="auto", help="tokenloom's quantization (auto: the GGUF's own weights)")
    p.add_argument("--baseline", default="hf", choices=["hf", "none", "int8", "auto"],
                   help="transformers, or tokenloom itself with this quantization")
    p.add_argument("--baseline-kernel", default=None,
                   help="the quantized kernel level the baseline is limited to (ops/quant.limit_isa: "
                        "avx512_vnni, avx2, c); tokenloom keeps the best")
    p.add_argument("--baseline-dtype", default="auto", help="the baseline engine's dtype (e.g. bfloat16 for the "
                                                            "float path in bf16)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    from tokenloom.config import EngineConfig
    from tokenloom.core.engine_core import EngineCore
    from tokenloom.bench.common import hf_generate, load_hf_model, random_prompt_ids
    from tokenloom.messages import EngineCoreRequest
    from tokenloom.model.loader import load_tokenizer
    from tokenloom.sampling_params import SamplingParams

    B, IN, OUT = args.batch_size, args.input_len, args.output_len
    tokenizer = load_tokenizer(None)
    blocks = B * (-(-(IN + OUT) // 16) + 1) + 8
    core = EngineCore(EngineConfig(num_kv_blocks=blocks, max_num_seqs=max(B, 1), quantization=args.quantization))
    other = None if args.baseline == "hf" else EngineCore(EngineConfig(num_kv_blocks=blocks, max_num_seqs=max(B, 1),
                                                                       quantization=args.baseline,
                                                                       dtype=args.baseline_dtype))
    hf = load_hf_model(None, "float32", "cpu")[0] if other is None else None
    params = SamplingParams(temperature=0.0, max_tokens=OUT, ignore_eos=True)
    name = "transformers" if other is None else f"tokenloom[{other.info.quantization}, {args.baseline_dtype}" \
        f"{', ' + args.baseline_kernel if args.baseline_kernel else ''}]"

    def ours(prompts: list[list[int]], tag: str, core=core) -> float:
        for i, ids in enumerate(prompts):
            core.add_request(EngineCoreRequest(request_id=f"{tag}-{i}", prompt_token_ids=ids, sampling_params=params,
                                               eos_token_id=tokenizer.eos_token_id, arrival_time=time.monotonic()))
        start = time.process_time()
        while core.has_unfinished_requests():
            core.step()
        return (time.process_time() - start) / OUT * 1e3

    def theirs(prompts: list[list[int]]) -> float:
        if other is not None and args.baseline_kernel:
            from tokenloom.ops import quant
            quant.limit_isa(args.baseline_kernel)
            try:
                return ours(prompts, f"b{time.monotonic()}", core=other)
            finally:
                quant.limit_isa(None)
        if other is not None:
            return ours(prompts, f"b{time.monotonic()}", core=other)
        start = time.process_time()
        hf_generate(hf, prompts, OUT, B, tokenizer.eos_token_id, "cpu")
        return (time.process_time() - start) / OUT * 1e3

    warm = random_prompt_ids(tokenizer, 49152, B, IN, seed=1000)
    ours(warm, "warm")
    theirs(warm)
    a, b = [], []
    for r in range(args.rounds):
        prompts = random_prompt_ids(tokenizer, 49152, B, IN, seed=r)
        a.append(ours(prompts, f"r{r}"))
        b.append(theirs(prompts))
        print(f"round {r}: tokenloom {a[-1]:.2f} ms CPU/token-step, {name} {b[-1]:.2f}, ratio {b[-1] / a[-1]:.2f}x",
              flush=True)
    ma, mb = statistics.median(a), statistics.median(b)
    print(f"median (batch {B}, {IN} in, {OUT} out, {args.threads} thread): tokenloom "
          f"[{core.info.quantization}] {ma:.2f} ms, {name} {mb:.2f} ms, {name} / tokenloom = {mb / ma:.2f}x")


if __name__ == "__main__":
    main()
