"""Which layers share a KV cache group, and what each group's attention sees.

A hybrid model (Gemma 3: five sliding-window layers to one full-attention layer) keeps one KV
cache group per kind of attention, as vLLM V1 does: the layers of a group share one block table
and one attention metadata (its `sliding_window`), so a sliding-window group can give back the
blocks that fell out of its window while the full-attention group keeps growing. The model reads
only its `kv_cache_group_of_layer`; the runner, the KV cache manager and the scheduler read these
specs.

This is shared vocabulary (layer 0): it reads a model config by its field names and imports
nothing of the model package.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class _HasLayerTypes(Protocol):
    num_hidden_layers: int
    sliding_window: int | None
    layer_types: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    layer_ids: tuple[int, ...]
    sliding_window: int | None  # None: full attention


def kv_cache_groups(cfg: _HasLayerTypes) -> list[KVCacheGroupSpec]:
    """Full-attention layers form one group and sliding-window layers another (full first, so a
    model without a window has exactly one group, group 0, holding every layer)."""
    n = cfg.num_hidden_layers
    types = cfg.layer_types
    if types is None or cfg.sliding_window is None:
        return [KVCacheGroupSpec(tuple(range(n)), None)]
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for num_hidden_layers={n}")
    unknown = set(types) - {FULL_ATTENTION, SLIDING_ATTENTION}
    if unknown:
        raise ValueError(f"layer_types: unknown attention type(s) {sorted(unknown)}; expected "
                         f"{FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}")
    full = tuple(i for i, t in enumerate(types) if t == FULL_ATTENTION)
    sliding = tuple(i for i, t in enumerate(types) if t == SLIDING_ATTENTION)
    groups = []
    if full:
        groups.append(KVCacheGroupSpec(full, None))
    if sliding:
        groups.append(KVCacheGroupSpec(sliding, cfg.sliding_window))
    return groups


def group_of_layer(groups: list[KVCacheGroupSpec], num_layers: int) -> list[int]:
    """Layer index -> index of its group in `groups`."""
    out = [-1] * num_layers
    for g, spec in enumerate(groups):
        for layer in spec.layer_ids:
            out[layer] = g
    if -1 in out:
        raise ValueError(f"layers {[i for i, g in enumerate(out) if g < 0]} belong to no KV cache group")
    return out
