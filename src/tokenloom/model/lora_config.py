"""A LoRA adapter's `adapter_config.json`, read and checked without torch: the caller (the
input processor, the server's --lora-modules) checks an adapter before its request is queued, and
the front end imports no torch (model/lora.py loads the weights in the engine core)."""
from __future__ import annotations

import json
import math
import os
import stat
from dataclasses import dataclass

from tokenloom.model.registry import ARCHITECTURE_ENTRIES


@dataclass
class AdapterConfig:
    rank: int
    scaling: float
    path: str


def check_lora_support(architecture: str, enable_lora: bool) -> None:
    """A ValueError where enable_lora is asked of a family whose registry entry says its LoRA
    adapters do not apply (fused or reordered projections that PEFT's names do not address)."""
    entry = ARCHITECTURE_ENTRIES.get(architecture)
    if enable_lora and entry is not None and not entry.lora:
        raise ValueError(f"enable_lora=True: {entry.class_name} ({architecture}) does not take LoRA adapters "
                         "(see docs/models.md); start it without enable_lora")


def read_adapter_config(path: str, max_rank: int) -> AdapterConfig:
    """The adapter's `adapter_config.json`, checked: a ValueError says what cannot be served."""
    config_path = os.path.join(path, "adapter_config.json")
    try:
        cfg = json.loads(_read_regular_file(config_path))
    except FileNotFoundError:
        raise ValueError(f"lora_request.lora_path {path!r} holds no adapter_config.json (a PEFT LoRA adapter "
                         "directory is expected).") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"lora_request.lora_path: {config_path} could not be read: {e}") from None
    _check_weights_file(path)
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


def _not_regular(path: str) -> ValueError:
    return ValueError(f"lora_request.lora_path: {path} is not a regular file (a FIFO, device or folder cannot be "
                      "read as an adapter's file).")


def _read_regular_file(path: str) -> str:
    """The text of `path`, refused unless it is a regular file. Opened non-blocking: opening a FIFO
    for reading otherwise waits for a writer, which may never come (the caller would hang)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb", closefd=True) as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise _not_regular(path)
        return f.read().decode("utf-8")


def _check_weights_file(path: str) -> None:
    """The weights the engine core reads on the adapter's first request: a FIFO there would hang
    the core, so anything but a regular file is refused now (a missing one is the loader's error)."""
    weights = os.path.join(path, "adapter_model.safetensors")
    try:
        mode = os.stat(weights).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise _not_regular(weights)
