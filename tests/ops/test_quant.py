"""The quantized matmul kernels (ops/quant.py, csrc/quant_gemm.c) against a float64 reference:
random weights quantized by gguf's own quantizer (gguf.quants; for the K-quants, which it can only
dequantize, tests/model/kquants.py, and random block bytes), every format on every kernel this CPU
can run (AMX int8 from 16 rows, AVX-512 VNNI, AVX2, portable C)."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenloom.ops import amx, cpu_kernels, elementwise, quant

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))  # the K-quant quantizer
import kquants  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="no C compiler for the CPU kernels")

BLOCK_FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0]
K_FORMATS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
FORMATS = BLOCK_FORMATS + K_FORMATS
# (M, N, K): odd row counts (the 4-row kernels' tails), N not a multiple of 16, several K blocks.
BLOCK_SHAPES = [(1, 16, 32), (1, 40, 64), (3, 48, 96), (7, 100, 576), (70, 96, 160)]
K_SHAPES = [(1, 16, 256), (3, 40, 512), (7, 100, 768), (70, 24, 256)]
CASES = [(t, *shape) for t in BLOCK_FORMATS for shape in BLOCK_SHAPES] + \
        [(t, *shape) for t in K_FORMATS for shape in K_SHAPES]


INTEGER_KERNELS = ["c", "avx2", "avx512_vnni", "avx512_vnni+amx_int8"]
AMX_BF16 = "avx512_vnni+amx_bf16"


def _kernels() -> list[str]:
    """The integer kernels this CPU can run (the bf16 tiles round differently: tested below)."""
    best = quant.limit_isa(None)
    return INTEGER_KERNELS[: INTEGER_KERNELS.index(best) + 1] if best != AMX_BF16 else INTEGER_KERNELS


@pytest.fixture(params=_kernels())
def kernel(request):
    used = quant.limit_isa(request.param)
    assert used == request.param
    old = quant.set_f32_panel_rows(0)  # the AVX2 integer kernel at every row count (panels: below)
    yield used
    quant.set_f32_panel_rows(old)
    quant.limit_isa(None)


def _quantize_blocks(x: np.ndarray) -> np.ndarray:
    """x [M, K] float32 -> what the kernel's int8 activation codes times their scale stand for:
    llama.cpp's Q8_0 rounding, with a float32 scale per 32 elements."""
    blocks = x.reshape(x.shape[0], -1, 32)
    amax = np.abs(blocks).max(-1, keepdims=True)
    inv = np.where(amax > 0, np.float32(127) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    return (np.rint(blocks * inv) * (amax / np.float32(127))).reshape(x.shape).astype(np.float32)


def _reference(x: np.ndarray, w: np.ndarray, levels: int) -> np.ndarray:
    """float64 x @ w.T, with x first as the kernel represents it in `levels` int8 planes (0: x
    itself), so that only summation order is left between the two."""
    if levels:
        first = _quantize_blocks(x.astype(np.float32))
        if levels == 2:  # the rounding error in steps of 1/256 of the first plane's scale
            blocks = x.reshape(x.shape[0], -1, 32).astype(np.float32)
            step = (np.abs(blocks).max(-1, keepdims=True) / np.float32(127)) / np.float32(256)
            err = blocks - first.reshape(blocks.shape)
            q2 = np.clip(np.rint(err / np.where(step > 0, step, 1)), -127, 127)
            first = (first.reshape(blocks.shape).astype(np.float64) + q2 * step).reshape(x.shape)
        x = first
    return x.astype(np.float64) @ w.astype(np.float64).T


def _check_matmul(raw: np.ndarray, qtype: Q, M: int, levels: int, seed: int) -> None:
    """The kernel on GGUF blocks `raw` against float64 on what gguf says the weight is."""
    rng = np.random.default_rng(seed)
    N = raw.shape[0]
    w_deq = quants.dequantize(raw, qtype)  # what the file says the weight is
    K = w_deq.shape[1]
    tw = quant.tile_gguf(raw, qtype)
    # The repack has the file's bytes, plus zero rows up to whole tiles of 16.
    assert tw.format_name == qtype.name and tw.nbytes == -(-N // 16) * 16 * raw.shape[1]
    x = rng.standard_normal((M, K), dtype=np.float32)
    got = quant.qlinear(torch.from_numpy(x), tw, act_levels=levels).double().numpy()
    assert got.shape == (M, N)
    check_bounds(got, x, w_deq, levels)


def check_bounds(got: np.ndarray, x: np.ndarray, w: np.ndarray, levels: int) -> None:
    """A kernel's x @ w.T against float64, with the bounds every integer kernel meets."""
    plain = _reference(x, w, 0)
    scale = np.abs(plain).max()
    # Same activation codes: float32 accumulation order only.
    assert np.abs(got - _reference(x, w, levels)).max() <= 2e-5 * scale
    # Against the float activations: one int8 plane costs ~1% of the largest output, two ~1e-5.
    assert np.abs(got - plain).max() <= (0.02 if levels == 1 else 5e-5) * scale


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("qtype,M,N,K", CASES, ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_matmul_matches_float64_reference(kernel, qtype, M, N, K, levels):
    rng = np.random.default_rng(M * 1000 + N + K)
    w = rng.standard_normal((N, K), dtype=np.float32)
    raw = kquants.quantize(w, qtype)
    # The quantizer's blocks stand for the weight (so the tiny models below mean something).
    assert np.abs(quants.dequantize(raw, qtype) - w).max() < 0.4
    _check_matmul(raw, qtype, M, levels, seed=K)


def _random_blocks(rng: np.random.Generator, qtype: Q, N: int, K: int) -> np.ndarray:
    """Any bytes are valid K-quant blocks once their fp16 super-block scales are finite: every
    code, 6-bit scale and min (Q6_K: signed scale) pattern the format can hold."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (N, K // block, size), dtype=np.uint8)
    scales = (rng.random((N, K // block, 2)) * 0.02 + 1e-3).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[..., 208:210] = scales[..., 0:2]
    else:  # d, dmin
        raw[..., 0:4] = scales
    return raw.reshape(N, -1)


@pytest.mark.parametrize("qtype", K_FORMATS, ids=lambda t: t.name)
def test_k_quants_on_random_block_bytes(kernel, qtype):
    rng = np.random.default_rng(11)
    for levels in (1, 2):
        _check_matmul(_random_blocks(rng, qtype, 37, 512), qtype, 5, levels, seed=1)
        _check_matmul(_random_blocks(rng, qtype, 16, 256), qtype, 66, levels, seed=2)


AMX = "avx512_vnni+amx_int8"
AMX_FORMATS = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q8_0, Q.Q4_K, Q.Q5_K]  # Q6_K stays on VNNI


@pytest.mark.skipif(cpu_kernels.load() is None or quant.limit_isa(None) not in (AMX, AMX_BF16),
                    reason="the CPU has no AMX int8 (amx_tile + amx_int8), or Linux refused its "
                           "tile state: the AMX kernel cannot run here")
@pytest.mark.parametrize("qtype", AMX_FORMATS, ids=lambda t: t.name)
def test_amx_kernel_matches_reference_and_vnni(qtype, request):
    """The AMX kernel (from 8 rows, 16 with one plane) against float64, and bit for bit against the VNNI kernel
    it replaces there (the same integer sums, scaled in the same order): row counts around its
    16-row tiles and 64-row blocks, N not a multiple of 16, K not a multiple of 64 (block
    formats), both activation plane counts."""
    quant.limit_isa(AMX)  # without the bf16 tiles, which take over from 16 rows where the CPU has them
    request.addfinalizer(lambda: quant.limit_isa(None))
    assert quant.kernel_isa(quant.GGML_FORMATS[int(qtype)]) == AMX
    k_quant = qtype in (Q.Q4_K, Q.Q5_K)
    N, K = (40, 512) if k_quant else (40, 96)
    rng = np.random.default_rng(int(qtype))
    raw = kquants.quantize(rng.standard_normal((N, K), dtype=np.float32), qtype)
    tw = quant.tile_gguf(raw, qtype)
    for M in (1, 8, 16, 17, 64, 79):
        for levels in (1, 2):
            _check_matmul(raw, qtype, M, levels, seed=M)
            x = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
            amx = quant.qlinear(x, tw, act_levels=levels)
            try:
                quant.limit_isa("avx512_vnni")
                vnni = quant.qlinear(x, tw, act_levels=levels)
            finally:
                quant.limit_isa(AMX)
            assert torch.equal(amx, vnni), (M, levels)


@pytest.mark.skipif(cpu_kernels.load() is None or quant.limit_isa(None) != AMX_BF16,
                    reason="the CPU has no AMX-BF16 (amx_tile + amx_bf16 + avx512_bf16), or Linux "
                           "refused its tile state: the bf16 tiles cannot run here")
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_amx_bf16_tiles_match_bf16_reference(qtype):
    """From 16 rows the weight's panels are dequantized to bfloat16 and multiplied on AMX-BF16
    tiles: against float64 on bf16(x) @ bf16(dequantized w) (the same numbers, float32 sums
    only), and within bfloat16 rounding of the exact product. Rows around the 16-row threshold,
    the 32-row tile pairs and the 256-row blocks; N with a partial last column tile and an odd
    number of 16-column tiles (a panel's second half past N); a bias. Below the threshold the
    integer kernels run, as before."""
    assert quant.kernel_isa(quant.GGML_FORMATS[int(qtype)]) == AMX_BF16
    N, K = (40, 512) if qtype in K_FORMATS else (100, 96)
    rng = np.random.default_rng(int(qtype))
    raw = kquants.quantize(rng.standard_normal((N, K), dtype=np.float32), qtype)
    tw = quant.tile_gguf(raw, qtype)
    w = torch.from_numpy(quants.dequantize(raw, qtype))
    w_bf16 = w.bfloat16().double()
    bias = torch.from_numpy(rng.standard_normal(N, dtype=np.float32))
    for M in (8, 16, 17, 33, 79, 300):
        x = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
        got = quant.qlinear(x, tw, bias).double()
        exact = x.double() @ w.double().T + bias.double()
        scale = float(exact.abs().max())
        if M < 16:  # the integer kernel: two activation planes, ~1e-5
            assert float((got - exact).abs().max()) <= 5e-5 * scale
            continue
        same_numbers = x.bfloat16().double() @ w_bf16.T + bias.double()
        assert float((got - same_numbers).abs().max()) <= 2e-6 * scale, M
        assert float((got - exact).abs().max()) <= 2e-2 * scale, M
    # An output past 4 MiB is written with streaming stores, whole lines only (the last column
    # pair here is half a pair: masked stores); f32 and bf16 outputs.
    raw_big = kquants.quantize(rng.standard_normal((1040, K), dtype=np.float32), qtype)
    w_big = torch.from_numpy(quants.dequantize(raw_big, qtype)).bfloat16().double()
    x = torch.from_numpy(rng.standard_normal((1100, K), dtype=np.float32)).bfloat16()
    want = x.double() @ w_big.T
    for xin in (x.float(), x):
        got = quant.qlinear(xin, quant.tile_gguf(raw_big, qtype)).double()
        assert float((got - want).abs().max()) <= (2e-6 if xin.dtype == torch.float32 else 1e-2) * float(want.abs().max())
    # The threshold moves, and 0 turns the tiles off (the integer kernels' results come back).
    x = torch.from_numpy(rng.standard_normal((33, K), dtype=np.float32))
    old = quant.set_amx_bf16_rows(0)
    try:
        ints = quant.qlinear(x, tw)
    finally:
        quant.set_amx_bf16_rows(old)
    assert old == 16
    assert float((ints - x.double() @ w.double().T).abs().max()) <= 5e-5 * float(ints.abs().max())


@pytest.mark.skipif(cpu_kernels.load() is None or quant.limit_isa(None) != "avx2",
                    reason="float32 panels run where the quantized kernels' level is AVX2")
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_f32_panels_match_float64_reference(qtype, request):
    """From 16 rows on AVX2 CPUs each 16-column tile of the weight is dequantized to a float32
    panel per thread and multiplied as the float path's panel matmul (csrc/f32_panel.c): against
    float64 on x @ (dequantized w), float32 sums only, and bit for bit the panel matmul on the
    dequantized weight (the same products, summed alike). Rows around the threshold and the
    row blocks of a pass (96 at K = 1536, more at smaller K), N with a partial last tile, a bias,
    rows with a stride. Below the threshold the integer kernel runs, as before; 0 turns the
    panels off."""
    request.addfinalizer(lambda: quant.set_f32_panel_rows(16))
    assert quant.set_f32_panel_rows(16) == 16 and quant.f32_panel_rows(quant.GGML_FORMATS[int(qtype)]) == 16
    lib = cpu_kernels.load()
    N, K = (40, 1536) if qtype in K_FORMATS else (100, 96)
    rng = np.random.default_rng(int(qtype))
    raw = kquants.quantize(rng.standard_normal((N, K), dtype=np.float32), qtype)
    tw = quant.tile_gguf(raw, qtype)
    w = torch.from_numpy(quants.dequantize(raw, qtype))
    panels = cpu_kernels.f32_panel_pack(w)
    bias = torch.from_numpy(rng.standard_normal(N, dtype=np.float32))
    for M in (8, 15, 16, 17, 97, 300):
        wide = torch.from_numpy(rng.standard_normal((M, K + 8), dtype=np.float32))
        x = wide[:, 3:K + 3]  # rows with a stride
        got = quant.qlinear(x, tw, bias)
        exact = x.double() @ w.double().T + bias.double()
        scale = float(exact.abs().max())
        if M < 16:  # the integer kernel: two activation planes, ~1e-5
            assert float((got.double() - exact).abs().max()) <= 5e-5 * scale
            continue
        assert float((got.double() - exact).abs().max()) <= 2e-6 * scale, M
        assert torch.equal(got, cpu_kernels.f32_panel_linear(lib, x, panels, N, bias)), M
    # The threshold moves, and 0 turns the panels off (the integer kernel's results come back).
    x = torch.from_numpy(rng.standard_normal((33, K), dtype=np.float32))
    assert quant.set_f32_panel_rows(0) == 16
    ints = quant.qlinear(x, tw)
    quant.set_f32_panel_rows(16)
    assert not torch.equal(ints, quant.qlinear(x, tw))
    assert float((ints - x.double() @ w.double().T).abs().max()) <= 5e-5 * float(ints.abs().max())


def test_k_quant_shape_errors_name_the_tensor():
    raw = np.zeros((16, 100), np.uint8)  # not whole 144-byte super-blocks
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_down\.weight: Q4_K rows must be whole 256-weight"):
        quant.tile_gguf(raw, Q.Q4_K, "blk.0.ffn_down.weight")


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_bias_leading_dims_and_empty_input(kernel, qtype):
    rng = np.random.default_rng(5)
    w = rng.standard_normal((24, 256 if qtype in K_FORMATS else 64), dtype=np.float32)
    raw = kquants.quantize(w, qtype)
    tw = quant.tile_gguf(raw, qtype)
    x = torch.from_numpy(rng.standard_normal((2, 3, w.shape[1]), dtype=np.float32))
    bias = torch.arange(24, dtype=torch.float32)
    K = w.shape[1]
    got = quant.qlinear(x, tw, bias)
    plain = quant.qlinear(x.reshape(6, K), tw).reshape(2, 3, 24)
    assert got.shape == (2, 3, 24) and torch.allclose(got, plain + bias)
    assert quant.qlinear(torch.empty(0, K), tw).shape == (0, 24)
    with pytest.raises(ValueError, match=str(K)):
        quant.qlinear(torch.zeros(1, 32), tw)


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_embedding_rows_are_the_dequantized_rows(qtype):
    rng = np.random.default_rng(9)
    K = 512 if qtype in K_FORMATS else 96
    w = rng.standard_normal((50, K), dtype=np.float32)
    raw = kquants.quantize(w, qtype)
    tw = quant.tile_gguf(raw, qtype)
    ids = torch.tensor([[0, 49, 17], [17, 3, 48]])
    got = quant.dequant_rows(tw, ids)
    assert got.shape == (2, 3, K)
    expected = quants.dequantize(raw, qtype)[ids.numpy()]
    assert np.array_equal(got.numpy(), expected)
    with pytest.raises(IndexError, match="out of range"):
        quant.dequant_rows(tw, torch.tensor([50]))


def test_int8_weights_from_float(kernel):
    """The int8 path: a float weight -> int8 codes with a scale per 32 weights (Q8_0 as gguf
    writes it), then the same kernel."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((80, 128), dtype=np.float32) * 0.05
    tw = quant.quantize_q8(torch.from_numpy(w))
    assert tw.format_name == "Q8_0" and tw.nbytes == 80 * 128 // 32 * 34
    # The same codes and scales as gguf's Q8_0 quantizer (ties aside): rows dequantize alike.
    ref_rows = quants.dequantize(quants.quantize(w, Q.Q8_0), Q.Q8_0)
    rows = quant.dequant_rows(tw, torch.arange(80)).numpy()
    assert np.abs(rows - ref_rows).max() <= np.abs(w).max() / 127 + 1e-6
    x = rng.standard_normal((5, 128), dtype=np.float32)
    got = quant.qlinear(torch.from_numpy(x), tw).double().numpy()
    ref = x.astype(np.float64) @ w.astype(np.float64).T
    assert np.abs(got - ref).max() <= 0.02 * np.abs(ref).max()
    with pytest.raises(ValueError, match="divisible by 32"):
        quant.quantize_q8(torch.zeros(4, 40))


def test_fused_rows_and_unsupported_type():
    rng = np.random.default_rng(4)
    parts = [quant.tile_gguf(quants.quantize(rng.standard_normal((n, 64), dtype=np.float32), Q.Q4_1), Q.Q4_1)
             for n in (32, 16, 20)]
    fused = quant.concat_rows(parts)
    assert fused is not None and fused.out_features == 68
    x = torch.from_numpy(rng.standard_normal((3, 64), dtype=np.float32))
    assert torch.equal(quant.qlinear(x, fused), torch.cat([quant.qlinear(x, p) for p in parts], dim=1))
    other = quant.tile_gguf(quants.quantize(rng.standard_normal((16, 64), dtype=np.float32), Q.Q8_0), Q.Q8_0)
    assert quant.concat_rows([parts[0], other]) is None
    with pytest.raises(ValueError, match="Q5_1"):
        quant.tile_gguf(quants.quantize(rng.standard_normal((16, 64), dtype=np.float32), Q.Q5_1), Q.Q5_1)


@pytest.mark.skipif(cpu_kernels.load() is None or quant.limit_isa(None) != AMX_BF16,
                    reason="bfloat16 activations take the bf16 tiles, which this CPU lacks")
@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_bf16_activations_are_the_bf16_float_matmul(qtype, request):
    """A bfloat16 x (a GGUF computed in bfloat16) on the tiles gives the bf16 float path's matmul
    (ops/amx on the dequantized weight rounded to bf16) bit for bit, in one sum over K or in
    oneDNN's chunks; N with a partial last column tile. The tiles run from 16 rows (below, the
    integer kernels: within bf16 rounding); the threshold moved to 1 here."""
    N, K = (40, 512) if qtype in K_FORMATS else (40, 576)
    rng = np.random.default_rng(int(qtype) + 100)
    raw = kquants.quantize(rng.standard_normal((N, K), dtype=np.float32), qtype)
    tw = quant.tile_gguf(raw, qtype)
    packed = amx.pack(torch.from_numpy(quants.dequantize(raw, qtype)))
    bias = torch.from_numpy(rng.standard_normal(N, dtype=np.float32))
    x = torch.from_numpy(rng.standard_normal((5, K), dtype=np.float32)).bfloat16()
    ints, want = quant.qlinear(x, tw, bias), amx.linear(x, packed, bias)
    assert ints.dtype == torch.bfloat16
    assert float((ints.float() - want.float()).abs().max()) <= 2e-2 * float(want.float().abs().max())
    old = quant.set_amx_bf16_rows(1)
    request.addfinalizer(lambda: quant.set_amx_bf16_rows(old))
    for M, kchunk in ((1, 0), (5, 0), (16, 0), (33, 0), (33, K // 2), (79, 64)):
        x = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32)).bfloat16()
        got = quant.qlinear(x, tw, bias, kchunk=kchunk)
        assert torch.equal(got, amx.linear(x, packed, bias, kchunk=kchunk)), (M, kchunk)


@pytest.mark.skipif(cpu_kernels.load() is None or quant.limit_isa(None) != AMX_BF16,
                    reason="the SiLU epilogue runs on the bf16 tiles, which this CPU lacks")
@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_silu_epilogue_is_silu_and_mul_of_the_matmul(qtype):
    """The MLP's gate|up matmul with SiLU-and-mul in its epilogue gives exactly what the two ops
    give (the model's greedy output must not move): rows around the tiles' 32-row blocks, an odd
    number of 16-column tiles per half (I = 48), a bias, and an output past 4 MiB (streaming
    stores). Where it does not apply (below the tiles' threshold, I not a multiple of 16,
    bfloat16, turned off) it says so with None and the caller runs the two ops."""
    K = 256 if qtype in K_FORMATS else 96
    rng = np.random.default_rng(int(qtype) + 7)

    def gate_up(inter: int) -> quant.TiledQuantWeight:
        halves = [quant.tile_gguf(kquants.quantize(rng.standard_normal((inter, K), dtype=np.float32),
                                                   qtype), qtype) for _ in range(2)]
        return quant.concat_rows(halves)

    w = gate_up(48)
    bias = torch.from_numpy(rng.standard_normal(96, dtype=np.float32))
    for M in (16, 33, 64, 300):
        x = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
        for b in (None, bias):
            got = quant.qlinear_silu_and_mul(x, w, b)
            assert got is not None and got.shape == (M, 48)
            assert torch.equal(got, elementwise.silu_and_mul(quant.qlinear(x, w, b))), (M, b is None)
    x = torch.from_numpy(rng.standard_normal((1100, K), dtype=np.float32))
    big = gate_up(1024)
    assert torch.equal(quant.qlinear_silu_and_mul(x, big),
                       elementwise.silu_and_mul(quant.qlinear(x, big)))
    fmt = quant.GGML_FORMATS[int(qtype)]
    assert quant.silu_epilogue_rows(fmt) == 16
    assert quant.qlinear_silu_and_mul(x[:15], w) is None
    old = quant.set_silu_epilogue(False)
    try:
        assert quant.silu_epilogue_rows(fmt) == 0 and quant.qlinear_silu_and_mul(x, w) is None
    finally:
        quant.set_silu_epilogue(old)
    assert quant.qlinear_silu_and_mul(x[:, :K], quant.tile_gguf(
        kquants.quantize(rng.standard_normal((40, K), dtype=np.float32), qtype), qtype)) is None
    assert quant.qlinear_silu_and_mul(x[:, :K].bfloat16(), w) is None


@pytest.mark.skipif(cpu_kernels.load() is None or quant.limit_isa(None) != AMX_BF16,
                    reason="the L1 chunks are the bf16 tiles' own, which this CPU lacks")
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q8_0, Q.Q4_K, Q.Q6_K], ids=lambda t: t.name)
def test_bf16_tiles_l1_chunks_are_the_whole_panels_bits(qtype):
    """A decode step's matmul (a few 32-row pairs) dequantizes its panels a K chunk at a time into
    L1, the sums waiting between chunks: the same bits as the whole panel dequantized at once, the
    model's greedy output unmoved. K with a partial last chunk; row counts of one to four pairs
    and one past them (a pass of the whole panels, then one of chunks); float32 and bfloat16
    activations, a bias, the SiLU epilogue."""
    K = 768 if qtype in K_FORMATS else 352
    rng = np.random.default_rng(int(qtype) + 11)
    tw = quant.tile_gguf(kquants.quantize(rng.standard_normal((80, K), dtype=np.float32), qtype), qtype)
    gu = quant.concat_rows([quant.tile_gguf(kquants.quantize(rng.standard_normal((48, K), dtype=np.float32),
                                                             qtype), qtype) for _ in range(2)])
    bias = torch.from_numpy(rng.standard_normal(80, dtype=np.float32))

    def run() -> list[torch.Tensor]:
        out = []
        for M in (16, 33, 64, 128, 300):
            x = torch.from_numpy(rng.standard_normal((M, K), dtype=np.float32))
            out += [quant.qlinear(x, tw, bias), quant.qlinear(x.bfloat16(), tw),
                    quant.qlinear_silu_and_mul(x, gu)]
        return out

    state = rng.bit_generator.state
    chunked = run()
    rng.bit_generator.state = state
    old = quant.set_bf16_tiles_l1_chunks(False)
    try:
        whole = run()
    finally:
        quant.set_bf16_tiles_l1_chunks(old)
    assert old is True
    for i, (a, b) in enumerate(zip(chunked, whole)):
        assert torch.equal(a, b), i


@pytest.mark.parametrize("qtype", FORMATS, ids=lambda t: t.name)
def test_tiled_in_row_chunks_as_in_one_go(qtype, monkeypatch):
    """tile_gguf tiles a few MB of rows at a time (a whole LM head at once held several copies of
    it beside the model): in chunks of 32 rows, 100 rows (the last tile padded) come out in the
    same bytes as in one go."""
    K = 512 if qtype in K_FORMATS else 96
    raw = kquants.quantize(np.random.default_rng(5).standard_normal((100, K), dtype=np.float32), qtype)
    whole = quant.tile_gguf(raw, qtype)
    monkeypatch.setattr(quant, "_TILE_CHUNK_BYTES", raw.shape[1] * 32)
    chunked = quant.tile_gguf(raw, qtype)
    assert (chunked.out_features, chunked.in_features) == (whole.out_features, whole.in_features) == (100, K)
    assert chunked.data.shape == whole.data.shape and torch.equal(chunked.data, whole.data)
