"""The panel-packed float32 matmul (csrc/f32_panel.c, `cpu_kernels.f32_panel_linear`), the float
path's one copy of each weight on AVX2 CPUs: `F.linear` to float32 rounding on the models' shapes
and the awkward ones (N not a multiple of the 16-column panel, K across several 256-element
chunks or shorter than one, row counts across the 6-row tile and the 96-row work item, strided
inputs, bias), and each output summed in one order whatever the batch it comes in, its place in
a tile and the thread count, which the fused decode step relies on to give the eager layers'
results bit for bit."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.ops import cpu_kernels

lib = cpu_kernels.load()
pytestmark = pytest.mark.skipif(lib is None, reason="no C compiler for the CPU kernels")


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return cpu_kernels.f32_panel_linear(lib, x, cpu_kernels.f32_panel_pack(w), w.shape[0], b)


def test_pack_layout():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    p = cpu_kernels.f32_panel_pack(w)
    assert p.shape == (2, 3, 16)
    assert torch.equal(p[0, :, 5], w[5]) and torch.equal(p[1, :, 3], w[19])
    assert p[1, :, 4:].eq(0).all()  # zeros past N


@pytest.mark.parametrize("N,K", [(960, 576), (576, 1536), (16, 256), (1, 8), (7, 13), (37, 600),
                                 (18, 1), (33, 257), (5, 31)])
@pytest.mark.parametrize("M", [1, 5, 6, 7, 97, 200])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_float64_reference(N, K, M, with_bias):
    g = torch.Generator().manual_seed(N * 1000 + K + M)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if with_bias else None
    got = _linear(x, w, b)
    want = x.double() @ w.double().t() + (0 if b is None else b.double())
    # float32 sums of K products, one chain per 256 of them: error ~ sqrt(K) eps |x||w|
    scale = (x.abs() @ w.abs().t()).max().item()
    assert got.shape == (M, N)
    assert (got.double() - want).abs().max().item() <= 8 * K ** 0.5 * 1.2e-7 * scale + 1e-7
    assert torch.allclose(got, F.linear(x, w, b), rtol=1e-4, atol=1e-4 * scale)


@pytest.mark.parametrize("K", [576, 19, 600])
def test_each_row_is_summed_alike_in_any_batch(K):
    """Row m's output bit for bit the same alone, in batches that put it at another place of a
    6-row tile or in another 96-row work item, and on one thread or two."""
    g = torch.Generator().manual_seed(K)
    w, x = torch.randn(67, K, generator=g), torch.randn(110, K, generator=g)
    b = torch.randn(67, generator=g)
    p = cpu_kernels.f32_panel_pack(w)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # the kernel's OpenMP runtime is torch's
        batch = cpu_kernels.f32_panel_linear(lib, x, p, 67, b)
        for m in (0, 5, 6, 95, 96, 109):
            assert torch.equal(cpu_kernels.f32_panel_linear(lib, x[m:m + 1], p, 67, b)[0], batch[m])
        assert torch.equal(cpu_kernels.f32_panel_linear(lib, x[1:100], p, 67, b), batch[1:100])
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.f32_panel_linear(lib, x, p, 67, b), batch)
    finally:
        torch.set_num_threads(threads)


def test_strided_rows_leading_dims_and_empty_batch():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(40, 24, generator=g)
    wide = torch.randn(3, 2, 64, generator=g)
    x = wide[..., 8:32]
    assert not x.is_contiguous()
    got = _linear(x, w, None)
    assert got.shape == (3, 2, 40)
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert _linear(torch.empty(0, 24), w, None).shape == (0, 40)


def test_rejected_shapes_name_them():
    p = cpu_kernels.f32_panel_pack(torch.randn(20, 8))
    with pytest.raises(ValueError, match="f32_panel_linear rejected"):
        cpu_kernels.f32_panel_linear(lib, torch.randn(2, 9), p, 20, None)  # K differs
    with pytest.raises(ValueError, match="f32_panel_linear rejected"):
        cpu_kernels.f32_panel_linear(lib, torch.randn(2, 8), p, 40, None)  # more columns than packed
    with pytest.raises(ValueError, match="f32_panel_linear rejected"):
        cpu_kernels.f32_panel_linear(lib, torch.randn(2, 8), p, 20, torch.randn(19))
