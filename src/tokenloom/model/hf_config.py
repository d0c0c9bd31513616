"""An HF model directory's architecture facts: `config.json` and the EOS ids of
`generation_config.json`. No tensor library: the caller's process reads this (hf_loader.py
reads the weights in the engine core)."""
from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.errors import ModelLoadError, ModelNotFoundError
from tokenloom.model.registry import HF_ARCHITECTURES


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path}: invalid JSON ({e})") from None


def _token_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either layout: transformers 5's `rope_parameters` (theta inside) or
    the older top-level `rope_theta` + `rope_scaling`."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg.get("rope_scaling") or {})
    if "type" in scaling and "rope_type" not in scaling:
        scaling["rope_type"] = scaling.pop("type")
    if scaling.get("rope_type", "default") == "default":
        return theta, None
    return theta, scaling


def _scaled_context(max_positions: int, scaling: dict[str, Any] | None) -> int:
    """The positions a scaled RoPE reaches, as vLLM derives them: dynamic NTK and YaRN stretch the
    original context by `factor` (and record the original in `scaling`)."""
    kind = (scaling or {}).get("rope_type")
    if kind not in ("dynamic", "yarn"):
        return max_positions
    assert scaling is not None
    if kind == "dynamic":  # transformers grows the base past max_position_embeddings, whatever else is set
        scaling["original_max_position_embeddings"] = max_positions
    original = int(scaling.setdefault("original_max_position_embeddings", max_positions))
    return max(max_positions, int(original * float(scaling["factor"])))


def read_config_json(directory: str, hf_overrides: dict[str, Any] | None = None,
                     convert: str = "auto") -> dict[str, Any]:
    """config.json as the engine reads it: vLLM's `hf_overrides` replace its top-level keys, and
    `convert="classify"` makes a `*ForCausalLM` a `*ForSequenceClassification` (vLLM's
    as_seq_cls_model: the same decoder with a `score` head, read from the checkpoint or made
    from LM-head rows by `classifier_from_token`)."""
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{directory}: no config.json (expected an HF model directory or a .gguf file)")
    cfg = _read_json(path) | dict(hf_overrides or {})
    if convert == "classify":
        cfg["architectures"] = [n.replace("ForCausalLM", "ForSequenceClassification")
                                for n in cfg.get("architectures") or []]
    return cfg


def hf_model_config(directory: str, hf_overrides: dict[str, Any] | None = None,
                    convert: str = "auto") -> ModelArchConfig:
    path = os.path.join(directory, "config.json")
    cfg = read_config_json(directory, hf_overrides, convert)
    names = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), None)
    if arch is None:
        raise ModelLoadError(f"{path}: unsupported architecture {names or cfg.get('model_type')!r} "
                             f"(supported: {', '.join(HF_ARCHITECTURES)})")

    def need(key: str) -> Any:
        if key not in cfg:
            raise ModelLoadError(f"{path}: missing key {key!r}")
        return cfg[key]

    hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
    theta, scaling = _rope(cfg)
    max_positions = _scaled_context(int(need("max_position_embeddings")), scaling)
    eos = _token_ids(cfg.get("eos_token_id"))
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.isfile(gen_path):
        eos = _token_ids(_read_json(gen_path).get("eos_token_id")) or eos
    # Llama's reading of config.json; a family's FAMILY_FIELDS entry adds or replaces fields.
    fields: dict[str, Any] = dict(
        architecture=arch,
        num_hidden_layers=int(need("num_hidden_layers")),
        hidden_size=hidden,
        intermediate_size=int(need("intermediate_size")),
        num_attention_heads=heads,
        num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=int(cfg.get("head_dim") or hidden // heads),
        vocab_size=int(need("vocab_size")),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope_theta=theta,
        max_position_embeddings=max_positions,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        rope_scaling=scaling,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        **_classifier_fields(cfg, path, directory, names[0].endswith("ForSequenceClassification")),
    )
    return ModelArchConfig(**(fields | FAMILY_FIELDS.get(arch, _llama_fields)(cfg, path)))


def _llama_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """What Llama reads beyond the common fields: SiLU only, `attention_bias` on q/k/v and o_proj,
    `mlp_bias` on gate/up/down, no sliding window."""
    act = cfg.get("hidden_act", "silu")
    if act != "silu":
        raise ModelLoadError(f"{path}: unsupported hidden_act {act!r} (expected 'silu')")
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        raise ModelLoadError(f"{path}: sliding-window attention (use_sliding_window=true) is not supported "
                             f"for {cfg['architectures'][0]}")
    bias = bool(cfg.get("attention_bias"))
    return {"attention_bias": bias, "o_proj_bias": bias, "mlp_bias": bool(cfg.get("mlp_bias"))}


def _sliding_fields(path: str, n_layers: int, window: Any, layer_types: Any) -> dict[str, Any]:
    """sliding_window and layer_types (HF's names, one per layer) where a window applies."""
    if not window:
        return {}
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ModelLoadError(f"{path}: sliding_window must be a positive integer, got {window!r}")
    types = tuple(layer_types)
    if len(types) != n_layers:
        raise ModelLoadError(f"{path}: layer_types has {len(types)} entries for {n_layers} layers")
    return {"sliding_window": int(window), "layer_types": types}


def _mistral_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Llama with a sliding window over every layer where the config sets one (Mistral 7B v0.1;
    later ones set null). Its attention and MLP have no biases whatever the config says."""
    n = int(cfg.get("num_hidden_layers", 0))
    return (_llama_fields(cfg | {"use_sliding_window": False}, path)
            | {"attention_bias": False, "o_proj_bias": False, "mlp_bias": False}
            | _sliding_fields(path, n, cfg.get("sliding_window"), ["sliding_attention"] * n))


def _qwen2_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Qwen2 always has q/k/v biases (config.json does not say so) and none on o_proj or the MLP.
    With use_sliding_window, the layers from max_window_layers on see the window (or as its
    layer_types say)."""
    n = int(cfg.get("num_hidden_layers", 0))
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    first = int(cfg.get("max_window_layers", 28))
    types = cfg.get("layer_types") or ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return (_llama_fields(cfg | {"use_sliding_window": False}, path)
            | {"attention_bias": True, "o_proj_bias": False, "mlp_bias": False}
            | _sliding_fields(path, n, window, types))


def _qwen3_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    return _llama_fields(cfg, path) | {"qk_norm": True, "mlp_bias": False}


def _granite_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Llama with four scalars: the embedding's, the residual branches', the attention scale
    (attention_multiplier replaces head_dim ** -0.5; transformers' default is 1) and the logits'
    divisor."""
    return _llama_fields(cfg, path) | {
        "embedding_multiplier": float(cfg.get("embedding_multiplier", 1.0)),
        "residual_multiplier": float(cfg.get("residual_multiplier", 1.0)),
        "attention_multiplier": float(cfg.get("attention_multiplier", 1.0)),
        "logits_scaling": float(cfg.get("logits_scaling", 1.0)),
    }


def _olmo2_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    # The layer layout (post-norms, q/k norm over the whole projection) is olmo2.py's; its MLP
    # has no bias.
    return _llama_fields(cfg, path) | {"mlp_bias": False}


def _smollm3_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Llama with NoPE layers: `no_rope_layers[i]` is 1 where layer i uses RoPE, 0 where not
    (default: every `no_rope_layer_interval`-th layer is NoPE); a sliding window only with
    use_sliding_window, on the layers its layer_types say."""
    n = int(cfg.get("num_hidden_layers", 0))
    flags = cfg.get("no_rope_layers")
    if flags is None:
        interval = int(cfg.get("no_rope_layer_interval", 4))
        flags = [int((i + 1) % interval != 0) for i in range(n)]
    if len(flags) != n:
        raise ModelLoadError(f"{path}: no_rope_layers has {len(flags)} entries for {n} layers")
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    types = cfg.get("layer_types") or ["full_attention"] * n
    return (_llama_fields(cfg | {"use_sliding_window": False}, path)
            | {"nope_layers": tuple(i for i, f in enumerate(flags) if not f)}
            | _sliding_fields(path, n, window, types))


def _stablelm_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Llama with LayerNorms (with bias), RoPE on the first partial_rotary_factor of each head,
    and q/k/v biases with use_qkv_bias. StableLM 2 12B's per-head q/k LayerNorm and parallel
    residual are refused."""
    for key in ("qk_layernorm", "use_parallel_residual"):
        if cfg.get(key):
            raise ModelLoadError(f"{path}: {key}=true is not supported for StableLmForCausalLM")
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = float(cfg.get("partial_rotary_factor") or params.get("partial_rotary_factor") or 0.25)
    head_dim = int(cfg["hidden_size"]) // int(cfg["num_attention_heads"])
    return _llama_fields(cfg | {"attention_bias": False, "mlp_bias": False}, path) | {
        "layer_norm": True, "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
        "rotary_dim": int(head_dim * factor), "attention_bias": bool(cfg.get("use_qkv_bias")),
        "head_dim": head_dim,
    }


def _gpt_oss_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """q/k/v and o biases, attention sinks, sliding-window layers alternating with full ones
    (layer_types; transformers' default: the even layers slide), experts of width
    intermediate_size routed by a biased router, the clamped SwiGLU's alpha and limit, and the
    experts' MXFP4 weights where quantization_config says so."""
    n = int(cfg.get("num_hidden_layers", 0))
    types = cfg.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    method = (cfg.get("quantization_config") or {}).get("quant_method")
    if method not in (None, "mxfp4"):
        raise ModelLoadError(f"{path}: quantization_config.quant_method {method!r} is not supported for "
                             "GptOssForCausalLM (expected 'mxfp4', or none for float experts)")
    bias = bool(cfg.get("attention_bias", True))
    experts, top_k = int(cfg.get("num_local_experts", 0)), int(cfg.get("num_experts_per_tok", 0))
    if not 1 <= top_k <= experts:
        raise ModelLoadError(f"{path}: num_experts_per_tok must be between 1 and num_local_experts ({experts}), "
                             f"got {top_k}")
    return {"attention_bias": bias, "o_proj_bias": bias, "mlp_bias": False, "attention_sinks": True,
            "num_experts": experts, "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "swiglu_alpha": float(cfg.get("swiglu_alpha", 1.702)), "swiglu_limit": float(cfg.get("swiglu_limit", 7.0)),
            "experts_mxfp4": method == "mxfp4"} | _sliding_fields(path, n, cfg.get("sliding_window"), types)


# vLLM's ways of making a classifier's `score` head from LM-head rows (`method`, with the
# tokens in `classifier_from_token`): "from_2_way_softmax" is one label, the row of the second
# token minus the first's, so its sigmoid is the two tokens' softmax (Qwen3-Reranker's "yes"
# against "no"); "no_post_processing" is one label per token, their rows as they are.
CLASSIFIER_METHODS = ("from_2_way_softmax", "no_post_processing")


def _classifier_fields(cfg: dict[str, Any], path: str, directory: str, classifier: bool) -> dict[str, Any]:
    """classifier_labels, and for a head made from LM-head rows classifier_token_ids and
    classifier_method (see CLASSIFIER_METHODS); errors name the config.json / hf_overrides key."""
    tokens, method = cfg.get("classifier_from_token"), cfg.get("method")
    if cfg.get("is_original_qwen3_reranker"):
        method = "from_2_way_softmax"  # as vLLM's Qwen3ForSequenceClassification config does
    if tokens is None and method is None:
        return {"classifier_labels": _classifier_labels(cfg, path) if classifier else None}
    if not classifier:
        raise ModelLoadError(f"{path}: classifier_from_token makes a sequence classifier's score head, but the "
                             f"architecture is {cfg.get('architectures')!r}: also set architectures to "
                             "*ForSequenceClassification in hf_overrides, or convert='classify'")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise ModelLoadError(f"{path}: classifier_from_token must be a list of vocabulary tokens, e.g. "
                             f'["no", "yes"], got {tokens!r}')
    if method not in CLASSIFIER_METHODS:
        raise ModelLoadError(f"{path}: method must be one of {', '.join(CLASSIFIER_METHODS)} to make the score head "
                             f"from classifier_from_token (is_original_qwen3_reranker sets the first), got {method!r}")
    if method == "from_2_way_softmax" and len(tokens) != 2:
        raise ModelLoadError(f"{path}: method from_2_way_softmax takes two classifier_from_token (the false "
                             f"token, then the true one), got {len(tokens)}: {tokens!r}")
    n = 1 if method == "from_2_way_softmax" else len(tokens)
    # A language model scoring a pair reads the two texts joined (vLLM's use_sep_token, formerly
    # use_pad_token, is false for these unless the config says otherwise).
    use_sep_token = bool(cfg.get("use_sep_token", cfg.get("use_pad_token", False)))
    return {"classifier_labels": tuple(f"LABEL_{i}" for i in range(n)), "use_sep_token": use_sep_token,
            "classifier_token_ids": _vocabulary_ids(directory, tokens), "classifier_method": method}


def _vocabulary_ids(directory: str, tokens: list[str]) -> tuple[int, ...]:
    """Each token's id in the checkpoint's vocabulary, as the tokenizer's convert_tokens_to_ids
    (a token, not text to encode: "yes" and "Ġyes" are different tokens)."""
    from tokenizers import Tokenizer

    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
        raise ModelNotFoundError(f"{directory}: classifier_from_token needs tokenizer.json to find the tokens' ids")
    tokenizer = Tokenizer.from_file(path)
    ids = [tokenizer.token_to_id(t) for t in tokens]
    missing = [t for t, i in zip(tokens, ids) if i is None]
    if missing:
        raise ModelLoadError(f"{directory}: classifier_from_token {missing!r} not in the tokenizer's vocabulary")
    return tuple(ids)


def _classifier_labels(cfg: dict[str, Any], path: str) -> tuple[str, ...]:
    """A sequence classifier's labels in class order: config.json's id2label (transformers writes
    it for every classifier), else num_labels of transformers' default names LABEL_0, LABEL_1, ..."""
    id2label = cfg.get("id2label")
    if isinstance(id2label, dict) and id2label:
        try:
            labels = {int(k): str(v) for k, v in id2label.items()}
        except (TypeError, ValueError):
            raise ModelLoadError(f"{path}: id2label keys must be class indices, got {sorted(id2label)[:3]}") from None
        if sorted(labels) != list(range(len(labels))):
            raise ModelLoadError(f"{path}: id2label must name the classes 0..{len(labels) - 1}, got {sorted(labels)}")
        return tuple(labels[i] for i in range(len(labels)))
    n = cfg.get("num_labels", 2)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ModelLoadError(f"{path}: num_labels must be a positive integer, got {n!r}")
    return tuple(f"LABEL_{i}" for i in range(n))


def _gemma3_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Gemma 3's fields of ModelArchConfig (and its RoPE, which differs per layer type) from a
    `gemma3_text` config.json, in transformers 5's layout (`rope_parameters` per layer type) or
    the older one (`rope_theta`, `rope_local_base_freq`, `rope_scaling`); the defaults are
    transformers' `Gemma3TextConfig`'s."""
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ModelLoadError(f"{path}: unsupported hidden_activation {act!r} (expected 'gelu_pytorch_tanh')")
    if cfg.get("attn_logit_softcapping") is not None:
        raise ModelLoadError(f"{path}: attn_logit_softcapping is not supported")
    if cfg.get("use_bidirectional_attention"):
        raise ModelLoadError(f"{path}: use_bidirectional_attention=true is not supported")
    n = int(cfg.get("num_hidden_layers", 0))
    layer_types = cfg.get("layer_types")
    if layer_types is None:  # the older config's pattern: every sixth layer is global
        pattern = int(cfg.get("sliding_window_pattern", 6))
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "full_attention" in params:
        full = dict(params.get("full_attention") or {})
        local = dict(params.get("sliding_attention") or {})
        theta = float(full.pop("rope_theta", 1_000_000.0))
        local_theta = float(local.get("rope_theta", 10_000.0))
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"{path}: scaled RoPE on the sliding-window layers is not supported")
        scaling = full if full.get("rope_type", "default") != "default" else None
    else:
        theta = float(cfg.get("rope_theta", 1_000_000.0))
        local_theta = float(cfg.get("rope_local_base_freq", 10_000.0))
        scaling = dict(cfg.get("rope_scaling") or {}) or None
        if scaling is not None and "type" in scaling and "rope_type" not in scaling:
            scaling["rope_type"] = scaling.pop("type")
        if scaling is not None and scaling.get("rope_type", "default") == "default":
            scaling = None
    window = cfg.get("sliding_window")
    return dict(
        qk_norm=True,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        rope_theta=theta,
        rope_scaling=scaling,
        rope_local_theta=local_theta,
        sliding_window=None if window is None else int(window),
        layer_types=tuple(layer_types),
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        final_logit_softcapping=cfg.get("final_logit_softcapping"),
    )

# ------------------------------------------------ Gemma, Gemma 2, Phi-3/4, GLM-4, Command-R
# transformers' names for Gemma's tanh-approximated GELU ("gelu" is the legacy spelling that
# transformers itself maps to the tanh approximation for Gemma).
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")


def _refuse(cfg: dict[str, Any], path: str, *keys: str) -> None:
    for key in keys:
        if cfg.get(key):
            raise ModelLoadError(f"{path}: {key}={cfg[key]!r} is not supported for {cfg['architectures'][0]}")


def _activation(cfg: dict[str, Any], path: str, allowed: tuple[str, ...]) -> None:
    act = cfg.get("hidden_activation") or cfg.get("hidden_act") or allowed[0]
    if act not in allowed:
        raise ModelLoadError(f"{path}: unsupported hidden activation {act!r} (expected one of {', '.join(allowed)})")


def _rotary_dim(cfg: dict[str, Any], default_factor: float) -> int:
    """head_dim times partial_rotary_factor (transformers 5 keeps it in rope_parameters, older
    configs at the top level), rounded down as transformers does."""
    params = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
    factor = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", default_factor)))
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // int(cfg["num_attention_heads"]))
    return int(head_dim * factor)


def _gemma_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Gemma 1 (gemma.py): GeGLU, (1 + w) norms, a scaled embedding, the LM head tied."""
    _activation(cfg, path, _GELU_TANH)
    _refuse(cfg, path, "attention_bias", "use_bidirectional_attention")
    if not cfg.get("tie_word_embeddings", True):
        raise ModelLoadError(f"{path}: tie_word_embeddings=false is not supported for {cfg['architectures'][0]} "
                             "(its LM head is the embedding)")
    return {"tie_word_embeddings": True}


def _gemma2_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Gemma 2 (gemma.py): Gemma's, every other layer sliding (transformers' default
    layer_types), the attention scale and both soft-caps; defaults are Gemma2Config's."""
    n = int(cfg.get("num_hidden_layers", 0))
    types = cfg.get("layer_types") or ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)]
    return _gemma_fields(cfg, path) | _sliding_fields(path, n, cfg.get("sliding_window", 4096), types) | {
        "query_pre_attn_scalar": float(cfg.get("query_pre_attn_scalar", 256)),
        "final_logit_softcapping": cfg.get("final_logit_softcapping", 30.0),
        "attn_logit_softcapping": cfg.get("attn_logit_softcapping", 50.0),
    }


def _phi3_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Phi-3 / Phi-4 (phi3.py): Llama with partial rotary (Phi-4-mini), LongRoPE (older configs
    call it "su" and keep original_max_position_embeddings at the top level) and a sliding window
    over every layer where the config sets one (Phi-3-mini-4k)."""
    n = int(cfg.get("num_hidden_layers", 0))
    _, scaling = _rope(cfg)
    if scaling is not None and scaling.get("rope_type") in ("longrope", "su"):
        scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"} | {"rope_type": "longrope"}
        scaling.setdefault("original_max_position_embeddings",
                           int(cfg.get("original_max_position_embeddings") or cfg["max_position_embeddings"]))
    return (_llama_fields(cfg | {"use_sliding_window": False, "attention_bias": False, "mlp_bias": False}, path)
            | {"rotary_dim": _rotary_dim(cfg, 1.0), "rope_scaling": scaling}
            | _sliding_fields(path, n, cfg.get("sliding_window"), ["sliding_attention"] * n))


def _glm4_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """GLM-4 0414 (glm4.py): q/k/v biases (on by default, none on o_proj), RoPE on half of each
    head (default partial_rotary_factor 0.5) in adjacent pairs."""
    _activation(cfg, path, ("silu",))
    return {"attention_bias": bool(cfg.get("attention_bias", True)), "rotary_dim": _rotary_dim(cfg, 0.5)}


def _cohere_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Command-R (cohere.py): LayerNorm without bias (layer_norm_eps), the LM head tied, the
    logits times logit_scale (our logits_scaling divides); per-head q/k LayerNorm (Command R+)
    and biases are refused."""
    _activation(cfg, path, ("silu",))
    _refuse(cfg, path, "attention_bias", "use_qk_norm")
    scale = float(cfg.get("logit_scale", 0.0625))
    if scale <= 0:
        raise ModelLoadError(f"{path}: logit_scale must be positive, got {scale}")
    return {"rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-5)),
            "tie_word_embeddings": bool(cfg.get("tie_word_embeddings", True)), "logits_scaling": 1.0 / scale}


# ------------------------------------------------------------ encoders: BERT, XLM-R, ModernBERT
_ENCODER_ACTS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu", "silu", "tanh")  # model/bert.ACTIVATIONS


def _encoder_act(cfg: dict[str, Any], path: str, key: str, default: str = "gelu") -> str:
    act = cfg.get(key) or default
    if act not in _ENCODER_ACTS:
        raise ModelLoadError(f"{path}: unsupported {key} {act!r} (expected one of {', '.join(_ENCODER_ACTS)})")
    return act


def _bert_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """BERT (bert.py): absolute positions, token types, post-norm LayerNorms (layer_norm_eps),
    biases everywhere; position_embedding_type other than absolute is refused."""
    kind = cfg.get("position_embedding_type", "absolute")
    if kind != "absolute":
        raise ModelLoadError(f"{path}: position_embedding_type {kind!r} is not supported (expected 'absolute')")
    return {"encoder": True, "layer_norm": True, "rms_norm_eps": float(cfg.get("layer_norm_eps", 1e-12)),
            "hidden_act": _encoder_act(cfg, path, "hidden_act"), "type_vocab_size": int(cfg.get("type_vocab_size", 2)),
            "tie_word_embeddings": False, "eos_token_ids": []}


def _xlm_roberta_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """XLM-RoBERTa (bert.py): BERT's, with position p at row p + pad_token_id + 1 of the table,
    so that max_position_embeddings - pad_token_id - 1 positions are usable (514 -> 512)."""
    offset = int(cfg.get("pad_token_id", 1)) + 1
    return _bert_fields(cfg, path) | {"position_offset": offset,
                                      "max_position_embeddings": int(cfg["max_position_embeddings"]) - offset}


def _modernbert_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """ModernBERT (modernbert.py): local and global layers (layer_types, or every
    global_attn_every_n_layers-th global) with their RoPE bases, in transformers 5's layout
    (`rope_parameters` per layer type) or the older one (global_rope_theta, local_rope_theta)."""
    n = int(cfg.get("num_hidden_layers", 0))
    every = int(cfg.get("global_attn_every_n_layers", 3))
    types = cfg.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(n)]
    params = cfg.get("rope_parameters")
    thetas = {"full_attention": float(cfg.get("global_rope_theta", 160_000.0)),
              "sliding_attention": float(cfg.get("local_rope_theta", 10_000.0))}
    if isinstance(params, dict):
        for kind, p in params.items():
            if isinstance(p, dict):
                if p.get("rope_type", "default") != "default":
                    raise ModelLoadError(f"{path}: scaled RoPE ({kind}: {p.get('rope_type')!r}) is not supported "
                                         "for ModernBERT")
                thetas[kind] = float(p.get("rope_theta", thetas.get(kind, 10_000.0)))
    return {"encoder": True, "layer_norm": True, "rms_norm_eps": float(cfg.get("norm_eps", 1e-5)),
            "norm_bias": bool(cfg.get("norm_bias", False)), "attention_bias": bool(cfg.get("attention_bias", False)),
            "mlp_bias": bool(cfg.get("mlp_bias", False)),
            "hidden_act": _encoder_act(cfg, path, "hidden_activation"),
            "classifier_activation": _encoder_act(cfg, path, "classifier_activation"),
            "classifier_bias": bool(cfg.get("classifier_bias", False)),
            "rope_theta": thetas["full_attention"], "rope_scaling": None, "rope_local_theta": thetas["sliding_attention"],
            "local_attention": int(cfg.get("local_attention", 128)),
            "local_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
            "tie_word_embeddings": False, "eos_token_ids": []}

# ------------------------------------------------ mixtures of experts (model/moe.py)
def _moe_fields(cfg: dict[str, Any], path: str, width: Any, norm: bool) -> dict[str, Any]:
    """The experts' fields; `mlp_only_layers` also takes the layers that decoder_sparse_step
    leaves dense (transformers: layer i is sparse where (i + 1) % step == 0). The expert count
    is num_experts (Qwen's checkpoints) or num_local_experts (Mixtral's, and transformers 5
    saves Qwen's so)."""
    n = int(cfg.get("num_hidden_layers", 0))
    num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    k = int(cfg.get("num_experts_per_tok") or 0)
    if not isinstance(num_experts, int) or num_experts < 1:
        raise ModelLoadError(f"{path}: the number of experts must be a positive integer, got {num_experts!r}")
    if not 1 <= k <= num_experts:
        raise ModelLoadError(f"{path}: num_experts_per_tok must be between 1 and the {num_experts} experts, "
                             f"got {cfg.get('num_experts_per_tok')!r}")
    step = int(cfg.get("decoder_sparse_step") or 1)
    dense = {int(i) for i in cfg.get("mlp_only_layers") or []} | {i for i in range(n) if (i + 1) % step}
    return {"num_experts": num_experts, "num_experts_per_tok": k, "moe_intermediate_size": int(width),
            "norm_topk_prob": norm, "mlp_only_layers": tuple(sorted(dense))}


def _qwen3_moe_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Qwen3's attention; experts of moe_intermediate_size, renormalised where norm_topk_prob."""
    return _qwen3_fields(cfg, path) | _moe_fields(cfg, path, cfg.get("moe_intermediate_size"),
                                                  bool(cfg.get("norm_topk_prob", False)))


def _qwen2_moe_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Qwen2's attention (q/k/v bias unless qkv_bias says no); experts as Qwen3-MoE's, and a
    shared expert of shared_expert_intermediate_size gated by a sigmoid."""
    return (_llama_fields(cfg, path)
            | {"attention_bias": bool(cfg.get("qkv_bias", True)), "o_proj_bias": False, "mlp_bias": False,
               "shared_expert_intermediate_size": int(cfg.get("shared_expert_intermediate_size") or 0)}
            | _moe_fields(cfg, path, cfg.get("moe_intermediate_size"),
                          bool(cfg.get("norm_topk_prob", False))))


def _mixtral_fields(cfg: dict[str, Any], path: str) -> dict[str, Any]:
    """Mistral's attention; num_local_experts experts of intermediate_size, always renormalised."""
    return _mistral_fields(cfg, path) | _moe_fields(cfg, path, cfg.get("intermediate_size"), True)


# Our architecture name -> its reading of config.json beyond the common fields: a function of
# (config.json as a dict, its path for errors) -> ModelArchConfig fields, which replace the common
# ones. A family without an entry reads as Llama (_llama_fields).
FAMILY_FIELDS: dict[str, Callable[[dict[str, Any], str], dict[str, Any]]] = {
    "llama": _llama_fields,
    "qwen2": _qwen2_fields,
    "qwen3": _qwen3_fields,
    "gemma3": _gemma3_fields,
    "mistral": _mistral_fields,
    "granite": _granite_fields,
    "olmo2": _olmo2_fields,
    "smollm3": _smollm3_fields,
    "stablelm": _stablelm_fields,
    "gemma": _gemma_fields,
    "gemma2": _gemma2_fields,
    "phi3": _phi3_fields,
    "glm4": _glm4_fields,
    "cohere": _cohere_fields,
    "bert": _bert_fields,
    "xlm_roberta": _xlm_roberta_fields,
    "modernbert": _modernbert_fields,
    "qwen3_moe": _qwen3_moe_fields,
    "qwen2_moe": _qwen2_moe_fields,
    "mixtral": _mixtral_fields,
    "gpt_oss": _gpt_oss_fields,
}
