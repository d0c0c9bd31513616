"""GGML tensor types (a GGUF file's `ggml_type` ids) and their block sizes: gguf-py's
`GGMLQuantizationType` and `GGML_QUANT_SIZES`, as the file format fixes them.

Not imported from gguf-py: `import gguf` runs its package's init, which imports its vocabulary
module and through it mistral_common (pydantic, requests, jsonschema) wherever that is installed,
tens of MB resident in every process that reads a GGUF header (the caller's, to build the config
and the tokenizer, and the engine core's) for two constants. gguf-py is imported where a tensor is
dequantized (model/gguf_file.dequantize). tests/model/test_gguf_loader.py checks this table against
gguf-py's.
"""
from __future__ import annotations

from enum import IntEnum


class GGMLQuantizationType(IntEnum):
    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q5_0 = 6
    Q5_1 = 7
    Q8_0 = 8
    Q8_1 = 9
    Q2_K = 10
    Q3_K = 11
    Q4_K = 12
    Q5_K = 13
    Q6_K = 14
    Q8_K = 15
    IQ2_XXS = 16
    IQ2_XS = 17
    IQ3_XXS = 18
    IQ1_S = 19
    IQ4_NL = 20
    IQ3_S = 21
    IQ2_S = 22
    IQ4_XS = 23
    I8 = 24
    I16 = 25
    I32 = 26
    I64 = 27
    F64 = 28
    IQ1_M = 29
    BF16 = 30
    TQ1_0 = 34
    TQ2_0 = 35
    MXFP4 = 39
    NVFP4 = 40
    Q1_0 = 41


Q = GGMLQuantizationType
# type -> (weights per block, bytes per block)
GGML_QUANT_SIZES: dict[GGMLQuantizationType, tuple[int, int]] = {
    Q.F32: (1, 4), Q.F16: (1, 2), Q.Q4_0: (32, 18), Q.Q4_1: (32, 20), Q.Q5_0: (32, 22),
    Q.Q5_1: (32, 24), Q.Q8_0: (32, 34), Q.Q8_1: (32, 40), Q.Q2_K: (256, 84), Q.Q3_K: (256, 110),
    Q.Q4_K: (256, 144), Q.Q5_K: (256, 176), Q.Q6_K: (256, 210), Q.Q8_K: (256, 292),
    Q.IQ2_XXS: (256, 66), Q.IQ2_XS: (256, 74), Q.IQ3_XXS: (256, 98), Q.IQ1_S: (256, 50),
    Q.IQ4_NL: (32, 18), Q.IQ3_S: (256, 110), Q.IQ2_S: (256, 82), Q.IQ4_XS: (256, 136), Q.I8: (1, 1),
    Q.I16: (1, 2), Q.I32: (1, 4), Q.I64: (1, 8), Q.F64: (1, 8), Q.IQ1_M: (256, 56), Q.BF16: (1, 2),
    Q.TQ1_0: (256, 54), Q.TQ2_0: (256, 66), Q.MXFP4: (32, 17), Q.NVFP4: (64, 36), Q.Q1_0: (128, 18),
}
