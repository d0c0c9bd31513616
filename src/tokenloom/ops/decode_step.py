"""A whole decode step of a Llama-family decoder in one C call (csrc/decode_step.c), on
quantized weights (float32 activations, or bfloat16 ones on AMX-BF16 CPUs), on bfloat16
weights (bfloat16 activations) or on plain float32 weights (float32 activations).

Why: at batch 1 the quantized kernels stream a step's weights in a few milliseconds, and the
eager decoder spent about as long again issuing its few hundred per-layer calls while the second
OpenMP thread waited (perf, benchmarks/CHANGELOG.md). `DecodeStep` strings the same C
kernels together in C, in the eager order: on quantized weights it returns the eager path's
hidden states bit for bit. In bfloat16 its matmuls run on AMX tiles or AVX512-BF16 dot
products (ops/amx), as the eager layers' do, each output rounded to bfloat16 once. On float32 weights it
calls the C matmul the eager layers use (csrc/f32_panel.c on panel-packed weights, any step
size; csrc/f32_gemv.c on plain ones, at decode sizes), bit for bit theirs again. It knows
nothing of modules or plans: model/fused_decode.py builds it from a loaded model and decides
per step whether it applies.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokenloom.ops import amx, cpu_kernels, quant
from tokenloom.ops.cpu_kernels import F32Panels
from tokenloom.ops.amx import AmxPackedWeight
from tokenloom.ops.quant import TiledQuantWeight
from tokenloom.ops.quant_moe import QuantExperts

_c_i32, _c_i64, _c_p, _c_f = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _Mat(ctypes.Structure):
    _fields_ = [("w", _c_p), ("bias", _c_p), ("n", _c_i64), ("fmt", _c_i32), ("pad_", _c_i32)]


class _Moe(ctypes.Structure):  # tl_moe
    _fields_ = [("router", _c_p), ("w13", _c_p), ("w2", _c_p), ("fmt13", _c_i32), ("fmt2", _c_i32)]


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", _c_p), ("post_norm", _c_p), ("qkv", _Mat), ("o", _Mat),
                ("gate_up", _Mat), ("down", _Mat), ("k_cache", _c_p), ("v_cache", _c_p),
                ("q_norm", _c_p), ("k_norm", _c_p), ("moe", ctypes.POINTER(_Moe)),
                ("k_part", _Mat), ("v_part", _Mat)]


class _Model(ctypes.Structure):
    _fields_ = [("num_layers", _c_i32), ("hidden", _c_i32), ("num_heads", _c_i32),
                ("num_kv_heads", _c_i32), ("head_dim", _c_i32), ("intermediate", _c_i32),
                ("block_size", _c_i32), ("act_levels", _c_i32), ("eps", _c_f), ("scale", _c_f),
                ("kv_bf16", _c_i32), ("act_bf16", _c_i32), ("final_norm", _c_p),
                ("cos_sin", _c_p), ("cs_stride", _c_i64), ("moe_experts", _c_i32),
                ("moe_top_k", _c_i32), ("moe_width", _c_i32), ("moe_renorm", _c_i32)]


class _LoRAProj(ctypes.Structure):  # csrc/lora_decode.c's tl_lora_proj
    _fields_ = [("a", _c_p), ("b_t", _c_p), ("rank", _c_i32), ("num_parts", _c_i32),
                ("r_start", _c_i32 * 4), ("n_start", _c_i32 * 3), ("n_end", _c_i32 * 3)]


class _LoRA(ctypes.Structure):  # tl_lora
    _fields_ = [("adapters", _c_p), ("token_adapter", _c_p), ("xa", _c_p), ("max_rank", _c_i32),
                ("num_layers", _c_i32)]


_FMT_BF16 = -1  # csrc/decode_step.c's TL_BF16: a bfloat16 weight packed for AMX
_FMT_F32 = -2  # TL_F32: a plain row-major float32 weight
_FMT_F32_PANEL = -3  # TL_F32_PANEL: a float32 weight packed in panels (cpu_kernels.F32Panels)


@dataclass(frozen=True, eq=False)
class F32Weight:
    """A plain row-major float32 weight [out, in] (a `Linear`'s own), for csrc/f32_gemv.c."""

    data: torch.Tensor

    @property
    def out_features(self) -> int:
        return self.data.shape[0]

    @property
    def in_features(self) -> int:
        return self.data.shape[1]


_bound: set[int] = set()


def _lib() -> ctypes.CDLL | None:
    lib = cpu_kernels.load()
    if lib is not None and id(lib) not in _bound:
        lib.tl_llama_decode_workspace.restype = _c_i64
        lib.tl_llama_decode_workspace.argtypes = [ctypes.POINTER(_Model), _c_i64]
        lib.tl_llama_decode.restype = _c_i32
        lib.tl_llama_decode.argtypes = [ctypes.POINTER(_Model), ctypes.POINTER(_Layer), _c_p, _c_p,
                                        _c_i32, _c_p, _c_p, _c_p, _c_i64, _c_p, _c_p, ctypes.POINTER(_LoRA)]
        _bound.add(id(lib))
    return lib


@dataclass(frozen=True, eq=False)
class LoRAProjection:
    """One LoRA adapter on one of a layer's projections, in float32: `a` stacks its parts' A
    matrices [rank, in], `b_t` their scaled B^T matrices [rank, out], block-diagonally; `parts`
    gives each part's (first column of x A^T, end, first output column, end)."""

    a: torch.Tensor
    b_t: torch.Tensor
    parts: tuple[tuple[int, int, int, int], ...]


class DecodeLoRATable:
    """One adapter's projections as the C step reads them: per layer qkv, o, gate_up and down,
    None where the adapter has none."""

    def __init__(self, projections: list[LoRAProjection | None]) -> None:
        self.max_rank = 0
        self._keep: list[torch.Tensor] = []
        self.table = (_LoRAProj * len(projections))()
        for dst, p in zip(self.table, projections):
            if p is None:
                continue
            if p.a.dtype != torch.float32 or p.b_t.dtype != torch.float32 or not 0 < len(p.parts) <= 3:
                raise ValueError("the fused decode step takes float32 adapters of 1-3 parts")
            a, b_t = p.a.contiguous(), p.b_t.contiguous()
            self._keep += [a, b_t]
            dst.a, dst.b_t, dst.rank, dst.num_parts = a.data_ptr(), b_t.data_ptr(), a.shape[0], len(p.parts)
            for i, (r0, r1, n0, n1) in enumerate(p.parts):
                dst.r_start[i], dst.r_start[i + 1], dst.n_start[i], dst.n_end[i] = r0, r1, n0, n1
            self.max_rank = max(self.max_rank, a.shape[0])


@dataclass(eq=False)
class DecodeMoe:
    """A mixture-of-experts block in place of a layer's MLP (float32 steps): the float32 router
    [E, hidden] and the experts (ops/quant_moe.QuantExperts), `top_k` of them per token, their
    weights renormalised where `renormalize`."""

    router: torch.Tensor
    experts: QuantExperts
    top_k: int
    renormalize: bool


@dataclass(eq=False)
class DecodeLayer:
    """One decoder layer's parameters: norm weights in the activations' dtype (float32 for
    quantized or float32 matrices, bfloat16 for bfloat16 ones), and the four matrices, each a
    tiled quantized weight, a bfloat16 one packed for AMX or a float32 one, plain or in panels."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: TiledQuantWeight | AmxPackedWeight | F32Weight | F32Panels
    o: TiledQuantWeight | AmxPackedWeight | F32Weight | F32Panels
    gate_up: TiledQuantWeight | AmxPackedWeight | F32Weight | F32Panels
    down: TiledQuantWeight | AmxPackedWeight | F32Weight | F32Panels | None
    qkv_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # Qwen3's per-head norms (float32 [head_dim])
    k_norm: torch.Tensor | None = None
    moe: DecodeMoe | None = None  # in place of gate_up and down (None there)
    # k's and v's quantized weights where q|k|v could not be one (formats differ): qkv is q's
    kv_parts: tuple[TiledQuantWeight, TiledQuantWeight] | None = None


class DecodeStep:
    """All layers of a decode step: embeddings [T, hidden] in, the final norm's output out, in
    the activations' dtype (float32 with quantized or float32 matrices, bfloat16 with bfloat16
    ones)."""

    def __init__(self, layers: list[DecodeLayer], final_norm: torch.Tensor,
                 cos_sin: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, act_levels: int | None = None) -> None:
        lib = _lib()
        if lib is None:
            raise RuntimeError("the fused decode step needs the CPU kernels (ops/cpu_kernels)")
        self._lib = lib
        first = layers[0]
        self.dtype = final_norm.dtype
        bf16 = self.dtype == torch.bfloat16
        if bf16 and not amx.available():
            raise RuntimeError("the bfloat16 decode step needs AMX or AVX512-BF16 (ops/amx)")
        self.num_kv_heads = num_kv_heads
        # Kept referenced: the C structs hold raw pointers into these tensors.
        self._keep: list[torch.Tensor] = [final_norm, cos_sin]
        dense = [lay for lay in layers if lay.moe is None]
        moe = next((lay.moe for lay in layers if lay.moe is not None), None)
        if bf16 and moe is not None:
            raise RuntimeError("the fused decode step computes MoE blocks in float32 only")
        self._model = _Model(
            num_layers=len(layers), hidden=first.qkv.in_features, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            intermediate=dense[0].gate_up.out_features // 2 if dense else 0, block_size=0,
            act_levels=quant.ACT_LEVELS if act_levels is None else act_levels, eps=eps,
            scale=head_dim ** -0.5, act_bf16=int(bf16), final_norm=final_norm.data_ptr(),
            cos_sin=cos_sin.data_ptr(), cs_stride=cos_sin.stride(0),
            moe_experts=0 if moe is None else moe.experts.num_experts, moe_top_k=0 if moe is None else moe.top_k,
            moe_width=0 if moe is None else moe.experts.width, moe_renorm=int(moe is not None and moe.renormalize))
        self._moes: list[_Moe] = []
        self._layers = (_Layer * len(layers))()
        for dst, lay in zip(self._layers, layers):
            self._keep += [lay.input_norm, lay.post_norm]
            dst.input_norm, dst.post_norm = lay.input_norm.data_ptr(), lay.post_norm.data_ptr()
            for field, w in (("qkv", lay.qkv), ("o", lay.o), ("gate_up", lay.gate_up), ("down", lay.down)):
                if w is None:  # an MoE layer's MLP
                    continue
                fmt = (w.fmt if isinstance(w, TiledQuantWeight) else _FMT_F32 if isinstance(w, F32Weight)
                       else _FMT_F32_PANEL if isinstance(w, F32Panels) else _FMT_BF16)
                self._keep.append(w.data)
                setattr(dst, field, _Mat(w=w.data.data_ptr(), bias=None, n=w.out_features, fmt=fmt))
            if lay.qkv_bias is not None:
                bias = lay.qkv_bias.float().contiguous()
                self._keep.append(bias)
                dst.qkv.bias = bias.data_ptr()
            if lay.kv_parts is not None:
                if bf16:
                    raise RuntimeError("the fused decode step takes q, k and v apart in float32 only")
                col = lay.qkv.out_features
                for field, w in zip(("k_part", "v_part"), lay.kv_parts):
                    self._keep.append(w.data)
                    part = _Mat(w=w.data.data_ptr(), bias=None, n=w.out_features, fmt=w.fmt)
                    if lay.qkv_bias is not None:
                        part.bias = dst.qkv.bias + 4 * col
                    setattr(dst, field, part)
                    col += w.out_features
            if lay.q_norm is not None:
                qn, kn = lay.q_norm.float().contiguous(), lay.k_norm.float().contiguous()
                self._keep += [qn, kn]
                dst.q_norm, dst.k_norm = qn.data_ptr(), kn.data_ptr()
            if lay.moe is not None:
                m, x = lay.moe, lay.moe.experts
                if (x.num_experts, m.top_k, x.width, m.renormalize) != (moe.experts.num_experts, moe.top_k,
                                                                         moe.experts.width, moe.renormalize):
                    raise ValueError("the fused decode step takes MoE layers of one shape")
                router = m.router.float().contiguous()
                self._keep += [router, x.w13_ptrs, x.w2_ptrs]
                block = _Moe(router=router.data_ptr(), w13=x.w13_ptrs.data_ptr(), w2=x.w2_ptrs.data_ptr(),
                             fmt13=x.fmt13, fmt2=x.fmt2)
                self._moes.append(block)
                dst.moe = ctypes.pointer(block)
        self._caches: tuple[int, ...] = ()
        self._workspace = torch.empty(0, dtype=torch.uint8)

    def _set_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Points each layer at its cache ([2, num_blocks, block_size, Hkv, D], float32 or
        bfloat16), when the runner's caches are not the ones of the last call."""
        ptrs = tuple(c.data_ptr() for c in kv_caches)
        if ptrs == self._caches:
            return
        for dst, cache in zip(self._layers, kv_caches, strict=True):
            dst.k_cache = cache.data_ptr()
            dst.v_cache = cache.data_ptr() + cache.element_size() * cache.stride(0)
        self._model.block_size = kv_caches[0].shape[2]
        self._model.kv_bf16 = int(kv_caches[0].dtype == torch.bfloat16)
        self._caches = ptrs

    def __call__(self, h: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor,
                 kv_caches: list[torch.Tensor],
                 lora: tuple[list[DecodeLoRATable], torch.Tensor] | None = None) -> torch.Tensor:
        """h: [T, hidden] embeddings in the step's dtype; positions, slots: int64 [T];
        block_table: int32 [T, max blocks], seq_lens: int32 [T], all contiguous on the CPU, one
        decode token per request in request order. lora: the step's adapters and, per token, the
        index of its adapter among them (int32 [T], -1 for none); float32 steps only."""
        self._set_caches(kv_caches)
        lora_arg = None
        if lora is not None:
            tables, token_adapter = lora
            if self.dtype != torch.float32 or token_adapter.dtype != torch.int32 or token_adapter.numel() != h.shape[0]:
                raise ValueError("LoRA in the fused decode step: float32 steps, an int32 adapter index per token")
            max_rank = max(t.max_rank for t in tables)
            ptrs = (_c_p * len(tables))(*(ctypes.addressof(t.table) for t in tables))
            xa = torch.empty(h.shape[0] * max_rank, dtype=torch.float32)
            token_adapter = token_adapter.contiguous()  # referenced until the call returns
            lora_arg = _LoRA(adapters=ctypes.addressof(ptrs), token_adapter=token_adapter.data_ptr(),
                             xa=xa.data_ptr(), max_rank=max_rank, num_layers=len(self._layers))
        T = h.shape[0]
        need = self._lib.tl_llama_decode_workspace(ctypes.byref(self._model), T)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.uint8)
        out = torch.empty_like(h)
        rc = self._lib.tl_llama_decode(
            ctypes.byref(self._model), self._layers, h.data_ptr(), out.data_ptr(), T,
            positions.data_ptr(), slots.data_ptr(), block_table.data_ptr(), block_table.stride(0),
            seq_lens.data_ptr(), self._workspace.data_ptr(),
            None if lora_arg is None else ctypes.byref(lora_arg))
        if rc != 0:
            raise ValueError(f"fused decode step failed (code {rc})")
        return out
