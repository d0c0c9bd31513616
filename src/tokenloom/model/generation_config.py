"""Default sampling parameters from a model's `generation_config.json` (vLLM's
`--generation-config`).

Model authors put their recommended sampling there (Gemma 3: top_k 64, top_p 0.95; many chat
models a temperature), and vLLM applies it by default to every request that leaves a parameter
unset, so the same request sampled differently here than on vLLM unless we read it too. Plain
JSON, no tensor library: the caller's process reads this (source.py's rule).
"""
from __future__ import annotations

import logging
import os
from typing import Any

from tokenloom.model.errors import ModelLoadError
from tokenloom.model.hf_config import _read_json
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger("tokenloom")

# The generation_config.json keys that become sampling defaults (vLLM's list, in its order);
# HF's max_new_tokens is SamplingParams' max_tokens.
SAMPLING_KEYS = ("repetition_penalty", "presence_penalty", "frequency_penalty", "temperature", "top_k", "top_p",
                 "min_p", "max_new_tokens")


def _read(path: str) -> dict[str, Any]:
    value = _read_json(path)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: a generation config is a JSON object, got {type(value).__name__}")
    return value


def _generation_config(directory: str) -> dict[str, Any]:
    """The folder's generation_config.json, else its config.json (transformers builds a model's
    generation config from it when the file is missing, and so does vLLM); {} for neither."""
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            return _read(path)
    return {}


def default_sampling_params(model: str | None, generation_config: str = "auto",
                            override: dict[str, Any] | None = None) -> dict[str, Any]:
    """The sampling defaults a request gets for what it leaves unset: {} keeps SamplingParams'.

    `generation_config`: "auto" reads the model's own folder (an HF directory; a GGUF file carries
    no generation config), "vllm" reads nothing, anything else is a folder holding a
    generation_config.json. `override` (vLLM's --override-generation-config) is merged on top.
    Keys are SamplingParams' names (max_new_tokens becomes max_tokens)."""
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    elif generation_config == "auto":
        from tokenloom.model.source import resolve_model

        path, kind = resolve_model(model)
        config = _generation_config(path) if kind == "hf" else {}
    else:
        folder = os.path.abspath(os.path.expanduser(generation_config))
        if not os.path.isdir(folder):
            raise ModelLoadError(f"generation_config: {generation_config!r} is neither 'auto', 'vllm' nor a folder")
        config = _generation_config(folder)
    config = {**config, **(override or {})}
    unknown = set(override or {}) - set(SAMPLING_KEYS)
    if unknown:
        # vLLM drops them silently; a typo in a launch line deserves a word.
        logger.warning("override_generation_config: %s are not sampling defaults (known: %s); ignored.",
                       ", ".join(sorted(unknown)), ", ".join(SAMPLING_KEYS))
    defaults = {key: config[key] for key in SAMPLING_KEYS if config.get(key) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    try:  # at start-up, not as every request's 400
        SamplingParams.from_optional(**defaults)
    except ValueError as e:
        source = "override_generation_config" if override else f"generation_config ({generation_config})"
        raise ValueError(f"{source}: the default sampling parameters {defaults} are not valid: {e}") from None
    return defaults


def max_tokens_cap(generation_config: str, defaults: dict[str, Any],
                   override: dict[str, Any] | None = None) -> int | None:
    """The most tokens any request may ask for, as vLLM's server enforces it: a generation config
    read from a folder caps by its max_new_tokens; with "auto"/"vllm" only an override's
    max_new_tokens caps (the model's own is only the default for a request that gives none)."""
    if generation_config not in ("auto", "vllm"):
        return defaults.get("max_tokens")
    return (override or {}).get("max_new_tokens")


def defaults_source(generation_config: str, override: dict[str, Any] | None) -> str:
    """Where the defaults came from, for the line that says so (vLLM warns of them too)."""
    sources = [] if generation_config == "vllm" else [
        "the model's generation_config.json" if generation_config == "auto" else f"{generation_config}/generation_config.json"]
    return " and ".join(sources + (["override_generation_config"] if override else []))
