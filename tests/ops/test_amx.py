"""The AMX bfloat16 matmul (ops/amx.py, csrc/amx_gemm.c) against a float64 reference: every
output within one bfloat16 rounding of the exact product of the bf16 inputs, for row counts
around the tile sizes, widths that are not whole tiles, and a bias."""
from __future__ import annotations

import pytest
import torch

from tokenloom.ops import amx

pytestmark = pytest.mark.skipif(not amx.available(), reason="no AMX-BF16 on this CPU (or not granted)")


@pytest.mark.parametrize("M", [1, 15, 16, 17, 33, 64, 300])
@pytest.mark.parametrize("N,K", [(960, 576), (100, 70), (49, 1536), (32, 32)])
def test_matches_float64(M, N, K):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    b = torch.randn(N, generator=g)
    exact = x.double() @ w.double().t() + b.double()
    got = amx.linear(x, amx.pack(w), b)
    assert got.dtype == torch.bfloat16 and got.shape == (M, N)
    # float32 accumulation, then one rounding to bf16 (8 significant bits: 2^-8 relative)
    tol = exact.abs() * 2.0 ** -8 + 1e-3 * exact.abs().max()
    assert ((got.double() - exact).abs() <= tol).all()


@pytest.mark.parametrize("M", [1, 16, 48, 97, 160])
@pytest.mark.parametrize("N,K", [(960, 576), (3072, 576), (576, 1536)])
def test_rounds_as_onednn_bf16_linear(M, N, K):
    """Bit for bit what a bf16 `F.linear` (oneDNN; transformers' bf16 path) gives at the row
    counts of decodes and of chat-prompt prefills, on SmolLM2's shapes: from 33 rows oneDNN sums
    K in chunks (measured with torch 2.13 and 2 threads, ops/amx.py), and so do we."""
    g = torch.Generator().manual_seed(M + N + K)
    x = torch.randn(M, K, generator=g).bfloat16()
    w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        expected = torch.nn.functional.linear(x[None], w)[0]
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(amx.linear(x, amx.pack(w)), expected)


def test_strided_rows_and_no_bias():
    x = torch.randn(8, 2 * 64).bfloat16()[:, :64]  # rows 128 apart
    w = torch.randn(40, 64).bfloat16()
    exact = x.double() @ w.double().t()
    got = amx.linear(x, amx.pack(w))
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-3 * exact.abs().max()).all()


@pytest.mark.parametrize("stream_min,prefetch", [(0, True), (None, True), (None, False)])
def test_output_stores_give_the_same_bits(stream_min, prefetch):
    """Outputs written with streaming stores (large outputs, and unaligned or partial 32-column
    blocks beside them), or through the caches with and without the lines requested ahead: the
    same bits as the default policy, within a bf16 rounding of float64; a large prefill-sized
    output by default takes the streaming path."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1100, 576, generator=g).bfloat16()
    w = (torch.randn(2000, 576, generator=g) * 0.05).bfloat16()  # 2000: a partial last block
    b = torch.randn(2000, generator=g)
    packed = amx.pack(w)
    assert 1100 * 2000 * 2 >= amx.STREAM_MIN_BYTES
    default = amx.linear(x, packed, b)
    try:
        amx.set_stores(stream_min, prefetch)
        got = amx.linear(x, packed, b)
        got_offset = amx.linear(x[3:], packed, b)  # rows no longer whole tiles
    finally:
        amx.set_stores()
    assert torch.equal(got, default) and torch.equal(got_offset, default[3:])
    exact = x.double() @ w.double().t() + b.double()
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-3 * exact.abs().max()).all()

