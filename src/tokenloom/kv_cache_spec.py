"""KV cache groups: which layers share a block table, and what each group's attention needs.

DESIGN (vLLM V1's hybrid allocator, in tokenloom's words). A model whose layers all attend to the
whole context has one KV cache group: every layer reads the same blocks, so one block table and
one block id per `block_size` tokens serve them all. A model with sliding-window layers (Gemma 3:
five of every six layers see only the last `sliding_window` tokens) needs less: a sliding layer
can give back the blocks that fell out of its window, while a full layer keeps them. So the
layers are split into groups of the *same attention type*, each group with its own block table.

Memory layout. All groups share ONE pool of block ids; a block id is owned by one group at a time,
and a block holds the K/V of `group_size` layers (those of the group that owns it). For that,
every group has the same number of layers: `group_size` is the smallest layer count of
any attention type, and each type is cut into groups of that many layers. Gemma 3 270M (18
layers: 3 full, 15 sliding) gives six groups of three: one full, five sliding. The runner then
allocates `group_size` KV tensors of `num_blocks` blocks each, and layer k of every group reads
and writes tensor k: block b of tensor k belongs to whichever group holds block id b. Memory
moves between attention types with the workload (short requests: mostly sliding blocks; long
ones: mostly full blocks), instead of a fixed split that would idle one side. A type whose layer
count is not a multiple of `group_size` gets a last, smaller group; its blocks leave the tensors
it does not use idle (the price of one block size for all).

A model with full attention in every layer keeps exactly one group of all its layers: the same
block table, block bytes and per-step work as before groups existed.

This is shared vocabulary (layer 0): it reads a model config by its field names and imports
nothing of the model package. The model reads only `kv_cache_group_of_layer` (from
`group_of_layer`); the runner, the KV cache manager and the scheduler read the specs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

# Hugging Face's names in `config.layer_types`.
FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


class _HasLayerTypes(Protocol):
    num_hidden_layers: int
    sliding_window: int | None
    layer_types: tuple[str, ...] | None


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """One KV cache group: its layers (model layer indices, in order) and their window (None:
    full causal attention; W: the query at position p reads keys p - W < j <= p)."""

    layer_ids: tuple[int, ...]
    sliding_window: int | None = None

    @property
    def attention_type(self) -> str:
        return FULL_ATTENTION if self.sliding_window is None else SLIDING_ATTENTION


def layer_windows(cfg: _HasLayerTypes) -> list[int | None]:
    """Each layer's window (None: full attention), from `layer_types` and `sliding_window` of a
    model config. Without `layer_types` (or without a window) every layer is full: a
    `sliding_window` alone is not trusted (Qwen2's configs carry one they do not use)."""
    n = cfg.num_hidden_layers
    window = cfg.sliding_window
    types = cfg.layer_types
    if types is None or window is None:
        return [None] * n
    if len(types) != n:
        raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
    out: list[int | None] = []
    for i, t in enumerate(types):
        if t == FULL_ATTENTION:
            out.append(None)
        elif t == SLIDING_ATTENTION:
            if not window:
                raise ValueError(f"layer {i} is {SLIDING_ATTENTION!r} but the config has no sliding_window")
            out.append(int(window))
        else:
            raise ValueError(f"layer {i}: unknown layer type {t!r} (expected {FULL_ATTENTION!r} "
                             f"or {SLIDING_ATTENTION!r})")
    return out


def kv_cache_groups(cfg: _HasLayerTypes) -> list[KVCacheGroupSpec]:
    """The model's KV cache groups (see the module docstring): groups of `group_size` layers of
    one attention type each, full-attention groups first, layers in model order inside a type."""
    windows = layer_windows(cfg)
    by_type: dict[int | None, list[int]] = {}
    for layer, w in enumerate(windows):
        by_type.setdefault(w, []).append(layer)
    if len(by_type) == 1:
        ((w, layers),) = by_type.items()
        return [KVCacheGroupSpec(tuple(layers), w)]
    group_size = min(len(layers) for layers in by_type.values())
    groups = []
    for w in sorted(by_type, key=lambda w: (w is not None, w or 0)):  # full first, then by window
        layers = by_type[w]
        for start in range(0, len(layers), group_size):
            groups.append(KVCacheGroupSpec(tuple(layers[start:start + group_size]), w))
    return groups


def group_size(groups: list[KVCacheGroupSpec]) -> int:
    """Layers per block: the KV tensors the runner allocates (the largest group)."""
    return max(len(g.layer_ids) for g in groups)


def group_of_layer(groups: list[KVCacheGroupSpec], num_layers: int) -> list[int]:
    """Layer index -> its group's index."""
    out = [-1] * num_layers
    for g, spec in enumerate(groups):
        for layer in spec.layer_ids:
            out[layer] = g
    if -1 in out:
        raise ValueError(f"layer {out.index(-1)} is in no KV cache group")
    return out


def kv_tensor_of_layer(groups: list[KVCacheGroupSpec], num_layers: int) -> list[int]:
    """Layer index -> which of the `group_size` shared KV tensors it reads and writes: its place
    inside its group."""
    out = [0] * num_layers
    for spec in groups:
        for k, layer in enumerate(spec.layer_ids):
            out[layer] = k
    return out
