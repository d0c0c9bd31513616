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

`--write-gguf PATH`: instead, write that shape as llama.cpp's `gpt-oss` GGUF (random weights,
MXFP4 experts, float32 attention, a 260-token byte vocabulary with one merge, which llama.cpp
requires), for `tokenloom bench latency --model PATH --baseline llamacpp` on the same file.

    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/mxfp4_experts.py
    OMP_NUM_THREADS=1 PYTHONPATH=src python benchmarks/mxfp4_experts.py --rows 1 16 --reps 20
    PYTHONPATH=src python benchmarks/mxfp4_experts.py --decode --layers 2 --rounds 3
    PYTHONPATH=src python benchmarks/mxfp4_experts.py --write-gguf /tmp/gpt-oss-2l.gguf --layers 2
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


def write_gguf(path: str, layers: int) -> None:
    """gpt-oss-20b's layer shape x `layers` as llama.cpp's gpt-oss GGUF, random weights."""
    import gguf

    c = GPT_OSS_20B
    H, I, E, heads, kv, hd = (c["hidden_size"], c["intermediate_size"], c["num_local_experts"],
                              c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"])
    rng = np.random.default_rng(0)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
    from model_helpers import byte_tokenizer

    tokenizer = byte_tokenizer()
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer)))) + ["\u0120\u0120"]
    w = gguf.GGUFWriter(path, "gpt-oss")
    w.add_block_count(layers)
    w.add_context_length(c["max_position_embeddings"])
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_expert_count(E)
    w.add_expert_used_count(c["num_experts_per_tok"])
    w.add_expert_feed_forward_length(I)
    w.add_sliding_window(c["sliding_window"])
    w.add_rope_freq_base(150000.0)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    w.add_token_merges(["\u0120 \u0120"])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * 0.02

    def experts(rows: int, cols: int) -> np.ndarray:  # ggml's MXFP4 blocks: a scale byte, 16 nibble bytes
        blocks = rng.integers(0, 256, (E, rows, cols // 32, 17), dtype=np.uint8)
        blocks[..., 0] = rng.integers(119, 123, (E, rows, cols // 32))
        return blocks.reshape(E, rows, -1)

    w.add_tensor("token_embd.weight", normal(len(tokens), H))
    w.add_tensor("output_norm.weight", np.ones(H, np.float32))
    w.add_tensor("output.weight", normal(len(tokens), H))
    for i in range(layers):
        tensors = {"attn_norm.weight": np.ones(H, np.float32), "post_attention_norm.weight": np.ones(H, np.float32),
                   "attn_q.weight": normal(heads * hd, H), "attn_q.bias": normal(heads * hd),
                   "attn_k.weight": normal(kv * hd, H), "attn_k.bias": normal(kv * hd),
                   "attn_v.weight": normal(kv * hd, H), "attn_v.bias": normal(kv * hd),
                   "attn_output.weight": normal(H, heads * hd), "attn_output.bias": normal(H),
                   "attn_sinks.weight": normal(heads), "ffn_gate_inp.weight": normal(E, H), "ffn_gate_inp.bias": normal(E),
                   "ffn_gate_exps.bias": normal(E, I), "ffn_up_exps.bias": normal(E, I), "ffn_down_exps.bias": normal(E, H)}
        for name, a in tensors.items():
            w.add_tensor(f"blk.{i}.{name}", a)
        for name, (rows, cols) in {"gate": (I, H), "up": (I, H), "down": (H, I)}.items():
            w.add_tensor(f"blk.{i}.ffn_{name}_exps.weight", experts(rows, cols), raw_dtype=gguf.GGMLQuantizationType.MXFP4)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"wrote {path}")


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
    ap.add_argument("--write-gguf", metavar="PATH", help="write the --layers shape as a gpt-oss GGUF instead")
    args = ap.parse_args()
    if args.write_gguf:
        return write_gguf(args.write_gguf, args.layers)
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
