"""Dequantizing a GGUF's tensors (model/gguf_loader.py) for the float path."""
from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize
from kquants import quantize

from tokenloom.model import gguf_loader


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K])
@pytest.mark.parametrize("shape", [(37, 512), (512,)])
def test_dequantized_in_chunks_as_in_one_go(qtype, shape, monkeypatch):
    """The loader dequantizes a few rows at a time (a whole table at once held several copies of
    it); the values are the same as gguf's in one call, across chunks of 5 rows with 2 left over."""
    raw = quantize(np.random.default_rng(0).standard_normal(shape).astype(np.float32), qtype)
    monkeypatch.setattr(gguf_loader, "_DEQUANT_CHUNK_BYTES", 5 * 512 * 4)
    got = gguf_loader._dequantize_in_chunks(raw, qtype)
    expected = dequantize(raw, qtype)
    assert got.dtype == np.float32 and got.shape == shape
    assert np.array_equal(got, expected)
