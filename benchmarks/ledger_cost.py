"""What the ledger costs: the offline throughput workload with the ledger on and off.

    .venv/bin/python benchmarks/ledger_cost.py [--num-prompts 64 --input-len 128 --output-len 64 --rounds 3]

Two engines are built side by side (one with `enable_ledger=True`, one with `False`; an idle
engine core blocks and costs nothing) and the same workload (random prompt token ids, greedy,
ignore_eos) runs on them alternately, A B B A per round, so drift in the machine's load hits both
alike. Reported: each run's time and throughput, and the ratio of the median times (on / off);
the target is below 1.02.

A second, model-free measurement isolates the ledger's own work: the same workload through the
scheduler with a fake model runner, with and without the core ledger (and the caller's
bookkeeping: RequestMetrics stamps, decomposition, Prometheus observations), in microseconds per
step. Divided by a real step's time it says what the ratio should be without noise.
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path


def run_engine_benchmark(args: argparse.Namespace) -> dict:
    from tokenloom import LLM, SamplingParams

    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    common = dict(kv_cache_memory_bytes=args.kv_cache_memory_bytes, multiprocess=not args.inprocess)
    engines = {"on": LLM(enable_ledger=True, **common), "off": LLM(enable_ledger=False, **common)}
    try:
        for llm in engines.values():  # warm-up: first-step allocations, lazy imports
            llm.generate(prompts[:2], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        times: dict[str, list[float]] = {"on": [], "off": []}
        num_tokens = args.num_prompts * (args.input_len + args.output_len)
        for round_ in range(args.rounds):
            for name in ("on", "off", "off", "on"):
                t0 = time.perf_counter()
                outputs = engines[name].generate(prompts, params, use_tqdm=False)
                elapsed = time.perf_counter() - t0
                assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
                times[name].append(elapsed)
                print(f"round {round_} ledger {name:>3}: {elapsed:7.2f} s  {num_tokens / elapsed:8.1f} tok/s", flush=True)
    finally:
        for llm in engines.values():
            llm.shutdown()
    ratio = statistics.median(times["on"]) / statistics.median(times["off"])
    pairs = [a / b for a, b in zip(times["on"], times["off"])]
    return {"times": times, "ratio": ratio, "pair_ratios": pairs}


def run_micro_benchmark(args: argparse.Namespace) -> dict:
    """The same workload through the scheduler alone (a fake runner), ledger on vs off."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "core"))
    from sched_helpers import fake_runner_output, make_request, make_scheduler

    from tokenloom.messages import EngineCoreOutputs, now
    from tokenloom.metrics.core_ledger import CoreLedger
    from tokenloom.metrics.stats import LedgerMetrics
    from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from prometheus_client import CollectorRegistry

    def one_run(with_ledger: bool) -> tuple[float, int]:
        s = make_scheduler(
            num_blocks=4096, block_size=16, max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096
        )
        ledger = CoreLedger() if with_ledger else None
        caller = LedgerMetrics(CollectorRegistry()) if with_ledger else None
        metrics: dict[str, RequestMetrics] = {}
        for i in range(args.num_prompts):
            r = make_request(f"r{i}", args.input_len, max_tokens=args.output_len, ignore_eos=True)
            s.add_request(r)
            metrics[r.request_id] = RequestMetrics(now(), tokenized_time=now())
            if ledger is not None:
                ledger.add(r.request_id, now(), now(), now())
        elapsed, steps = 0.0, 0
        while s.has_unfinished_requests():
            so = s.schedule()
            runner_output = fake_runner_output(s, so)
            # Only the ledger's own work is timed, around the untimed scheduler.
            t0 = time.perf_counter()
            if ledger is not None:
                ledger.on_schedule(so, s.requests, now())
            elapsed += time.perf_counter() - t0
            outputs: EngineCoreOutputs = s.update_from_output(so, runner_output)
            t0 = time.perf_counter()
            if ledger is not None:
                t = now()
                outputs.timestamp = t
                ledger.on_update(outputs.outputs, t)
                for out in outputs.outputs:  # the caller's side of the same message
                    m = metrics[out.request_id]
                    m.record_tokens(len(out.new_token_ids), t)
                    if out.timing is not None:
                        m.core = out.timing
                        m.finished_time = m.detokenized_time = m.returned_time = now()
                        caller.record_finished(RequestOutput(out.request_id, None, None, None, [CompletionOutput(0, "", [], None, None, "length")], True, m))  # type: ignore[union-attr]
                caller.record_scheduler_stats(outputs.scheduler_stats)  # type: ignore[union-attr, arg-type]
            elapsed += time.perf_counter() - t0
            steps += 1
        return elapsed, steps

    on, steps = min((one_run(True) for _ in range(3)), key=lambda x: x[0])
    return {"ledger_us_per_step": on / steps * 1e6, "steps": steps}


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
    on, off = result["times"]["on"], result["times"]["off"]
    mean_step = statistics.median(off) / micro["steps"]
    print(f"median time: ledger on {statistics.median(on):.2f} s, off {statistics.median(off):.2f} s")
    print(f"cost ratio (on / off, medians): {result['ratio']:.4f}   per pair: "
          + ", ".join(f"{r:.3f}" for r in result["pair_ratios"]))
    print(f"expected from the model-free measurement: {1 + micro['ledger_us_per_step'] * 1e-6 / mean_step:.4f} "
          f"(ledger {micro['ledger_us_per_step']:.0f} us per ~{mean_step * 1e3:.0f} ms step)")


if __name__ == "__main__":
    main()
