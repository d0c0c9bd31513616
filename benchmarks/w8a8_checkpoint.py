"""Write a random-weight compressed-tensors W8A8 checkpoint (`int-quantized`: int8 weights with a
bfloat16 scale per output channel, dynamic per-token int8 activations, LM head left in bfloat16
as llm-compressor's recipes leave it) of a model shape, for timing with no download:

    python benchmarks/gguf_shapes.py llama-3.2-1b /tmp/shapes --hf-config --quantize ''
    python benchmarks/w8a8_checkpoint.py /tmp/shapes/llama-3.2-1b-hf /tmp/shapes/llama-3.2-1b-w8a8
    tokenloom bench throughput --model /tmp/shapes/llama-3.2-1b-w8a8 --num-prompts 64
    tokenloom bench throughput --model /tmp/shapes/llama-3.2-1b-hf --load-format dummy --quantization int8 --num-prompts 64

SOURCE_DIR holds config.json and the tokenizer (gguf_shapes.py --hf-config writes one). The
tensors and config are what compressed-tensors' ModelCompressor writes for its W8A8 preset
(tests/model/test_int8_fp8_checkpoints.py builds tiny ones with it), written directly here so
that no float copy of the model is ever made. Codes are uniform in [-127, 127] and scales make
weights of about N(0, 0.02)'s range: the text is noise, the timing is the shape's.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import torch

# compressed-tensors' W8A8 preset as its ModelCompressor.update_config writes it.
W8A8_CONFIG = {
    "config_groups": {"group_0": {
        "format": "int-quantized", "targets": ["Linear"], "output_activations": None,
        "input_activations": {"dynamic": True, "group_size": None, "num_bits": 8, "strategy": "token",
                              "symmetric": True, "type": "int"},
        "weights": {"dynamic": False, "group_size": None, "num_bits": 8, "strategy": "channel",
                    "symmetric": True, "type": "int"}}},
    "format": "int-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None, "quant_method": "compressed-tensors",
    "quantization_status": "compressed", "sparsity_config": {}, "transform_config": {},
}


# compressed-tensors' FP8_DYNAMIC preset (e4m3 weights per channel, dynamic per-token activations).
FP8_CONFIG = json.loads(json.dumps(W8A8_CONFIG).replace('"int"', '"float"').replace("int-quantized", "float-quantized"))


def write_w8a8(source: str, out: str, seed: int = 0, fp8: bool = False) -> str:
    """OUT: SOURCE's config with W8A8_CONFIG (FP8_CONFIG with `fp8`), random int8 (e4m3) codes and
    per-channel scales, bfloat16 embedding, head and norms, and SOURCE's tokenizer files.
    Returns OUT."""
    with open(os.path.join(source, "config.json")) as f:
        cfg = json.load(f)
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    H, inter, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    head_dim = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * head_dim, cfg["num_key_value_heads"] * head_dim
    shapes = {"self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
              "self_attn.o_proj": (H, q), "mlp.gate_proj": (inter, H), "mlp.up_proj": (inter, H),
              "mlp.down_proj": (H, inter)}
    tensors: dict[str, torch.Tensor] = {}
    for i in range(layers):
        for name, (n, k) in shapes.items():
            prefix = f"model.layers.{i}.{name}"
            if fp8:  # codes of about N(0, 64), e4m3's range is +-448
                tensors[f"{prefix}.weight"] = (torch.randn(n, k, generator=g) * 64).to(torch.float8_e4m3fn)
                tensors[f"{prefix}.weight_scale"] = torch.full((n, 1), 0.02 / 64, dtype=torch.bfloat16)
            else:
                tensors[f"{prefix}.weight"] = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
                tensors[f"{prefix}.weight_scale"] = torch.full((n, 1), 0.05 / 127, dtype=torch.bfloat16)
        for norm in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{norm}.weight"] = torch.ones(H, dtype=torch.bfloat16)
    tensors["model.norm.weight"] = torch.ones(H, dtype=torch.bfloat16)
    vocab = cfg["vocab_size"]
    tensors["model.embed_tokens.weight"] = (torch.randn(vocab, H, generator=g) * 0.02).to(torch.bfloat16)
    if not cfg.get("tie_word_embeddings", False):
        tensors["lm_head.weight"] = (torch.randn(vocab, H, generator=g) * 0.02).to(torch.bfloat16)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg["quantization_config"] = FP8_CONFIG if fp8 else W8A8_CONFIG
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for name in os.listdir(source):  # tokenizer, chat template, generation config
        if name != "config.json" and not name.endswith((".safetensors", ".bin")):
            shutil.copy(os.path.join(source, name), out)
    size = os.path.getsize(os.path.join(out, "model.safetensors"))
    print(f"w8a8_checkpoint: {layers} layers of {'fp8' if fp8 else 'int8'}, {size / 2**20:,.0f} MiB -> {out}", file=sys.stderr)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("source", help="directory with config.json and the tokenizer files")
    p.add_argument("out", help="directory to write (created)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fp8", action="store_true", help="FP8 e4m3 weights (compressed-tensors FP8_DYNAMIC) instead")
    args = p.parse_args()
    write_w8a8(args.source, args.out, args.seed, args.fp8)
    return 0


if __name__ == "__main__":
    sys.exit(main())
