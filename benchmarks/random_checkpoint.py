"""Write a random-weight Hugging Face checkpoint of a model's shape, for timing on a machine that
lacks the model's weights (a GPU box without the embedded GGUF, say).

    python benchmarks/random_checkpoint.py SOURCE_DIR OUT_DIR [--dtype bfloat16] [--seed 0]

SOURCE_DIR holds the model's config.json and its tokenizer files (what `save_pretrained` writes;
no weights). OUT_DIR gets the same config and tokenizer and safetensors weights drawn from
transformers' own initialization, seeded. Throughput and latency depend on the shapes, not on
the values, so `tokenloom bench` on OUT_DIR times the model; its text is noise.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="directory with config.json and the tokenizer files")
    p.add_argument("out", help="directory to write (created)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if not os.path.isfile(os.path.join(args.source, "config.json")):
        print(f"random_checkpoint: {args.source} has no config.json", file=sys.stderr)
        return 2
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.source)
    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, args.dtype)).eval()
    os.makedirs(args.out, exist_ok=True)
    model.save_pretrained(args.out)
    for name in os.listdir(args.source):  # tokenizer, chat template, generation config
        if name != "config.json" and not name.endswith((".safetensors", ".bin")):
            shutil.copy(os.path.join(args.source, name), args.out)
    n = sum(t.numel() for t in model.parameters())
    print(f"random_checkpoint: {type(model).__name__}, {n / 1e6:.1f}M parameters, {args.dtype}, -> {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
