"""When a decode step of a Llama-family model runs as one C call (ops/decode_step.py).

`FusedDecode.build(model)` checks once, after the model runner laid out the weights, that
every layer is what the C step computes: the Llama decoder layer (not Gemma 3's), q/k norm in
float32 only, no sliding window, no tensor parallelism (a `RowParallel` o_proj or down_proj is neither kind of
linear below), optional q/k/v bias, and either
- quantized: every linear one tiled quantized weight (q|k|v and gate|up fused), float32 norms;
  the step returns the eager layers' results bit for bit; or
- bfloat16: every linear a bf16 `Linear` whose weight the model runner packed in AMX tile
  order (model/packed_linear, ops/amx: AMX tiles, or AVX512-BF16 dot products on CPUs without
  AMX), or, with AMX, a tiled quantized weight in a bfloat16 model (ops/quant's bf16 tiles): the
  step multiplies the same weights with the same kernel as the eager layers; or
- float32: every linear a float32 `Linear` packed in panels (AVX2 CPUs, csrc/f32_panel.c) or a
  tiled quantized one: the step calls the kernels the eager layers call, at any step size, so it
  returns their results bit for bit; or with its plain row-major weight (panels turned off), where
  the step runs for fewer tokens than `packed_linear.GEMV_BELOW_ROWS`, the eager layers calling
  the same C GEMV there, and leaves larger steps to oneDNN's packed matmuls.
A mixture-of-experts block (model/moe.SparseMoeBlock, no shared expert, softmax routing) takes a
layer's MLP in float32 where its experts run as one C call (ops/quant_moe.QuantExperts) and its
router is a plain float32 weight: the step routes in C (softmax, top-k) and calls the same
`tl_q_moe`, so its results equal the eager layers' to float rounding (not bit for bit: the C
softmax), and a step with an expert chosen by the plan's `moe_fused_below_rows` tokens or more
runs the eager layers.
Each step it then checks that the step is a plain decode step -- one attention plan, every token
a decode of its own request in order, the C decode kernel's block table built, a cache the step
can write -- and otherwise returns None, so the eager layers run (prefills, mixed steps, the
PyTorch fallbacks).

With LoRA adapters in the step (`lora_state`, set by worker/lora_manager.py), a float32 step
adds their products in C (csrc/lora_decode.c), equal to the eager LoRALinear's to rounding; a
bfloat16 one returns None.

`TOKENLOOM_FUSED_DECODE=0` keeps the eager layers for every step (for A/B measurements).
"""
from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from tokenloom.attention.torch_backend import TorchAttentionPlan
from tokenloom.model import packed_linear
from tokenloom.model.llama import Linear
from tokenloom.model.lora import LoRAState
from tokenloom.model.quant_linear import QuantLinear
from tokenloom.ops import amx, cpu_kernels, kernel_plan
from tokenloom.ops.amx import AmxPackedWeight
from tokenloom.ops.cpu_kernels import F32Panels
from tokenloom.ops.decode_step import DecodeLayer, DecodeMoe, DecodeStep, F32Weight
from tokenloom.ops.quant import TiledQuantWeight
from tokenloom.ops.quant_moe import QuantExperts

logger = logging.getLogger(__name__)


def _tiled(module: nn.Module, bias_ok: bool = False) -> TiledQuantWeight | None:
    if type(module) is not QuantLinear or len(module.parts) != 1:
        return None
    part = module.parts[0]
    if not isinstance(part, TiledQuantWeight) or (module.bias is not None and not bias_ok):
        return None
    return part


def _bf16(module: nn.Module, bias_ok: bool = False) -> AmxPackedWeight | None:
    if type(module) is not Linear or (module.bias is not None and not bias_ok):
        return None
    return module.packed_weight if isinstance(module.packed_weight, AmxPackedWeight) else None


def _f32(module: nn.Module, bias_ok: bool = False) -> F32Weight | F32Panels | None:
    """The float32 matrix as the eager layers multiply it: its panels, else its plain weight where
    they take the C GEMV."""
    if type(module) is not Linear or (module.bias is not None and not bias_ok):
        return None
    if isinstance(module.packed_weight, F32Panels):
        return module.packed_weight
    return F32Weight(module.weight.detach()) if packed_linear.gemv_weight(module.weight) else None


def _split_qkv(module: nn.Module) -> tuple[TiledQuantWeight, ...] | None:
    """q, k and v of a QuantLinear kept as three tiled weights (their formats differ: a Q4_K_M
    file's Q6_K attn_v), or None."""
    if type(module) is not QuantLinear or len(module.parts) != 3:
        return None
    parts = tuple(module.parts)
    return parts if all(isinstance(p, TiledQuantWeight) for p in parts) else None


def _moe(block: nn.Module) -> DecodeMoe | None:
    """An MoE block as the C step computes it, or None: no shared expert, softmax routing,
    experts one C call (ops/quant_moe), a plain float32 router."""
    experts = block.experts
    router = _f32(block.gate)
    if (getattr(block, "shared_expert", None) is not None or experts.scoring != "softmax"
            or experts.quant_layer is None or experts.quant_layer.below <= 1 or not isinstance(router, F32Weight)):
        return None
    return DecodeMoe(router=router.data, experts=experts.quant_layer, top_k=experts.top_k,
                     renormalize=experts.renormalize)


class FusedDecode:
    """The C decode step of a loaded model, with the per-step applicability check."""

    def __init__(self, step: DecodeStep, max_tokens: int | None = None) -> None:
        self.step = step
        self.max_tokens = max_tokens  # None: any step size
        self.steps = 0  # decode steps run fused (tests and benchmarks read it)
        # The LoRA adapters of each step (model/lora.LoRAState), set when the runner has them.
        self.lora_state: LoRAState | None = None
        self.moe_experts: list[QuantExperts] = []  # the MoE layers' experts (the step checks their rows)

    @classmethod
    def build(cls, model: nn.Module) -> FusedDecode | None:
        """The fused step for `model`, or None when any part of it is not what the C step
        computes (then every step runs the eager layers, as before)."""
        if not kernel_plan.current().fused_decode or cpu_kernels.load() is None:
            return None
        cfg = model.config
        if (not getattr(model, "fused_decode_ok", False) or cfg.sliding_window is not None
                or model.vocab_gather is not None or not len(model.layers)):
            return None
        dtype = model.norm.weight.dtype
        if cfg.qk_norm and dtype != torch.float32:
            return None
        if dtype == torch.float32:
            def kind(m: nn.Module, bias_ok: bool = False) -> TiledQuantWeight | F32Weight | F32Panels | None:
                return _tiled(m, bias_ok) or _f32(m, bias_ok)
        elif dtype == torch.bfloat16 and amx.available():
            # bf16 weights packed in tile order (AMX tiles or AVX512-BF16 dot products), or
            # quantized ones in a bf16 model (ops/quant's bf16 tiles: AMX only)
            def kind(m: nn.Module, bias_ok: bool = False) -> TiledQuantWeight | AmxPackedWeight | None:
                return _bf16(m, bias_ok) or (_tiled(m, bias_ok) if amx.tiles() else None)
        else:
            return None
        layers = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            moe = _moe(mlp) if hasattr(mlp, "experts") else None
            if hasattr(mlp, "experts") and (moe is None or dtype != torch.float32):
                return None
            mlp_mats = (None, None) if moe else (kind(mlp.gate_up_proj), kind(mlp.down_proj))
            mats = (kind(attn.qkv_proj, bias_ok=True), kind(attn.o_proj))
            kv_parts = None
            if mats[0] is None and dtype == torch.float32:
                mats, kv_parts = _split_qkv(attn.qkv_proj), None
                if mats is not None:
                    mats, kv_parts = (mats[0], kind(attn.o_proj)), mats[1:]
                else:
                    mats = (None, None)
            norms = (layer.input_layernorm.weight, layer.post_attention_layernorm.weight)
            if (any(m is None for m in mats) or (moe is None and None in mlp_mats)
                    or any(n.dtype != dtype for n in norms)):
                return None
            bias = attn.qkv_proj.bias
            qk = (attn.q_norm.weight.detach(), attn.k_norm.weight.detach()) if cfg.qk_norm else (None, None)
            layers.append(DecodeLayer(
                input_norm=norms[0].detach(), post_norm=norms[1].detach(), qkv=mats[0], o=mats[1],
                gate_up=mlp_mats[0], down=mlp_mats[1], qkv_bias=None if bias is None else bias.detach(),
                q_norm=qk[0], k_norm=qk[1], moe=moe, kv_parts=kv_parts))
        step = DecodeStep(layers, model.norm.weight.detach(), model.cos_sin,
                          num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                          head_dim=cfg.head_dim, eps=cfg.rms_norm_eps)
        mats = [m for lay in layers for m in (lay.qkv, lay.o, lay.gate_up, lay.down) if m is not None]
        self_moe = [lay.moe.experts for lay in layers if lay.moe is not None]
        f32 = any(isinstance(m, (F32Weight, F32Panels)) for m in mats)
        matmuls = ("float32" if f32 else "quantized" if isinstance(layers[0].qkv, TiledQuantWeight)
                   else "bfloat16")
        # plain float32 matrices: only the step sizes the eager layers also run on the C GEMV
        # (on panels they run the panel kernel at every size)
        max_tokens = packed_linear.GEMV_BELOW_ROWS - 1 if any(isinstance(m, F32Weight) for m in mats) else None
        logger.info("decode steps run as one C call per step (%s matmuls, %s activations%s)",
                    matmuls, str(dtype).removeprefix("torch."),
                    f", up to {max_tokens} tokens" if max_tokens else "")
        fused = cls(step, max_tokens)
        fused.moe_experts = self_moe
        return fused

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 attn_plans: list[Any]) -> torch.Tensor | None:
        """The final hidden states of a plain decode step, or None for any other step."""
        if len(attn_plans) != 1 or not isinstance(attn_plans[0], TorchAttentionPlan):
            return None
        plan = attn_plans[0]
        T = h.shape[0]
        if self.max_tokens is not None and T > self.max_tokens:
            return None
        if self.moe_experts and T >= self.moe_experts[0].below:
            # an expert may get `below` rows or more: the eager layers pick per layer
            return None
        dp = plan.decode
        if (dp is None or plan.padded_prefill is not None or plan.request_prefills
                or dp.block_table_i32 is None or dp.sliding_window is not None
                or dp.token_slice is None or dp.token_slice.start not in (0, None)
                or dp.num_decodes != T or plan.num_actual_tokens != T
                or h.dtype != self.step.dtype or h.device.type != "cpu"
                or positions.dtype != torch.int64 or not positions.is_contiguous()):
            return None
        lora = None
        state = self.lora_state
        if state is not None and state.active:
            if self.step.dtype != torch.float32:  # the C step adds adapters to float32 steps only
                return None
            lora = ([a.decode_table(len(kv_caches)) for a in state.adapters], state.token_adapter)
        cache = kv_caches[0]
        # A bfloat16 step needs a bfloat16 cache; a float32 one writes float32 or bfloat16.
        ok = (torch.bfloat16,) if self.step.dtype == torch.bfloat16 else (torch.float32, torch.bfloat16)
        if cache.dtype not in ok or not cache.is_contiguous() or cache.shape[3] != self.step.num_kv_heads:
            return None
        out = self.step(h.contiguous(), positions, plan.write_slots.contiguous(),
                        dp.block_table_i32, dp.seq_lens_i32, kv_caches, lora)
        self.steps += 1
        return out
