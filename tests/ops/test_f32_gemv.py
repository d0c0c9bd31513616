"""The float32 GEMV (csrc/f32_gemv.c, `cpu_kernels.f32_linear`): `F.linear` to float32 rounding on
every shape the models bring and the awkward ones (K not a multiple of the vector width, N not
of the row group, strided inputs, bias), and each output summed in one order whatever the batch
it comes in and however many threads run, which the fused decode step relies on to give the
eager layers' results bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.ops import cpu_kernels

lib = cpu_kernels.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the CPU kernels")


def _reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().t()
    return (out if b is None else out + b.double()).float()


@pytest.mark.parametrize("N,K", [(960, 576), (3072, 576), (576, 1536), (1, 8), (7, 13), (37, 100),
                                 (18, 1), (33, 17), (5, 31)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 15])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(N, K, M, with_bias):
    g = torch.Generator().manual_seed(N * 1000 + K + M)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    got = cpu_kernels.f32_linear(lib, x, w, b)
    want = _reference(x, w, b)
    # float32 sums of K products: error ~ sqrt(K) eps |x||w|; F.linear's is of the same size
    scale = (x.abs() @ w.abs().t()).max().item()
    assert got.shape == (M, N)
    assert (got - want).abs().max().item() <= 4 * K ** 0.5 * 1.2e-7 * scale + 1e-7
    assert torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4 * scale)


def test_strided_rows_and_leading_dims():
    """Rows of x may be strided (a view into a wider activation); leading dims are kept."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    wide = torch.randn(3, 2, 64, generator=g)
    x = wide[..., 8:32]
    assert not x.is_contiguous()
    got = cpu_kernels.f32_linear(lib, x, w, None)
    assert got.shape == (3, 2, 40)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("K", [576, 19])
def test_each_row_is_summed_alike_in_any_batch(K):
    """Row m's output bit for bit the same alone, in an even batch, in an odd one, at either
    position of a pair, and on one thread or two."""
    g = torch.Generator().manual_seed(K)
    w, x = torch.randn(67, K, generator=g), torch.randn(7, K, generator=g)
    b = torch.randn(67, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the kernel's OpenMP runtime is torch's
        batch = cpu_kernels.f32_linear(lib, x, w, b)
        for m in range(7):
            assert torch.equal(cpu_kernels.f32_linear(lib, x[m:m + 1], w, b)[0], batch[m])
        assert torch.equal(cpu_kernels.f32_linear(lib, x[1:5], w, b), batch[1:5])
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.f32_linear(lib, x, w, b), batch)
    finally:
        torch.set_num_threads(threads)


def test_empty_batch_and_rejected_shapes():
    w = torch.randn(8, 16)
    assert cpu_kernels.f32_linear(lib, torch.empty(0, 16), w, None).shape == (0, 8)
    with pytest.raises(ValueError, match="f32_linear rejected"):
        cpu_kernels.f32_linear(lib, torch.randn(2, 16), torch.empty(8, 0), None)
