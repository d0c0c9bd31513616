"""What the ledger costs: the offline throughput workload with the ledger on and off.

    .venv/bin/python benchmarks/ledger_cost.py [--num-prompts 64 --input-len 128 --output-len 64 --rounds 3]

Two engines are built side by side (one with `enable_ledger=True`, one with `False`; an idle
engine core blocks and costs nothing) and the same workload (random prompt token ids, greedy,
ignore_eos) runs on them alternately, A B B A per round, so drift in the machine's load hits both
alike. Reported: each run's time and throughput, and the ratio of the median times (on / off);
the target is below 1.02. Besides wall time, the CPU seconds of the caller and the engine-core
process are compared: on a shared machine they move much less with the load of others.

A second, model-free measurement isolates the ledger's own work: the same workload through the
scheduler with a fake model runner, with and without the core ledger (and the caller's
bookkeeping: RequestMetrics stamps, decomposition, Prometheus observations), in microseconds per
step. Divided by a real step's time it says what the ratio should be without noise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path


def run_engine_benchmark(args: argparse.Namespace) -> dict:
    from tokenloom import LLM, SamplingParams
    from tokenloom.entrypoints.bench.common import CpuMeter, random_prompt_ids

    common = dict(kv_cache_memory_bytes=args.kv_cache_memory_bytes, multiprocess=not args.inprocess)
    engines = {"on": LLM(enable_ledger=True, **common), "off": LLM(enable_ledger=False, **common)}
    try:
        on = engines["on"]
        # The workload of `tokenloom bench throughput`: ordinary token ids, exact lengths.
        prompts = random_prompt_ids(
            on.get_tokenizer(), on.llm_engine.engine_core.info.vocab_size, args.num_prompts + 2, args.input_len, seed=0
        )
        warmup, prompts = prompts[:2], prompts[2:]
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
        for llm in engines.values():  # first-step allocations, lazy imports
            llm.generate(warmup, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
        num_tokens = args.num_prompts * (args.input_len + args.output_len)
        for round_ in range(args.rounds):
            for name in ("on", "off", "off", "on"):
                llm = engines[name]
                with CpuMeter(llm.llm_engine.engine_core.info.pid) as meter:
                    outputs = llm.generate(prompts, params, use_tqdm=False)
                assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
                r = meter.result
                r["cpu_s"] = r["caller_cpu_s"] + r.get("core_cpu_s", 0.0)
                runs[name].append(r)
                print(
                    f"round {round_} ledger {name:>3}: {r['wall_s']:7.2f} s wall ({num_tokens / r['wall_s']:7.1f} tok/s), "
                    f"{r['cpu_s']:7.2f} CPU s (caller {r['caller_cpu_s']:.2f}, core {r.get('core_cpu_s', 0.0):.2f})",
                    flush=True,
                )
    finally:
        for llm in engines.values():
            llm.shutdown()

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    return {
        "runs": runs,
        "wall_ratio": median("on", "wall_s") / median("off", "wall_s"),
        "cpu_ratio": median("on", "cpu_s") / median("off", "cpu_s"),
        "median_wall_off": median("off", "wall_s"),
    }


def run_micro_benchmark(args: argparse.Namespace) -> dict:
    """The same workload through the scheduler alone (a fake runner), timing only the ledger's
    work around it: the core ledger's two hooks per step, and the caller's side of each message
    (token stamps; for each finished request its decomposition and Prometheus observations)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "core"))
    from sched_helpers import fake_runner_output, make_request, make_scheduler

    from tokenloom.messages import now
    from tokenloom.metrics.core_ledger import CoreLedger
    from tokenloom.metrics.prometheus import PrometheusMetrics
    from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def one_run() -> tuple[float, int]:
        s = make_scheduler(
            num_blocks=4096, block_size=16, max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096
        )
        ledger, caller = CoreLedger(), PrometheusMetrics("bench")
        metrics: dict[str, RequestMetrics] = {}
        for i in range(args.num_prompts):
            r = make_request(f"r{i}", args.input_len, max_tokens=args.output_len, ignore_eos=True)
            s.add_request(r)
            metrics[r.request_id] = RequestMetrics(now(), tokenized_time=now())
            ledger.add(r.request_id, now(), now(), now())
        elapsed, steps = 0.0, 0
        while s.has_unfinished_requests():
            so = s.schedule()
            t0 = time.perf_counter()
            ledger.on_schedule(so, s.requests, now())
            elapsed += time.perf_counter() - t0
            outputs = s.update_from_output(so, fake_runner_output(s, so))
            t0 = time.perf_counter()
            t = now()
            ledger.on_update(outputs.outputs, t)
            for out in outputs.outputs:
                m = metrics[out.request_id]
                m.record_tokens(len(out.new_token_ids), t)
                if out.timing is not None:
                    m.core = out.timing
                    m.finished_time = m.detokenized_time = m.returned_time = now()
                    done = CompletionOutput(0, "", [], None, None, "length")
                    caller.record_request_output(RequestOutput(out.request_id, None, None, None, [done], True, m))
            caller.record_scheduler_stats(outputs.scheduler_stats)  # type: ignore[arg-type]
            elapsed += time.perf_counter() - t0
            steps += 1
        return elapsed, steps

    elapsed, steps = min(one_run() for _ in range(3))
    return {"ledger_us_per_step": elapsed / steps * 1e6, "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3, help="rounds of on, off, off, on")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--inprocess", action="store_true", help="run the engine cores in this process")
    p.add_argument("--micro-only", action="store_true", help="only the model-free measurement")
    args = p.parse_args()

    micro = run_micro_benchmark(args)
    print(f"ledger's own work: {micro['ledger_us_per_step']:.0f} us per step over {micro['steps']} steps "
          f"({args.num_prompts} requests, model-free)", flush=True)
    if args.micro_only:
        return
    result = run_engine_benchmark(args)
    mean_step = result["median_wall_off"] / micro["steps"]
    print(f"cost ratio (ledger on / off, medians): wall {result['wall_ratio']:.4f}, CPU seconds {result['cpu_ratio']:.4f}")
    print(f"expected from the model-free measurement: {1 + micro['ledger_us_per_step'] * 1e-6 / mean_step:.4f} "
          f"(ledger {micro['ledger_us_per_step']:.0f} us per ~{mean_step * 1e3:.0f} ms step)")


if __name__ == "__main__":
    main()
