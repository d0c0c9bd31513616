"""A plain K-quant quantizer for tests (Q4_K, Q5_K, Q6_K): the `gguf` package dequantizes these
types but cannot quantize them. Scales and mins come from each sub-block's range, without
llama.cpp's search for the best scale, so the blocks are valid GGUF bytes (checked against
`gguf.quants.dequantize` in tests/ops/test_quant.py), a little less accurate than llama.cpp's.
"""
from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import quants

QK_K = 256


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16)[..., None].view(np.uint8)


def _q45_k(x: np.ndarray, bits: int) -> np.ndarray:
    """x [n, 256] -> Q4_K (bits 4) or Q5_K (bits 5) blocks [n, 144 | 176]."""
    n = x.shape[0]
    sub = x.reshape(n, 8, 32)
    lo = np.minimum(sub.min(-1), 0)  # w = scale * q - min, min >= 0
    top = (1 << bits) - 1
    scale = (sub.max(-1) - lo) / top
    mins = -lo
    d = scale.max(-1) / 63
    dmin = mins.max(-1) / 63
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d16 > 0, d16, 1)[:, None]), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(mins / np.where(dmin16 > 0, dmin16, 1)[:, None]), 0, 63).astype(np.uint8)
    eff_s = (d16[:, None] * sc)[..., None]
    eff_m = (dmin16[:, None] * mn)[..., None]
    q = np.clip(np.rint((sub + eff_m) / np.where(eff_s > 0, eff_s, 1)), 0, top).astype(np.uint8)
    scales = np.concatenate([sc[:, :4] | ((sc[:, 4:] >> 4) << 6), mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
                             (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)], axis=1)
    pairs = q.reshape(n, 4, 2, 32)  # sub-blocks 2c (low nibbles) and 2c + 1 (high) share bytes
    qs = ((pairs[:, :, 0] & 15) | ((pairs[:, :, 1] & 15) << 4)).reshape(n, 128)
    parts = [_f16_bytes(d).reshape(n, 2), _f16_bytes(dmin).reshape(n, 2), scales]
    if bits == 5:  # byte i, bit s: the fifth bit of weight i of sub-block s
        fifth = (q >> 4).astype(np.uint16) << np.arange(8, dtype=np.uint16)[:, None]
        parts.append(fifth.sum(1).astype(np.uint8))
    return np.concatenate([*parts, qs], axis=1)


def _q6_k(x: np.ndarray) -> np.ndarray:
    """x [n, 256] -> Q6_K blocks [n, 210]: w = d * sc * (q - 32), one int8 sc per 16."""
    n = x.shape[0]
    sub = x.reshape(n, 16, 16)
    scale = np.abs(sub).max(-1) / 31
    d = scale.max(-1) / 127
    d16 = d.astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d16 > 0, d16, 1)[:, None]), -128, 127).astype(np.int8)
    eff = (d16[:, None] * sc)[..., None]
    q = (np.clip(np.rint(sub / np.where(eff > 0, eff, 1)), -32, 31) + 32).astype(np.uint8).reshape(n, 2, 128)
    ql = (q[:, :, :64] & 15) | ((q[:, :, 64:] & 15) << 4)  # per 128: weights i and 64 + i
    top = (q >> 4).reshape(n, 2, 4, 32).astype(np.uint16)  # bit pair r: weights 32r + i
    qh = (top << (2 * np.arange(4, dtype=np.uint16))[:, None]).sum(2).astype(np.uint8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8),
                           _f16_bytes(d).reshape(n, 2)], axis=1)


def quantize(a: np.ndarray, qtype: int) -> np.ndarray:
    """Like gguf.quants.quantize (float [..., K] -> uint8 [..., K / block * bytes]), K-quants
    included."""
    qtype = Q(qtype)
    if qtype not in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return quants.quantize(a, qtype)
    if a.shape[-1] % QK_K:
        raise ValueError(f"{qtype.name} needs rows of a multiple of {QK_K}, got {a.shape[-1]}")
    x = a.astype(np.float32).reshape(-1, QK_K)
    blocks = _q6_k(x) if qtype == Q.Q6_K else _q45_k(x, 4 if qtype == Q.Q4_K else 5)
    return blocks.reshape(*a.shape[:-1], -1)
