"""Write a random-weight F16 GGUF of a named model shape, and have llama.cpp's own quantizer make
Q4_K_M, Q4_0 and Q8_0 of it: the sizes people run, timed with no download.

    python benchmarks/gguf_shapes.py llama-3.2-1b OUT_DIR [--quantize Q4_K_M,Q4_0,Q8_0]
        [--llamacpp-python /tmp/llamacpp-venv/bin/python] [--seed 0] [--keep-f16]
    python benchmarks/gguf_shapes.py llama-3.2-1b OUT_DIR --hf-config

`--hf-config` writes no weights: OUT_DIR/<shape>-hf gets the shape's Hugging Face config.json and
the same tokenizer (saved by transformers from the embedded GGUF), for the float path with random
weights (`--load-format dummy`, vLLM's flag, which vLLM's CPU build takes too):

    tokenloom bench throughput --model OUT_DIR/llama-3.2-1b-hf --load-format dummy --quantization none

OUT_DIR gets `<shape>-F16.gguf` and `<shape>-<TYPE>.gguf` for each type of `--quantize`
(llama.cpp's `llama_model_quantize`, run by `--llamacpp-python`, the python of an environment
with llama-cpp-python installed: it is no dependency of tokenloom; see
src/tokenloom/bench/llamacpp_baseline.py). Without `--llamacpp-python` only the F16 file is
written.

The files carry llama.cpp's tensor and key names (architecture `llama` or `qwen2`), each shape's
published body (hidden size, layers, heads, KV heads, FFN size, head size, rope base, norm epsilon,
tied or untied head, Qwen2's q/k/v biases, Llama 3.1/3.2's rope-scaling factors as a
`rope_freqs.weight`) and the **vocabulary of the embedded SmolLM2-135M** (49,152 tokens: its
GGUF's tokenizer metadata is copied, so the files load and tokenize anywhere the embedded model
does). The vocabulary is not the named model's (128,256 for Llama 3, 151,936 for Qwen2.5), so the
embedding and head are smaller than the real model's; the body, which a decode step mostly
reads, is the real one. Llama-3.2-1B gets an untied head by default (`--tied` shares it, as the
real model does) so that its file matches the one in issue 52.

Weights are random (a seeded pool of N(0, 0.02) values, read at a random offset per tensor);
speed depends on the shapes, not the values, and the generated text is noise. Tensors are
written one at a time, so an 8B-shaped file (about 16 GB of F16) needs memory for its largest
tensor only.
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
    arch: str  # llama.cpp architecture: "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    rope_theta: float
    rms_eps: float
    tied: bool
    context: int
    rope_factor: float | None = None  # Llama 3.1/3.2 ("llama3" rope scaling)
    head_size: int | None = None  # where it is not hidden / heads (Qwen3)
    experts: int = 0  # a mixture of experts in every layer (qwen3moe): expert count
    experts_used: int = 0  # top-k
    expert_ffn: int = 0  # each expert's width (moe_intermediate_size)
    vocab: int | None = None  # the named model's vocabulary: SmolLM2's padded with unused tokens

    @property
    def head_dim(self) -> int:
        return self.head_size or self.hidden // self.heads


# The published configs (Hugging Face config.json of each model).
SHAPES = {
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 500000.0, 1e-5, False, 131072, 32.0),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 1000000.0, 1e-6, True, 32768),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 500000.0, 1e-5, True, 131072, 32.0),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 500000.0, 1e-5, False, 131072, 8.0),
    "qwen2.5-7b": Shape("qwen2", 3584, 28, 28, 4, 18944, 1000000.0, 1e-6, False, 32768),
    # Qwen3-30B-A3B's body with 12 of its 48 layers (so that it fits: about 15 GB of F16, 4.5 GB
    # of Q4_K_M), its full vocabulary and q/k norms.
    "qwen3-30b-a3b-12l": Shape("qwen3moe", 2048, 12, 32, 4, 6144, 1000000.0, 1e-6, False, 40960,
                               head_size=128, experts=128, experts_used=8, expert_ffn=768, vocab=151936),
}

# llama.cpp's file types (LLAMA_FTYPE_MOSTLY_*), as `llama_model_quantize` takes them.
FTYPES = {"F16": 1, "Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}

_POOL_SIZE = (1 << 24) + 4099  # prime-ish tail: offsets do not line up with row sizes
_QUANTIZE_SCRIPT = """
import ctypes, sys
import llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype = int(sys.argv[3])
params.nthread = int(sys.argv[4])
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)))
"""


def tensor_specs(shape: Shape, vocab: int) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, numpy shape [rows, cols], kind) in llama.cpp's order; kind is "weight" (F16,
    random), "norm" (F32 ones), "bias" and "router" (F32 random) or "rope_freqs" (F32, computed)."""
    h, d = shape.hidden, shape.head_dim
    q, kv = shape.heads * d, shape.kv_heads * d
    specs: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (vocab, h), "weight")]
    if shape.rope_factor is not None:
        specs.append(("rope_freqs.weight", (d // 2,), "rope_freqs"))
    for i in range(shape.layers):
        b = f"blk.{i}"
        specs += [(f"{b}.attn_norm.weight", (h,), "norm"),
                  (f"{b}.attn_q.weight", (q, h), "weight"),
                  (f"{b}.attn_k.weight", (kv, h), "weight"),
                  (f"{b}.attn_v.weight", (kv, h), "weight")]
        if shape.arch == "qwen2":
            specs += [(f"{b}.attn_q.bias", (q,), "bias"), (f"{b}.attn_k.bias", (kv,), "bias"),
                      (f"{b}.attn_v.bias", (kv,), "bias")]
        if shape.arch == "qwen3moe":
            specs += [(f"{b}.attn_q_norm.weight", (d,), "norm"), (f"{b}.attn_k_norm.weight", (d,), "norm")]
        specs += [(f"{b}.attn_output.weight", (h, q), "weight"),
                  (f"{b}.ffn_norm.weight", (h,), "norm")]
        if shape.experts:  # stacked [E, rows, cols] as convert_hf_to_gguf.py writes them; the router F32
            E, f = shape.experts, shape.expert_ffn
            specs += [(f"{b}.ffn_gate_inp.weight", (E, h), "router"),
                      (f"{b}.ffn_gate_exps.weight", (E, f, h), "weight"),
                      (f"{b}.ffn_up_exps.weight", (E, f, h), "weight"),
                      (f"{b}.ffn_down_exps.weight", (E, h, f), "weight")]
        else:
            specs += [(f"{b}.ffn_gate.weight", (shape.ffn, h), "weight"),
                      (f"{b}.ffn_up.weight", (shape.ffn, h), "weight"),
                      (f"{b}.ffn_down.weight", (h, shape.ffn), "weight")]
    specs.append(("output_norm.weight", (h,), "norm"))
    if not shape.tied:
        specs.append(("output.weight", (vocab, h), "weight"))
    return specs


def llama3_rope_factors(shape: Shape) -> np.ndarray:
    """The per-frequency divisors of Llama 3's rope scaling (low 1, high 4, original context
    8192), as llama.cpp's converter writes them into `rope_freqs.weight`."""
    assert shape.rope_factor is not None
    factor, low, high, old_ctx = shape.rope_factor, 1.0, 4.0, 8192
    dim = shape.head_dim
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * shape.rope_theta ** (i / dim)
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


@functools.lru_cache(maxsize=2)
def _tokenizer_fields(source: str) -> tuple[list[tuple[str, Any, Any, Any]], int]:
    """Every `tokenizer.*` key of `source` (the embedded SmolLM2 GGUF) as (key, value, type,
    element type), and its vocabulary size. Parsing the file takes seconds: read once."""
    from gguf import GGUFReader, GGUFValueType

    reader = GGUFReader(source)
    fields, vocab = [], 0
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == GGUFValueType.ARRAY and len(field.types) > 1 else None
        fields.append((key, field.contents(), vtype, sub))
        if key == "tokenizer.ggml.tokens":
            vocab = len(field.data)
    if not vocab:
        raise SystemExit(f"gguf_shapes: {source} has no tokenizer.ggml.tokens")
    return fields, vocab


_TOKEN_UNUSED = 5  # llama.cpp's LLAMA_TOKEN_TYPE_UNUSED


def _copy_tokenizer(writer, source: str, size: int | None = None) -> int:
    """Copies the tokenizer of `source` into `writer`, its vocabulary padded to `size` entries
    with unused tokens (never produced by the merges: the embedding and head get the named model's
    rows); returns the vocabulary size."""
    fields, vocab = _tokenizer_fields(source)
    pad = max(0, (size or vocab) - vocab)
    for key, value, vtype, sub in fields:
        if pad and key == "tokenizer.ggml.tokens":
            value = [*value, *(f"<|unused_{i}|>" for i in range(pad))]
        elif pad and key == "tokenizer.ggml.token_type":
            value = [*value, *([_TOKEN_UNUSED] * pad)]
        elif pad and key == "tokenizer.ggml.scores":
            value = [*value, *([0.0] * pad)]
        writer.add_key_value(key, value, vtype, sub)
    return vocab + pad


def write_f16(name: str, shape: Shape, out: str, source: str, seed: int) -> None:
    # long because: header, keys and then one streamed tensor after another, in llama.cpp's order
    from gguf import GGUFWriter, GGMLQuantizationType, LlamaFileType

    writer = GGUFWriter(out, shape.arch)
    writer.add_name(f"{name} (random weights, SmolLM2 vocabulary)")
    writer.add_file_type(LlamaFileType.MOSTLY_F16)
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.ffn)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    if shape.head_size is not None:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    if shape.experts:
        writer.add_expert_count(shape.experts)
        writer.add_expert_used_count(shape.experts_used)
        writer.add_expert_feed_forward_length(shape.expert_ffn)
    vocab = _copy_tokenizer(writer, source, shape.vocab)
    writer.add_vocab_size(vocab)
    writer.add_quantization_version(2)
    specs = tensor_specs(shape, vocab)
    for tname, tshape, kind in specs:
        f16 = kind == "weight"
        nbytes = int(np.prod(tshape)) * (2 if f16 else 4)
        writer.add_tensor_info(tname, tshape, np.dtype(np.float16 if f16 else np.float32), nbytes,
                               GGMLQuantizationType.F16 if f16 else GGMLQuantizationType.F32)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    pool = (rng.standard_normal(_POOL_SIZE, dtype=np.float32) * 0.02).astype(np.float16)
    for tname, tshape, kind in specs:
        n = int(np.prod(tshape))
        if kind == "weight":
            start = int(rng.integers(0, _POOL_SIZE))
            data = np.resize(np.roll(pool, -start), n).reshape(tshape)  # tiles the pool
        elif kind == "norm":
            data = np.ones(tshape, dtype=np.float32)
        elif kind in ("bias", "router"):
            data = (rng.standard_normal(n, dtype=np.float32) * 0.02).reshape(tshape)
        else:
            data = llama3_rope_factors(shape)
        writer.write_tensor_data(data)
        del data
    writer.close()


def quantize(python: str, src: str, dst: str, qtype: str, threads: int) -> None:
    """llama.cpp's own quantizer (`llama_model_quantize`, its default mixture for the type)."""
    t0 = time.monotonic()
    proc = subprocess.run([python, "-c", _QUANTIZE_SCRIPT, src, dst, str(FTYPES[qtype]), str(threads)],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr[-4000:])
        raise SystemExit(f"gguf_shapes: llama_model_quantize to {qtype} failed (exit {proc.returncode})")
    print(f"  {qtype}: {dst} ({os.path.getsize(dst) / 2**20:,.0f} MiB, {time.monotonic() - t0:.0f} s)")


def hf_config(shape: Shape) -> dict[str, Any]:
    """The shape as a Hugging Face config.json (LlamaForCausalLM or Qwen2ForCausalLM)."""
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM" if shape.arch == "llama" else "Qwen2ForCausalLM"],
        "model_type": shape.arch, "hidden_size": shape.hidden, "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
        "intermediate_size": shape.ffn, "head_dim": shape.head_dim, "rope_theta": shape.rope_theta,
        "rms_norm_eps": shape.rms_eps, "tie_word_embeddings": shape.tied,
        "max_position_embeddings": shape.context, "hidden_act": "silu", "torch_dtype": "bfloat16",
    }
    if shape.rope_factor is not None:  # Llama 3.1/3.2's published rope scaling
        config["rope_scaling"] = {"rope_type": "llama3", "factor": shape.rope_factor, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    if shape.arch == "qwen2":
        config["attention_bias"] = True
    if shape.arch == "qwen3moe":
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=shape.experts,
                      num_experts_per_tok=shape.experts_used, moe_intermediate_size=shape.expert_ffn,
                      norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
    return config


def write_hf_config(name: str, shape: Shape, out: str, source: str) -> str:
    """OUT/<name>-hf: config.json and the embedded model's tokenizer, no weights (load_format=dummy)."""
    import json

    # benchmarks/kernels.py, first on sys.path when this runs as a script, would shadow the
    # `kernels` package that transformers imports.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    from transformers import AutoTokenizer

    directory = os.path.join(out, f"{name}-hf")
    os.makedirs(directory, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(os.path.dirname(source), gguf_file=os.path.basename(source))
    tokenizer.save_pretrained(directory)
    config = hf_config(shape)
    config.update(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    return directory


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("shape", choices=sorted(SHAPES), help="the model whose shape to write")
    p.add_argument("out_dir", help="directory to write (created)")
    p.add_argument("--quantize", default="Q4_K_M,Q4_0,Q8_0",
                   help=f"comma-separated llama.cpp types to make of the F16 file ({', '.join(t for t in FTYPES if t != 'F16')}); empty for none")
    p.add_argument("--llamacpp-python", default=None,
                   help="python of an environment with llama-cpp-python installed (runs the quantizer)")
    p.add_argument("--tied", action="store_true", help="share the embedding as the LM head (Llama-3.2-1B only: the others follow their model)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="quantizer threads")
    p.add_argument("--keep-f16", action="store_true", help="keep the F16 file after quantizing")
    p.add_argument("--hf-config", action="store_true",
                   help="write only a Hugging Face config directory of the shape (no weights: --load-format dummy)")
    args = p.parse_args()
    types = [t.strip() for t in args.quantize.split(",") if t.strip()]
    bad = [t for t in types if t not in FTYPES or t == "F16"]
    if bad:
        p.error(f"--quantize: unknown type(s) {bad}; choose from {[t for t in FTYPES if t != 'F16']}")
    if types and not args.llamacpp_python:
        p.error("--quantize needs --llamacpp-python (or pass --quantize '' for the F16 file alone)")
    shape = SHAPES[args.shape]
    if args.tied:
        if args.shape != "llama-3.2-1b":
            p.error("--tied: only llama-3.2-1b's head is configurable")
        shape = dataclasses.replace(shape, tied=True)
    from tokenloom.model.loader import default_model_path

    os.makedirs(args.out_dir, exist_ok=True)
    if args.hf_config:
        print(f"{args.shape}: {write_hf_config(args.shape, shape, args.out_dir, default_model_path())}")
        return 0
    f16 = os.path.join(args.out_dir, f"{args.shape}-F16.gguf")
    t0 = time.monotonic()
    write_f16(args.shape, shape, f16, default_model_path(), args.seed)
    print(f"{args.shape}: {f16} ({os.path.getsize(f16) / 2**20:,.0f} MiB, {time.monotonic() - t0:.0f} s)")
    for qtype in types:
        quantize(args.llamacpp_python, f16, os.path.join(args.out_dir, f"{args.shape}-{qtype}.gguf"), qtype, args.threads)
    if types and not args.keep_f16:
        os.remove(f16)
    return 0


if __name__ == "__main__":
    sys.exit(main())
