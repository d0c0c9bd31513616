"""The config-resolution step: what a model's files decide about an engine (whether it pools and
how, its architecture facts, its context length), decided from a validated EngineConfig.

The caller's engine (engine/frontend.py) resolves once, before the engine core starts, and sends
the resolved config; torch-free, like everything the caller imports from model/.
"""
from __future__ import annotations

from tokenloom.config import EngineConfig
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.hub import fetch_model_files
from tokenloom.model.lora_config import check_lora_support
from tokenloom.model.pooling_config import resolve_encoder, resolve_pooling
from tokenloom.model.source import check_load_format, check_tokenizer_mode, load_model_config, resolve_model


def resolve_max_model_len(requested: int | None, model_max: int) -> int:
    """The context length an engine serves: the one asked for, at most the model's."""
    if requested is None:
        return model_max
    if requested > model_max:
        raise ValueError(
            f"max_model_len={requested} is larger than the model's context length ({model_max})."
        )
    return requested


def resolve_engine_config(config: EngineConfig) -> ModelArchConfig:
    """Validates `config` and resolves, in place, where the model is (a hub id downloaded:
    model/hub.fetch_model_files) and what the model's files decide (the runner and the pooler:
    model/pooling_config.resolve_pooling); returns the model's architecture facts
    (metadata only, with hf_overrides and convert applied). enable_lora on a family that takes
    no adapters is refused here."""
    config.validate()
    check_tokenizer_mode(config.tokenizer_mode)
    fetch_model_files(config)  # hub ids -> local paths (a no-op for local ones)
    check_load_format(*resolve_model(config.model), config.load_format)
    resolve_pooling(config)
    model_config = load_model_config(config.model, config.hf_overrides, config.convert)
    check_lora_support(model_config.architecture, config.enable_lora)
    resolve_encoder(config, model_config)
    return model_config
