"""The config-resolution step: everything a model's files decide about an engine, decided once
from a validated EngineConfig, in the caller's process, before any engine core starts.

`resolve_engine_config` rewrites the config in place: `model` and `tokenizer` become local paths
(a hub id downloaded: model/hub.fetch_model_files; `model=None`: the embedded GGUF's path),
`max_model_len` the context length served (the model's, or the one asked for when the model
allows it), `runner` and `pooler_config` what the model pools with, and `model_name` the model as
the user gave it (a hub id, not the folder it was downloaded to), which also marks the config as
resolved. `EngineArgs.create_engine_config()` calls it (vLLM's shape); an `EngineConfig` built by
hand is resolved by the engine it is given to (engine/frontend.py). The engine core and the model
runner read the resolved fields and decide none of them again. Torch-free, like everything the
caller imports from model/.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import os
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.hub import fetch_model_files
from tokenloom.model.lora_config import check_lora_support
from tokenloom.model.pooling_config import resolve_encoder, resolve_pooling
from tokenloom.model.source import check_load_format, check_tokenizer_mode, load_model_config, resolve_model

# The name of `model=None`, the embedded SmolLM2-135M-Instruct GGUF (model/source.default_model_path).
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def resolve_max_model_len(requested: int | None, model_max: int, source: str = "the model's config") -> int:
    """The context length an engine serves: the one asked for, at most the model's (`source` says
    where the model's came from, for the error)."""
    if requested is None:
        return model_max
    if requested > model_max:
        raise ValueError(f"max_model_len={requested} is larger than the model's context length ({model_max}, "
                         f"{source}): pass max_model_len <= {model_max}, or leave it unset for {model_max}.")
    return requested


def resolve_engine_config(config: EngineConfig) -> None:
    """Validates `config` and resolves it in place (see the module's docstring). enable_lora on a
    family that takes no adapters is refused here. Call it once: `config.model_name` set says a
    config is resolved."""
    if config.model_name is not None:
        raise ValueError(f"this EngineConfig is resolved already (model {config.model_name!r}): resolve a config once")
    config.validate()
    check_tokenizer_mode(config.tokenizer_mode)
    given = config.model
    fetch_model_files(config)  # hub ids -> local paths (a no-op for local ones)
    path, kind = resolve_model(config.model)
    check_load_format(path, kind, config.load_format)
    config.model = path
    config.tokenizer = config.tokenizer or path
    resolve_pooling(config)
    if config.runner == "auto":
        config.runner = "generate"
    arch = model_arch_config(config.model, config.hf_overrides, config.convert)
    check_lora_support(arch.architecture, config.enable_lora)
    resolve_encoder(config, arch)
    source = ("the GGUF's context_length" if kind == "gguf" else "max_position_embeddings in its config.json"
              + (" with rope_scaling" if arch.rope_scaling else ""))
    config.max_model_len = resolve_max_model_len(config.max_model_len, arch.max_position_embeddings, source)
    config.model_name = given or DEFAULT_MODEL_NAME


def model_arch_config(path: str, hf_overrides: dict[str, Any] | None, convert: str) -> ModelArchConfig:
    """The architecture facts of a resolved config's model (its local `model` path; metadata only,
    with hf_overrides and convert applied): read once per file and overrides in a process (the
    resolution and the front end both need them), each caller getting its own copy."""
    overrides = json.dumps(hf_overrides, sort_keys=True) if hf_overrides else None
    metadata = os.path.join(path, "config.json") if os.path.isdir(path) else path
    return dataclasses.replace(_arch(path, os.stat(metadata).st_mtime_ns, overrides, convert))


@functools.lru_cache(maxsize=8)
def _arch(path: str, mtime_ns: int, overrides: str | None, convert: str) -> ModelArchConfig:
    return load_model_config(path, json.loads(overrides) if overrides else None, convert)
