"""A GGUF file's architecture facts from its metadata (and a Llama 3.1 file's few-dozen rope
frequency factors). No tensor library: the caller's process reads this (gguf_loader.py reads the
weights in the engine core)."""
from __future__ import annotations

import re

import numpy as np

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.errors import ModelLoadError
from tokenloom.model.gguf_file import GGUFFile, dequantize
from tokenloom.model.registry import GGUF_ARCHITECTURES
from tokenloom.ops.ggml_types import GGMLQuantizationType


def gguf_model_config(g: GGUFFile) -> ModelArchConfig:
    md, path = g.metadata, g.path
    gguf_arch = g.architecture
    arch = GGUF_ARCHITECTURES.get(gguf_arch)
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported GGUF architecture {gguf_arch!r} "
                             f"(supported: {', '.join(sorted(GGUF_ARCHITECTURES))})")

    if g.metadata.get(f"{gguf_arch}.expert_count") and arch in _EXPERT_FORMS:
        arch = _EXPERT_FORMS[arch]

    def get(key: str, default=None, required: bool = False):
        full = f"{gguf_arch}.{key}"
        if full not in md:
            if required:
                raise ModelLoadError(f"{path}: missing GGUF metadata key {full!r}")
            return default
        return md[full]

    hidden = int(get("embedding_length", required=True))
    heads = int(get("attention.head_count", required=True))
    kv_heads = int(get("attention.head_count_kv", heads))
    head_dim = int(get("attention.key_length", hidden // heads))
    rot_dim = get("rope.dimension_count")
    if rot_dim is not None and int(rot_dim) != head_dim and arch not in _PARTIAL_ROTARY:
        raise ModelLoadError(f"{path}: partial rotary embedding ({gguf_arch}.rope.dimension_count="
                             f"{rot_dim}, head_dim={head_dim}) is not supported")

    vocab = get("vocab_size")
    if vocab is None:
        embd = g.tensors.get("token_embd.weight")
        vocab = embd.shape[0] if embd is not None else len(md.get("tokenizer.ggml.tokens", []))

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = md.get(f"tokenizer.ggml.{key}")
        if tid is not None and int(tid) not in eos_ids:
            eos_ids.append(int(tid))
    bos = md.get("tokenizer.ggml.bos_token_id")

    n_layers = int(get("block_count", required=True))
    family = GGUF_FAMILY_FIELDS.get(arch)
    return ModelArchConfig(**(dict(
        architecture=arch,
        num_hidden_layers=n_layers,
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length", required=True)),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        vocab_size=int(vocab),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        max_position_embeddings=int(get("context_length", required=True)),
        tie_word_embeddings="output.weight" not in g.tensors,
        rope_scaling=_rope_scaling(g, get),
        attention_bias="blk.0.attn_q.bias" in g.tensors,
        o_proj_bias="blk.0.attn_output.bias" in g.tensors,
        mlp_bias="blk.0.ffn_down.bias" in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        rotary_dim=None if rot_dim is None else int(rot_dim),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=eos_ids,
    ) | (family(g, get, n_layers, head_dim, hidden // heads) if family else {})))


# Our architectures whose GGUFs with experts (`expert_count`) are another family: llama.cpp
# writes Mixtral as `llama`.
_EXPERT_FORMS = {"llama": "mixtral"}

# Architectures whose files may rotate part of each head (rope.dimension_count < head_dim):
# llama.cpp rotates those halves NeoX-style, as HF does.
_PARTIAL_ROTARY = frozenset({"stablelm", "phi3", "glm4"})


def _granite_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    """llama.cpp's names for Granite's multipliers (its converter writes each that is set)."""
    scale = get("attention.scale")
    return dict(attention_multiplier=None if scale is None else float(scale),
                embedding_multiplier=float(get("embedding_scale", 1.0)),
                residual_multiplier=float(get("residual_scale", 1.0)),
                logits_scaling=float(get("logit_scale", 1.0)))


def _olmo2_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    # Its q/k norms span the whole projection (olmo2.py), not each head. llama.cpp also writes
    # OLMo 3 as olmo2, with sliding-window layers.
    if get("attention.sliding_window") is not None:
        raise ModelLoadError(f"{g.path}: olmo2 with sliding-window layers (OLMo 3) is not supported")
    return dict(qk_norm=False)


def _stablelm_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    if get("use_parallel_residual", True):  # llama.cpp's converter writes true where the config is silent
        raise ModelLoadError(f"{g.path}: stablelm.use_parallel_residual=true is not supported")
    if "blk.0.attn_q_norm.weight" in g.tensors:
        raise ModelLoadError(f"{g.path}: StableLM's per-head q/k LayerNorm is not supported")
    return dict(layer_norm=True, rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)))


def _smollm3_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    # The file does not say which layers skip RoPE: llama.cpp fixes every fourth, as SmolLM3's
    # config does by default.
    return dict(nope_layers=tuple(i for i in range(n_layers) if (i + 1) % 4 == 0))


def _gemma3_gguf_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    return _gemma3_fields(get, n_layers, head_dim, hidden_per_head)


def _gemma3_fields(get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    """What llama.cpp's Gemma 3 GGUF leaves to the architecture: one full-attention layer in six
    (unless the file says otherwise), local RoPE base 10,000, and the attention scale: llama.cpp's
    rule, query_pre_attn_scalar = head_dim, except hidden / heads for the 27B (62 layers), which
    are the checkpoints' own values (256 for the 270M to 12B, 168 for the 27B)."""
    pattern = get("attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer converters: one flag per layer, true = sliding
        sliding = [bool(p) for p in pattern]
    else:
        period = int(pattern) if pattern is not None else 6
        sliding = [bool((i + 1) % period) for i in range(n_layers)]
    window = get("attention.sliding_window")
    softcap = get("final_logit_softcapping")
    return dict(
        sliding_window=None if window is None else int(window),
        layer_types=tuple("sliding_attention" if s else "full_attention" for s in sliding),
        rope_local_theta=float(get("rope.freq_base_swa", 10_000.0)),
        query_pre_attn_scalar=float(hidden_per_head if n_layers == 62 else head_dim),
        final_logit_softcapping=None if softcap is None else float(softcap),
    )


def _rope_scaling(g: GGUFFile, get) -> dict | None:
    # llama.cpp writes Llama 3.1's scaling as per-pair frequency divisors in a `rope_freqs`
    # tensor rather than as metadata; 64-odd float32s, cheap to read here.
    freqs = g.tensors.get("rope_freqs.weight")
    if freqs is not None:
        values = dequantize(g.raw(freqs), freqs.ggml_type).astype(np.float32).reshape(-1)
        return {"rope_type": "freq_factors", "freq_factors": values.tolist()}
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    scaling: dict = {"rope_type": str(kind)}
    factor = get("rope.scaling.factor")
    if factor is not None:
        scaling["factor"] = float(factor)
    original = get("rope.scaling.original_context_length")
    if original is not None:
        scaling["original_max_position_embeddings"] = int(original)
    for key in ("low_freq_factor", "high_freq_factor"):
        value = get(f"rope.scaling.{key}")
        if value is not None:
            scaling[key] = float(value)
    for ours, theirs in (("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow")):
        value = get(f"rope.scaling.{theirs}")
        if value is not None:
            scaling[ours] = float(value)
    return scaling


# Our architecture name -> what its GGUF metadata adds to the common fields (as hf_config's
# FAMILY_FIELDS): (file, get(key, default), layers, head_dim, hidden / heads) -> fields.
def _gemma2_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    """What llama.cpp's Gemma 2 GGUF leaves to the architecture: every other layer sliding, from
    the first; the attention scale by llama.cpp's rule, query_pre_attn_scalar = head_dim but
    hidden / heads for the 27B (46 layers), the checkpoints' own values."""
    window = get("attention.sliding_window")
    caps = {key: get(key) for key in ("attn_logit_softcapping", "final_logit_softcapping")}
    return dict(
        sliding_window=None if window is None else int(window),
        layer_types=tuple("sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n_layers)),
        query_pre_attn_scalar=float(hidden_per_head if n_layers == 46 else head_dim),
        **{key: None if cap is None else float(cap) for key, cap in caps.items()},
    )


def _phi3_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    """llama.cpp's Phi-3: a sliding window over every layer (0: none, Phi-4), and LongRoPE as
    `rope_factors_long` / `rope_factors_short` tensors with its attention factor."""
    window = int(get("attention.sliding_window", 0) or 0)
    fields: dict = {}
    if window > 0:
        fields |= {"sliding_window": window, "layer_types": ("sliding_attention",) * n_layers}
    long, short = g.tensors.get("rope_factors_long.weight"), g.tensors.get("rope_factors_short.weight")
    if long is not None and short is not None:
        def values(info) -> list[float]:
            return dequantize(g.raw(info), info.ggml_type).astype(np.float32).reshape(-1).tolist()
        fields["rope_scaling"] = {
            "rope_type": "longrope", "long_factor": values(long), "short_factor": values(short),
            "original_max_position_embeddings": int(get("rope.scaling.original_context_length", required=True)),
            "attention_factor": float(get("rope.scaling.attn_factor", 1.0))}
    return fields


def _glm4_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    return dict(rotary_dim=int(get("rope.dimension_count", head_dim // 2)))


def _cohere_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    """llama.cpp's Command-R: LayerNorm eps and logit_scale (our logits_scaling divides); Command
    R+'s per-head q/k LayerNorm is refused as it is for an HF directory."""
    if "blk.0.attn_q_norm.weight" in g.tensors:
        raise ModelLoadError(f"{g.path}: per-head q/k LayerNorm (Command R+, attn_q_norm) is not supported")
    return dict(rms_norm_eps=float(get("attention.layer_norm_epsilon", 1e-5)),
                logits_scaling=1.0 / float(get("logit_scale", required=True)), qk_norm=False)


def _moe_fields(g: GGUFFile, get, n_layers: int, norm: bool) -> dict:
    """The experts' counts and width (expert_feed_forward_length; Mixtral's converter writes only
    feed_forward_length), whether the k weights are renormalised (expert_weights_norm where the
    file says; else llama.cpp's fixed choice for the architecture, `norm`), and the layers with a
    dense MLP (those without a router tensor)."""
    E, k = int(get("expert_count", required=True)), int(get("expert_used_count", required=True))
    if not 1 <= k <= E:
        raise ModelLoadError(f"{g.path}: expert_used_count must be between 1 and the {E} experts, got {k}")
    width = get("expert_feed_forward_length") or get("feed_forward_length", required=True)
    return dict(num_experts=E, num_experts_per_tok=k, moe_intermediate_size=int(width),
                norm_topk_prob=bool(get("expert_weights_norm", norm)),
                mlp_only_layers=tuple(i for i in range(n_layers) if f"blk.{i}.ffn_gate_inp.weight" not in g.tensors),
                shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)))


def _qwen3_moe_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    return _moe_fields(g, get, n_layers, norm=True)


def _qwen2_moe_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    return _moe_fields(g, get, n_layers, norm=False)


def _mixtral_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    return _moe_fields(g, get, n_layers, norm=True)


def _gpt_oss_fields(g: GGUFFile, get, n_layers: int, head_dim: int, hidden_per_head: int) -> dict:
    """What llama.cpp's gpt-oss leaves to the architecture (as hf_config's gpt-oss fields): q/k/v
    and o biases, attention sinks, every even layer sliding, the clamped SwiGLU's alpha and limit
    (llama.cpp fixes transformers' defaults) and YaRN without truncating its ramp (gpt-oss's
    `truncate: false`). Experts stay MXFP4 where every expert tensor of the file is MXFP4."""
    window = get("attention.sliding_window")
    experts = [i for name, i in g.tensors.items() if re.fullmatch(r"blk\.\d+\.ffn_(gate|up|down)_exps\.weight", name)]
    rope = _rope_scaling(g, get)
    return _moe_fields(g, get, n_layers, norm=False) | dict(
        attention_sinks=True, mlp_bias=False, mlp_only_layers=(),
        sliding_window=None if window is None else int(window),
        layer_types=tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)),
        rope_scaling=rope if rope is None or rope["rope_type"] != "yarn" else rope | {"truncate": False},
        experts_mxfp4=bool(experts) and all(i.ggml_type == GGMLQuantizationType.MXFP4 for i in experts))


GGUF_FAMILY_FIELDS = {
    "gemma3": _gemma3_gguf_fields,
    "granite": _granite_fields,
    "olmo2": _olmo2_fields,
    "stablelm": _stablelm_fields,
    "smollm3": _smollm3_fields,
    "gemma2": _gemma2_fields,
    "phi3": _phi3_fields,
    "glm4": _glm4_fields,
    "cohere": _cohere_fields,
    "qwen3_moe": _qwen3_moe_fields,
    "qwen2_moe": _qwen2_moe_fields,
    "mixtral": _mixtral_fields,
    "gpt_oss": _gpt_oss_fields,
}
