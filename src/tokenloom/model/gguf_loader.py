"""GGUF (llama.cpp) checkpoints' tensors, dequantized, renamed to HF's names and with llama.cpp's
q/k row order undone (the architecture config is read by gguf_config.py).

Every tensor is checked (present, of a type we can dequantize, of the shape the config implies)
before any is dequantized, so a bad file fails in milliseconds with a message naming the tensor.
"""
from __future__ import annotations

import os
import re
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.errors import ModelLoadError
from tokenloom.model.gguf_file import GGUFFile, GGUFTensorInfo
from tokenloom.model.registry import GGUF_ARCHITECTURES
from tokenloom.ops.ggml_types import GGML_QUANT_SIZES, Q

# Types we dequantize. gguf-py knows more (IQ*, TQ*, ...), but these are the ones the llama.cpp
# quantizers produce for ordinary Llama/Qwen files (and gpt-oss's MXFP4 experts, which a gpt-oss
# model keeps packed: `MXFP4_KEPT`) and the ones tests cover.
SUPPORTED_GGML_TYPES = (Q.F32, Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0,
                        Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.MXFP4)
_SUPPORTED_IDS = frozenset(int(t) for t in SUPPORTED_GGML_TYPES)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output_norm.bias": "model.norm.bias",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_norm.bias": "input_layernorm.bias",
    "ffn_norm.bias": "post_attention_layernorm.bias",
    "ffn_gate.bias": "mlp.gate_proj.bias",
    "ffn_up.bias": "mlp.up_proj.bias",
    "ffn_down.bias": "mlp.down_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Gemma 3 norms around both blocks: llama.cpp's `ffn_norm` is its pre-feedforward norm.
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# OLMo 2 norms each block's output only (its q/k norms span the whole projection: same names).
_OLMO2_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith(("attn_norm", "ffn_norm"))},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
# Phi-3: q/k/v and gate/up fused, as in its HF checkpoint (`ffn_up` holds gate then up).
_PHI3_LAYER_NAMES = {**_LAYER_NAMES, "attn_qkv.weight": "self_attn.qkv_proj.weight",
                     "ffn_up.weight": "mlp.gate_up_proj.weight"}
# GLM-4: norms after attention and MLP (GLM's HF names), gate/up fused.
_GLM4_LAYER_NAMES = {**_LAYER_NAMES, "post_attention_norm.weight": "post_self_attn_layernorm.weight",
                     "post_ffw_norm.weight": "post_mlp_layernorm.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"}
# Mixtures of experts (model/moe.py): the router, the experts stacked [E, ...] in one tensor per
# part (`{e}` marks the expert index: check_gguf_tensors cuts the stack into the checkpoint's
# per-expert tensors) and Qwen2-MoE's shared expert. llama.cpp writes Mixtral as `llama`, so
# Llama's table holds Mixtral's names.
_MIXTRAL_LAYER_NAMES = {**_LAYER_NAMES, "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
                        "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
                        "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
                        "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight"}
_QWEN_MOE_LAYER_NAMES = {**_LAYER_NAMES, "ffn_gate_inp.weight": "mlp.gate.weight",
                         "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
                         "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
                         "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
                         "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
                         "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
                         "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
                         "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight"}
# gpt-oss: the names llama.cpp's converter maps to its tensors, its experts' parts apart and
# stacked (gate and up from the checkpoint's interleaved gate_up_proj; [E, out, in], biases
# [E, out]); gpt_oss.GptOssForCausalLM.gguf_checkpoint_shapes expects these.
_GPT_OSS_LAYER_NAMES = {
    **{k: v for k, v in _LAYER_NAMES.items() if not k.startswith(("ffn_", "post_"))},
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "attn_sinks.weight": "self_attn.sinks",
    "ffn_gate_inp.weight": "mlp.router.weight", "ffn_gate_inp.bias": "mlp.router.bias",
    **{f"ffn_{part}_exps.{kind}": f"mlp.experts.{part}_proj.{kind}"
       for part in ("gate", "up", "down") for kind in ("weight", "bias")},
}
# Gemma 2: Gemma 3's names (llama.cpp's converter writes no q/k norm for it).
_ARCH_LAYER_NAMES = {"gemma3": _GEMMA3_LAYER_NAMES, "olmo2": _OLMO2_LAYER_NAMES, "gemma2": _GEMMA3_LAYER_NAMES,
                     "phi3": _PHI3_LAYER_NAMES, "glm4": _GLM4_LAYER_NAMES, "llama": _MIXTRAL_LAYER_NAMES,
                     "mixtral": _MIXTRAL_LAYER_NAMES, "qwen3_moe": _QWEN_MOE_LAYER_NAMES,
                     "qwen2_moe": _QWEN_MOE_LAYER_NAMES, "gpt_oss": _GPT_OSS_LAYER_NAMES}

# Our architectures whose q/k rows llama.cpp's converter permutes (its LlamaModel and the classes
# built on it: Mistral's files are `llama`, Granite, SmolLM3); the others keep HF's order.
PERMUTED_QK = frozenset({"llama", "granite", "smollm3", "mixtral"})
_HF_TO_GGUF_GLOBAL = {v: k for k, v in _GLOBAL_NAMES.items()}

# GGUF files of these architectures store each RMSNorm weight as 1 + w (llama.cpp's converter
# folds Gemma's (1 + w) scaling into the weight; transformers' GGUF loader subtracts the 1 again).
_NORM_PLUS_ONE = frozenset({"gemma", "gemma2", "gemma3"})


def _layer_names(arch: str) -> dict[str, str]:
    return _ARCH_LAYER_NAMES.get(arch, _LAYER_NAMES)


def gguf_to_hf_name(name: str, arch: str = "llama") -> str | None:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if name.startswith("blk."):
        _, layer, rest = name.split(".", 2)
        suffix = _layer_names(arch).get(rest)
        if suffix is not None and layer.isdigit():
            return f"model.layers.{layer}.{suffix}"
    return None  # e.g. rope_freqs.weight (read into the config), or tensors we do not use


def hf_to_gguf_name(name: str, arch: str = "llama") -> str:
    if name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[name]
    _, _, layer, rest = name.split(".", 3)  # model.layers.N.<rest>
    to_gguf = {v: k for k, v in _layer_names(arch).items()}
    expert = re.fullmatch(r"(.*\.experts)\.(\d+)\.(.*)", rest)
    if expert:  # one expert of a stacked tensor
        return f"blk.{layer}.{to_gguf[f'{expert.group(1)}.{{e}}.{expert.group(3)}']}[{expert.group(2)}]"
    return f"blk.{layer}.{to_gguf[rest]}"


def _expert_slices(info: GGUFTensorInfo) -> list[GGUFTensorInfo]:
    """A stacked expert tensor [E, rows, cols] -> E tensors [rows, cols], each a byte range of
    the file (expert e's bytes follow expert e - 1's), named `name[e]`."""
    E = info.shape[0]
    step = info.nbytes // E
    return [GGUFTensorInfo(f"{info.name}[{e}]", info.shape[1:], info.ggml_type, info.offset + e * step, step,
                           info.part) for e in range(E)]


def _squeezed(shape: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


# ----------------------------------------------------------------------------------- tensors
def _to_torch(g: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    """The tensor as stored, dequantized: float32, or float16/bfloat16 for those types."""
    raw = g.raw(info)
    if info.ggml_type == Q.F32:
        return torch.from_numpy(raw.view(np.float32).copy())
    if info.ggml_type == Q.F16:
        return torch.from_numpy(raw.view(np.float16).copy())
    if info.ggml_type == Q.BF16:
        return torch.from_numpy(raw.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(_dequantize_in_chunks(raw, Q(info.ggml_type)))


# Output bytes a dequantize call makes at a time: gguf's numpy dequantization holds several
# arrays of its output's size, which for a whole embedding table (Gemma 3 270M: 671 MB) raised
# the load's peak resident memory by gigabytes; in chunks it holds one output and small pieces.
_DEQUANT_CHUNK_BYTES = 16 << 20


def _dequantize_in_chunks(raw: np.ndarray, qtype: Q) -> np.ndarray:
    """`dequantize(raw, qtype)` (float32 `[*rows, elements]`), a few thousand rows at a time."""
    from gguf.quants import dequantize  # see ops/ggml_types for why here

    block, type_size = GGML_QUANT_SIZES[qtype]
    rows = raw.reshape(-1, raw.shape[-1])
    out = np.empty((rows.shape[0], raw.shape[-1] // type_size * block), dtype=np.float32)
    step = max(1, _DEQUANT_CHUNK_BYTES // max(1, out.shape[1] * 4))
    for r in range(0, rows.shape[0], step):
        out[r:r + step] = dequantize(rows[r:r + step], qtype)
    return out.reshape(*raw.shape[:-1], out.shape[1])


def mxfp4_bytes(g: GGUFFile, info: GGUFTensorInfo) -> torch.Tensor:
    """An MXFP4 tensor's blocks as stored, uint8 [*rows, cols / 32, 17] (a block: its E8M0 scale
    byte, then 16 bytes of E2M1 pairs in ggml's order; model/mxfp4.from_ggml reads them)."""
    raw = g.raw(info)
    t = torch.from_numpy(raw.reshape(*raw.shape[:-1], -1, 17).copy())
    g.release(info)
    return t


def _undo_llama_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """llama.cpp's converter reorders each head's rows of Llama's q/k from [first half, second
    half] (HF's rotate-half pairing) to interleaved pairs (row i of each half side by side). Put
    them back: view the interleaved rows as [head, pair, 2] and swap the last two axes."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def check_gguf_tensors(g: GGUFFile, expected: dict[str, tuple[int, ...]]) -> dict[str, GGUFTensorInfo]:
    """HF name -> tensor info, for every tensor the model expects; raises on the first missing,
    unsupported or wrong-shaped one."""
    found: dict[str, GGUFTensorInfo] = {}
    arch = GGUF_ARCHITECTURES.get(g.architecture, "llama")
    for info in g.tensors.values():
        hf = gguf_to_hf_name(info.name, arch)
        if hf is not None and "{e}" in hf and len(info.shape) == 3:
            for e, sub in enumerate(_expert_slices(info)):
                if (name := hf.format(e=e)) in expected:
                    found[name] = sub
        elif hf in expected:
            found[hf] = info
    for hf, shape in expected.items():
        info = found.get(hf)
        if info is None:
            raise ModelLoadError(f"{hf_to_gguf_name(hf, arch)}: missing tensor (expected shape {shape}) in {g.path}")
        if info.ggml_type not in _SUPPORTED_IDS:
            raise ModelLoadError(
                f"{info.name}: unsupported tensor type {info.type_name} in {g.path} "
                f"(supported: {', '.join(t.name for t in SUPPORTED_GGML_TYPES)})")
        # ([H] and [1, H] are one tensor: llama.cpp reads Qwen2-MoE's shared-expert gate as [H])
        if info.shape != shape and _squeezed(info.shape) != _squeezed(shape):
            raise ModelLoadError(
                f"{info.name}: expected shape {shape}, got {info.shape} in {g.path} "
                f"(row-major order; GGUF ne order is the reverse: got ne={info.ne})")
    return found


def iter_gguf_weights(g: GGUFFile, config: ModelArchConfig, expected: dict[str, tuple[int, ...]],
                      dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor in `dtype`) for every expected tensor, dequantized on a few threads
    (numpy releases the GIL in the bulk of `dequantize`), in file order, with at most a small
    window of dequantized tensors alive at a time."""
    found = check_gguf_tensors(g, expected)
    permuted = config.architecture in PERMUTED_QK
    norm_plus_one = config.architecture in _NORM_PLUS_ONE

    def convert(item: tuple[str, GGUFTensorInfo]) -> tuple[str, torch.Tensor]:
        hf, info = item
        if config.experts_mxfp4 and info.ggml_type == Q.MXFP4:
            return hf, mxfp4_bytes(g, info)
        t = _to_torch(g, info)
        g.release(info)
        if permuted and info.name.endswith(("attn_q.weight", "attn_k.weight", "attn_q.bias", "attn_k.bias")):
            heads = config.num_attention_heads if "attn_q" in info.name else config.num_key_value_heads
            t = _undo_llama_permute(t, heads)
        if norm_plus_one and hf.endswith("norm.weight"):
            t = t.float() - 1.0
        return hf, t.to(dtype)

    items = sorted(found.items(), key=lambda kv: kv[1].offset)
    workers = max(1, min(4, os.cpu_count() or 1))
    with ThreadPoolExecutor(workers, thread_name_prefix="gguf-dequant") as pool:
        window: deque = deque()
        it = iter(items)
        for item in it:
            window.append(pool.submit(convert, item))
            if len(window) >= 2 * workers:
                break
        while window:
            result = window.popleft().result()
            nxt = next(it, None)
            if nxt is not None:
                window.append(pool.submit(convert, nxt))
            yield result
