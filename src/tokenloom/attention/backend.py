"""The one interface every attention backend implements.

The model calls `forward` once per layer; the model runner calls `prepare` once per step, so
whatever a backend derives from the metadata (index tensors, masks, kernel grids) is computed once
and shared by all layers.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from tokenloom.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    name: str = "abstract"

    @abstractmethod
    def prepare(self, meta: AttentionMetadata) -> Any:
        """Per-step plan shared by all layers (returned object is passed back to `forward`)."""

    def prepare_for_cuda_graph(self, meta: AttentionMetadata) -> Any | None:
        """The plan of a decode batch that a CUDA graph captures once and replays every step
        (worker/cuda_graph.py), or None where the backend cannot make one. Such a plan launches
        the same kernels on the same grids whatever the lengths: `meta.max_seq_len` is the
        longest context any replay may have, and the lengths themselves are read on the device
        (the host copies in `meta` describe the capture's padding, not the replays)."""
        return None

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, num_heads, head_dim]
        key: torch.Tensor,  # [T, num_kv_heads, head_dim]
        value: torch.Tensor,  # [T, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        plan: Any,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,  # [num_heads]
    ) -> torch.Tensor:  # [T, num_heads, head_dim]
        """Write the new tokens' K/V through `slot_mapping`, then attend causally over each
        request's whole context read through `block_table`. `softcap` (Gemma 2): each scaled
        score s becomes softcap * tanh(s / softcap) before the softmax. `sinks` (gpt-oss): one
        logit per query head added to each softmax's denominator (a key that holds no value)."""


