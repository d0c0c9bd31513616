"""gpt-oss's MXFP4 matmul in C (csrc/mxfp4_gemm.c, `cpu_kernels.mxfp4_linear`) at every ISA level
this CPU runs: the source built alone with cpu_kernels' flags for each level (AVX-512, AVX2, plain
C), against model/mxfp4's unpacking and a float64 matmul, on random bytes (every nibble, scales
around one) at the rows of a decode step and past one pass of the kernel's row blocks; its
unpacking (`mxfp4_unpack`) bit for bit against model/mxfp4's. The AVX-512 loops are also run on
an emulator by tests/ops/test_avx512_emulated.py."""
from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tokenloom.model import mxfp4
from tokenloom.ops import cpu_features, cpu_kernels

LEVELS = ("avx512", "avx2", "scalar")
HERE_LEVELS = LEVELS[LEVELS.index(cpu_features.detect().isa):]
ISA_IDS = {"avx512": 2, "avx2": 1, "scalar": 0}  # tl_mxfp4_isa's answer
# (rows, outputs, inputs): one row; odd counts; a whole and a partial AVX-512 row block (8); a
# decode batch of 16 and 17; a gpt-oss-like K (2880 / 10).
SHAPES = [(1, 5, 32), (3, 37, 64), (8, 64, 256), (9, 33, 96), (16, 130, 288), (17, 8, 64)]


@pytest.fixture(scope="module", params=HERE_LEVELS)
def lib(request, tmp_path_factory):
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    out = tmp_path_factory.mktemp(f"mxfp4-{request.param}") / "mxfp4.so"
    src = Path(cpu_kernels.__file__).with_name("csrc") / "mxfp4_gemm.c"
    # Compiled with the library's flags, linked apart without them: linking with -ffast-math adds
    # crtfastmath.o, which turns on flush-to-zero for the whole test process when loaded.
    obj = out.with_suffix(".o")
    subprocess.run([cc, *cpu_kernels.compile_flags(request.param), "-c", str(src), "-o", str(obj)],
                   check=True, capture_output=True)
    subprocess.run([cc, "-shared", "-fopenmp", str(obj), "-o", str(out), "-lm"], check=True, capture_output=True)
    return request.param, cpu_kernels.bind_mxfp4(ctypes.CDLL(str(out)))


def random_mxfp4(N: int, K: int, seed: int, exponents: tuple[int, int] = (117, 137)) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks [N, K / 32, 16] and scales [N, K / 32] (E8M0 bytes in `exponents`)."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (N, K // 32, 16), dtype=torch.uint8, generator=g)
    return blocks, torch.randint(*exponents, (N, K // 32), dtype=torch.uint8, generator=g)


def check_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Within float32's rounding of a K-term sum of the float64 reference."""
    ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
    bound = x.shape[-1] * 2.0 ** -23 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((got.double() - ref).abs() <= bound).all(), (got.double() - ref).abs().max()


@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matches_the_unpacked_matmul(lib, M, N, K, with_bias):
    level, so = lib
    assert so.tl_mxfp4_isa() == ISA_IDS[level]
    blocks, scales = random_mxfp4(N, K, seed=M * 1000 + N + K)
    g = torch.Generator().manual_seed(K)
    x = torch.randn(M, K, generator=g)
    bias = torch.randn(N, generator=g) if with_bias else None
    check_close(cpu_kernels.mxfp4_linear(so, x, blocks, scales, bias), x, mxfp4.dequantize(blocks, scales), bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unpack_is_model_mxfp4s(lib, dtype):
    """Every scale byte (E8M0's NaN and the subnormal one included), every nibble: the same bits."""
    _, so = lib
    g = torch.Generator().manual_seed(5)
    blocks = torch.randint(0, 256, (256, 3, 16), dtype=torch.uint8, generator=g)
    scales = torch.arange(256, dtype=torch.uint8)[:, None].expand(256, 3).contiguous()
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    got, ref = cpu_kernels.mxfp4_unpack(so, blocks, scales, dtype), mxfp4.dequantize(blocks, scales, dtype)
    nan = ref.isnan()  # zero times E8M0's NaN scale: a NaN either way, its payload bits may differ
    assert torch.equal(got.isnan(), nan) and torch.equal(got.view(bits)[~nan], ref.view(bits)[~nan])


def test_strided_rows_and_bad_shapes(lib):
    _, so = lib
    blocks, scales = random_mxfp4(16, 64, seed=1)
    wide = torch.randn(4, 100)
    x = wide[:, 10:74]  # rows strided, elements contiguous
    check_close(cpu_kernels.mxfp4_linear(so, x, blocks, scales), x, mxfp4.dequantize(blocks, scales), None)
    with pytest.raises(ValueError, match="mxfp4_linear rejected the shapes"):
        cpu_kernels.mxfp4_linear(so, torch.randn(2, 32), blocks, scales)


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C kernels here")
def test_gpt_oss_decode_rows_run_the_kernel():
    """An expert of gpt-oss's MoE layer: a decode step's rows on the C kernel (the plan's
    mxfp4_matmul), the same values as the unpacked float matmul the larger steps run."""
    import functools

    from tokenloom.model import gpt_oss
    from tokenloom.ops import kernel_plan

    plan = kernel_plan.current()
    below = plan.mxfp4_c_below_rows
    assert below > 1 and plan.kernel("mxfp4_matmul", "float32", 1).kernel == "tl_mxfp4_linear"
    assert plan.kernel("mxfp4_matmul", "float32", below).kernel == "tl_mxfp4_unpack + F.linear"
    act = functools.partial(gpt_oss.clamped_swiglu, alpha=1.702, limit=7.0)
    experts = gpt_oss.Mxfp4FusedMoE(2, 1, 64, 96, bias=True, scoring="topk_softmax", activation=act)
    for name, (N, K) in {"w13": (192, 64), "w2": (64, 96)}.items():
        blocks, scales = random_mxfp4(2 * N, K, seed=N, exponents=(119, 124))  # weights of a model's size
        getattr(experts, f"{name}_blocks").copy_(blocks.view(2, N, K // 32, 16))
        getattr(experts, f"{name}_scales").copy_(scales.view(2, N, K // 32))
        getattr(experts, f"{name}_bias").data.normal_()
    for rows in (1, below - 1, below):
        x = torch.randn(rows, 64) * 0.1
        assert (experts.c_kernels(x) is not None) == (rows < below)
        w13 = mxfp4.dequantize(experts.w13_blocks[1], experts.w13_scales[1])
        w2 = mxfp4.dequantize(experts.w2_blocks[1], experts.w2_scales[1])
        ref = F.linear(act(F.linear(x, w13, experts.w13_bias[1])), w2, experts.w2_bias[1])
        torch.testing.assert_close(experts.expert_forward(1, x), ref, rtol=1e-5, atol=1e-5)
    bf16 = plan.mxfp4_c_below_rows_bf16
    assert experts.c_kernels(torch.zeros(bf16 - 1, 64).bfloat16()) is not None
    assert experts.c_kernels(torch.zeros(bf16, 64).bfloat16()) is None
