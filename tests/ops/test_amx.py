"""The packed bfloat16 matmul (ops/amx.py) on both of its kernels, AMX tiles (csrc/amx_gemm.c)
and AVX512-BF16 dot products (csrc/bf16_dp_gemm.c), each where this CPU has it: against a
float64 reference, every output within one bfloat16 rounding of the exact product of the bf16
inputs, for row counts around the tile and row-block sizes, widths that are not whole tiles, an
odd K and a bias; the dot products also bit for bit against their definition (VDPBF16PS: per
pair the odd product, then the even one, added in float32), and the default kernel against a
bf16 `F.linear` on this CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.ops import amx

pytestmark = pytest.mark.skipif(not amx.available(),
                                reason="neither AMX-BF16 nor AVX512-BF16 on this CPU (or not granted)")
# The kernels this CPU runs: the tiles where granted (AMX CPUs have AVX512-BF16 too).
KERNELS = [k for k, here in (("tiles", amx.tiles()),
                             ("dot_products", amx.dot_products_built())) if here]


@pytest.fixture(params=KERNELS)
def kernel(request):
    amx.set_kernel(request.param)
    yield request.param
    amx.set_kernel(None)


@pytest.mark.parametrize("M", [1, 12, 13, 15, 16, 17, 26, 27, 33, 64, 300])
@pytest.mark.parametrize("N,K", [(960, 576), (100, 70), (49, 1536), (32, 32), (45, 37)])
def test_matches_float64(kernel, M, N, K):
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


def test_strided_rows_and_no_bias(kernel):
    x = torch.randn(8, 2 * 64).bfloat16()[:, :64]  # rows 128 apart
    w = torch.randn(40, 64).bfloat16()
    exact = x.double() @ w.double().t()
    got = amx.linear(x, amx.pack(w))
    assert ((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + 1e-3 * exact.abs().max()).all()


@pytest.mark.skipif(not amx.tiles(), reason="store policies of the AMX kernel")
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



def _dot_products_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                            kchunk: int) -> torch.Tensor:
    """VDPBF16PS's sums in float32, one k pair at a time (odd product first, as Intel defines
    it), in K chunks of `kchunk` (0: one) added in order, then the bias, rounded to bf16 once."""
    xf, wf = x.float(), w.float()
    if x.shape[1] % 2:  # the odd last k pairs with a zero
        xf, wf = F.pad(xf, (0, 1)), F.pad(wf, (0, 1))
    pairs = xf.shape[1] // 2
    step = kchunk // 2 if kchunk else pairs
    total = None
    for c0 in range(0, pairs, step):
        acc = torch.zeros(x.shape[0], w.shape[0])
        for p in range(c0, min(pairs, c0 + step)):
            acc = acc + xf[:, 2 * p + 1, None] * wf[None, :, 2 * p + 1]
            acc = acc + xf[:, 2 * p, None] * wf[None, :, 2 * p]
        total = acc if total is None else total + acc
    return (total if bias is None else total + bias).bfloat16()


@pytest.mark.skipif(not amx.dot_products_built(), reason="no AVX512-BF16 kernel in this build")
@pytest.mark.parametrize("M,N,K,kchunk", [(1, 40, 64, 0), (13, 45, 37, 0), (25, 100, 576, 512),
                                          (7, 33, 1536, 1024), (12, 64, 96, 32),
                                          (64, 100, 576, 512), (40, 200, 96, 0)])
def test_dot_products_sum_in_their_defined_order(M, N, K, kchunk):
    """Bit for bit the definition, on random inputs and on a probe that tells the orders apart:
    with x = (1, 2^12, -2^12, 1) and w = (1, 2^12, 2^12, 1) the odd-first order gives
    ((2^24 + 1) + 1) - 2^24 = 0 in float32, the even-first one (1 + 2^24) - 2^24 + 1 = 1."""
    amx.set_kernel("dot_products")
    try:
        g = torch.Generator().manual_seed(M + N + K)
        x = torch.randn(M, K, generator=g).bfloat16()
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        b = torch.randn(N, generator=g)
        got = amx.linear(x, amx.pack(w), b, kchunk=kchunk)
        assert torch.equal(got, _dot_products_reference(x, w, b, kchunk))
        probe_x = torch.tensor([[1.0, 2.0 ** 12, -2.0 ** 12, 1.0]]).bfloat16()
        probe_w = torch.tensor([[1.0, 2.0 ** 12, 2.0 ** 12, 1.0]]).bfloat16()
        assert amx.linear(probe_x, amx.pack(probe_w), kchunk=0).item() == 0.0
    finally:
        amx.set_kernel(None)
