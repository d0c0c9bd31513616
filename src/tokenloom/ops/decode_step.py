"""A whole decode step of a Llama-family decoder on quantized weights in one C call
(csrc/decode_step.c).

Why: at batch 1 the quantized kernels stream a step's weights in a few milliseconds, and the
eager decoder spent about as long again issuing its ~400 per-layer calls while the second OpenMP
thread waited (benchmarks/README.md, "Quantized weights"). `QuantDecodeStep` strings the same C
kernels together in C, in the eager order, so it returns the eager path's hidden states bit for
bit. It knows nothing of modules or plans: model/fused_decode.py builds it from a loaded model
and decides per step whether it applies.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from tokenloom.ops import cpu_kernels, quant
from tokenloom.ops.quant import TiledQuantWeight

_c_i32, _c_i64, _c_p, _c_f = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class _QMat(ctypes.Structure):
    _fields_ = [("w", _c_p), ("bias", _c_p), ("n", _c_i64), ("fmt", _c_i32), ("pad_", _c_i32)]


class _QLayer(ctypes.Structure):
    _fields_ = [("input_norm", _c_p), ("post_norm", _c_p), ("qkv", _QMat), ("o", _QMat),
                ("gate_up", _QMat), ("down", _QMat), ("k_cache", _c_p), ("v_cache", _c_p)]


class _QModel(ctypes.Structure):
    _fields_ = [("num_layers", _c_i32), ("hidden", _c_i32), ("num_heads", _c_i32),
                ("num_kv_heads", _c_i32), ("head_dim", _c_i32), ("intermediate", _c_i32),
                ("block_size", _c_i32), ("act_levels", _c_i32), ("eps", _c_f), ("scale", _c_f),
                ("kv_bf16", _c_i32), ("pad_", _c_i32), ("final_norm", _c_p), ("cos_sin", _c_p), ("cs_stride", _c_i64)]


_bound: set[int] = set()


def _lib() -> ctypes.CDLL:
    lib = quant._lib()  # raises the quantized path's own error when the kernels are missing
    if id(lib) not in _bound:
        lib.tl_llama_decode_q_workspace.restype = _c_i64
        lib.tl_llama_decode_q_workspace.argtypes = [ctypes.POINTER(_QModel), _c_i64]
        lib.tl_llama_decode_q.restype = _c_i32
        lib.tl_llama_decode_q.argtypes = [ctypes.POINTER(_QModel), ctypes.POINTER(_QLayer), _c_p,
                                          _c_p, _c_i32, _c_p, _c_p, _c_p, _c_i64, _c_p, _c_p]
        _bound.add(id(lib))
    return lib


@dataclass(eq=False)
class QuantDecodeLayer:
    """One decoder layer's parameters: float32 norm weights, tiled quantized matrices."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: TiledQuantWeight
    o: TiledQuantWeight
    gate_up: TiledQuantWeight
    down: TiledQuantWeight
    qkv_bias: torch.Tensor | None = None


class QuantDecodeStep:
    """All layers of a decode step: embeddings [T, hidden] in, the final norm's output out."""

    def __init__(self, layers: list[QuantDecodeLayer], final_norm: torch.Tensor,
                 cos_sin: torch.Tensor, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, act_levels: int | None = None) -> None:
        self._lib = _lib()
        first = layers[0]
        self.hidden = first.qkv.in_features
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        # Kept referenced: the C structs hold raw pointers into these tensors.
        self._keep = [final_norm, cos_sin, *(t for lay in layers for t in
                                             (lay.input_norm, lay.post_norm, lay.qkv_bias) if t is not None)]
        self._model = _QModel(
            num_layers=len(layers), hidden=self.hidden, num_heads=num_heads,
            num_kv_heads=num_kv_heads, head_dim=head_dim,
            intermediate=first.gate_up.out_features // 2, block_size=0,
            act_levels=quant.ACT_LEVELS if act_levels is None else act_levels, eps=eps,
            scale=head_dim ** -0.5, final_norm=final_norm.data_ptr(), cos_sin=cos_sin.data_ptr(),
            cs_stride=cos_sin.stride(0))
        self._layers = (_QLayer * len(layers))()
        for dst, lay in zip(self._layers, layers):
            dst.input_norm, dst.post_norm = lay.input_norm.data_ptr(), lay.post_norm.data_ptr()
            for field, w in (("qkv", lay.qkv), ("o", lay.o), ("gate_up", lay.gate_up), ("down", lay.down)):
                self._keep.append(w.data)
                setattr(dst, field, _QMat(w=w.data.data_ptr(), bias=None, n=w.out_features, fmt=w.fmt))
            if lay.qkv_bias is not None:
                dst.qkv.bias = lay.qkv_bias.data_ptr()
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
                 kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """h: float32 [T, hidden] embeddings (overwritten); positions, slots: int64 [T];
        block_table: int32 [T, max blocks], seq_lens: int32 [T], all contiguous on the CPU, one
        decode token per request in request order."""
        self._set_caches(kv_caches)
        T = h.shape[0]
        need = self._lib.tl_llama_decode_q_workspace(ctypes.byref(self._model), T)
        if self._workspace.numel() < need:
            self._workspace = torch.empty(need, dtype=torch.uint8)
        out = torch.empty_like(h)
        rc = self._lib.tl_llama_decode_q(
            ctypes.byref(self._model), self._layers, h.data_ptr(), out.data_ptr(), T,
            positions.data_ptr(), slots.data_ptr(), block_table.data_ptr(), block_table.stride(0),
            seq_lens.data_ptr(), self._workspace.data_ptr())
        if rc != 0:
            raise ValueError(f"fused quantized decode step failed (code {rc})")
        return out
