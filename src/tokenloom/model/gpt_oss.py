"""gpt-oss (`GptOssForCausalLM`) as its difference from the MoE decoder (moe.py):

- attention: q/k/v and o biases, a learned sink logit per query head in every softmax
  (`self_attn.sinks`, the attention backend's `sinks`: the torch backend's eager path; the C
  decode kernel has none), and sliding-window layers alternating with full ones (`layer_types`,
  the KV cache groups);
- the MoE block: the router is a Linear with a bias (`mlp.router`), its weights a softmax over
  the top-k logits; the experts have biases and a clamped SwiGLU, `(up + 1) * gate *
  sigmoid(alpha * gate)` with gate clamped above at `limit` and up to [-limit, limit];
- the checkpoint stores each layer's experts stacked, gate|up interleaved by columns
  (`mlp.experts.gate_up_proj` [E, H, 2I], `down_proj` [E, I, H], as transformers' GptOssExperts),
  or as shipped, in MXFP4 (`*_blocks`, `*_scales`, mxfp4.py): those bytes are kept and each
  expert's matrices are made float for the step that uses them (`Mxfp4FusedMoE`).
"""
from __future__ import annotations

import functools
import re

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model import mxfp4
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.llama import Linear
from tokenloom.model.moe import FusedMoE, MoeDecoderLayer, MoeForCausalLM, SparseMoeBlock


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] (gate rows first, FusedMoE's layout) -> [n, I], as transformers' GptOssExperts."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Mxfp4FusedMoE(FusedMoE):
    """FusedMoE whose expert weights are MXFP4 bytes (w13 rows gate first, as FusedMoE's):
    `w13_blocks` [E, 2I, H / 32, 16] with `w13_scales` [E, 2I, H / 32], `w2_blocks` [E, H, I / 32,
    16] with `w2_scales` [E, H, I / 32], all uint8; an expert is dequantized when a token chose it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        E, H, I = self.num_experts, self.hidden_size, self.intermediate_size
        if H % mxfp4.GROUP or I % mxfp4.GROUP:
            raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size divisible by {mxfp4.GROUP}, "
                             f"got {H} and {I}")
        self.w13_weight = self.w2_weight = None
        G = mxfp4.GROUP
        self.register_buffer("w13_blocks", torch.empty(E, 2 * I, H // G, G // 2, dtype=torch.uint8))
        self.register_buffer("w13_scales", torch.empty(E, 2 * I, H // G, dtype=torch.uint8))
        self.register_buffer("w2_blocks", torch.empty(E, H, I // G, G // 2, dtype=torch.uint8))
        self.register_buffer("w2_scales", torch.empty(E, H, I // G, dtype=torch.uint8))

    def packed_bytes_per_expert(self) -> int:
        """What one expert's matrices occupy (quant_linear.weight_bytes_per_token)."""
        return sum(t[0].numel() for t in (self.w13_blocks, self.w13_scales, self.w2_blocks, self.w2_scales))

    def fill_dummy_(self, lay_over, phase: int) -> int:
        """load_format="dummy": the blocks from the loader's random bytes (`lay_over(flat, phase)
        -> phase`), every scale 2 ** -6 (values up to 6 / 64)."""
        for blocks, scales in ((self.w13_blocks, self.w13_scales), (self.w2_blocks, self.w2_scales)):
            phase = lay_over(blocks.view(-1), phase)
            scales.fill_(127 - 6)
        return phase

    def expert_forward(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w13 = mxfp4.dequantize(self.w13_blocks[e], self.w13_scales[e], x.dtype)
        w2 = mxfp4.dequantize(self.w2_blocks[e], self.w2_scales[e], x.dtype)
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        b2 = None if self.w2_bias is None else self.w2_bias[e]
        return F.linear(self.activation(F.linear(x, w13, b13)), w2, b2)


class GptOssMoeBlock(SparseMoeBlock):
    """The router (a Linear with a bias, `mlp.router`) and the experts, under gpt-oss's names."""

    def __init__(self, cfg: ModelArchConfig) -> None:
        nn.Module.__init__(self)
        E, H = cfg.num_experts, cfg.hidden_size
        self.router = Linear(H, E, bias=True)
        experts_cls = Mxfp4FusedMoE if cfg.experts_mxfp4 else FusedMoE
        self.experts = experts_cls(E, cfg.num_experts_per_tok, H, cfg.moe_intermediate_size, bias=True,
                                   scoring="topk_softmax",
                                   activation=functools.partial(clamped_swiglu, alpha=cfg.swiglu_alpha,
                                                                limit=cfg.swiglu_limit))
        self.shared_expert = self.shared_expert_gate = None

    @property
    def gate(self) -> Linear:
        """The router under SparseMoeBlock's name (int8 quantization keeps it float)."""
        return self.router

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts(x, self.router(x))

    def linear_groups(self) -> dict[tuple[nn.Module, str], list[str]]:
        return {(self, "router"): ["mlp.router"]}

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        x = self.experts
        E, H, I = x.num_experts, x.hidden_size, x.intermediate_size
        shapes = {"mlp.router.weight": (E, H), "mlp.router.bias": (E,),
                  "mlp.experts.gate_up_proj_bias": (E, 2 * I), "mlp.experts.down_proj_bias": (E, H)}
        if isinstance(x, Mxfp4FusedMoE):
            for ours, theirs in (("w13", "gate_up_proj"), ("w2", "down_proj")):
                shapes[f"mlp.experts.{theirs}_blocks"] = tuple(getattr(x, f"{ours}_blocks").shape)
                shapes[f"mlp.experts.{theirs}_scales"] = tuple(getattr(x, f"{ours}_scales").shape)
        else:
            shapes |= {"mlp.experts.gate_up_proj": (E, H, 2 * I), "mlp.experts.down_proj": (E, I, H)}
        return shapes

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """gate|up columns (float) or rows (MXFP4) interleaved -> FusedMoE's gate rows, then up."""
        m = re.fullmatch(r"mlp\.(router\.(?:weight|bias)|experts\.(\w+))", name)
        if m is None:
            return False
        if m.group(2) is None:
            getattr(self.router, m.group(1).split(".")[1]).copy_(tensor)
            return True
        x, part = self.experts, m.group(2)
        if part == "gate_up_proj_bias":
            x.w13_bias.copy_(torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1))
        elif part == "down_proj_bias":
            x.w2_bias.copy_(tensor)
        elif part == "gate_up_proj":  # [E, H, 2I] -> [E, 2I, H]
            x.w13_weight.copy_(torch.cat([tensor[:, :, 0::2], tensor[:, :, 1::2]], dim=2).transpose(1, 2))
        elif part == "down_proj":  # [E, I, H] -> [E, H, I]
            x.w2_weight.copy_(tensor.transpose(1, 2))
        elif part in ("gate_up_proj_blocks", "gate_up_proj_scales"):
            getattr(x, "w13_" + part.rsplit("_", 1)[1]).copy_(torch.cat([tensor[:, 0::2], tensor[:, 1::2]], dim=1))
        elif part in ("down_proj_blocks", "down_proj_scales"):
            getattr(x, "w2_" + part.rsplit("_", 1)[1]).copy_(tensor)
        else:
            return False
        return True


class GptOssDecoderLayer(MoeDecoderLayer):
    moe_block_cls = GptOssMoeBlock  # the attention's sinks are llama.Attention's (attention_sinks)


class GptOssForCausalLM(MoeForCausalLM):
    decoder_layer_cls = GptOssDecoderLayer
    fused_decode_ok = False  # attention sinks and its own experts

    def checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        shapes = super().checkpoint_shapes()
        for i in range(self.config.num_hidden_layers):
            shapes[f"model.layers.{i}.self_attn.sinks"] = (self.config.num_attention_heads,)
        return shapes
