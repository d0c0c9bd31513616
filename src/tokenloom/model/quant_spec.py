"""A pre-quantized checkpoint's quantization, as model/quant_config.py reads it from config.json:
its own module so that the loaders, which quant_config imports by name, can import it too."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's `quantization_config` says, in one shape for every method."""

    method: str  # one of CHECKPOINT_METHODS
    format: str  # compressed-tensors: "pack-quantized" | "int-quantized" | "float-quantized"; "awq-gemm"; "gptq"; "fp8"
    bits: int
    group_size: int | None = None  # weights per scale along the input; None: one per output channel
    symmetric: bool = True
    desc_act: bool = False  # GPTQ's act-order: input columns grouped by g_idx, not in order
    zeros_minus_one: bool = False  # GPTQ v1 stores each zero point minus 1
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def describe(self) -> str:
        group = "channel" if self.group_size is None else f"g{self.group_size}"
        return f"{self.method} {self.format} int{self.bits} {group} {'sym' if self.symmetric else 'asym'}"
