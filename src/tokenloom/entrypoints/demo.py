"""`make run`: a short chat demo on the embedded SmolLM2-135M-Instruct."""
from __future__ import annotations

import time

from tokenloom import LLM, SamplingParams

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "Write a haiku about the sea.",
    "What is 12 plus 30?",
]


def main() -> None:
    t0 = time.perf_counter()
    with LLM() as llm:
        ready = time.perf_counter()
        params = SamplingParams(temperature=0.0, max_tokens=64)
        outputs = llm.chat([[{"role": "user", "content": q}] for q in QUESTIONS], params)
        done = time.perf_counter()
    for q, out in zip(QUESTIONS, outputs):
        print(f"\nQ: {q}\nA: {out.outputs[0].text.strip()}")
    n = sum(len(o.outputs[0].token_ids) for o in outputs)
    print(f"\n(engine ready in {ready - t0:.1f}s; {n} tokens generated in {done - ready:.1f}s)")


if __name__ == "__main__":
    main()
