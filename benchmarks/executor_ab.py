"""The default (uni-process) executor against a checkout without the executor layer, by CPU time.

Wall times on a shared 2-core machine measure the other processes more than the engine; the CPU
seconds the engine spends per output token do not. Each round runs the same offline batch
(`LLM(multiprocess=False)`: the engine core in the measuring process, one thread) once per source
tree, alternating, in a fresh process per run, and reports CPU ms per output token:

    python benchmarks/executor_ab.py --before /work/main/src --after src --rounds 2

(--before: a tree without the change; --after: this one; both on the same venv.)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

_CHILD = r"""
import json, sys, time
from tokenloom import LLM, SamplingParams
n, inp, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
llm = LLM(None, multiprocess=False, max_num_seqs=n)
import random
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(inp)]} for _ in range(n)]
params = SamplingParams(max_tokens=out, temperature=0, ignore_eos=True)
llm.generate(prompts[:4], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), use_tqdm=False)
c0, w0 = time.process_time(), time.perf_counter()
outs = llm.generate(prompts, params, use_tqdm=False)
c1, w1 = time.process_time(), time.perf_counter()
tokens = sum(len(o.outputs[0].token_ids) for o in outs)
print(json.dumps({"cpu_ms_per_token": (c1 - c0) * 1e3 / tokens, "wall_s": w1 - w0, "tokens": tokens}))
"""


def run(tree: str, args: argparse.Namespace) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree), TOKENLOOM_NUM_THREADS="1")
    res = subprocess.run([sys.executable, "-c", _CHILD, str(args.num_prompts), str(args.input_len),
                          str(args.output_len)], env=env, capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    got: dict[str, list[float]] = {"before": [], "after": []}
    for r in range(args.rounds):
        for name in ("before", "after") if r % 2 == 0 else ("after", "before"):
            res = run(getattr(args, name), args)
            got[name].append(res["cpu_ms_per_token"])
            print(f"round {r + 1} {name:>6}: {res['cpu_ms_per_token']:.3f} CPU ms / output token "
                  f"({res['tokens']} tokens, {res['wall_s']:.1f} s wall)", flush=True)
    b, a = statistics.median(got["before"]), statistics.median(got["after"])
    print(f"median CPU ms / output token: before {b:.3f}, after {a:.3f}, after/before {a / b:.3f}")


if __name__ == "__main__":
    main()
