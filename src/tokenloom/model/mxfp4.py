"""MXFP4 weights as gpt-oss ships its experts (`quantization_config.quant_method == "mxfp4"`,
the OCP microscaling format): each row of a matrix is cut into groups of 32 values; a group is
16 bytes of `*_blocks` (two 4-bit E2M1 values a byte, the low nibble first) and one byte of
`*_scales` (an E8M0 power of two, biased by 127). A `[rows, cols]` matrix is stored as blocks
`[rows, cols / 32, 16]` uint8 and scales `[rows, cols / 32]` uint8, rows being the output
features (an `nn.Linear` weight's rows), as transformers' integrations/mxfp4.py reads them.

The bytes are kept as shipped; a matrix is made float only for the step that multiplies by it
(`dequantize`), so a model holds the packed experts and never a float copy beside them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# The 16 values of an E2M1 nibble (sign bit on top), as transformers' FP4_VALUES.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
GROUP = 32  # values per scale
_PAIRS: dict[torch.dtype, torch.Tensor] = {}


def _pair_lut(dtype: torch.dtype) -> torch.Tensor:
    """[256, 2]: a byte's two values, the low nibble's first."""
    lut = _PAIRS.get(dtype)
    if lut is None:
        values = torch.tensor(FP4_VALUES, dtype=dtype)
        byte = torch.arange(256)
        lut = _PAIRS[dtype] = torch.stack([values[byte & 0x0F], values[byte >> 4]], dim=-1)
    return lut


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks [..., rows, G, 16] uint8 and scales [..., rows, G] uint8 -> [..., rows, G * 32] in
    `dtype` (exact: every MXFP4 value is a float32 one, and a bfloat16 one but for scales past its range)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise TypeError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != GROUP // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(expected blocks [..., G, {GROUP // 2}] for scales [..., G])")
    # One lookup per byte (both nibbles), then each group times its power of two: exact in
    # float32 and in bfloat16 (float32's exponent range); float16 goes through float32.
    work = dtype if dtype in (torch.float32, torch.bfloat16) else torch.float32
    values = F.embedding(blocks.int(), _pair_lut(work)).flatten(-2)
    values.mul_(torch.exp2(scales.to(work) - 127).unsqueeze(-1))
    return values.flatten(-2).to(dtype)


def from_ggml(stored: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's MXFP4 blocks (GGML_TYPE_MXFP4, uint8 [..., G, 17]: the scale byte, then 16
    bytes whose low nibbles are values 0-15 of the group and high nibbles values 16-31) -> the
    checkpoint's (blocks [..., G, 16], value 2j in the low nibble of byte j; scales [..., G]).
    Both scales are E8M0 biased by 127 (ggml's E2M1 table is doubled and its scale halved)."""
    if stored.dtype != torch.uint8 or stored.shape[-1] != GROUP // 2 + 1:
        raise ValueError(f"GGML MXFP4 blocks are uint8 [..., {GROUP // 2 + 1}], got {stored.dtype} {tuple(stored.shape)}")
    q = stored[..., 1:]
    values = torch.cat([q & 0x0F, q >> 4], dim=-1)
    return values[..., 0::2] | (values[..., 1::2] << 4), stored[..., 0].contiguous()
