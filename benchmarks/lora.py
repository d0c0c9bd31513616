"""What a LoRA adapter costs: one engine with enable_lora, the same greedy requests run without an
adapter and with one (and with a different adapter per request), alternating rounds, output
tokens per second and the ratio to the base model in the same process.

The adapter is random PEFT LoRA of rank `--rank` on every projection of the model's shape
(built with peft on a random transformers model of the same config; only the shapes matter).

    PYTHONPATH=src .venv/bin/python benchmarks/lora.py --batch-sizes 1 8 --rank 16
    PYTHONPATH=src .venv/bin/python benchmarks/lora.py --quantization none   # the float path
"""
from __future__ import annotations

import argparse
import tempfile
import time

import torch

from tokenloom import LLM, LoRARequest, SamplingParams
from tokenloom.model.source import default_model_path, load_model_config
from tokenloom.ops import cpu_features


def make_adapter(directory: str, rank: int, seed: int) -> str:
    import transformers
    from peft import LoraConfig, get_peft_model

    c = load_model_config(default_model_path())
    config = transformers.LlamaConfig(vocab_size=c.vocab_size, hidden_size=c.hidden_size,
                                      intermediate_size=c.intermediate_size, num_hidden_layers=c.num_hidden_layers,
                                      num_attention_heads=c.num_attention_heads, num_key_value_heads=c.num_key_value_heads,
                                      head_dim=c.head_dim)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  init_lora_weights=False))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.02)
    peft_model.save_pretrained(directory)
    return directory


def run(llm: LLM, n: int, lora, output_len: int) -> tuple[float, int]:
    prompts = [f"Write a story about the number {i}." for i in range(n)]
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=lora)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quantization", default="auto")
    args = ap.parse_args()
    print(f"machine: {cpu_features.detect().summary()}")
    with tempfile.TemporaryDirectory() as tmp:
        a = LoRARequest("a", 1, make_adapter(f"{tmp}/a", args.rank, 1))
        b = LoRARequest("b", 2, make_adapter(f"{tmp}/b", args.rank, 2))
        llm = LLM(quantization=args.quantization, enable_lora=True, max_loras=2, max_lora_rank=args.rank,
                  num_kv_blocks=512)
        try:
            run(llm, 2, a, 8)  # warm-up: kernels built, adapters loaded
            run(llm, 2, b, 8)
            for n in args.batch_sizes:
                cases = {"base": None, "one adapter": a, "two adapters": [a if i % 2 else b for i in range(n)]}
                if n == 1:
                    del cases["two adapters"]
                rates: dict[str, list[float]] = {k: [] for k in cases}
                for _ in range(args.rounds):
                    for name, lora in cases.items():
                        dt, tokens = run(llm, n, lora, args.output_len)
                        rates[name].append(tokens / dt)
                base = sorted(rates["base"])[len(rates["base"]) // 2]
                for name, r in rates.items():
                    med = sorted(r)[len(r) // 2]
                    print(f"batch {n:3d} {name:13s} {med:8.1f} tok/s  x{med / base:.2f} of base  "
                          f"(rounds {' '.join(f'{x:.1f}' for x in r)})")
        finally:
            llm.shutdown()


if __name__ == "__main__":
    main()
