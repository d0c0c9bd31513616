"""A mixture-of-experts layer's quantized experts in one C call (csrc/quant_moe.inc, `tl_q_moe`).

At decode sizes each chosen expert has a row or a few: two matmuls, an activation and an add per
chosen expert (ops/moe.fused_experts) are 4 x k Python calls per layer, each matmul its own
OpenMP region. `QuantExperts` holds the experts' tiled gate|up and down weights as two tables of
pointers, and `QuantExperts.forward` runs the whole layer (pairs sorted by expert, every chosen
expert's gate|up tiles one work list, SiLU-and-mul, the down tiles, the weighted sum) in one call.
Which row counts take it is the kernel plan's `moe_fused_below_rows` (ops/kernel_plan.py); above
it the per-expert path keeps its AMX and bf16 kernels.
"""
from __future__ import annotations

import ctypes

import torch

from tokenloom.ops import kernel_plan, quant
from tokenloom.ops.quant import TiledQuantWeight

_c_i32, _c_i64, _c_p = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
_bound: set[int] = set()


def _lib() -> ctypes.CDLL:
    lib = quant._lib()
    if id(lib) not in _bound:
        lib.tl_q_moe.restype = _c_i32
        lib.tl_q_moe.argtypes = [_c_i32, _c_p, _c_i32, _c_p, _c_i64, _c_i64, _c_i64, _c_p, _c_i64, _c_i64,
                                 _c_p, _c_p, _c_p, _c_p, _c_i32]
        lib.tl_q_moe_scratch_bytes.restype = _c_i64
        lib.tl_q_moe_scratch_bytes.argtypes = [_c_i64, _c_i64, _c_i64]
        _bound.add(id(lib))
    return lib


class QuantExperts:
    """E experts' tiled gate|up [2I, H] and down [H, I] weights, each set in one format; see the
    module docstring. The weights stay where they are (the modules own them): the tables hold
    their addresses."""

    def __init__(self, w13: list[TiledQuantWeight], w2: list[TiledQuantWeight]) -> None:
        self.fmt13, self.fmt2 = w13[0].fmt, w2[0].fmt
        self.num_experts = len(w13)
        self.hidden, self.width = w13[0].in_features, w2[0].in_features
        self._keep = (w13, w2)
        self.below = kernel_plan.current().moe_fused_below_rows  # the plan when the model loaded
        self.w13_ptrs = torch.tensor([w.data.data_ptr() for w in w13], dtype=torch.int64)
        self.w2_ptrs = torch.tensor([w.data.data_ptr() for w in w2], dtype=torch.int64)

    @classmethod
    def of(cls, w13: list, w2: list) -> QuantExperts | None:
        """From per-expert `QuantLinear`s (model/quant_linear.py): None unless each is one tiled
        weight, without bias, all gate|up in one format and all down in one, of the shapes the
        kernel takes (H and I whole units, I whole tiles)."""
        def tiled(m) -> TiledQuantWeight | None:
            parts = getattr(m, "parts", None)
            ok = parts is not None and len(parts) == 1 and isinstance(parts[0], TiledQuantWeight)
            return parts[0] if ok and getattr(m, "bias", None) is None and not hasattr(m, "in_perm") else None

        a, b = [tiled(m) for m in w13], [tiled(m) for m in w2]
        if not a or any(w is None for w in (*a, *b)):
            return None
        H, I = a[0].in_features, b[0].in_features
        if ({(w.fmt, w.in_features, w.out_features) for w in a} != {(a[0].fmt, H, 2 * I)}
                or {(w.fmt, w.in_features, w.out_features) for w in b} != {(b[0].fmt, I, H)}):
            return None
        unit = quant.QK_K if b[0].fmt in quant._K_QUANTS else quant.QK
        unit13 = quant.QK_K if a[0].fmt in quant._K_QUANTS else quant.QK
        if H % unit13 or I % unit or I % quant.TILE_N:
            return None
        return cls(a, b)

    def takes(self, x: torch.Tensor, topk_ids: torch.Tensor) -> bool:
        """Whether this step runs here: float32 activations and every chosen expert below the
        plan's rows (a step of T tokens gives an expert at most T)."""
        below = self.below
        if x.dtype != torch.float32 or below <= 0:
            return False
        T = x.shape[0]
        return T < below or int(torch.bincount(topk_ids.reshape(-1), minlength=1).max()) < below

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x float32 [T, H], the routing of ops/moe.select_experts -> [T, H]."""
        lib = _lib()
        T, k = topk_ids.shape
        x = x.contiguous()
        ids = topk_ids.to(torch.int64).contiguous()
        w = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(T, self.hidden, dtype=torch.float32)
        scratch = torch.empty(lib.tl_q_moe_scratch_bytes(T * k, self.hidden, self.width), dtype=torch.uint8)
        rc = lib.tl_q_moe(self.fmt13, self.w13_ptrs.data_ptr(), self.fmt2, self.w2_ptrs.data_ptr(),
                          self.num_experts, self.hidden, self.width, x.data_ptr(), T, k, ids.data_ptr(),
                          w.data_ptr(), out.data_ptr(), scratch.data_ptr(), quant.ACT_LEVELS)
        if rc == -2:
            raise MemoryError("tl_q_moe could not allocate its counting table")
        if rc != 0:
            raise ValueError(f"tl_q_moe rejected the experts: {self.num_experts} experts, hidden "
                             f"{self.hidden}, width {self.width}, expert ids within [0, {self.num_experts})")
        return out
