"""gpt-oss's MXFP4 expert matmuls: the C kernel (csrc/mxfp4_gemm.c, `cpu_kernels.mxfp4_linear`)
at each ISA level this CPU runs, against the torch path it replaces for decode (model/mxfp4.py:
the expert's matrix unpacked to float, then F.linear), in float32 and bfloat16 activations, and
the larger steps' path (the matrix unpacked in C, `cpu_kernels.mxfp4_unpack`, then F.linear), on
the same random MXFP4 bytes in the same run. Median CPU time of the calling thread over many
calls, one thread (torch and OpenMP), so a shared machine's scheduler stays out of it.

Shapes: gpt-oss-20b's expert matrices (hidden 2880, expert width 2880): gate|up 5760 x 2880 and
down 2880 x 2880; rows of x 1, 4, 16 (a decode step's tokens on one expert) and 64.

`--decode`: instead, one request's decode through the engine (`LLM`, in process) on gpt-oss-20b's
layer shape cut to `--layers` layers (32 experts, top 4, random MXFP4 bytes: load_format
"dummy"; a 259-token byte vocabulary), the C kernel against the unpacking path (the kernel
switched off on the model's experts), alternating rounds; wall-clock ms per output token.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/mxfp4_experts.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/mxfp4_experts.py --rows 1 16 --reps 20
    PYTHONPATH=src python benchmarks/mxfp4_experts.py --decode --layers 2 --rounds 3
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from quant_kernels import bench  # the median thread CPU time of calls (this folder's script)

from tokenloom.model import mxfp4
from tokenloom.ops import cpu_features, cpu_kernels

SHAPES = {"gate_up": (5760, 2880), "down": (2880, 2880)}
# gpt-oss-20b's config.json, but its layer count and vocabulary
GPT_OSS_20B = dict(hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
                   head_dim=64, num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                   max_position_embeddings=4096)


def decode(layers: int, rounds: int, prompt_len: int, out_len: int) -> None:
    """ms per output token of one request, the C kernel against the unpacking, alternating."""
    import transformers

    from tokenloom import LLM, SamplingParams
    from tokenloom.model import gpt_oss

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
    from model_helpers import byte_tokenizer

    tokenizer = byte_tokenizer()
    with tempfile.TemporaryDirectory() as d:
        cfg = transformers.GptOssConfig(vocab_size=len(tokenizer), num_hidden_layers=layers, **GPT_OSS_20B)
        cfg = cfg.to_dict() | {"architectures": ["GptOssForCausalLM"],
                               "quantization_config": {"quant_method": "mxfp4"}}
        Path(d, "config.json").write_text(json.dumps(cfg))
        tokenizer.save_pretrained(d)
        llm = LLM(d, load_format="dummy", dtype="float32", multiprocess=False)
        params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
        prompt = {"prompt_token_ids": list(range(3, 3 + prompt_len))}
        c_kernels = gpt_oss.Mxfp4FusedMoE.c_kernels
        times: dict[str, list[float]] = {"C kernel": [], "unpack + F.linear": []}
        for _ in range(rounds):
            for path in times:
                gpt_oss.Mxfp4FusedMoE.c_kernels = c_kernels if path == "C kernel" else (lambda self, x: None)
                llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
                t = time.perf_counter()
                llm.generate([prompt], params, use_tqdm=False)
                one = time.perf_counter()
                llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
                prefill = time.perf_counter() - one
                times[path].append(((one - t) - prefill) / (out_len - 1) * 1e3)
        gpt_oss.Mxfp4FusedMoE.c_kernels = c_kernels
    base = float(np.median(times["unpack + F.linear"]))
    print(f"# gpt-oss-20b layer shape x {layers} layers, prompt {prompt_len}, {out_len} tokens, "
          f"{rounds} alternating rounds; torch threads {torch.get_num_threads()}")
    print("| path | ms / output token (median) | vs unpack |")
    print("|---|---|---|")
    for path, ts in times.items():
        med = float(np.median(ts))
        print(f"| {path} | {med:.1f} | {base / med:.1f}x |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--decode", action="store_true", help="one request's decode through the engine instead")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=16)
    args = ap.parse_args()
    if args.decode:
        return decode(args.layers, args.rounds, args.prompt_len, args.output_len)
    torch.set_num_threads(1)
    feats = cpu_features.detect()
    levels = ("avx512", "avx2", "scalar")[("avx512", "avx2", "scalar").index(feats.isa):]
    libs = {lvl: cpu_kernels.load_isa(lvl) for lvl in levels}
    print(f"# {feats.summary()}; torch threads {torch.get_num_threads()}")
    print("| matrix | rows | path | ms | vs torch f32 unpack |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for name, (N, K) in SHAPES.items():
        blocks = torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 124, (N, K // 32), dtype=torch.uint8, generator=g)
        bias = torch.randn(N, generator=g)
        for M in args.rows:
            x = torch.randn(M, K, generator=g)
            xb = x.bfloat16()
            rows = {
                "torch f32 unpack": lambda: F.linear(x, mxfp4.dequantize(blocks, scales, torch.float32), bias),
                "torch bf16 unpack": lambda: F.linear(xb, mxfp4.dequantize(blocks, scales, torch.bfloat16),
                                                      bias.bfloat16()),
            }
            for lvl, lib in libs.items():
                rows[f"C {lvl}"] = lambda lib=lib: cpu_kernels.mxfp4_linear(lib, x, blocks, scales, bias)
            lib = libs[feats.isa]  # the larger steps' path: unpacked in C, then torch's matmul
            rows["C unpack f32 + F.linear"] = lambda: F.linear(x, cpu_kernels.mxfp4_unpack(lib, blocks, scales), bias)
            rows["C unpack bf16 + F.linear"] = lambda: F.linear(
                xb, cpu_kernels.mxfp4_unpack(lib, blocks, scales, torch.bfloat16), bias.bfloat16())
            base = None
            for path, f in rows.items():
                t = bench(f, args.reps)
                base = base or t
                print(f"| {name} {N}x{K} | {M} | {path} | {t * 1e3:.2f} | {base / t:.1f}x |", flush=True)


if __name__ == "__main__":
    main()
