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
  or as shipped, in MXFP4 (`*_blocks`, `*_scales`, mxfp4.py): those bytes are kept; a step of a
  few rows multiplies them in C (csrc/mxfp4_gemm.c, below the kernel plan's
  `mxfp4_c_below_rows`, by dtype), a larger one makes each chosen expert's matrices float for that step
  (in C too, `cpu_kernels.mxfp4_unpack`) for torch's matmul (`Mxfp4FusedMoE`);
- llama.cpp's `gpt-oss` GGUF holds each part of the experts apart, stacked [E, out, in] (gate and
  up de-interleaved, biases [E, out]), under the names its converter maps
  (`gguf_checkpoint_shapes`), MXFP4 in ggml's block layout (mxfp4.from_ggml).
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
from tokenloom.ops import cpu_kernels, kernel_plan


def clamped_swiglu(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """[n, 2I] (gate rows first, FusedMoE's layout) -> [n, I], as transformers' GptOssExperts."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class Mxfp4FusedMoE(FusedMoE):
    """FusedMoE whose expert weights are MXFP4 bytes (w13 rows gate first, as FusedMoE's):
    `w13_blocks` [E, 2I, H / 32, 16] with `w13_scales` [E, 2I, H / 32], `w2_blocks` [E, H, I / 32,
    16] with `w2_scales` [E, H, I / 32], all uint8; an expert is computed from them when a token
    chose it."""

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
        # Steps of fewer rows run csrc/mxfp4_gemm.c, by the activations' dtype (the plan of the
        # process that built the model, read once: it is asked for every expert of every step).
        plan = kernel_plan.current()
        self.c_below_rows = {torch.float32: plan.mxfp4_c_below_rows, torch.bfloat16: plan.mxfp4_c_below_rows_bf16}

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
        b13 = None if self.w13_bias is None else self.w13_bias[e]
        b2 = None if self.w2_bias is None else self.w2_bias[e]
        lib = self.c_kernels(x)
        if lib is not None:  # a decode step's few rows: the C kernel on the packed bytes
            def linear(h, blocks, scales, bias):
                bias = None if bias is None else bias.float()
                return cpu_kernels.mxfp4_linear(lib, h.float(), blocks, scales, bias).to(x.dtype)

            h = self.activation(linear(x, self.w13_blocks[e], self.w13_scales[e], b13))
            return linear(h, self.w2_blocks[e], self.w2_scales[e], b2)
        w13 = _unpack(self.w13_blocks[e], self.w13_scales[e], x)
        w2 = _unpack(self.w2_blocks[e], self.w2_scales[e], x)
        return F.linear(self.activation(F.linear(x, w13, b13)), w2, b2)

    def c_kernels(self, x: torch.Tensor):  # noqa: ANN201 - the ctypes library or None
        """The C kernels where the plan runs MXFP4 matmuls of `x`'s rows on them
        (csrc/mxfp4_gemm.c), else None: the expert is unpacked to float for torch's matmul."""
        if x.device.type != "cpu" or x.shape[0] >= self.c_below_rows.get(x.dtype, 0):
            return None
        return cpu_kernels.load()


def _unpack(blocks: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The matrix in `x`'s dtype: unpacked in C where the kernels are built (the same values)."""
    lib = cpu_kernels.load() if x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16) else None
    if lib is None:
        return mxfp4.dequantize(blocks, scales, x.dtype)
    return cpu_kernels.mxfp4_unpack(lib, blocks, scales, x.dtype)


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

    def gguf_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """As `checkpoint_shapes`, under the names llama.cpp's converter gives a GGUF's tensors."""
        x = self.experts
        E, H, I = x.num_experts, x.hidden_size, x.intermediate_size
        return {"mlp.router.weight": (E, H), "mlp.router.bias": (E,),
                "mlp.experts.gate_proj.weight": (E, I, H), "mlp.experts.up_proj.weight": (E, I, H),
                "mlp.experts.down_proj.weight": (E, H, I), "mlp.experts.gate_proj.bias": (E, I),
                "mlp.experts.up_proj.bias": (E, I), "mlp.experts.down_proj.bias": (E, H)}

    def _load_gguf_part(self, part: str, kind: str, tensor: torch.Tensor) -> None:
        """One GGUF expert tensor (`part` gate, up or down): a float weight or bias, or MXFP4
        blocks as stored (uint8 [E, out, in / 32, 17], gguf_loader.mxfp4_bytes)."""
        x, I = self.experts, self.experts.intermediate_size
        rows = slice(0, I) if part == "gate" else slice(I, 2 * I) if part == "up" else slice(None)
        ours = "w2" if part == "down" else "w13"
        if kind == "bias":
            getattr(x, f"{ours}_bias")[:, rows].copy_(tensor)
        elif tensor.dtype == torch.uint8:
            blocks, scales = mxfp4.from_ggml(tensor)
            getattr(x, f"{ours}_blocks")[:, rows].copy_(blocks)
            getattr(x, f"{ours}_scales")[:, rows].copy_(scales)
        else:
            getattr(x, f"{ours}_weight")[:, rows].copy_(tensor)

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> bool:
        """gate|up columns (float) or rows (MXFP4) interleaved -> FusedMoE's gate rows, then up;
        or a GGUF's parts apart (`gguf_checkpoint_shapes`)."""
        m = re.fullmatch(r"mlp\.(router\.(?:weight|bias)|experts\.(\w+))", name)
        if m is None:
            m = re.fullmatch(r"mlp\.experts\.(gate|up|down)_proj\.(weight|bias)", name)
            if m is not None:
                self._load_gguf_part(m.group(1), m.group(2), tensor)
            return m is not None
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

    def gguf_checkpoint_shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors a GGUF holds, under the HF names gguf_loader maps them to: the MoE blocks'
        as llama.cpp's converter names them (GptOssMoeBlock.gguf_checkpoint_shapes)."""
        shapes = self.checkpoint_shapes()
        for i, block in self.moe_blocks():
            p = f"model.layers.{i}."
            for name in block.checkpoint_shapes():
                del shapes[p + name]
            shapes |= {p + name: shape for name, shape in block.gguf_checkpoint_shapes().items()}
        return shapes
