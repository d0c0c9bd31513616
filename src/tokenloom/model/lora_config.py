"""A LoRA adapter's `adapter_config.json`, read and checked without torch: the caller (the
input processor, the server's --lora-modules) checks an adapter before its request is queued, and
the front end imports no torch (model/lora.py loads the weights in the engine core)."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass


@dataclass
class AdapterConfig:
    rank: int
    scaling: float
    path: str


def read_adapter_config(path: str, max_rank: int) -> AdapterConfig:
    """The adapter's `adapter_config.json`, checked: a ValueError says what cannot be served."""
    config_path = os.path.join(path, "adapter_config.json")
    try:
        with open(config_path) as f:
            cfg = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"lora_request.lora_path {path!r} holds no adapter_config.json (a PEFT LoRA adapter "
                         "directory is expected).") from None
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_request.lora_path: {config_path} could not be read: {e}") from None
    if not isinstance(cfg, dict) or cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora_request.lora_path: {config_path} is not a LoRA adapter "
                         f"(peft_type {cfg.get('peft_type') if isinstance(cfg, dict) else None!r}).")
    rank, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"lora_request.lora_path: {config_path} has no valid r and lora_alpha.")
    unsupported = [name for name in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save",
                                     "layers_to_transform") if cfg.get(name)]
    if cfg.get("bias", "none") != "none":
        unsupported.append(f"bias={cfg['bias']!r}")
    if unsupported:
        raise ValueError(f"lora_request: the adapter uses {', '.join(unsupported)}, which is not supported "
                         "(plain LoRA on the attention and MLP projections is).")
    if rank > max_rank:
        raise ValueError(f"lora_request: the adapter's rank is {rank}, above max_lora_rank={max_rank} "
                         "(--max-lora-rank).")
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    return AdapterConfig(rank, float(scaling), path)
