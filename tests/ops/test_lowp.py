"""Matmuls on FP8 e4m3 and bfloat16 weights kept as stored (ops/lowp.py, csrc/lowp_gemm.c), on
every kernel level this CPU has: each weight widened exactly (every e4m3 byte, denormals
included, times its scale as the float32 dequantization at load computes it), sums against
float64 on the dequantized weight, and the kernel the plan names is the one that runs."""
from __future__ import annotations

import pytest
import torch

from tokenloom.model.fp8_checkpoint import dequantize_fp8
from tokenloom.ops import cpu_kernels, kernel_plan, lowp

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")

VECTOR_LEVELS = ("lp_portable", "lp_avx2", "lp_avx512")


@pytest.fixture(params=VECTOR_LEVELS)
def level(request):
    """The vector kernels (the AMX tiles only run from the plan's bf16 rows: `test_amx_rows`)."""
    got = lowp.limit_level(request.param)
    request.addfinalizer(lambda: lowp.limit_level(None))
    if got != request.param:
        pytest.skip(f"{request.param} is not available on this CPU")
    return got


def _e4m3(N: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (N, K), generator=g, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # no NaN weights (a checkpoint stores none)
    return codes.view(torch.float8_e4m3fn)


def test_every_e4m3_byte_is_widened_exactly_times_its_scale(level):
    """One-hot activations read single weights back: every byte value (denormals and negative
    zero too) times its column's scale is the float32 dequantization's weight, bit for bit."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0
    w = codes.reshape(16, 16).repeat(1, 4).view(torch.float8_e4m3fn)  # [16, 64]
    scales = torch.rand(16, 2, generator=torch.Generator().manual_seed(1)) * 0.01
    packed = lowp.pack_e4m3(w, scales, 32)
    reference = dequantize_fp8(w, scales, torch.float32, "w", block=(1, 32))
    assert torch.equal(packed.dequantize(), reference)
    y = lowp.linear(torch.eye(64), packed)
    assert lowp.last_kernel() == level
    assert torch.equal(y, reference.t())


@pytest.mark.parametrize("kind", ["bf16", "per-tensor", "per-channel", "block"])
@pytest.mark.parametrize("M", [1, 6])
def test_matmul_matches_float64_on_the_dequantized_weight(level, kind, M):
    N, K = 83, 330  # a partial tile, K not a multiple of 32, two tile groups and a remainder
    g = torch.Generator().manual_seed(M)
    if kind == "bf16":
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        packed, dense = lowp.pack_bf16(w), w.float()
    else:
        w = _e4m3(N, K, M)
        groups, gk = {"per-tensor": (1, K), "per-channel": (1, K), "block": (3, 128)}[kind]
        s = torch.rand(1 if kind == "per-tensor" else N, groups, generator=g) * 1e-3 + 1e-4
        s = s.expand(N, groups).contiguous()
        packed, dense = lowp.pack_e4m3(w, s, gk), dequantize_fp8(w, s, torch.float32, "w", block=(1, gk))
        assert torch.equal(packed.dequantize(), dense)
    x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
    y = lowp.linear(x, packed, bias)
    ref = x.double() @ dense.double().t() + bias.double()
    assert y.shape == (M, N) and lowp.last_kernel() == level
    scale = (x.double().abs() @ dense.double().abs().t()).max()
    assert (y.double() - ref).abs().max() <= 1e-6 * scale


def test_rows_and_columns_cut_as_tensor_parallelism_does():
    w, s = _e4m3(64, 256, 5), torch.rand(64, 2) + 0.5
    packed = lowp.pack_e4m3(w, s, 128)
    dense = packed.dequantize()
    assert torch.equal(packed.take_rows(16, 48).dequantize(), dense[16:48])
    assert torch.equal(packed.take_cols(128, 256, "w").dequantize(), dense[:, 128:])
    with pytest.raises(ValueError, match="w: columns 64:256 cut a scale block of 128"):
        packed.take_cols(64, 256, "w")


@pytest.mark.skipif(cpu_kernels.load() is None or kernel_plan.current().lowp_level != 3,
                    reason="no AMX-BF16 here")
def test_amx_rows_run_the_tiles_with_bf16_rounding():
    """From the plan's bf16 rows: the AMX tiles (the kernel the plan names), a bfloat16 matmul's
    results: the activations and FP8 weights (times their scales) rounded to bfloat16, float32 sums."""
    plan = kernel_plan.current()
    rows = plan.quant_bf16_rows
    w, s = _e4m3(70, 256, 9), torch.rand(70, 2) * 1e-2
    packed = lowp.pack_e4m3(w, s, 128)
    for M in (1, rows, 2 * rows + 3):
        x = torch.randn(M, 256)
        y = lowp.linear(x, packed)
        assert lowp.last_kernel() == plan.kernel("lowp_matmul", "float8_e4m3", M).kernel
        if M >= rows:
            ref = x.bfloat16().double() @ packed.dequantize().bfloat16().double().t()
            assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_bad_input_is_refused_naming_the_limit():
    with pytest.raises(ValueError, match="scale groups of 48 inputs: the kernels take multiples of 32"):
        lowp.pack_e4m3(_e4m3(4, 96, 0), torch.ones(4, 2), 48)
    with pytest.raises(ValueError, match=r"scales of shape \[4, 1\], expected \[4, 3\]"):
        lowp.pack_e4m3(_e4m3(4, 96, 0), torch.ones(4, 1), 32)
    with pytest.raises(ValueError, match="even width"):
        lowp.pack_bf16(torch.ones(4, 5, dtype=torch.bfloat16))
