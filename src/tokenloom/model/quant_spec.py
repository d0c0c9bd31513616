"""A pre-quantized checkpoint's quantization, as model/quant_config.py reads it from config.json:
its own module so that the loaders, which quant_config imports by name, can import it too."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# Formats whose weights are FP8 (e4m3), dequantized at load.
FP8_FORMATS = frozenset({"float-quantized", "fp8"})


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
    act_bits: int | None = None  # W8A8: activations quantized at run time; None: weight-only
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def dequantized_at_load(self) -> bool:
        """FP8 weights: dequantized once at load and computed on the float path (fp8_checkpoint)."""
        return self.format in FP8_FORMATS

    @property
    def scheme(self) -> str:
        """vLLM's name of the scheme: W8A8, W8A16, W4A16."""
        return f"W{self.bits}A{self.act_bits or 16}"

    def describe(self) -> str:
        group = "channel" if self.group_size is None else f"g{self.group_size}"
        kind = "fp" if self.dequantized_at_load else "int"
        return f"{self.method} {self.format} {kind}{self.bits} {group} {'sym' if self.symmetric else 'asym'}"
