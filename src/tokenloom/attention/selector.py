"""Choosing an attention backend by name and device."""
from __future__ import annotations

import importlib.util
import os

import torch

from tokenloom.attention.backend import AttentionBackend

BACKEND_NAMES = ("auto", "torch", "triton")


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def _triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def get_attn_backend(name: str = "auto", device: torch.device | str | None = None,
                     softcap: bool = False, sinks: bool = False) -> AttentionBackend:
    """`auto`: the Triton kernels on CUDA when triton is importable, the PyTorch backend otherwise.
    `triton` off CUDA is only allowed under `TRITON_INTERPRET=1` (the kernels' CPU test mode).
    `softcap`: the model caps its attention scores (Gemma 2); `sinks`: its softmax has a learned
    logit per head (gpt-oss). Only the PyTorch backend does either."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if name == "auto":
        name = "triton" if dev.type == "cuda" and _triton_importable() and not (softcap or sinks) else "torch"
    if name == "triton" and softcap:
        raise ValueError("attention backend 'triton' cannot cap attention scores "
                         "(the model's attn_logit_softcapping); use --attention-backend torch or auto")
    if name == "triton" and sinks:
        raise ValueError("attention backend 'triton' has no attention sinks "
                         "(the model's self_attn.sinks); use --attention-backend torch or auto")
    if name == "torch":
        from tokenloom.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend()
    if name == "triton":
        if not _triton_importable():
            raise RuntimeError("attention backend 'triton' requested but triton is not installed; "
                               "use --attention-backend torch")
        if dev.type != "cuda" and not _triton_interpreter_on():
            raise RuntimeError(
                f"attention backend 'triton' needs a CUDA device (got {dev}); on CPU use the "
                "'torch' backend, or set TRITON_INTERPRET=1 to run the kernels in Triton's "
                "(slow) interpreter for testing")
        from tokenloom.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose one of {BACKEND_NAMES}")
