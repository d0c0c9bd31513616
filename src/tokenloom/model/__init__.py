"""Model definitions and weight loading (HF safetensors directories and GGUF files).

Names are resolved lazily: importing `tokenloom.model.config` (a plain dataclass, used on the
caller side) must not drag in torch and transformers."""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ModelArchConfig": "tokenloom.model.config",
    "ModelLoadError": "tokenloom.model.errors",
    "ModelNotFoundError": "tokenloom.model.errors",
    "LoadedModel": "tokenloom.model.loader",
    "default_model_path": "tokenloom.model.loader",
    "gemma3_270m_path": "tokenloom.model.loader",
    "load_model": "tokenloom.model.loader",
    "load_model_config": "tokenloom.model.loader",
    "load_tokenizer": "tokenloom.model.loader",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tokenloom.model' has no attribute {name!r}")
