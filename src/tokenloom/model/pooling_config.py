"""Which runner a model gets and how it pools, read from its files (torch-free: the caller
resolves it once, in model/resolve.py, and the engine core gets the answer in its config).

vLLM's rules: `runner="auto"` is "pooling" for a checkpoint without a language-model head
(`architectures` naming `*Model`, e.g. Qwen3Model) and "generate" otherwise; a `*ForCausalLM`
checkpoint (Qwen3-Embedding's config says Qwen3ForCausalLM) embeds with `runner="pooling"`;
`convert="classify"`, or `hf_overrides` naming a `*ForSequenceClassification`, pools as a
classifier (hf_config.read_config_json applies both before anything here reads config.json).
A sentence-transformers model's `modules.json` and pooling config give its pooling type and
whether it normalizes; `pooler_config` fields set by the user override them.
"""
from __future__ import annotations

import json
import os
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.hf_config import read_config_json
from tokenloom.model.registry import ARCHITECTURE_ENTRIES, HF_ARCHITECTURES
from tokenloom.pooling_params import PoolerConfig

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")

# sentence-transformers' pooling modes -> vLLM's pooling types (the first one set wins), in the
# config's older layout (a flag per mode) and in sentence-transformers 6's (`pooling_mode`).
_ST_MODES = {"pooling_mode_lasttoken": "LAST", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_cls_token": "CLS"}
_ST_MODE_NAMES = {"lasttoken": "LAST", "mean": "MEAN", "cls": "CLS"}


def _st_pooling_type(st: dict[str, Any], path: str) -> str | None:
    """The pooling type of a sentence-transformers Pooling module's config.json."""
    mode = st.get("pooling_mode")
    if isinstance(mode, str):
        if mode not in _ST_MODE_NAMES:
            raise ValueError(f"{path}: pooling_mode {mode!r} is not supported (supported: "
                             f"{', '.join(_ST_MODE_NAMES)}); set pooler_config={{'pooling_type': ...}} to pool otherwise.")
        return _ST_MODE_NAMES[mode]
    return next((v for k, v in _ST_MODES.items() if st.get(k)), None)


def _json(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def model_directory(model: str | None) -> str | None:
    """The HF directory of `model`, None for the embedded model or a GGUF file (no such files)."""
    return model if model is not None and os.path.isdir(model) else None


def _config(directory: str, hf_overrides: dict[str, Any] | None, convert: str = "auto") -> dict[str, Any]:
    try:
        return read_config_json(directory, hf_overrides, convert)
    except (OSError, ValueError):
        return {}  # the loader names what is wrong with it


def has_lm_head(directory: str | None, hf_overrides: dict[str, Any] | None = None, convert: str = "auto") -> bool:
    """Whether config.json (with hf_overrides) names a generative architecture (`*For*LM`);
    GGUFs always do."""
    if directory is None:
        return True
    names = _config(directory, hf_overrides, convert).get("architectures") or []
    return not names or any("ForCausalLM" in n or "ForConditionalGeneration" in n for n in names)


def resolve_runner(model: str | None, runner: str, convert: str, hf_overrides: dict[str, Any] | None = None) -> str:
    if runner not in RUNNERS:
        raise ValueError(f"runner must be one of {', '.join(RUNNERS)}, got {runner!r}.")
    if convert not in CONVERTS:
        raise ValueError(f"convert must be one of {', '.join(CONVERTS)} (a language model is not converted into a "
                         f"reward model; *ForSequenceClassification checkpoints classify as they are), "
                         f"got {convert!r}.")
    headless = not has_lm_head(model_directory(model), hf_overrides, convert)
    if runner == "auto":
        runner = "pooling" if convert in ("embed", "classify") or headless else "generate"
    if runner == "generate" and convert in ("embed", "classify"):
        raise ValueError(f"convert={convert!r} makes a pooling model: use it with runner='pooling' (or 'auto').")
    if runner == "generate" and headless:
        raise ValueError(f"{model}: the checkpoint has no language-model head (its config.json names no *ForCausalLM "
                         "architecture): it can only embed or classify; start it with runner='pooling' "
                         "(--runner pooling).")
    return runner


def model_pooling_type(cfg: dict[str, Any]) -> str:
    """The model's own pooling (vLLM's default_pooling_type): its registry entry's (CLS for
    encoders, LAST for decoders); a ModernBERT classifier's `classifier_pooling` "mean" is MEAN."""
    names = cfg.get("architectures") or []
    arch = next((HF_ARCHITECTURES[n] for n in names if n in HF_ARCHITECTURES), None)
    if arch is None:
        return "LAST"
    if names[0].endswith("ForSequenceClassification") and cfg.get("classifier_pooling") == "mean":
        return "MEAN"
    return ARCHITECTURE_ENTRIES[arch].pooling_type


def resolve_pooler_config(model: str | None, user: PoolerConfig | None,
                          hf_overrides: dict[str, Any] | None = None) -> PoolerConfig:
    """The engine's pooling: the user's fields, else the model's sentence-transformers files,
    else the model's default (`model_pooling_type`; normalized); Matryoshka facts from config.json."""
    directory = model_directory(model)
    pooling_type = normalize = None
    own_pooling = "LAST"
    matryoshka: list[int] | None = None
    is_matryoshka = False
    if directory is not None:
        modules = _json(os.path.join(directory, "modules.json"))
        if isinstance(modules, list):
            types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
            normalize = any(t.endswith("Normalize") for t in types)
            for m in modules:
                if isinstance(m, dict) and str(m.get("type", "")).endswith("Pooling"):
                    st_path = os.path.join(directory, str(m.get("path", "")), "config.json")
                    pooling_type = _st_pooling_type(_json(st_path) or {}, st_path)
        cfg = _config(directory, hf_overrides)
        own_pooling = model_pooling_type(cfg)
        if own_pooling == "MEAN":  # a classifier's own pooling, before its head: not the ST files' to change
            pooling_type = own_pooling
        dims = cfg.get("matryoshka_dimensions")
        if isinstance(dims, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in dims):
            matryoshka = list(dims)
        is_matryoshka = bool(cfg.get("is_matryoshka")) or matryoshka is not None
    user = user or PoolerConfig()
    return PoolerConfig(
        pooling_type=user.pooling_type or pooling_type or own_pooling,
        normalize=user.normalize if user.normalize is not None else (normalize if normalize is not None else True),
        dimensions=user.dimensions,
        is_matryoshka=is_matryoshka,
        matryoshka_dimensions=matryoshka,
    )


def resolve_pooling(config: EngineConfig) -> None:
    """Decides, in place, whether the engine of `config` pools: then its runner becomes "pooling"
    and its pooler_config the whole resolved one; a generating engine's config is left as its
    caller wrote it. The caller's engine decides before the core starts (model/resolve.py), so that
    errors name the setting there; idempotent."""
    if resolve_runner(config.model, config.runner, config.convert, config.hf_overrides) != "pooling":
        if config.pooler_config is not None:
            raise ValueError("pooler_config applies to pooling models: start the engine with runner='pooling' "
                             "(--runner pooling).")
        return
    config.runner = "pooling"
    config.pooler_config = resolve_pooler_config(config.model, config.pooler_config, config.hf_overrides)
    if config.speculative_config is not None:
        raise ValueError("speculative_config does not apply to runner='pooling': a pooling model never decodes.")


def resolve_encoder(config: EngineConfig, model_config: ModelArchConfig) -> None:
    """An encoder's engine settings, in place (vLLM's for encoder-only models): each prompt runs
    whole in one step (bidirectional attention needs all of it), so chunked prefill and the
    prefix cache are off and a step's token budget holds the longest prompt; the context is
    sentence-transformers' max_seq_length (sentence_bert_config.json) where the user set none,
    as vLLM reads it."""
    if not model_config.encoder:
        return
    if config.runner != "pooling":
        raise ValueError(f"{config.model}: an encoder model ({model_config.architecture}) embeds or scores only: "
                         "start it with runner='pooling' (--runner pooling).")
    config.enable_chunked_prefill = False
    config.enable_prefix_caching = False
    directory = model_directory(config.model)
    st = _json(os.path.join(directory, "sentence_bert_config.json")) if directory is not None else None
    max_seq = st.get("max_seq_length") if isinstance(st, dict) else None
    if config.max_model_len is None and isinstance(max_seq, int) and 0 < max_seq < model_config.max_position_embeddings:
        config.max_model_len = max_seq
    longest = min(config.max_model_len or model_config.max_position_embeddings, model_config.max_position_embeddings)
    config.max_num_batched_tokens = max(config.max_num_batched_tokens, longest)
