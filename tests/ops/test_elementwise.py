"""The C element-wise kernels (ops/csrc/elementwise.c) against the PyTorch ops they replace in the
model: shapes that are not multiples of the vector width, strided rows (the fused projections'
slices), enough rows to take the threaded branch, and values where exp saturates."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenloom.model.rope import cos_sin_cache
from tokenloom.ops.elementwise import apply_rope
from tokenloom.ops import cpu_kernels, elementwise

pytestmark = pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler here")


@pytest.fixture(scope="module")
def lib():
    lib = cpu_kernels.load()
    assert lib is not None  # a compiler exists, so a failed build is a failure
    return lib


def _rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("T,H", [(1, 576), (5, 100), (300, 576), (2048, 64)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm(lib, T, H, with_residual):
    torch.manual_seed(T + H)
    wide = torch.randn(T, H + 24) * 3
    x = wide[:, 8:8 + H]  # strided rows, as a slice of a wider output
    w = torch.randn(H)
    residual = torch.randn(T, H) if with_residual else None
    expected_res = None if residual is None else x + residual
    expected = _rms_norm(x if residual is None else expected_res, w, 1e-5)
    res_in = None if residual is None else residual.clone()
    got = cpu_kernels.add_rms_norm(lib, x, res_in, w, 1e-5)
    torch.testing.assert_close(got, expected, rtol=2e-6, atol=2e-6)
    if with_residual:  # updated in place, exactly (one float addition per element)
        assert torch.equal(res_in, expected_res)
    assert torch.equal(wide[:, 8:8 + H], x)  # input untouched


@pytest.mark.parametrize("T,I", [(1, 1536), (3, 37), (64, 1536), (700, 96)])
def test_silu_and_mul(lib, T, I):
    torch.manual_seed(I)
    gate_up = torch.randn(T, 2 * I) * 4
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])  # exp saturates both ways
    wide = torch.zeros(T, 2 * I + 8)
    wide[:, 3:3 + 2 * I] = gate_up
    for src in (gate_up, wide[:, 3:3 + 2 * I]):
        got = cpu_kernels.silu_and_mul(lib, src)
        expected = F.silu(gate_up[:, :I]) * gate_up[:, I:]
        torch.testing.assert_close(got, expected, rtol=3e-6, atol=1e-6)


@pytest.mark.parametrize("T,heads,D", [(1, 12, 64), (9, 5, 36), (600, 12, 64), (4, 3, 128)])
def test_rope_in_place(lib, T, heads, D):
    torch.manual_seed(D)
    table = cos_sin_cache(D, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (T,), dtype=torch.int64)
    qkv = torch.randn(T, (heads + 2) * D)  # rows strided: the rotated heads are a prefix slice
    x = qkv[:, :heads * D].view(T, heads, D)
    cos, sin = table.index_select(0, positions).unsqueeze(1).chunk(2, dim=-1)
    expected = apply_rope(x.clone(), cos, sin)
    tail = qkv[:, heads * D:].clone()
    got = cpu_kernels.rope_(lib, x, positions, table)
    assert got.data_ptr() == x.data_ptr()
    torch.testing.assert_close(x, expected, rtol=1e-6, atol=2e-6)
    assert torch.equal(qkv[:, heads * D:], tail)  # nothing past the rotated heads is touched


# ---- bfloat16: the kernels follow the reference's bf16 rounding step by step, so they must agree
# with the PyTorch ops run in bfloat16 (as transformers runs them) bit for bit on most elements, and
# elsewhere to within two bf16 roundings (exp's last float32 bit can flip an intermediate's
# rounding, which the next bf16 op carries).
BF16_ULP = 2 ** -7  # relative spacing of bfloat16


def _close_bf16(got: torch.Tensor, expected: torch.Tensor, min_exact: float) -> None:
    assert got.dtype == torch.bfloat16
    diff = (got.float() - expected.float()).abs()
    assert (diff <= 2 * BF16_ULP * expected.float().abs() + 1e-6).all(), diff.max()
    assert (got == expected).float().mean().item() >= min_exact


@pytest.mark.parametrize("T,H", [(1, 576), (5, 100), (300, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_bf16(lib, T, H, with_residual):
    torch.manual_seed(T + H)
    wide = (torch.randn(T, H + 24) * 3).bfloat16()
    x = wide[:, 8:8 + H]
    w = torch.randn(H).bfloat16()
    residual = torch.randn(T, H).bfloat16() if with_residual else None
    with elementwise.torch_ops_only():  # the PyTorch path in bfloat16, the reference's op order
        expected = elementwise.rms_norm(x, w, 1e-5, None if residual is None else residual.clone())
    res_in = None if residual is None else residual.clone()
    got = cpu_kernels.add_rms_norm(lib, x, res_in, w, 1e-5)
    if with_residual:
        expected, expected_res = expected
        assert torch.equal(res_in, expected_res)  # one bf16 addition per element
    # The squares summed in torch's order, the mean and 1/sqrt rounded as torch rounds them: the
    # PyTorch path's (transformers') bits, on every ISA level.
    assert torch.equal(got, expected)


@pytest.mark.parametrize("T,I", [(1, 1536), (3, 37), (64, 1536)])
def test_silu_and_mul_bf16(lib, T, I):
    torch.manual_seed(I)
    gate_up = (torch.randn(T, 2 * I) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])
    got = cpu_kernels.silu_and_mul(lib, gate_up)
    expected = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    if cpu_kernels.isa() == "avx512":  # torch's own expf (Sleef's): F.silu's bits
        assert torch.equal(got, expected)
    else:
        _close_bf16(got, expected, min_exact=0.97)


@pytest.mark.parametrize("T,heads,D", [(1, 12, 64), (9, 5, 36), (40, 4, 128)])
def test_rope_bf16(lib, T, heads, D):
    torch.manual_seed(D)
    table = cos_sin_cache(D, 4096, 10000.0, None)
    positions = torch.randint(0, 4096, (T,), dtype=torch.int64)
    qkv = torch.randn(T, (heads + 2) * D).bfloat16()
    x = qkv[:, :heads * D].view(T, heads, D)
    cos, sin = table.index_select(0, positions).bfloat16().unsqueeze(1).chunk(2, dim=-1)
    expected = apply_rope(x.clone(), cos, sin)
    cpu_kernels.rope_(lib, x, positions, table)
    _close_bf16(x, expected, min_exact=0.97)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entry_points_choose_the_c_kernels(lib, dtype):
    """ops.elementwise runs the C kernels for float32 and bfloat16 CPU tensors (the model's one op
    path), the PyTorch ops under torch_ops_only() and for other dtypes, with matching results."""
    torch.manual_seed(0)
    x, w = torch.randn(7, 64).to(dtype), torch.randn(64).to(dtype)
    gate_up = torch.randn(7, 96).to(dtype)
    assert elementwise.c_kernels_active(x)
    assert not elementwise.c_kernels_active(x.half())
    got = elementwise.rms_norm(x, w, 1e-5), elementwise.silu_and_mul(gate_up)
    with elementwise.torch_ops_only():
        assert not elementwise.c_kernels_active(x)
        expected = elementwise.rms_norm(x, w, 1e-5), elementwise.silu_and_mul(gate_up)
    tol = 2e-5 if dtype == torch.float32 else 2 * BF16_ULP
    for g, e in zip(got, expected):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), e.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("T,V", [(1, 49152), (64, 49152), (3, 17), (5, 1000)])
def test_argmax_is_torchs(lib, T, V):
    """The greedy sampler's argmax: torch.argmax's indices for random logits, ties (the first
    wins), rows all -inf, +inf, NaN (the first NaN wins, as in torch) and strided rows."""
    g = torch.Generator().manual_seed(T * V)
    x = torch.randn(T, V, generator=g)
    assert torch.equal(elementwise.argmax(x), x.argmax(-1))
    x = torch.randn(8, 1000, generator=g)
    x[0, 7] = x[0, 900] = 1e9
    x[1, :] = 3.0
    x[2, :] = float("-inf")
    x[3, 999] = float("inf")
    x[4, 10] = x[4, 500] = float("nan")
    x[5, 998] = float("nan")
    x[5, 3] = float("inf")
    assert torch.equal(elementwise.argmax(x), x.argmax(-1))
    wide = torch.randn(6, 2 * V, generator=g)[:, :V]
    assert torch.equal(elementwise.argmax(wide), wide.argmax(-1))


@pytest.mark.slow
def test_kernel_benchmark_script_runs():
    """benchmarks/cpu_kernels.py (the figures in benchmarks/README.md) still runs and reports
    every case, on a one-layer, one-round workload."""
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "cpu_kernels.py"
    out = subprocess.run([sys.executable, str(script), "--layers", "1", "--repeat", "1"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    assert out.count("decode B=") == 4 and out.count("bfloat16 cache") == 4, out
    for name in ("add+norm", "rope", "silu*mul"):
        assert out.count(name) == 2, out  # at 64 and 2048 rows
