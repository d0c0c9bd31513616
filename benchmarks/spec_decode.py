"""Speculative decoding (n-gram prompt lookup): the same engine with and without
`speculative_config`, side by side in one process, on answers that repeat text (code to edit or
repeat, lists to continue: where prompt lookup is meant to pay) and on ordinary chat answers
(where it finds little and should cost little). Greedy, so both engines must give the same
tokens (checked); the time ratio is the speed-up.

    .venv/bin/python benchmarks/spec_decode.py                       # the default GGUF path
    .venv/bin/python benchmarks/spec_decode.py --quantization none   # the float path
    .venv/bin/python benchmarks/spec_decode.py --batch-size 8 --num-speculative-tokens 2
    .venv/bin/python benchmarks/spec_decode.py --batch-size 8 --disable-by-batch-size 4

`--batch-size 1` sends one request at a time (a chat user's latency); larger batches run
`--batch-size` requests together. Rounds alternate between the engines.
"""
from __future__ import annotations

import argparse
import statistics
import time

CODE = ("def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
        "def mul(a, b):\n    return a * b\n\n\ndef div(a, b):\n    return a / b\n")
REPEATING = [
    "Repeat this code exactly, then stop:\n" + CODE,
    "Add type hints to every function of this code:\n" + CODE,
    "Write the numbers from 1 to 40, separated by commas.",
    "Rename the function sub to subtract in this code and show all of it:\n" + CODE,
    "List the days of the week, each on its own line, twice.",
    "Copy this JSON and add a field \"age\": 30 to it: {\"name\": \"Ada\", \"city\": \"London\", \"language\": \"Python\"}",
    "Convert this list to uppercase: apple, banana, cherry, date, elderberry, fig, grape",
    "Write a Python class Point with x and y, and methods add, sub and scale.",
]
CHAT = [
    "What is the capital of France?", "Write a haiku about the sea.", "How do airplanes fly?",
    "Give me a tip for learning to cook.", "What is photosynthesis?", "Describe a cat in one sentence.",
    "Why is the sky blue?", "Name three prime numbers and explain why they are prime.",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quantization", default="auto", help="auto: the GGUF's own weights (default); none: the float path")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--prompt-lookup-max", type=int, default=3)
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="speculative_config's: no drafts while this many requests run")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()

    from tokenloom import LLM, SamplingParams
    from tokenloom.bench.machine import format_machine, machine_info

    spec = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
            "prompt_lookup_max": args.prompt_lookup_max, "prompt_lookup_min": args.prompt_lookup_min,
            "disable_by_batch_size": args.disable_by_batch_size}
    quant = None if args.quantization == "none" else args.quantization
    engines = {"plain": LLM(quantization=quant, max_model_len=2048),
               "ngram": LLM(quantization=quant, max_model_len=2048, speculative_config=spec)}
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)

    def run(llm: LLM, questions: list[str]) -> tuple[list[list[int]], int]:
        outs = []
        for i in range(0, len(questions), args.batch_size):
            convs = [[{"role": "user", "content": q}] for q in questions[i:i + args.batch_size]]
            outs += [o.outputs[0].token_ids for o in llm.chat(convs, params, use_tqdm=False)]
        return outs, sum(len(o) for o in outs)

    def counters(llm: LLM) -> tuple[float, float, float]:
        m = {x.name.split(":")[1]: x.value for x in llm.get_metrics()
             if x.name.split(":")[1] in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens",
                                         "spec_decode_num_accepted_tokens")}
        return m["spec_decode_num_drafts"], m["spec_decode_num_draft_tokens"], m["spec_decode_num_accepted_tokens"]

    for llm in engines.values():
        run(llm, CHAT[:2])  # warm-up: kernels built, pages touched
    print(format_machine(machine_info()))
    print(f"quantization {args.quantization}, speculative_config {spec}, batch size {args.batch_size}, "
          f"greedy, max_tokens {args.max_tokens}; {args.rounds} alternating rounds")
    for workload, questions in (("repeating text", REPEATING), ("chat", CHAT)):
        times: dict[str, list[float]] = {name: [] for name in engines}
        tokens: dict[str, list[list[int]]] = {}
        before = counters(engines["ngram"])
        num_tokens = 0
        for _ in range(args.rounds):
            for name, llm in engines.items():
                llm.reset_prefix_cache()
                start = time.perf_counter()
                tokens[name], num_tokens = run(llm, questions)
                times[name].append(time.perf_counter() - start)
        after = counters(engines["ngram"])
        drafts, drafted, accepted = (a - b for a, b in zip(after, before))
        same = sum(a == b for a, b in zip(tokens["plain"], tokens["ngram"]))
        plain, ngram = statistics.median(times["plain"]), statistics.median(times["ngram"])
        print(f"{workload:>15}: {num_tokens} tokens; plain {num_tokens / plain:6.1f} tok/s, ngram "
              f"{num_tokens / ngram:6.1f} tok/s: {plain / ngram:.2f}x (rounds "
              f"{', '.join(f'{p / n:.2f}' for p, n in zip(times['plain'], times['ngram']))}); drafts in "
              f"{drafts / args.rounds:.0f} steps, {accepted / max(drafted, 1):.0%} of draft tokens accepted, "
              f"{accepted / max(drafts, 1):.2f} per draft; answers identical: {same} of {len(questions)}")
    for llm in engines.values():
        llm.shutdown()


if __name__ == "__main__":
    main()
