"""Mixture-of-experts decoders: Qwen3-MoE, Qwen2-MoE and Mixtral, each Llama's decoder with the
MLP of (most) layers replaced by a sparse MoE block.

- `FusedMoE` (vLLM's shape): the experts' weights stacked, gate|up `w13_weight` [E, 2I, H] and
  `w2_weight` [E, H, I] (optional biases `w13_bias` [E, 2I], `w2_bias` [E, H]); `forward(x,
  router_logits)` routes (ops/moe.select_experts), groups the tokens by expert and runs one
  gate|up and one down matmul per chosen expert over only its tokens (ops/moe.fused_experts). A
  GGUF's quantized experts replace the stacked floats with one `QuantLinear` pair per expert
  (`install_quantized`), tiled from the file's bytes once. A family with other experts (gpt-oss:
  biases, a clamped SwiGLU, MXFP4) passes its `activation` or overrides `expert_forward`.
- `SparseMoeBlock`: the router (`gate`, a Linear [E, H]), the experts and, for Qwen2-MoE, a
  shared expert (a dense MLP) scaled by sigmoid(`shared_expert_gate`). It owns the checkpoint's
  names of its tensors: Qwen's `mlp.experts.{e}.gate_proj`, Mixtral's
  `block_sparse_moe.experts.{e}.w1` (gate), `w3` (up), `w2` (down).
- `MoeDecoderLayer`: Llama's layer with that block as `mlp`, but in `mlp_only_layers`.

Routing: softmax over the experts, the top `num_experts_per_tok`, renormalised where
`norm_topk_prob` (Qwen3-MoE's configs set it, Qwen2-MoE's do not, Mixtral always).
"""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import MLP, DecoderLayer, Linear, LlamaForCausalLM
from tokenloom.ops import elementwise as ops
from tokenloom.ops.moe import fused_experts, select_experts
from tokenloom.ops.quant_moe import QuantExperts

# The parts of an expert, in the order of `SparseMoeBlock.expert_names`.
EXPERT_PARTS = ("gate", "up", "down")


class FusedMoE(nn.Module):
    """The experts of one layer, stacked; see the module docstring. `activation` maps the gate|up
    product [n, 2I] (gate rows first) to [n, I]: SiLU-and-mul unless the family says otherwise."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *,
                 renormalize: bool = True, scoring: str = "softmax", bias: bool = False,
                 activation: Callable[[torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.renormalize, self.scoring = renormalize, scoring
        self.activation = activation or ops.silu_and_mul
        E, H, I = num_experts, hidden_size, intermediate_size
        self.w13_weight: nn.Parameter | None = nn.Parameter(torch.empty(E, 2 * I, H))
        self.w2_weight: nn.Parameter | None = nn.Parameter(torch.empty(E, H, I))
        self.w13_bias = nn.Parameter(torch.empty(E, 2 * I)) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(E, H)) if bias else None
        # Per expert, a module x [n, H] -> [n, 2I] (gate|up) and one [n, I] -> [n, H] (down),
        # in place of the stacked weights (a GGUF's quantized experts); None: the stacked floats.
        self.quant_w13: nn.ModuleList | None = None
        self.quant_w2: nn.ModuleList | None = None
        # Those experts as one C call per layer at decode sizes (ops/quant_moe), where they fit it.
        self.quant_layer: QuantExperts | None = None

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H]."""
        weights, ids = select_experts(router_logits, self.top_k, self.scoring, self.renormalize)
        if self.quant_layer is not None and self.quant_layer.takes(x, ids):
            return self.quant_layer.forward(x, weights, ids)
        return fused_experts(x, weights, ids, self.expert_forward)

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e over its tokens' rows x [n, H] -> [n, H]."""
        if self.quant_w13 is not None:
            w13, w2 = self.quant_w13[e], self.quant_w2[e]
            # SiLU-and-mul in the quantized matmul's epilogue where its kernel has one.
            fused = getattr(w13, "silu_and_mul", None) if self.activation is ops.silu_and_mul else None
            act = fused(x) if fused is not None else None
            return w2(self.activation(w13(x)) if act is None else act)
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        b2 = None if self.w2_bias is None else self.w2_bias[e]
        return F.linear(self.activation(F.linear(x, self.w13_weight[e], b13)), self.w2_weight[e], b2)

    @torch.no_grad()
    def load_expert(self, e: int, part: str, tensor: torch.Tensor, bias: bool = False) -> None:
        """One checkpoint tensor of expert e: its "gate" or "up" rows of w13, or its "down"
        (w2); the weight, or with `bias` the bias."""
        I = self.intermediate_size
        w13 = self.w13_bias if bias else self.w13_weight
        if part == "gate":
            w13[e, :I].copy_(tensor)
        elif part == "up":
            w13[e, I:].copy_(tensor)
        elif part == "down":
            (self.w2_bias if bias else self.w2_weight)[e].copy_(tensor)
        else:
            raise ValueError(f"expert part must be one of {', '.join(EXPERT_PARTS)}, got {part!r}")

    def install_quantized(self, w13: list[nn.Module], w2: list[nn.Module]) -> None:
        """Compute with one (gate|up, down) module pair per expert from now on; the stacked float
        weights are dropped (never written: the loader skips the tensors these consumed)."""
        if len(w13) != self.num_experts or len(w2) != self.num_experts:
            raise ValueError(f"{self.num_experts} experts, got {len(w13)} gate|up and {len(w2)} down modules")
        self.quant_w13, self.quant_w2 = nn.ModuleList(w13), nn.ModuleList(w2)
        self.w13_weight = self.w2_weight = None
        plain = self.activation is ops.silu_and_mul and type(self).expert_forward is FusedMoE.expert_forward
        self.quant_layer = QuantExperts.of(w13, w2) if plain else None

    def extra_repr(self) -> str:
        kind = "float" if self.quant_w13 is None else "quantized"
        return (f"experts={self.num_experts}, top_k={self.top_k}, hidden={self.hidden_size}, "
                f"intermediate={self.intermediate_size}, scoring={self.scoring}, "
                f"renormalize={self.renormalize}, {kind}")


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert; see the module docstring."""

    prefix = "mlp"  # the block's name in the checkpoint (under model.layers.N.)
    expert_names = ("gate_proj", "up_proj", "down_proj")  # gate, up, down

    def __init__(self, cfg: ModelArchConfig) -> None:
        super().__init__()
        self.gate = Linear(cfg.hidden_size, cfg.num_experts)
        # the router's plain weight stays beside its packed copy (a few rows): the fused decode
        # step routes with it (model/fused_decode), and the eager step's C GEMV reads it
        self.gate.keep_plain = True
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, renormalize=cfg.norm_topk_prob)
        S = cfg.shared_expert_intermediate_size
        self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=S, mlp_bias=False)) if S else None
        self.shared_expert_gate = Linear(cfg.hidden_size, 1) if S else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out

    # ------------------------------------------------------------------ checkpoint names
    def expert_weight_names(self, e: int) -> tuple[str, ...]:
        """Expert e's gate, up and down weights, relative to the layer (model.layers.N.)."""
        return tuple(f"{self.prefix}.experts.{e}.{n}.weight" for n in self.expert_names)

    def linear_groups(self) -> dict[tuple[nn.Module, str], list[str]]:
        """(module, attribute) of each Linear -> the checkpoint's names of its parts (relative
        to the layer, without .weight), as quant_linear.install_gguf_quantized swaps them."""
        groups = {(self, "gate"): [f"{self.prefix}.gate"]}
        if self.shared_expert is not None:
            p = f"{self.prefix}.shared_expert"
            groups |= {(self.shared_expert, "gate_up_proj"): [f"{p}.gate_proj", f"{p}.up_proj"],
                       (self.shared_expert, "down_proj"): [f"{p}.down_proj"],
                       (self, "shared_expert_gate"): [f"{self.prefix}.shared_expert_gate"]}
        return groups

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The block's tensors, relative to the layer, with their shapes."""
        x = self.experts
        E, H, I = x.num_experts, x.hidden_size, x.intermediate_size
        shapes: dict[str, tuple[int, ...]] = {f"{self.prefix}.gate.weight": (E, H)}
        for e in range(E):
            gate, up, down = self.expert_weight_names(e)
            shapes |= {gate: (I, H), up: (I, H), down: (H, I)}
        if self.shared_expert is not None:
            S, p = self.shared_expert.intermediate_size, f"{self.prefix}.shared_expert"
            shapes |= {f"{p}.gate_proj.weight": (S, H), f"{p}.up_proj.weight": (S, H),
                       f"{p}.down_proj.weight": (H, S), f"{self.prefix}.shared_expert_gate.weight": (1, H)}
        return shapes

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """Copies one checkpoint tensor (`name` relative to the layer) into the block; False
        where the name is not one of the block's."""
        rest = name.removeprefix(f"{self.prefix}.")
        if rest == name:
            return False
        m = re.fullmatch(r"experts\.(\d+)\.(\w+)\.weight", rest)
        if m and m.group(2) in self.expert_names:
            self.experts.load_expert(int(m.group(1)), EXPERT_PARTS[self.expert_names.index(m.group(2))], tensor)
            return True
        m = re.fullmatch(r"shared_expert\.(gate|up|down)_proj\.weight", rest)
        if m and self.shared_expert is not None:
            S = self.shared_expert.intermediate_size
            if m.group(1) == "down":
                self.shared_expert.down_proj.weight.copy_(tensor)
            else:
                start = 0 if m.group(1) == "gate" else S
                self.shared_expert.gate_up_proj.weight[start:start + S].copy_(tensor)
            return True
        target = {"gate.weight": self.gate, "shared_expert_gate.weight": self.shared_expert_gate}.get(rest)
        if target is None:
            return False
        target.weight.copy_(tensor)
        return True


class MixtralSparseMoeBlock(SparseMoeBlock):
    prefix = "block_sparse_moe"
    expert_names = ("w1", "w3", "w2")


def is_moe_layer(cfg: ModelArchConfig, layer_id: int) -> bool:
    return cfg.num_experts > 0 and layer_id not in cfg.mlp_only_layers


class MoeDecoderLayer(DecoderLayer):
    """Llama's layer (Qwen's q/k norm or q/k/v bias as configured) with a sparse MoE block as
    its MLP, but in `mlp_only_layers`."""

    moe_block_cls: type[SparseMoeBlock] = SparseMoeBlock

    def __init__(self, cfg: ModelArchConfig, layer_id: int = 0) -> None:
        super().__init__(cfg, layer_id)
        if is_moe_layer(cfg, layer_id):
            self.mlp = self.moe_block_cls(cfg)


class MixtralDecoderLayer(MoeDecoderLayer):
    moe_block_cls = MixtralSparseMoeBlock


class MoeForCausalLM(LlamaForCausalLM):
    """Qwen3-MoE and Qwen2-MoE (Mixtral: `MixtralForCausalLM`): Llama's model with
    `MoeDecoderLayer`s; checkpoint names and loading of the MoE blocks are the blocks'."""

    decoder_layer_cls = MoeDecoderLayer
    fused_decode_ok = True  # float32 with quantized experts: model/fused_decode checks each block

    def __init__(self, config: ModelArchConfig) -> None:
        super().__init__(config)
        plain = dataclasses.replace(config, num_experts=0).is_plain_llama
        self.fused_decode_ok = type(self).fused_decode_ok and plain

    def moe_blocks(self) -> Iterable[tuple[int, SparseMoeBlock]]:
        for i, layer in enumerate(self.layers):
            if isinstance(layer.mlp, SparseMoeBlock):
                yield i, layer.mlp

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """Llama's, with each MoE layer's dense MLP replaced by its block's tensors."""
        shapes = super().checkpoint_shapes()
        for i, block in self.moe_blocks():
            p = f"model.layers.{i}."
            for part in ("gate_proj", "up_proj", "down_proj"):
                del shapes[f"{p}mlp.{part}.weight"]
            shapes |= {p + name: shape for name, shape in block.checkpoint_shapes().items()}
        return shapes

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        blocks = dict(self.moe_blocks())
        loaded: set[str] = set()

        def dense(items: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in items:
                m = re.match(r"model\.layers\.(\d+)\.(.*)", name)
                block = blocks.get(int(m.group(1))) if m else None
                if block is not None and block.load(m.group(2), tensor):
                    loaded.add(name)
                else:
                    yield name, tensor

        return super().load_weights(dense(weights)) | loaded


class MixtralForCausalLM(MoeForCausalLM):
    decoder_layer_cls = MixtralDecoderLayer
