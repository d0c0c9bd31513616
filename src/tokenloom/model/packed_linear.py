"""Linear weights pre-packed for oneDNN, the CPU matmul fast path.

`F.linear` on a plain weight makes MKL re-pack the weight into its GEMM panel layout on every call:
for the small-M matmuls of decode (one row per running request) that packing is a pass over the
whole weight for a few FLOPs each, and it dominates. oneDNN can keep a weight in its blocked layout
(`_reorder_linear_weight`), so a step only streams it: a clear win at decode sizes.

One packed copy serves every M (the batch-size hint only picks the blocking). From about 512 rows
up MKL's own GEMM on the plain weight is as fast or faster again (the packing cost is spread over
many rows), so prefill-sized inputs go to `F.linear`. Results match `F.linear` within float32
rounding (the reduction order differs). The threshold is measured by
benchmarks/panel_gemm.py.

bfloat16 is packed too where the CPU multiplies it natively (AVX-512 BF16 or AMX, see
ops/cpu_features.py); without that there is no fast bf16 GEMM to pack for, and bf16 stays on
`F.linear`. Where the CPU has AMX, bf16 weights are packed for our own AMX tile matmul
(ops/amx.py) instead of oneDNN: one copy that the eager layers and the fused decode step
(model/fused_decode.py, which cannot call oneDNN from C) both read: the tiles beat oneDNN at
decode and chat-prefill sizes (benchmarks/amx_matmul.py), and one copy instead of two keeps the
engine's memory where it was. Where the CPU has AVX512-BF16 but no AMX, the same packed copy is
multiplied with AVX512-BF16 dot products (ops/amx.py too), which keep up with oneDNN at every row
count (benchmarks/amx_matmul.py).
Each dtype's row threshold and whether the plain copy is worth keeping are in `_PLAIN_FROM_ROWS`.

On AVX2 CPUs (no AVX-512) float32 weights are packed for our own C matmul instead
(csrc/f32_panel.c, `cpu_kernels.F32Panels`): panels of 16 output columns that serve every row count
from one copy, where oneDNN's copy plus the plain one for the GEMV and MKL took two; it keeps up
with each of them at its own sizes (benchmarks/panel_gemm.py). `TOKENLOOM_F32_PANEL=0` goes back
to those.

The original weights stay in the model (tests and tools read them, and a model may be shared by
several runners), so packing costs one more copy of the matmul weights in memory, unless the
owner of the model calls `release_plain_weights`: the engine's model runner does where the packed
copy serves every row count as fast.
"""
from __future__ import annotations

import logging

import torch
from torch import nn

from tokenloom.ops import amx, cpu_features, cpu_kernels, kernel_plan
from tokenloom.ops.amx import AmxPackedWeight
from tokenloom.ops.cpu_kernels import F32Panels
from tokenloom.ops.cpu_memory import release_freed_heap

logger = logging.getLogger(__name__)

# The batch-size hint for the packed layout (see the module docstring: it barely matters).
_PACK_HINT_ROWS = 64
# From this many input rows up, `F.linear` on the plain weight beats the packed copy; None: the
# packed copy is never slower enough to keep the plain one for it (release_plain_weights).
# float32: MKL's GEMM on the plain weight wins at prefill sizes on AVX2 only, so on AVX-512 the
# plain copy (a second 4 bytes per weight) is not kept. bfloat16 (packed only on CPUs with native
# bf16): the packed copy is never slower than `F.linear`, so its plain copy is not kept either
# (benchmarks/panel_gemm.py; benchmarks/CHANGELOG.md, "what was tried").
_PLAIN_FROM_ROWS: dict[torch.dtype, int | None] = {
    torch.float32: kernel_plan.current().f32_plain_from_rows,
    torch.bfloat16: None,
}


# Below this many input rows a float32 matmul on a plain row-major weight runs the C kernel
# (ops/cpu_kernels.f32_linear): memory-bound, it streams the weight once, where oneDNN's blocked
# products only win once enough rows share each weight load (benchmarks/f32_gemv.py).
# TOKENLOOM_F32_GEMV=0 turns it off (A/B measurements).
GEMV_BELOW_ROWS = kernel_plan.current().f32_gemv_below_rows  # kernel_plan.F32_GEMV_BELOW_ROWS


def panels_wanted() -> bool:
    """Whether float32 weights are packed in panels on this CPU: AVX2 without AVX-512 (there
    oneDNN's copy alone serves every row count and was not compared), the C kernels built, not
    turned off by TOKENLOOM_F32_PANEL=0."""
    return kernel_plan.current().f32_panels and cpu_kernels.load() is not None


def _linear_packed(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def packed_linear_available(dtype: torch.dtype) -> bool:
    """True when oneDNN can pack and run a linear of `dtype` on this build and CPU (float32, and
    bfloat16 where the CPU multiplies it natively), checked on a tiny one; bfloat16 on an AMX CPU
    is packed for ops/amx instead."""
    if dtype == torch.bfloat16 and amx.available():
        return True
    if dtype == torch.float32 and panels_wanted():
        return True
    if dtype not in _PLAIN_FROM_ROWS or not torch.backends.mkldnn.is_available():
        return False
    if dtype == torch.bfloat16 and not cpu_features.detect().native_bf16:
        return False
    try:
        w, x = torch.randn(8, 4).to(dtype), torch.randn(3, 4).to(dtype)
        got = _linear_packed(x, pack_weight(w), None)
    except (RuntimeError, AttributeError) as exc:  # op missing from this build
        logger.info("oneDNN packed linear unavailable (%s); using F.linear", exc)
        return False
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return torch.allclose(got.float(), x.float() @ w.float().t(), atol=tol, rtol=tol)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | AmxPackedWeight | F32Panels:
    """[out, in] float32 or bfloat16 weight -> an opaque oneDNN tensor for `linear` (bfloat16 on
    an AMX CPU: the weight in AMX tile order; float32 on an AVX2 one: in panels)."""
    if weight.dtype == torch.bfloat16 and amx.available():
        return amx.pack(weight)
    if weight.dtype == torch.float32 and panels_wanted():
        return F32Panels(cpu_kernels.f32_panel_pack(weight), weight.shape[0])
    return onednn_pack_weight(weight)


def packed_nbytes(packed: torch.Tensor | AmxPackedWeight | F32Panels) -> int:
    """The bytes of a packed weight, padding included: what a matmul on it reads."""
    if isinstance(packed, (AmxPackedWeight, F32Panels)):
        return packed.data.numel() * packed.data.element_size()
    return packed.numel() * packed.element_size()  # oneDNN's blocked copy (an mkldnn tensor)


def onednn_pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 or bfloat16 weight -> oneDNN's blocked copy (for `_linear_packed`)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _PACK_HINT_ROWS)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | AmxPackedWeight | F32Panels | None,
           one_row_order: bool = False) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: float32 on a panel-packed copy through csrc/f32_panel.c,
    whatever the row count; float32 with fewer than `GEMV_BELOW_ROWS` rows on a plain row-major
    weight through the C GEMV; else through the packed copy when there is one of `x`'s dtype and
    `x` has fewer than `_PLAIN_FROM_ROWS` rows for that dtype (or the plain weight was released).
    oneDNN takes 2-D input; the model's activations are already [tokens, features].
    `one_row_order`: on the packed bf16 matmul (ops/amx), sum every row as a one-row bf16
    `F.linear` does whatever the row count (on AMX oneDNN sums K in chunks from 33 rows)."""
    if isinstance(packed, F32Panels):
        if x.dtype == torch.float32 and x.device.type == "cpu" and (lib := cpu_kernels.load()) is not None:
            return cpu_kernels.f32_panel_linear(lib, x, packed.data, packed.out_features,
                                                None if bias is None else bias.contiguous())
        packed = None  # a model cast or moved after packing reads its plain weight
    if (x.dtype == torch.float32 and x.device.type == "cpu"
            and 0 < x.numel() // max(x.shape[-1], 1) < GEMV_BELOW_ROWS and gemv_weight(weight)
            and (bias is None or bias.is_contiguous()) and (lib := cpu_kernels.load()) is not None):
        return cpu_kernels.f32_linear(lib, x, weight, bias)
    # A packed copy belongs to the dtype it was packed in, on the CPU; a model cast or moved
    # after packing reads its (plain) weight.
    if isinstance(packed, AmxPackedWeight):
        if x.dtype == torch.bfloat16 and x.device.type == "cpu":
            return amx.linear(x, packed, bias, one_row=one_row_order)
        packed = None
    if packed is not None and x.dtype == packed.dtype and x.device.type == "cpu":
        limit = _PLAIN_FROM_ROWS.get(x.dtype)
        if weight.numel() == 0 or limit is None or (x.dim() == 2 and x.shape[0] < limit):
            out = _linear_packed(x.reshape(-1, x.shape[-1]).contiguous(), packed, bias)
            return out.view(*x.shape[:-1], out.shape[-1])
    return nn.functional.linear(x, weight, bias)


def gemv_weight(weight: torch.Tensor) -> bool:
    """Whether `linear` multiplies `weight` with the C GEMV at decode sizes (the fused decode step
    takes the same ones): a plain, row-major float32 [out, in] on the CPU, the GEMV not turned off."""
    return (GEMV_BELOW_ROWS > 1 and weight.dtype == torch.float32 and weight.device.type == "cpu"
            and weight.dim() == 2 and weight.numel() > 0 and weight.is_contiguous())


def panels_in_use(model: nn.Module) -> bool:
    """Whether this model's float32 matmuls run on panel-packed copies (csrc/f32_panel.c); an
    untied LM head is packed as the model's `packed_lm_head`, not in its own slot."""
    packed = [m.packed_weight for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    return bool(packed) and all(isinstance(p, F32Panels) for p in packed)


def gemv_in_use(model: nn.Module) -> bool:
    """Whether `linear` sends this model's decode-sized float32 matmuls to the C GEMV: the
    kernels load and every weight is one it takes (AVX2 keeps the plain weights; elsewhere only
    the packed copy stays)."""
    layers = [m for m in model.modules() if hasattr(m, "packed_weight")]
    return bool(layers) and cpu_kernels.load() is not None and all(gemv_weight(m.weight) for m in layers)


@torch.no_grad()
def pack_linear_weights(model: nn.Module, release_plain: bool = False) -> int:
    """Gives every module with a `packed_weight` slot a packed copy of its `weight`; returns how
    many were packed (0 when this build or dtype has no packed path). `release_plain`: frees each
    plain weight that `release_plain_weights` would as soon as its copy is made, so that loading
    never holds two copies of every weight at once (the peak resident memory)."""
    head = getattr(model, "lm_head", None)  # compute_logits reads it through packed_lm_head
    slots = [m for m in model.modules() if hasattr(m, "packed_weight") and m is not head]
    if not slots or not packed_linear_available(slots[0].weight.dtype):
        return 0
    for m in slots:
        m.packed_weight = pack_weight(m.weight)
        if release_plain:
            _release_plain(m)
    if (hasattr(model, "packed_lm_head") and getattr(model, "quant_lm_head", None) is None
            and getattr(model, "computes_logits", True)):
        model.packed_lm_head = pack_weight(model.lm_head_weight)
    return len(slots)


@torch.no_grad()
def use_input_major_weights(model: torch.nn.Module) -> None:
    """Stores every 2-D weight transposed ([in, out] contiguous) and leaves the parameter as the
    transposed view, so shapes, names and the model code stay as they are. `F.linear(x, w)`
    multiplies by `w.t()`, which is then contiguous: MKL streams each weight row by row, which makes
    the memory-bound batch-1 matmuls faster and the batch-64 ones no slower (benchmarks/CHANGELOG.md,
    "What was tried").
    Embedding lookups read rows of the view (strided; negligible next to the matmuls)."""
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if param.dim() == 2 and param.is_contiguous():
                param.data = param.data.t().contiguous().t()


def prepare_cpu_weights(model: nn.Module) -> None:
    """Lays out a CPU model's weights for its matmuls, once, before the first step, for the
    model's owner (an engine's model runner): oneDNN-packed weights (float32; bfloat16 where the
    CPU has bf16 dot products) without their plain copy where it is never faster, else
    input-major float32 weights (bfloat16 ones stay as loaded); then hands the heap that loading
    and packing freed back to the OS."""
    if pack_linear_weights(model, release_plain=True):
        release_plain_weights(model)  # the tied embedding, once the LM head is packed
    elif all(p.dtype == torch.float32 for p in model.parameters() if p.dim() == 2):
        # Not bfloat16 (a CPU without native bf16, where `F.linear` runs torch's own bf16 GEMM):
        # that GEMM sums an input-major weight in another order than transformers' row-major
        # one, and keeping the checkpoint's layout keeps a bf16 prefill transformers' bit for bit.
        use_input_major_weights(model)
    release_freed_heap()


class PanelEmbedding(nn.Module):
    """An embedding that looks its rows up in the panel-packed LM head it is tied to: where the
    LM head runs on `F32Panels`, the plain table would be a second copy of the largest weight
    (SmolLM2-135M: 113 MB of 540; Gemma 3 270M: 671 MB). A lookup reads one float per 64-byte
    line, which is nothing next to a step's matmuls. `weight` is left empty, as a released Linear's."""

    def __init__(self, panels: F32Panels) -> None:
        super().__init__()
        self.panels = panels
        self.num_embeddings = panels.out_features
        self.weight = nn.Parameter(panels.data.new_empty(0), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel():
            lo, hi = torch.aminmax(ids)
            if int(lo) < 0 or int(hi) >= self.num_embeddings:  # as F.embedding refuses them
                raise IndexError(f"token id {int(lo) if int(lo) < 0 else int(hi)} is out of the "
                                 f"embedding's range [0, {self.num_embeddings})")
        return cpu_kernels.f32_panel_rows(self.panels.data, ids)


def _tied_embedding(model: nn.Module) -> tuple[nn.Module, str] | None:
    """(parent, attribute) of the embedding module whose plain table is the LM head's weight,
    packed in panels (inside a tensor-parallel rank's vocabulary slice too); else None."""
    head = getattr(model, "packed_lm_head", None)
    parent, name = model, "embed_tokens"
    embed = getattr(model, name, None)
    if embed is not None and isinstance(getattr(embed, "inner", None), nn.Module):
        parent, name, embed = embed, "inner", embed.inner  # tensor_parallel.VocabParallelEmbedding
    # tied: the LM head multiplies by the embedding's own table (lm_head_weight is it)
    if (not isinstance(head, F32Panels) or not isinstance(getattr(embed, "weight", None), torch.Tensor)
            or embed.weight is not getattr(model, "lm_head_weight", None)
            or tuple(embed.weight.shape) != (head.out_features, head.in_features)):
        return None
    return parent, name


@torch.no_grad()
def release_plain_weights(model: nn.Module) -> int:
    """Frees the plain weight of every packed Linear whose dtype never goes back to it (see
    `_PLAIN_FROM_ROWS`), leaving an empty parameter; returns the bytes freed. For the owner of the
    model only: afterwards the model runs through its packed copies alone. A tied embedding
    stays, but for one tied to a panel-packed LM head: it then looks up the panels
    (`PanelEmbedding`)."""
    freed = 0
    if (slot := _tied_embedding(model)) is not None:
        parent, name = slot
        table = getattr(parent, name).weight
        freed += table.numel() * table.element_size()
        setattr(parent, name, PanelEmbedding(model.packed_lm_head))
    return freed + sum(_release_plain(m) for m in model.modules())


def _release_plain(m: nn.Module) -> int:
    """Frees `m`'s plain weight if it has a packed copy that serves every row count; the bytes."""
    if getattr(m, "packed_weight", None) is None or m.weight.numel() == 0 or getattr(m, "keep_plain", False):
        return 0
    if not isinstance(m.packed_weight, F32Panels) and _PLAIN_FROM_ROWS.get(m.weight.dtype, 0) is not None:
        return 0
    freed = m.weight.numel() * m.weight.element_size()
    m.weight = nn.Parameter(m.weight.new_empty(0), requires_grad=False)
    return freed
