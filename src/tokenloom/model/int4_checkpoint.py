"""Weight-only int4 checkpoints (compressed-tensors pack-quantized, AutoAWQ GEMM, GPTQ) computed
on the GGUF path's Q4_0 / Q4_1 kernels (ops/quant). Work in progress (branch qint4)."""
from __future__ import annotations

from typing import Any

from tokenloom.model.errors import ModelLoadError


def install_checkpoint(model: Any, spec: Any, directory: str) -> Any:
    raise ModelLoadError(f"{directory}: {spec.describe()} checkpoints are not computed yet")
