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

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "freq_factors", "yarn", "dynamic", "longrope")


def rope_type_of(rope_scaling: dict[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type") or rope_scaling.get("type") or "default")


def check_rope_scaling(rope_scaling: dict[str, Any] | None, source: str) -> None:
    kind = rope_type_of(rope_scaling)
    if kind not in SUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"{source}: unsupported rope scaling type {kind!r} "
                             f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})")


def inv_frequencies(head_dim: int, theta: float, rope_scaling: dict[str, Any] | None,
                    max_positions: int | None = None) -> torch.Tensor:
    """float32 [head_dim // 2]: the angle per position of each rotated pair (`max_positions`:
    the model's context, which picks LongRoPE's factors)."""
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
    if kind == "yarn":
        return _yarn_inv_freq(head_dim, theta, rope_scaling)
    if kind == "dynamic":  # the frequencies within the original context (see cos_sin_cache)
        return inv_freq
    if kind == "longrope":
        factors = torch.tensor(_longrope_factors(rope_scaling, max_positions), dtype=torch.float32)
        return 1.0 / (factors * theta ** exponents)
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


def _yarn_inv_freq(dim: int, theta: float, p: dict[str, Any]) -> torch.Tensor:
    """YaRN: each pair's frequency blended between interpolated (divided by `factor`) and kept,
    by a linear ramp over the pairs whose wavelength falls between beta_fast and beta_slow
    rotations in the original context; computed as transformers does."""
    factor = float(p["factor"])
    original = float(p["original_max_position_embeddings"])
    beta_fast, beta_slow = float(p.get("beta_fast") or 32), float(p.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def yarn_attention_factor(p: dict[str, Any]) -> float:
    """YaRN's scale of cos and sin: `attention_factor`, else 0.1 ln(factor) + 1 (with `mscale`
    and `mscale_all_dim`, their ratio of that)."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    factor = float(p["factor"])

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if p.get("mscale") and p.get("mscale_all_dim"):
        return float(mscale(float(p["mscale"])) / mscale(float(p["mscale_all_dim"])))
    return mscale(1.0)


def _dynamic_angles(dim: int, max_positions: int, theta: float, p: dict[str, Any]) -> torch.Tensor:
    """Dynamic NTK: past the original context, the base grows with the sequence length. The row of
    position q uses the base of a sequence of q + 1 tokens, which is what transformers computes
    for each token it decodes past the original context; rows within it are the default
    frequencies. A cached key keeps the rotation it was written with, so a row depends on its
    position alone (transformers' prefill of a prompt longer than the original context rotates
    every position with the prompt's length instead)."""
    factor = float(p["factor"])
    original = int(p["original_max_position_embeddings"])
    positions = torch.arange(max_positions, dtype=torch.int64).to(torch.float32)
    angles = torch.outer(positions, inv_frequencies(dim, theta, None))
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    for q in range(original, max_positions):
        # In float32 tensor arithmetic, as transformers computes it from a tensor sequence length.
        seq_len = torch.tensor(q + 1, dtype=torch.int64)
        base = theta * ((factor * seq_len / original) - (factor - 1)) ** (dim / (dim - 2))
        angles[q] = positions[q] * (1.0 / (base ** exponents))
    return angles


def _longrope_factors(p: dict[str, Any], max_positions: int | None) -> list[float]:
    """Phi-3's LongRoPE divisors: `long_factor` for a model whose context reaches past the one it
    was pretrained with, `short_factor` otherwise. transformers picks per sequence (and recomputes
    its cache when one grows past the original length); a paged cache cannot re-rotate its keys,
    so one choice holds for the whole context."""
    long = max_positions is not None and max_positions > int(p["original_max_position_embeddings"])
    return [float(f) for f in (p["long_factor"] if long else p["short_factor"])]


def longrope_attention_factor(p: dict[str, Any], max_positions: int) -> float:
    """LongRoPE's scale of cos and sin: `attention_factor`, else sqrt(1 + ln(factor) / ln(original
    context)) with factor the context's stretch (the config's `factor`, or max / original)."""
    if p.get("attention_factor") is not None:
        return float(p["attention_factor"])
    original = int(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or max_positions / original)
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def interleaved_to_rotate_half(w: torch.Tensor, n_heads: int, rot_dim: int) -> torch.Tensor:
    """q/k projection rows (or biases) of a checkpoint whose RoPE rotates adjacent pairs (2i,
    2i + 1) of each head's first `rot_dim` dimensions (Cohere, GLM-4), reordered to the pairs
    (i, i + rot_dim / 2) of the rotate-half RoPE we run. q and k get the same order, so their dot
    products, and the attention, are unchanged."""
    head = w.reshape(n_heads, w.shape[0] // n_heads, *w.shape[1:])
    rest = head.shape[2:]
    rot = head[:, :rot_dim].reshape(n_heads, rot_dim // 2, 2, *rest).transpose(1, 2)
    return torch.cat([rot.reshape(n_heads, rot_dim, *rest), head[:, rot_dim:]], 1).reshape(w.shape)


def cos_sin_cache(head_dim: int, max_positions: int, theta: float,
                  rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos of each pair's angle in the first half, sin in the
    second. Angles are the float32 product position * inv_freq, as transformers computes them,
    so the two agree bit for bit before the trig. (`head_dim` is the rotated width: a partial
    rotary embedding's rotary_dim.)"""
    kind = rope_type_of(rope_scaling)
    if kind == "dynamic":
        assert rope_scaling is not None
        angles = _dynamic_angles(head_dim, max_positions, theta, rope_scaling)
    else:
        inv_freq = inv_frequencies(head_dim, theta, rope_scaling, max_positions)
        angles = torch.outer(torch.arange(max_positions, dtype=torch.int64).to(torch.float32), inv_freq)
    if kind in ("yarn", "longrope"):
        assert rope_scaling is not None
        scale = (yarn_attention_factor(rope_scaling) if kind == "yarn"
                 else longrope_attention_factor(rope_scaling, max_positions))
        return torch.cat([angles.cos() * scale, angles.sin() * scale], dim=-1)
    return torch.cat([angles.cos(), angles.sin()], dim=-1)
