"""What structured outputs cost: 64 requests constrained by a JSON schema against the same 64
unconstrained, in one run, and the first request of a new schema waiting for its grammar.

    nice -n 19 .venv/bin/python benchmarks/structured_outputs.py [--num-prompts 64 --input-len 128
                                                                 --output-len 64 --rounds 1]

Both settings compute exactly the same tokens: greedy, the same prompts (random ordinary token
ids), `output_len` tokens each. The unconstrained requests ignore EOS; the constrained ones follow
a schema whose string field needs more characters than `output_len` tokens can hold, so every
one runs to max_tokens too (and reports `length`, honestly, for its incomplete JSON). What differs
is only the grammar's work per step: the scheduler fills a bitmask row per request (xgrammar, one
batched call), the sampler applies it to the logits, and each matcher accepts its token. Runs
alternate A B B A per round so a drift in the machine's load hits both; the ratio of medians
(structured / unconstrained throughput) is reported. Target: >= 0.85.

The ledger part: a request with a schema the engine has not seen waits while its grammar
compiles (`queue_grammar_compile`, off the busy loop); a second request with the same schema
finds it cached and does not wait.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 9999},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "story": {"type": "string", "minLength": 4000},
    },
    "required": ["id", "tags", "story"],
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=1)
    args = p.parse_args()

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from tokenloom import LLM, SamplingParams
    from tokenloom.bench.common import CpuMeter, random_prompt_ids
    from tokenloom.bench.machine import format_machine, machine_info
    from tokenloom.messages import LedgerBucket
    from tokenloom.sampling_params import StructuredOutputsParams

    print(format_machine(machine_info()), flush=True)
    llm = LLM(max_num_seqs=max(args.num_prompts, 16))
    info = llm.llm_engine.engine_core.info
    prompts = random_prompt_ids(llm.get_tokenizer(), info.vocab_size, args.num_prompts + 2, args.input_len, seed=0)
    settings = {
        "free": SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
        "json": SamplingParams(temperature=0.0, max_tokens=args.output_len,
                               structured_outputs=StructuredOutputsParams(json=SCHEMA)),
    }

    # The ledger: the first request of this schema waits for its compilation (and, if the engine
    # has only just started, for the vocabulary xgrammar reads once at start-up on the compile
    # thread); the second finds it cached; the third brings another new schema.
    first = llm.generate(prompts[-1:], settings["json"], use_tqdm=False)[0]
    second = llm.generate(prompts[-2:-1], settings["json"], use_tqdm=False)[0]
    other = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=StructuredOutputsParams(
        json={**SCHEMA, "properties": {**SCHEMA["properties"], "extra": {"type": "boolean"}}}))
    third = llm.generate(prompts[-1:], other, use_tqdm=False)[0]
    for name, out in (("first request of a new schema", first),
                      ("second request, same schema", second), ("first request of another schema", third)):
        wait = out.metrics.core.seconds[LedgerBucket.GRAMMAR_COMPILE]
        print(f"ledger: {name}: queue_grammar_compile {wait * 1e3:.1f} ms "
              f"(parts: {out.metrics.parts.get('queue_grammar_compile', 0.0) * 1e3:.1f} ms)", flush=True)
    llm.generate(prompts[-2:], settings["free"], use_tqdm=False)  # warm the unconstrained path too

    runs: dict[str, list[dict[str, float]]] = {"free": [], "json": []}
    num_tokens = args.num_prompts * args.output_len
    for round_ in range(args.rounds):
        for name in ("free", "json", "json", "free"):
            assert llm.llm_engine.engine_core.call_utility("reset_prefix_cache")
            with CpuMeter(info.pid) as meter:
                outputs = llm.generate(prompts[: args.num_prompts], settings[name], use_tqdm=False)
            assert all(len(o.outputs[0].token_ids) == args.output_len for o in outputs)
            if name == "json":
                assert all(o.outputs[0].finish_reason == "length" for o in outputs)
            r = meter.result
            runs[name].append(r)
            print(f"round {round_} {name:>4}: {r['wall_s']:7.2f} s wall ({num_tokens / r['wall_s']:6.1f} output tok/s), "
                  f"core {r.get('core_cpu_s', 0.0):6.2f} CPU s", flush=True)

    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in runs[name])

    ratio = median("free", "wall_s") / median("json", "wall_s")
    cpu_ratio = median("free", "core_cpu_s") / median("json", "core_cpu_s")
    print(f"structured / unconstrained throughput: {ratio:.3f} (wall), {cpu_ratio:.3f} (engine-core CPU); "
          f"target >= 0.85", flush=True)
    llm.shutdown()
    return 0 if ratio >= 0.85 else 1


if __name__ == "__main__":
    sys.exit(main())
