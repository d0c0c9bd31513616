"""LoRA adapters over the decoder's linear layers, in PEFT's format (vLLM's LoRA, on a CPU).

An adapter adds `scaling * B @ A` to some of a layer's projections: for an input row x the
projection's output gains `scaling * (x @ A^T) @ B^T`. The weights stay apart from the model's
(which may be quantized, fused or packed): every targeted projection is wrapped in a
`LoRALinear`, which adds the adapters' products to the rows of the tokens that run with them.
Which tokens those are is set once per step on the shared `LoRAState` (worker/lora_manager.py),
so one step can mix the base model and several adapters, as vLLM's batches do.

PEFT names q/k/v and gate/up apart; here they are rows of the fused qkv_proj and gate_up_proj,
so an adapter's parts for one fused projection share one `x @ A^T` product (the A matrices
stacked) and one product with their B matrices placed block-diagonally (each part's B writes
only its own rows of the output): two matmuls per projection instead of one per part, fewer
dispatches on a path that per-op overhead rules at small batches (benchmarks/lora.py). Decode steps in float32 do not come here: the fused C step (model/fused_decode.py)
adds the same products itself, reading each adapter's `decode_table` and the state's per-token
adapter index.

Taken: `r`, `lora_alpha`, `use_rslora` (scaling alpha / sqrt(r)), `target_modules` among q, k,
v, o, gate, up and down projections. Refused, naming the option: DoRA, biases, per-module ranks
or alphas, adapters of the embeddings or the LM head, `modules_to_save`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tokenloom.model.lora_config import read_adapter_config
from tokenloom.ops.decode_step import DecodeLoRATable, LoRAProjection

# PEFT's module name -> (the fused projection here, which of its parts).
TARGETS: dict[str, tuple[str, int]] = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "self_attn.o_proj": ("self_attn.o_proj", 0),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
    "mlp.down_proj": ("mlp.down_proj", 0),
}
PROJECTIONS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn\.[qkvo]_proj|mlp\.(?:gate|up|down)_proj)"
                  r"\.lora_([AB])\.weight$")


@dataclass
class _Projection:
    """One adapter on one fused projection: `a` stacks its parts' A matrices, `b_t` their
    scaled B matrices, transposed and placed block-diagonally (part k's rank columns of
    `x @ a^T` feed only part k's output rows), so that adding the adapter is two matmuls,
    whatever the number of parts."""

    a: torch.Tensor  # [sum of ranks, in_features]
    b_t: torch.Tensor  # [sum of ranks, out_features]: scaling * B^T per part, zero elsewhere
    # per part: (its first column of x @ a^T, end, its first output row, end)
    parts: tuple[tuple[int, int, int, int], ...] = ()


@dataclass
class LoRAAdapter:
    lora_int_id: int
    rank: int
    projections: dict[tuple[int, str], _Projection] = field(default_factory=dict)
    _decode_table: DecodeLoRATable | None = field(default=None, repr=False)

    @property
    def nbytes(self) -> int:
        return sum(p.a.nbytes + p.b_t.nbytes for p in self.projections.values())

    def decode_table(self, num_layers: int) -> DecodeLoRATable:
        """The adapter as the fused decode step reads it (built on first use; float32 only)."""
        if self._decode_table is None:
            self._decode_table = DecodeLoRATable([
                None if (p := self.projections.get((layer, name))) is None else LoRAProjection(p.a, p.b_t, p.parts)
                for layer in range(num_layers) for name in PROJECTIONS])
        return self._decode_table


def load_adapter(lora_int_id: int, path: str, model: nn.Module, max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """An adapter's weights (adapter_model.safetensors), checked against `model`'s projections."""
    from safetensors.torch import load_file

    cfg = read_adapter_config(path, max_rank)
    weights_path = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(weights_path):
        raise ValueError(f"lora_request.lora_path {path!r} holds no adapter_model.safetensors (only safetensors "
                         "adapters are read).")
    tensors = load_file(weights_path)
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        match = _KEY.match(name)
        if match is None:
            raise ValueError(f"lora_request: the adapter has weights for {name!r}; only the attention and MLP "
                             "projections' lora_A / lora_B are supported.")
        layer, module, ab = int(match.group(1)), match.group(2), match.group(3)
        found.setdefault((layer, module), {})[ab] = tensor
    num_layers = len(model.layers)
    grouped: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, module), ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"lora_request: layer {layer} {module} has lora_{''.join(ab)} without its pair.")
        if layer >= num_layers:
            raise ValueError(f"lora_request: the adapter has layer {layer}, the model {num_layers} layers.")
        fused, part = TARGETS[module]
        grouped.setdefault((layer, fused), []).append((part, ab["A"], ab["B"]))
    adapter = LoRAAdapter(lora_int_id, cfg.rank)
    for (layer, fused), parts in grouped.items():
        base = model.layers[layer].get_submodule(fused)
        base = getattr(base, "base", base)  # already wrapped
        in_features, row_starts = _shape_of(model, fused)
        parts.sort(key=lambda p: p[0])
        total_rank = sum(a.shape[0] for _, a, _ in parts)
        b_t = torch.zeros(total_rank, row_starts[-1], dtype=torch.float32)
        col = 0
        spans = []
        for part, a, b in parts:
            row0, row1 = row_starts[part], row_starts[part + 1]
            if a.shape[1] != in_features or b.shape[0] != row1 - row0 or a.shape[0] != b.shape[1]:
                raise ValueError(f"lora_request: layer {layer}'s adapter shapes A {tuple(a.shape)}, B {tuple(b.shape)} "
                                 f"do not fit the model's projection ({row1 - row0} x {in_features}).")
            b_t[col:col + a.shape[0], row0:row1] = b.to(torch.float32).t() * cfg.scaling
            spans.append((col, col + a.shape[0], row0, row1))
            col += a.shape[0]
        a_cat = torch.cat([a.to(torch.float32) for _, a, _ in parts])
        adapter.projections[(layer, fused)] = _Projection(a_cat.to(dtype).contiguous(), b_t.to(dtype).contiguous(),
                                                          tuple(spans))
    return adapter


def _shape_of(model: nn.Module, fused: str) -> tuple[int, tuple[int, ...]]:
    """(in_features, the row where each part of the fused projection starts, then its end)."""
    c = model.config
    q, kv, hidden, inter = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim, c.hidden_size, c.intermediate_size
    return {
        "self_attn.qkv_proj": (hidden, (0, q, q + kv, q + 2 * kv)),
        "self_attn.o_proj": (q, (0, hidden)),
        "mlp.gate_up_proj": (hidden, (0, inter, 2 * inter)),
        "mlp.down_proj": (inter, (0, hidden)),
    }[fused]


class LoRAState:
    """Which tokens of the step run with which adapter (set by the model runner before each
    forward): `groups` of (token indices, adapter). Empty: the step is the base model's."""

    def __init__(self) -> None:
        self.groups: list[tuple[torch.Tensor | slice, LoRAAdapter]] = []
        # For the fused decode step: the step's adapters and each token's index among them
        # (int32 [T], -1 for none); set with `groups`.
        self.adapters: list[LoRAAdapter] = []
        self.token_adapter: torch.Tensor | None = None

    @property
    def active(self) -> bool:
        return bool(self.groups)

    def apply(self, key: tuple[int, str], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for rows, adapter in self.groups:
            proj = adapter.projections.get(key)
            if proj is None:
                continue
            xa = x[rows] @ proj.a.t()  # [n, sum of ranks]
            if isinstance(rows, slice):  # one run of tokens: added in place
                y[rows].addmm_(xa, proj.b_t)
            else:
                y.index_add_(0, rows, xa @ proj.b_t)
        return y


class LoRALinear(nn.Module):
    """A projection with the step's adapters added (see the module docstring)."""

    def __init__(self, base: nn.Module, key: tuple[int, str], state: LoRAState) -> None:
        super().__init__()
        self.base = base
        self.key = key
        self.state = state

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        return self.state.apply(self.key, x, y) if self.state.active else y

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """The base's fused gate|up + SiLU-and-mul (model/llama.MLP), only while no adapter is in
        the step: an adapter's product must be added before the activation."""
        fused = getattr(self.base, "silu_and_mul", None)
        return None if fused is None or self.state.active else fused(x)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_modules"]["base"], name)  # weight, bias, ... of the base


def wrap_projections(model: nn.Module, state: LoRAState) -> None:
    """Puts a LoRALinear around every layer's q|k|v, o, gate|up and down projection."""
    for i, layer in enumerate(model.layers):
        for name in PROJECTIONS:
            parent_name, attr = name.rsplit(".", 1)
            parent = layer.get_submodule(parent_name)
            module = getattr(parent, attr)
            if not isinstance(module, LoRALinear):
                setattr(parent, attr, LoRALinear(module, (i, name), state))
