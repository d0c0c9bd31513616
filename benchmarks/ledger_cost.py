"""What the ledger costs: the offline throughput workload with the ledger on and off.

    .venv/bin/python benchmarks/ledger_cost.py [--num-prompts 64 --input-len 128 --output-len 64]
                                               [--rounds 1] [--inprocess]

The workload is `tokenloom bench throughput`'s: random ordinary token ids, greedy, ignore_eos,
one `generate()` over all prompts per run. Runs alternate A B B A within a round, so a drift in
the machine's load hits both settings alike, and the ratio of the medians (on / off) is reported
for wall time and for CPU seconds (caller + engine-core process), which move much less with
other people's load on a shared machine. Target: below 1.02.

Two ways to get the two settings, because an engine's identity matters here: with identical
settings, the engine built first in a process measured 5-7% slower than the one built second
(an A/A run), which a naive on-vs-off comparison would book to the ledger.
- default (multiprocess): two sessions, one building the engines in the order (on, off) and one
  in the order (off, on); the geometric mean of the sessions' ratios cancels the order effect.
- `--inprocess`: one engine (core in this process), the ledger switched on and off between runs
  by swapping its two halves in and out; the same engine, the same memory, the cleanest A/B.

A model-free measurement comes first: the same workload through the scheduler with a fake
model runner, timing only the ledger's own work (the core ledger's hooks, and the caller's side:
token stamps, decomposition, Prometheus observations), in microseconds per step. Divided by a
real step's time it says what the ratio should be without noise.
"""
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _abba(args: argparse.Namespace, run_once: Callable[[str], dict[str, float]], label: str) -> dict[str, Any]:
    runs: dict[str, list[dict[str, float]]] = {"on": [], "off": []}
    num_tokens = args.num_prompts * (args.input_len + args.output_len)
    for round_ in range(args.rounds):
        for name in ("on", "off", "off", "on"):
            r = run_once(name)
            runs[name].append(r)
            print(
                f"{label} round {round_} ledger {name:>3}: {r['wall_s']:7.2f} s wall "
                f"({num_tokens / r['wall_s']:6.1f} tok/s), {r['cpu_s']:7.2f} CPU s",
                flush=True,
            )

    def ratio(key: str) -> float:
        return statistics.median(r[key] for r in runs["on"]) / statistics.median(r[key] for r in runs["off"])

    result = {"wall_ratio": ratio("wall_s"), "cpu_ratio": ratio("cpu_s"),
              "median_wall_off": statistics.median(r["wall_s"] for r in runs["off"])}
    print(f"{label}: on / off = {result['wall_ratio']:.4f} wall, {result['cpu_ratio']:.4f} CPU", flush=True)
    return result


def run_engine_benchmark(args: argparse.Namespace) -> dict[str, Any]:
    from tokenloom import LLM, SamplingParams
    from tokenloom.bench.common import CpuMeter, random_prompt_ids

    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0.0)
    common = dict(kv_cache_memory_bytes=args.kv_cache_memory_bytes, multiprocess=not args.inprocess)
    prompts: list[list[int]] = []

    def prepare(llm: Any) -> None:
        if not prompts:
            info = llm.llm_engine.engine_core.info
            prompts.extend(random_prompt_ids(llm.get_tokenizer(), info.vocab_size, args.num_prompts + 2,
                                             args.input_len, seed=0))
        # First-step allocations and lazy imports, on prompts the timed runs do not use.
        llm.generate(prompts[-2:], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)

    def timed(llm: Any) -> dict[str, float]:
        # Every run computes every prompt: nothing from the previous run is left in the cache.
        assert llm.llm_engine.engine_core.call_utility("reset_prefix_cache")
        with CpuMeter(llm.llm_engine.engine_core.info.pid) as meter:
            outputs = llm.generate(prompts[: args.num_prompts], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
        r = meter.result
        r["cpu_s"] = r["caller_cpu_s"] + r.get("core_cpu_s", 0.0)
        return r

    if args.inprocess:
        llm = LLM(enable_ledger=True, **common)
        try:
            engine = llm.llm_engine
            core = engine.engine_core.engine_core  # the in-process client's EngineCore
            # The ledger's parts in the core and in the caller, and the core's per-step CPU and
            # contention meter (ops/schedstat.py), which only runs with the ledger on.
            halves = (core.ledger, engine.ledger, core.cpu_meter)
            prepare(llm)

            accounts = engine.output_processor.accounts

            def run_once(name: str) -> dict[str, float]:
                core.ledger, engine.ledger, core.cpu_meter = halves if name == "on" else (None, None, None)
                # With the ledger off the core sends no timing, so no final output may wait for
                # one (engine/accounts.py); without this the caller waits forever.
                accounts.expect_timing = name == "on"
                return timed(llm)

            result = _abba(args, run_once, "in-process")
        finally:
            llm.shutdown()
        return {"sessions": [result], **result}

    sessions = []
    for order in (("on", "off"), ("off", "on")):
        engines = {name: LLM(enable_ledger=name == "on", **common) for name in order}
        try:
            for llm in engines.values():
                prepare(llm)
            sessions.append(_abba(args, lambda name: timed(engines[name]), f"built {order[0]} first"))
        finally:
            for llm in engines.values():
                llm.shutdown()

    def gmean(key: str) -> float:
        return math.sqrt(sessions[0][key] * sessions[1][key])

    return {"sessions": sessions, "wall_ratio": gmean("wall_ratio"), "cpu_ratio": gmean("cpu_ratio"),
            "median_wall_off": statistics.median(s["median_wall_off"] for s in sessions)}


def run_micro_benchmark(args: argparse.Namespace) -> dict:
    """The same workload through the scheduler alone (a fake runner), timing only the ledger's
    work around it: the core ledger's two hooks per step, and the caller's side of each message
    (token stamps; for each finished request its decomposition and Prometheus observations)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "core"))
    from sched_helpers import fake_runner_output, make_request, make_scheduler

    from tokenloom.messages import now
    from tokenloom.metrics.core_ledger import CoreLedger
    from tokenloom.metrics.live import LIVE_MAX_REQUESTS, LIVE_MAX_STEPS
    from tokenloom.metrics.prometheus import PrometheusMetrics
    from tokenloom.metrics.trace import TraceRecorder
    from tokenloom.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def one_run() -> tuple[float, int]:
        s = make_scheduler(
            num_blocks=4096, block_size=16, max_num_batched_tokens=2048, max_num_seqs=128, max_model_len=4096
        )
        ledger, caller = CoreLedger(), PrometheusMetrics("bench")
        # A server also keeps the recent past for its live view (`GET /ledger`).
        recent = TraceRecorder(None, {}, LIVE_MAX_STEPS, LIVE_MAX_REQUESTS) if args.live else None
        metrics: dict[str, RequestMetrics] = {}
        for i in range(args.num_prompts):
            r = make_request(f"r{i}", args.input_len, max_tokens=args.output_len, ignore_eos=True)
            s.add_request(r)
            metrics[r.request_id] = RequestMetrics(now(), tokenized_time=now())
            ledger.add(r.request_id, now(), now(), now())
        core_s, caller_s, steps = 0.0, 0.0, 0
        while s.has_unfinished_requests():
            so = s.schedule()
            t0 = time.perf_counter()
            ledger.on_schedule(so, now())
            core_s += time.perf_counter() - t0
            outputs = s.update_from_output(so, fake_runner_output(s, so))
            t0 = time.perf_counter()
            t = now()
            ledger.on_update(outputs.outputs, t)
            t1 = time.perf_counter()
            core_s += t1 - t0
            for out in outputs.outputs:
                m = metrics[out.request_id]
                m.record_tokens(len(out.new_token_ids), t)
                if out.timing is not None:
                    m.core = out.timing
                    m.finished_time = m.detokenized_time = m.returned_time = now()
                    done = CompletionOutput(0, "", [], None, None, "length")
                    finished = RequestOutput(out.request_id, None, None, None, [done], True, m)
                    caller.record_request_output(finished)
                    if recent is not None:
                        recent.record_request(finished)
            caller.record_scheduler_stats(outputs.scheduler_stats)  # type: ignore[arg-type]
            if recent is not None:
                recent.record_step(outputs)
            caller_s += time.perf_counter() - t1
            steps += 1
        return core_s, caller_s, steps

    core_s, caller_s, steps = min((one_run() for _ in range(3)), key=lambda r: r[0] + r[1])
    return {"ledger_us_per_step": (core_s + caller_s) / steps * 1e6, "core_us_per_step": core_s / steps * 1e6,
            "caller_us_per_step": caller_s / steps * 1e6, "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1, help="rounds of on, off, off, on (per session)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=1 << 30)
    p.add_argument("--inprocess", action="store_true", help="one engine in this process, the ledger toggled")
    p.add_argument("--micro-only", action="store_true", help="only the model-free measurement")
    p.add_argument("--live", action="store_true",
                   help="model-free measurement with the server's live-view recorder (GET /ledger) too")
    args = p.parse_args()

    micro = run_micro_benchmark(args)
    print(f"ledger's own work: {micro['ledger_us_per_step']:.0f} us per step over {micro['steps']} steps "
          f"({args.num_prompts} requests, model-free): {micro['core_us_per_step']:.0f} us in the engine core "
          f"(on the step's path), {micro['caller_us_per_step']:.0f} us in the caller (which overlaps the core's "
          "steps in the multiprocess engine)", flush=True)
    if args.micro_only:
        return
    result = run_engine_benchmark(args)
    step_s = result["median_wall_off"] / micro["steps"]
    print(f"cost ratio (ledger on / off): wall {result['wall_ratio']:.4f}, CPU seconds {result['cpu_ratio']:.4f}")
    print(f"expected from the model-free measurement: {1 + micro['ledger_us_per_step'] * 1e-6 / step_s:.4f} "
          f"(ledger {micro['ledger_us_per_step']:.0f} us per ~{step_s * 1e3:.0f} ms step)")


if __name__ == "__main__":
    main()
