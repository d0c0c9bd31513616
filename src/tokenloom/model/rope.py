"""Rotary position embedding: the inverse frequencies (with the scaling schemes we support) and
the cos/sin table the model indexes by position.

We use the "rotate half" convention of HF checkpoints: dimension i of a head pairs with dimension
i + head_dim/2. llama.cpp's converter reorders Llama's q/k rows to pair adjacent dimensions
instead; the GGUF loader undoes that, so one convention serves both formats.
"""
from __future__ import annotations

import math
from typing import Any

import torch

from tokenloom.model.errors import ModelLoadError

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


def check_rope_scaling(rope_scaling: dict[str, Any] | None, source: str) -> None:
    kind = rope_type_of(rope_scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope scaling type {kind!r} "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def inv_frequencies(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [head_dim // 2]: the angle per position of each rotated pair."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = rope_type_of(rope_scaling)
    if kind == "default":
        return inv_freq
    assert rope_scaling is not None
    if kind == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if kind == "freq_factors":
        # Llama 3.1+ GGUFs carry llama3 scaling as a `rope_freqs` tensor of per-pair divisors.
        factors = torch.tensor(rope_scaling["freq_factors"], dtype=torch.float32)
        return inv_freq / factors
    if kind == "llama3":
        return _llama3_scale(inv_freq, rope_scaling)
    raise ModelLoadError(f"unsupported rope scaling type {kind!r}")


def _llama3_scale(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's scheme: wavelengths longer than the original context / low_freq_factor are
    stretched by `factor`, those shorter than original / high_freq_factor are kept, and the band in
    between is blended linearly in 1/wavelength."""
    factor = float(p["factor"])
    low = float(p.get("low_freq_factor", 1.0))
    high = float(p.get("high_freq_factor", 4.0))
    original = float(p.get("original_max_position_embeddings", 8192))
    wavelen = 2 * math.pi / inv_freq
    long_wave = wavelen > original / low
    short_wave = wavelen < original / high
    blend = (original / wavelen - low) / (high - low)
    stretched = torch.where(long_wave, inv_freq / factor, inv_freq)
    mixed = (1 - blend) * stretched / factor + blend * stretched
    middle = ~long_wave & ~short_wave
    return torch.where(middle, mixed, stretched)


def cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                  rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos of each pair's angle in the first half, sin in the
    second. Angles are the float32 product position * inv_freq, as transformers computes them,
    so the two agree bit for bit before the trig."""
    inv_freq = inv_frequencies(head_dim, theta, rope_scaling)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.int64).to(torch.float32), inv_freq)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)
