"""Beam search: tokenloom's `LLM.beam_search` against transformers' `generate(num_beams=...)`.

Both search the same way where no sequence ends (ignore_eos here, no EOS there: the same
sequences, tests/entrypoints/test_llm.py), so this times the same work. Chat prompts, float32,
alternating rounds in one process; tokenloom's engine core runs in its own process as usual:

    .venv/bin/python benchmarks/beam_search.py --num-prompts 8 --beam-width 4 --max-tokens 32 --rounds 2
    .venv/bin/python benchmarks/beam_search.py --quantization auto   # tokenloom's GGUF path (not the same logits)

transformers runs the prompts one at a time (its beam search pads a batch, which changes what a
left-padded prompt computes); tokenloom runs them together, each step's live beams one batch.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three prime numbers.",
             "How do airplanes fly?", "Give me a tip for learning to cook.", "What is photosynthesis?",
             "Describe a cat in one sentence.", "Why is the sky blue?"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--beam-width", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quantization", default="none", help="tokenloom's (none: the float path transformers computes)")
    args = p.parse_args()

    from tokenloom import LLM
    from tokenloom.bench.common import load_hf_model
    from tokenloom.bench.machine import format_machine, machine_info
    from tokenloom.model.loader import default_model_path
    from tokenloom.sampling_params import BeamSearchParams

    path = default_model_path()
    hf = load_hf_model(path, "float32", "cpu")[0]
    llm = LLM(dtype="float32", quantization=None if args.quantization == "none" else args.quantization,
              kv_cache_memory_bytes=256 * 1024**2, enable_ledger=False)
    tokenizer = llm.get_tokenizer()
    questions = (QUESTIONS * (args.num_prompts // len(QUESTIONS) + 1))[: args.num_prompts]
    prompts = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                              tokenize=False), add_special_tokens=False) for q in questions]
    params = BeamSearchParams(beam_width=args.beam_width, max_tokens=args.max_tokens, ignore_eos=True)

    def run_ours() -> list[list[list[int]]]:
        outs = llm.beam_search([{"prompt_token_ids": ids} for ids in prompts], params)
        return [[s.tokens[len(ids):] for s in o.sequences] for ids, o in zip(prompts, outs)]

    def run_hf() -> list[list[list[int]]]:
        found = []
        for ids in prompts:
            inp = torch.tensor([ids])
            with torch.inference_mode():
                seqs = hf.generate(inp, attention_mask=torch.ones_like(inp), num_beams=args.beam_width,
                                   num_return_sequences=args.beam_width, max_new_tokens=args.max_tokens, do_sample=False,
                                   early_stopping=False, eos_token_id=None, pad_token_id=2)
            found.append([s[len(ids):].tolist() for s in seqs])
        return found

    run_ours()  # warm-up: kernels built, caches touched
    times: dict[str, list[float]] = {"tokenloom": [], "transformers": []}
    same = None
    for _ in range(args.rounds):
        for name, fn in (("tokenloom", run_ours), ("transformers", run_hf)):
            llm.reset_prefix_cache()
            start = time.perf_counter()
            result = fn()
            times[name].append(time.perf_counter() - start)
            if name == "tokenloom":
                ours = result
            else:
                same = sum(a == b for a, b in zip(ours, result))
    llm.shutdown()
    print(format_machine(machine_info()))
    print(f"{args.num_prompts} chat prompts, beam_width {args.beam_width}, {args.max_tokens} tokens (ignore_eos), "
          f"tokenloom quantization {args.quantization}; {args.rounds} alternating rounds")
    for name, ts in times.items():
        print(f"{name:>13}: median {statistics.median(ts):.2f} s  (rounds {', '.join(f'{t:.2f}' for t in ts)})")
    print(f"ratio (transformers / tokenloom time): {statistics.median(times['transformers']) / statistics.median(times['tokenloom']):.2f}x; "
          f"prompts whose {args.beam_width} sequences are identical: {same} of {args.num_prompts}")


if __name__ == "__main__":
    main()
