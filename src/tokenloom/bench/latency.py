"""`tokenloom bench latency`: the latency of one batch, prefill and per decode step.

Each iteration generates `--output-len` tokens (greedy, `ignore_eos`) for `--batch-size` new
random prompts of `--input-len` tokens (new ones every iteration, so the prefix cache never
helps). From the caller's timeline of each request: prefill = from the first request's arrival
to the last request's first token; decode = the time after that to the last token, divided by
`--output-len - 1` (ms per token: one decode step of the whole batch). Median and p90 over the
iterations after `--warmup`. The transformers baseline (`--baseline hf`) runs the same prompts
at the same batch size through `generate()`, timed by a logits processor that notes when each
step's logits are ready; llama.cpp (`--baseline llamacpp`, batch 1) runs them on the same GGUF
in its own environment (bench/llamacpp_baseline.py). Baseline iterations alternate
with ours. Next to the times: the bytes of matrix weights each decode step reads and the resident
memory of the process that holds the model (our engine core, llama.cpp's process), and each
decode figure against the measured memory roofline (bench/roofline.py).
"""
from __future__ import annotations

import argparse
from typing import Any

from tokenloom.entrypoints.engine_args import add_engine_args


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("latency", help="prefill time and per-token decode latency of one batch (vs transformers)")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--input-len", type=int, default=32, help="prompt length in tokens")
    p.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (ignore_eos)")
    p.add_argument("--num-iters", type=int, default=5, help="timed iterations")
    p.add_argument("--warmup", "--num-iters-warmup", dest="warmup", type=int, default=1,
                   help="untimed iterations first (--num-iters-warmup: vllm bench latency's name)")
    p.add_argument("--baseline", choices=["hf", "llamacpp"], default=None,
                   help="also run transformers generate() at the same batch size (hf), or llama.cpp on the same GGUF (llamacpp, batch 1)")
    p.add_argument("--baseline-dtype", choices=["float32", "bfloat16"], default=None,
                   help="the transformers baseline's dtype (default: float32 on the CPU, bfloat16 on CUDA; "
                        "llama.cpp runs the GGUF as stored)")
    p.add_argument("--llamacpp-python", default=None,
                   help="python of an environment with llama-cpp-python installed (for --baseline llamacpp)")
    p.add_argument("--profile", action="store_true", help="print the engine step profile over the timed iterations")
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument("--output-json", metavar="FILE", default=None,
                   help="also write the results, as --json prints them, to FILE (as vllm bench latency)")
    add_engine_args(p)
    p.set_defaults(func=run)


def _iteration_prompts(args: argparse.Namespace) -> list[list[list[int]]]:
    from tokenloom.bench.common import random_prompt_ids
    from tokenloom.model.loader import load_model_config, load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer or args.model, args.tokenizer_mode)
    vocab = load_model_config(args.model).vocab_size
    return [
        random_prompt_ids(tokenizer, vocab, args.batch_size, args.input_len, args.seed + i)
        for i in range(args.warmup + args.num_iters)
    ]


def _summarize(prefill: list[float], decode: list[float], e2e: list[float], cpu_s: list[float]) -> dict[str, Any]:
    from tokenloom.bench.common import summary_ms

    # CPU seconds per iteration (both processes for tokenloom): unlike the wall times, barely
    # moved by other load on a shared machine.
    return {"prefill": summary_ms(prefill), "decode_per_token": summary_ms(decode), "e2e": summary_ms(e2e),
            "cpu_per_iteration": summary_ms(cpu_s)}


class _Ours:
    """tokenloom side: one LLM (engine core in its child process) for all iterations."""

    def __init__(self, args: argparse.Namespace) -> None:
        from tokenloom.bench.common import StepRecorder, make_llm
        from tokenloom.sampling_params import SamplingParams

        self.args = args
        self.llm = make_llm(args, max_num_seqs=max(args.max_num_seqs, args.batch_size))
        self.info = self.llm.llm_engine.engine_core.info
        self.recorder = StepRecorder(self.llm)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.e2e: list[float] = []
        self.cpu_s: list[float] = []
        self.memory: dict[str, float] = {}

    def iteration(self, prompts: list[list[int]], timed: bool) -> None:
        from tokenloom.bench.common import CpuMeter, process_memory_mib

        self.recorder.recording = timed
        with CpuMeter(self.info.pid) as cpu:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)
        if not timed:
            return
        metrics = [o.metrics for o in outputs]
        start = min(m.arrival_time for m in metrics)
        first = max(m.first_token_time for m in metrics)
        last = max(m.last_token_time for m in metrics)
        self.prefill.append(first - start)
        self.decode.append((last - first) / max(1, self.args.output_len - 1))
        self.e2e.append(max(m.finished_time for m in metrics) - start)
        self.cpu_s.append(cpu.result.get("core_cpu_s", 0.0) + cpu.result["caller_cpu_s"])
        self.memory = process_memory_mib(self.info.pid)

    def result(self) -> dict[str, Any]:
        from tokenloom.bench.common import spec_decode_summary, step_profile

        out = {"backend": "tokenloom", "dtype": self.info.dtype, "quantization": self.info.quantization,
               "weight_bytes_per_token": self.info.weight_bytes_per_token, "memory": self.memory,
               **_summarize(self.prefill, self.decode, self.e2e, self.cpu_s)}
        if self.args.profile:
            out["profile"] = step_profile(self.recorder.stats)
        spec = spec_decode_summary(self.recorder.stats)
        if spec is not None:
            out["spec_decode"] = spec
        return out

    def shutdown(self) -> None:
        self.llm.shutdown()


class _HF:
    """transformers side, in this process, at the same batch size."""

    def __init__(self, args: argparse.Namespace) -> None:
        from tokenloom.bench.common import load_hf_model
        from tokenloom.model.loader import load_tokenizer

        self.args = args
        self.hf, dtype = load_hf_model(args.model, args.baseline_dtype, args.device)
        self.dtype = str(dtype).removeprefix("torch.")
        tokenizer = load_tokenizer(args.tokenizer or args.model, args.tokenizer_mode)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.e2e: list[float] = []
        self.cpu_s: list[float] = []

    def iteration(self, prompts: list[list[int]], timed: bool) -> None:
        import os

        from tokenloom.bench.common import CpuMeter, hf_generate

        with CpuMeter(os.getpid()) as cpu:
            res = hf_generate(self.hf, prompts, self.args.output_len, self.args.batch_size, self.pad, self.args.device)
        if not timed:
            return
        batch = res["batches"][0]
        steps = batch["decode_step_s"]
        self.prefill.append(batch["prefill_s"])
        self.decode.append(sum(steps) / max(1, len(steps)))
        self.e2e.append(res["elapsed_s"])
        self.cpu_s.append(cpu.result["caller_cpu_s"])

    def result(self) -> dict[str, Any]:
        return {"backend": "transformers", "dtype": self.dtype, **_summarize(self.prefill, self.decode, self.e2e, self.cpu_s)}


class _LlamaCpp:
    """llama.cpp side: a subprocess in its own environment, one prompt at a time."""

    def __init__(self, args: argparse.Namespace) -> None:
        from tokenloom.bench.llamacpp_baseline import LlamaCppBaseline

        self.args = args
        self.base = LlamaCppBaseline(args, n_ctx=args.input_len + args.output_len + 8)
        self.prefill: list[float] = []
        self.decode: list[float] = []
        self.e2e: list[float] = []
        self.cpu_s: list[float] = []
        self.memory: dict[str, float] = {}

    def iteration(self, prompts: list[list[int]], timed: bool) -> None:
        from tokenloom.bench.common import process_cpu_seconds

        cpu0 = process_cpu_seconds(self.base.proc.pid)
        run = self.base.run(prompts, self.args.output_len)[0]
        if timed:
            self.cpu_s.append(process_cpu_seconds(self.base.proc.pid) - cpu0)
            self.prefill.append(run["prefill_s"])
            self.decode.append(run["decode_s"] / max(1, self.args.output_len - 1))
            self.e2e.append(run["e2e_s"])
            self.memory = self.base.memory()

    def result(self) -> dict[str, Any]:
        return {**self.base.describe(), "memory": self.memory,
                **_summarize(self.prefill, self.decode, self.e2e, self.cpu_s)}

    def shutdown(self) -> None:
        self.base.close()


def run(args: argparse.Namespace) -> int:
    from tokenloom.bench.common import check_output_json, default_hf_dtype, emit, positive
    from tokenloom.model.hub import fetch_model_files

    for name in ("batch_size", "input_len", "output_len", "num_iters"):
        positive(name, getattr(args, name))
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}.")
    if args.baseline == "llamacpp" and not args.llamacpp_python:
        raise ValueError("--baseline llamacpp needs --llamacpp-python: the python of an environment with llama-cpp-python installed.")
    if args.baseline == "llamacpp" and args.batch_size != 1:
        raise ValueError("--baseline llamacpp runs one sequence at a time (llama-cpp-python): use --batch-size 1.")
    check_output_json(args.output_json)
    fetch_model_files(args)  # a hub id downloaded once: the prompts, the baselines and the engine read it
    args.baseline_dtype = args.baseline_dtype or default_hf_dtype(args.device)
    from tokenloom.bench.machine import Progress, machine_info

    batches = _iteration_prompts(args)
    result: dict[str, Any] = {
        "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
        "machine": machine_info(),
        "batch_size": args.batch_size,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "num_iters": args.num_iters,
        "warmup": args.warmup,
    }
    # Both engines stay loaded and the iterations alternate (ours, then the baseline's on the
    # same prompts), so a change in the machine's load hits both alike.
    progress = Progress()
    from tokenloom.bench.roofline import read_bandwidth

    progress.step("measuring the memory read bandwidth")
    result["read_bandwidth"] = read_bandwidth()
    progress.step("tokenloom: starting the engine")
    ours = _Ours(args)
    try:
        if args.baseline == "hf":
            progress.step(f"transformers ({args.baseline_dtype}): loading")
        elif args.baseline == "llamacpp":
            progress.step("llama.cpp: loading")
        hf = _HF(args) if args.baseline == "hf" else _LlamaCpp(args) if args.baseline == "llamacpp" else None
        try:
            for i, prompts in enumerate(batches):
                kind = "warm-up" if i < args.warmup else "timed"
                progress.step(f"iteration {i + 1}/{len(batches)} ({kind}): tokenloom")
                ours.iteration(prompts, timed=i >= args.warmup)
                if hf is not None:
                    progress.step(f"iteration {i + 1}/{len(batches)} ({kind}): {args.baseline}")
                    hf.iteration(prompts, timed=i >= args.warmup)
        finally:
            if isinstance(hf, _LlamaCpp):
                hf.shutdown()
    finally:
        ours.shutdown()
        progress.close()
    result["tokenloom"] = ours.result() | {"cpu_choice": ours.info.cpu,
                                           "kv_cache_dtype": ours.info.kv_cache_dtype}
    if hf is not None:
        result["baseline"] = hf.result()
    _add_rooflines(result, args)
    if hf is not None:
        ours, base = result["tokenloom"], result["baseline"]
        # > 1 means tokenloom is faster (the baseline takes that many times as long); no decode
        # figure with --output-len 1 (a prompt-processing run).
        for key, field in (("decode_per_token", "speedup_decode_per_token"), ("e2e", "speedup_e2e"),
                           ("prefill", "speedup_prefill"), ("cpu_per_iteration", "speedup_cpu")):
            if ours[key]["median_ms"] > 0 and base[key]["median_ms"] > 0:
                result[field] = base[key]["median_ms"] / ours[key]["median_ms"]
    return emit(result, args.json, _print_report, args.output_json)


def _add_rooflines(result: dict[str, Any], args: argparse.Namespace) -> None:
    """Each run that knows its weight bytes gets its decode step's roofline (bench/roofline.py):
    weights once a step, plus each sequence's KV at the mean decode context."""
    from tokenloom.bench.roofline import decode_roofline, kv_bytes_per_sequence
    from tokenloom.model.loader import load_model_config

    config = load_model_config(args.model)
    context = args.input_len + args.output_len // 2
    ceiling = result["read_bandwidth"]["bytes_per_s"]
    for key in ("tokenloom", "baseline"):
        run = result.get(key)
        if not run or not run.get("weight_bytes_per_token"):
            continue
        kv_dtype = run.get("kv_cache_dtype") or "float16"  # llama.cpp's default KV type
        kv = args.batch_size * kv_bytes_per_sequence(config, kv_dtype, context)
        run["roofline"] = decode_roofline(run["weight_bytes_per_token"], kv, args.batch_size,
                                          run["decode_per_token"]["median_ms"] / 1000, ceiling)


def _print_report(result: dict[str, Any]) -> None:
    from tokenloom.bench.common import format_profile, format_spec_decode, megabytes_cell, memory_cell, result_runs
    from tokenloom.bench.machine import format_machine

    print(f"{' tokenloom bench latency ':=^72}")
    print(f"model: {result['model']}")
    print(f"batch {result['batch_size']} x {result['input_len']} input tokens x {result['output_len']} output tokens; "
          f"{result['num_iters']} iterations after {result['warmup']} warm-up")
    print(format_machine(result["machine"]))
    print(f"tokenloom quantization: {result['tokenloom'].get('quantization') or 'none'}")
    runs = result_runs(result)
    print(f"{'':<28}" + "".join(f"{r['backend']:>22}" for r in runs))
    print(f"{'dtype':<28}" + "".join(f"{r['dtype'][:21]:>22}" for r in runs))
    if "weight_bytes_per_token" in result["tokenloom"]:
        print(f"{'weights read / token (MB)':<28}" + "".join(f"{megabytes_cell(r.get('weight_bytes_per_token')):>22}" for r in runs))
    if result["tokenloom"].get("memory"):
        print(f"{'resident memory (MiB)':<28}" + "".join(memory_cell(r, 'rss_mib', 22) for r in runs))
        print(f"{'peak resident (MiB)':<28}" + "".join(memory_cell(r, 'peak_rss_mib', 22) for r in runs))
    for key, label in (("prefill", "prefill"), ("decode_per_token", "decode per token"), ("e2e", "end to end"),
                       ("cpu_per_iteration", "CPU per iteration")):
        for stat in ("median_ms", "p90_ms"):
            name = f"{label} {stat.split('_')[0]} (ms)"
            print(f"{name:<28}" + "".join(f"{r[key][stat]:>22.2f}" for r in runs))
    if "read_bandwidth" in result:
        from tokenloom.bench.roofline import format_roofline

        bw = result["read_bandwidth"]
        print(f"memory read bandwidth (measured: {bw['threads']} threads over {bw['buffer_bytes'] >> 20} MiB): "
              f"{bw['bytes_per_s'] / 1e9:.1f} GB/s")
        for r in runs:
            if "roofline" in r:
                print(format_roofline(f"{r['backend']} decode (median)", r["roofline"]))
    if "baseline" in result:
        parts = [f"{label} {result[field]:.2f}x" for label, field in (
            ("decode per token", "speedup_decode_per_token"), ("prefill", "speedup_prefill"),
            ("end to end", "speedup_e2e"), ("CPU time per iteration", "speedup_cpu")) if field in result]
        print(f"speedup vs {result['baseline']['backend']} (median): " + ", ".join(parts))
    ours = result["tokenloom"]
    if ours.get("cpu_choice"):
        print(f"tokenloom CPU path: {ours['cpu_choice']}")
    for line in format_spec_decode(ours.get("spec_decode")):
        print(line)
    if "profile" in result["tokenloom"]:
        for line in format_profile(result["tokenloom"]["profile"], "tokenloom step profile"):
            print(line)
    print("=" * 72)
