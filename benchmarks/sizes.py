"""Issue 52's rows on one model shape, side by side, in one command: the speed at the sizes people
run (a Llama-3.2-1B- or Llama-3.1-8B-shaped Q4_K_M file from `benchmarks/gguf_shapes.py`, or
issue 50's Qwen3-30B-A3B-shaped mixture of experts, `qwen3-30b-a3b-12l`).

    python benchmarks/sizes.py --gguf /tmp/speed/shapes/llama-3.2-1b-Q4_K_M.gguf \
        --llamacpp-python /tmp/llamacpp-venv/bin/python \
        [--vllm-python /tmp/vllm-venv/bin/python] \
        [--rows batch1,prefill512,concurrent16,batch64] [--num-iters 3] [--out-dir DIR] \
        [--output-len 128] [--warmup 1]

`--output-len` (batch1, concurrent16) and `--warmup` shorten development runs on a busy machine;
the issue's figures are the defaults.

Each row is one `tokenloom bench` command (printed before it runs, its JSON kept in --out-dir),
with the baseline loaded beside tokenloom and their timed runs alternating:

- batch1: `bench latency`, 1 x 128 in x 128 out against llama.cpp on the same file: decode
  tokens/s (after the first token), end to end, the roofline fraction, resident memory and its
  peak (summed over each engine's processes);
- prefill512: `bench latency`, 512 prompt tokens, one output token: prompt tokens/s;
- concurrent16: `bench throughput`, 16 x 128 x 128 against llama.cpp's batch API (16 sequences);
- batch64: `bench throughput`, 64 x 128 x 128, tokenloom's default path on the GGUF against
  vLLM's CPU build at its best dtype on the same weights (the bench exports the GGUF once as a
  float32 Hugging Face directory, since vLLM's CPU backend runs no K-quant GGUF).

The summary table ends with the issue's target for each row. Figures go to
benchmarks/README.md (via results.json) with the machine line this prints.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from typing import Any

ROWS = ("batch1", "prefill512", "concurrent16", "batch64")


def _tokenloom() -> list[str]:
    return [sys.executable, "-m", "tokenloom.entrypoints.cli"]


def _commands(a: argparse.Namespace) -> dict[str, list[str]]:
    lc = ["--baseline", "llamacpp", "--llamacpp-python", a.llamacpp_python]
    iters = ["--num-iters", str(a.num_iters)]
    warm = ["--warmup", str(a.warmup)]
    out = str(a.output_len)
    cmds = {
        "batch1": ["bench", "latency", "--model", a.gguf, "--input-len", "128", "--output-len", out,
                   *iters, *warm, *lc],
        "prefill512": ["bench", "latency", "--model", a.gguf, "--input-len", "512", "--output-len", "1",
                       *iters, *warm, *lc],
        "concurrent16": ["bench", "throughput", "--model", a.gguf, "--num-prompts", "16",
                         "--input-len", "128", "--output-len", out, *iters, *lc],
    }
    if a.vllm_python:
        cmds["batch64"] = ["bench", "throughput", "--model", a.gguf, "--num-prompts", "64",
                           "--input-len", "128", "--output-len", "128", *iters, "--baseline", "vllm",
                           "--vllm-python", a.vllm_python, "--baseline-dtype", "best"]
    return cmds


def _run(name: str, args: list[str], out_dir: str) -> dict[str, Any]:
    path = os.path.join(out_dir, f"{name}.json")
    cmd = [*_tokenloom(), *args, "--output-json", path]
    print("$ tokenloom " + shlex.join(args), flush=True)
    subprocess.run(cmd, check=True)
    with open(path) as f:
        return json.load(f)


def _row(name: str, r: dict[str, Any]) -> tuple[str, str, str, str, str]:
    ours, base = r["tokenloom"], r.get("baseline", {})
    if name == "batch1":
        t, b = 1000 / ours["decode_per_token"]["median_ms"], 1000 / base["decode_per_token"]["median_ms"]
        frac = ours.get("roofline", {}).get("fraction_of_ceiling", 0.0)
        mem = (f"; RSS {ours['memory']['rss_mib']:.0f} / {base['memory']['rss_mib']:.0f} MiB, peak "
               f"{ours['memory']['peak_rss_mib']:.0f} / {base['memory']['peak_rss_mib']:.0f} MiB")
        return (f"1 x 128 x {r.get('output_len', 128)}, decode tok/s", f"{t:.1f} ({frac:.0%} of roofline)", f"{b:.1f}",
                f"{t / b:.2f}x", ">= 1.2x or >= 90% roofline" + mem)
    if name == "prefill512":
        n = r["input_len"]
        t, b = n / ours["prefill"]["median_ms"] * 1000, n / base["prefill"]["median_ms"] * 1000
        return ("prefill 512, prompt tok/s", f"{t:.0f}", f"{b:.0f}", f"{t / b:.2f}x", ">= 1.0x")
    t, b = ours["output_tokens_per_s"], base["output_tokens_per_s"]
    goal = ">= 1.5x llama.cpp batched" if name == "concurrent16" else ">= 1.3x vLLM best"
    label = f"{r.get('num_prompts', 16)} x 128 x {r.get('output_len', 128)}, out tok/s"
    return (label, f"{t:.1f}", f"{b:.1f} ({base['backend']} {base.get('dtype', '')})", f"{t / b:.2f}x", goal)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", required=True, help="the shape's Q4_K_M file (gguf_shapes.py)")
    p.add_argument("--llamacpp-python", required=True)
    p.add_argument("--vllm-python", default=None)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--output-len", type=int, default=128, help="output tokens of batch1 and concurrent16")
    p.add_argument("--warmup", type=int, default=1, help="untimed iterations of the latency rows")
    p.add_argument("--out-dir", default="/tmp/tokenloom-sizes")
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    cmds = _commands(a)
    wanted = [r for r in a.rows.split(",") if r]
    unknown = [r for r in wanted if r not in ROWS]
    if unknown:
        p.error(f"--rows: unknown {unknown}; choose from {ROWS}")
    table = []
    for name in wanted:
        if name not in cmds:
            print(f"(skipping {name}: needs --vllm-python)")
            continue
        table.append(_row(name, _run(name, cmds[name], a.out_dir)))
    print(f"\n{os.path.basename(a.gguf)}: tokenloom | baseline | ratio | target")
    for label, t, b, ratio, goal in table:
        print(f"| {label} | {t} | {b} | **{ratio}** | {goal} |")


if __name__ == "__main__":
    main()
