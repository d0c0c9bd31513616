"""The long fuzz run of issue 21: hypothesis draws SamplingParams at the edges of what is accepted
(tests/reliability/sampling_fuzz.py) and runs every accepted one through a real engine (the
in-process core, the embedded SmolLM2-135M), counting each outcome. An exception out of the engine
core (or a dead core) fails the run; a request failed alone (finish_reason "error") is counted.

    PYTHONPATH=src python benchmarks/fuzz_sampling_params.py --examples 2000

Accepted params are run in batches of --batch requests (one `generate` call each), next to the
ordinary requests they share steps with, so that 2,000 examples take minutes, not an hour. If a
batch raises, each of its params is run alone to name the culprit.
"""
from __future__ import annotations

import argparse
import collections
import json
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "reliability"))

from hypothesis import HealthCheck, given, settings  # noqa: E402
from sampling_fuzz import sampling_kwargs  # noqa: E402

from tokenloom import LLM  # noqa: E402
from tokenloom.messages import now  # noqa: E402
from tokenloom.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["The capital of France is", "Hello", "1, 2, 3,", "def f(x):"]


def cpu_model() -> str:
    """lscpu's model name with the ISA flags that matter for the CPU kernels."""
    name, flags = platform.processor(), set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            name = line.split(":", 1)[1].strip()
        elif line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
    isa = [f for f in ("avx2", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "amx_tile") if f in flags]
    return f"{name} ({' '.join(isa)})"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--examples", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=21)
    args = ap.parse_args()

    llm = LLM(multiprocess=False, max_model_len=256, num_kv_blocks=512, max_num_seqs=128, enable_ledger=False)
    processor = llm.llm_engine.input_processor
    counts: collections.Counter[str] = collections.Counter()
    pending: list[tuple[str, SamplingParams, dict]] = []
    failures: list[dict] = []

    def run(batch: list[tuple[str, SamplingParams, dict]]) -> None:
        outs = llm.generate([p for p, _, _ in batch], [s for _, s, _ in batch], use_tqdm=False)
        for out, (_, _, kwargs) in zip(outs, batch):
            for c in out.outputs:
                counts[f"finished: {c.finish_reason}"] += 1
                if c.finish_reason == "error":
                    failures.append({"kwargs": repr(kwargs), "error": out.error})

    def flush() -> None:
        batch = list(pending)
        pending.clear()
        try:
            run(batch)
        except Exception:
            counts["engine core raised"] += 1
            for item in batch:  # name the culprit
                try:
                    run([item])
                except Exception as e:  # noqa: BLE001 - recorded
                    failures.append({"kwargs": repr(item[2]), "raised": repr(e)})
            raise

    @settings(max_examples=args.examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(kwargs=sampling_kwargs())
    def fuzz(kwargs: dict) -> None:
        counts["examples"] += 1
        try:
            params = SamplingParams(**kwargs)
        except ValueError:
            counts["refused by SamplingParams"] += 1
            return
        prompt = PROMPTS[counts["examples"] % len(PROMPTS)]
        try:
            processor.process("probe", prompt, params, now())
        except ValueError:
            counts["refused by the input processor"] += 1
            return
        counts["accepted"] += 1
        pending.append((prompt, params, kwargs))
        if len(pending) >= args.batch:
            flush()

    t0 = time.perf_counter()
    ok = True
    try:
        fuzz()
        if pending:
            flush()
    except Exception as e:  # noqa: BLE001 - reported below
        ok = False
        print(f"FAILED: {e!r}")
    finally:
        llm.shutdown()
    elapsed = time.perf_counter() - t0
    print(json.dumps({"cpu": cpu_model(), "seconds": round(elapsed, 1), "counts": dict(sorted(counts.items())),
                      "failures": failures[:20]}, indent=2))  # fmt: skip
    return 0 if ok and not failures else 1


if __name__ == "__main__":
    raise SystemExit(main())
