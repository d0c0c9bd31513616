"""Pre-quantized checkpoints of a named model shape with random weights, and their speed next to
the paths they carry the same bits per weight as (issue 51): W4A16 against llama.cpp's Q4_K_M
on tokenloom, W8A8 against the int8 path.

    python benchmarks/ckpt_shapes.py llama-3.2-1b OUT_DIR [--group-size 128] [--asym]
    python benchmarks/ckpt_shapes.py llama-3.2-1b OUT_DIR --run /tmp/speed/shapes/llama-3.2-1b-Q4_K_M.gguf
        [--w8a8] [--fp8] [--batches 1,64] [--input-len 128] [--output-len 64] [--rounds 2]

The first form writes OUT_DIR/<shape>-w4a16: gguf_shapes.py's config.json and tokenizer (the
embedded SmolLM2's vocabulary) with a `quantization_config` as llm-compressor writes it for
W4A16 (compressed-tensors `pack-quantized`, symmetric int4, a bfloat16 scale per 128 weights;
`--asym` adds zero points), every linear layer's random 4-bit codes packed by compressed-tensors'
own packer (`pack_to_int32`), bfloat16 embeddings, head and norms. Codes and scales are drawn
directly (no float weights made), one tensor at a time.

`--run GGUF` loads the checkpoint and the GGUF (each with `LLM`, in this process, side by side,
the same engine options) and times `generate` on the same random prompts at each batch size
(greedy, `ignore_eos`), alternating the two engines over `--rounds` rounds; it prints output
tokens/s of each and their ratio, per batch size (the median over the rounds). `--w8a8` then
does the same for a W8A8 checkpoint of the shape (benchmarks/w8a8_checkpoint.py, written to
OUT_DIR/<shape>-w8a8) against the int8 path on the same config (`load_format="dummy"`,
`quantization="int8"`; and the W8A8 checkpoint with `quantize_lm_head=True`, its bfloat16 LM
head as Q8_0 like the int8 path's), and `--fp8` for an FP8 (per-channel e4m3) one against the bfloat16
float path of the shape (random weights, what a dequantized FP8 checkpoint ran as), one pair
loaded at a time; every ratio is printed at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def _linear_shapes(cfg: dict) -> list[tuple[str, int, int]]:
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * D, cfg["num_key_value_heads"] * D
    out = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj", q, H), (p + "self_attn.k_proj", kv, H), (p + "self_attn.v_proj", kv, H),
                (p + "self_attn.o_proj", H, q), (p + "mlp.gate_proj", I, H), (p + "mlp.up_proj", I, H),
                (p + "mlp.down_proj", H, I)]
    return out


def w4a16_config(group_size: int, symmetric: bool) -> dict:
    """quantization_config as compressed-tensors' ModelCompressor.update_config writes it."""
    weights = {"num_bits": 4, "type": "int", "symmetric": symmetric, "strategy": "group",
               "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ["lm_head"], "kv_cache_scheme": None}


def _gguf_shapes():
    """benchmarks/gguf_shapes.py, imported by path: with benchmarks/ on sys.path its kernels.py
    would shadow the `kernels` package that transformers imports."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gguf_shapes", os.path.join(HERE, "gguf_shapes.py"))
    module = sys.modules["gguf_shapes"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_w4a16(shape_name: str, out: str, group_size: int, symmetric: bool, seed: int) -> str:
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from safetensors.torch import save_file

    from tokenloom.model.loader import default_model_path

    gguf_shapes = _gguf_shapes()
    hf_dir = gguf_shapes.write_hf_config(shape_name, gguf_shapes.SHAPES[shape_name], out, default_model_path())
    directory = os.path.join(out, f"{shape_name}-w4a16" + ("" if symmetric else "-asym"))
    os.makedirs(directory, exist_ok=True)
    for f in os.listdir(hf_dir):
        os.replace(os.path.join(hf_dir, f), os.path.join(directory, f))
    os.rmdir(hf_dir)
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = w4a16_config(group_size, symmetric)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    g = torch.Generator().manual_seed(seed)
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    tensors = {"model.embed_tokens.weight": (torch.randn(V, H, generator=g) * 0.02).bfloat16(),
               "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
    if not cfg.get("tie_word_embeddings"):
        tensors["lm_head.weight"] = (torch.randn(V, H, generator=g) * 0.02).bfloat16()
    for i in range(cfg["num_hidden_layers"]):
        for n in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{n}.weight"] = torch.ones(H, dtype=torch.bfloat16)
    for name, N, K in _linear_shapes(cfg):
        codes = torch.randint(-8, 8, (N, K), generator=g, dtype=torch.int8)
        tensors[f"{name}.weight_packed"] = pack_to_int32(codes, 4)
        tensors[f"{name}.weight_scale"] = (torch.rand(N, K // group_size, generator=g) * 0.004 + 0.002).bfloat16()
        tensors[f"{name}.weight_shape"] = torch.tensor([N, K])
        if not symmetric:
            zeros = torch.randint(-2, 3, (N, K // group_size), generator=g, dtype=torch.int8)
            tensors[f"{name}.weight_zero_point"] = pack_to_int32(zeros, 4, packed_dim=0)
    save_file(tensors, os.path.join(directory, "model.safetensors"))
    return directory


def run(engines: dict[str, tuple[str, dict]], batches: list[int], input_len: int, output_len: int,
        rounds: int) -> dict:
    """{label: (model path, LLM options)} -> {batch: {label: median output tokens/s}}."""
    from tokenloom import LLM, SamplingParams

    rng = np.random.default_rng(0)
    llms = {label: LLM(path, **kwargs) for label, (path, kwargs) in engines.items()}
    for label, llm in llms.items():
        print(f"{label}: {llm.llm_engine.engine_core.info.quantization}", file=sys.stderr)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    results: dict = {}
    for batch in batches:
        times: dict[str, list[float]] = {label: [] for label in llms}
        for r in range(rounds + 1):  # round 0 warms up
            prompts = [{"prompt_token_ids": rng.integers(100, 40000, input_len).tolist()} for _ in range(batch)]
            for label, llm in llms.items():
                start = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                if r:
                    times[label].append(batch * output_len / (time.perf_counter() - start))
        results[batch] = {label: statistics.median(t) for label, t in times.items()}
        print(f"batch {batch}: " + ", ".join(f"{k} {v:.1f} output tok/s" for k, v in results[batch].items()),
              file=sys.stderr)
    for llm in llms.values():
        llm.shutdown()
    return results


def main() -> int:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shape")
    p.add_argument("out")
    p.add_argument("--format", choices=["w4a16"], default="w4a16")
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--asym", action="store_true", help="zero points (Q4_1 tiles) instead of symmetric (Q4_0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--run", metavar="GGUF", default=None, help="time the checkpoint against this GGUF")
    p.add_argument("--w8a8", action="store_true", help="also time a W8A8 checkpoint against the int8 path")
    p.add_argument("--fp8", action="store_true",
                   help="also time an FP8 checkpoint against the bfloat16 float path of the same shape")
    p.add_argument("--batches", default="1,64")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    directory = os.path.join(args.out, f"{args.shape}-w4a16" + ("-asym" if args.asym else ""))
    if not os.path.isfile(os.path.join(directory, "model.safetensors")):
        directory = write_w4a16(args.shape, args.out, args.group_size, not args.asym, args.seed)
        print(f"wrote {directory}", file=sys.stderr)
    if not (args.run or args.w8a8 or args.fp8):
        return 0
    batches = [int(b) for b in args.batches.split(",")]
    pairs = {("w4a16", "gguf"): {"w4a16": (directory, {}), "gguf": (args.run, {})}} if args.run else {}
    for kind, wanted in (("w8a8", args.w8a8), ("fp8", args.fp8)):
        if not wanted:
            continue
        ckpt = os.path.join(args.out, f"{args.shape}-{kind}")
        if not os.path.isfile(os.path.join(ckpt, "model.safetensors")):
            import importlib.util

            gguf_shapes = _gguf_shapes()
            from tokenloom.model.loader import default_model_path

            hf_dir = gguf_shapes.write_hf_config(args.shape, gguf_shapes.SHAPES[args.shape], args.out,
                                                 default_model_path())
            spec = importlib.util.spec_from_file_location("w8a8_checkpoint", os.path.join(HERE, "w8a8_checkpoint.py"))
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.write_w8a8(hf_dir, ckpt, args.seed, fp8=kind == "fp8")
        if kind == "w8a8":
            # the int8 path first: it builds the float32 model before quantizing it (the peak)
            pairs[("w8a8", "int8")] = {"int8": (ckpt, {"load_format": "dummy", "quantization": "int8"}),
                                       "w8a8": (ckpt, {}), "w8a8+q8head": (ckpt, {"quantize_lm_head": True})}
        else:  # what an FP8 checkpoint ran as before: dequantized to bfloat16, the float path
            pairs[("fp8", "bf16")] = {"fp8": (ckpt, {"dtype": "bfloat16"}),
                                      "bf16": (ckpt, {"load_format": "dummy", "dtype": "bfloat16"})}
    lines = []
    for (_, b), engines in pairs.items():
        res = run(engines, batches, args.input_len, args.output_len, args.rounds)
        for batch, r in res.items():
            for label in (x for x in r if x != b):  # each against the pair's baseline
                lines.append(f"batch {batch}: {label} {r[label]:.1f} tok/s, {b} {r[b]:.1f} tok/s, "
                             f"ratio {r[label] / r[b]:.2f}")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
