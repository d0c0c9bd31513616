"""The kernels' AVX-512 code run in an x86 emulator (avx512_emu/emulator.py: Bochs' Sapphire
Rapids model, the kernels built as on a Zen 4), so that a test run on an AVX2-only machine also
checks the code that AVX-512 machines run: the quantized matmuls' VNNI kernel against the same
float64 reference and bounds as tests/ops/test_quant.py, and the element-wise kernels' AVX-512
(and AVX512-BF16) loops against the PyTorch ops as in tests/ops/test_elementwise.py, the decode
attention kernel (csrc/paged_decode.c) against float64 attention over its paged cache, and the
AVX512-BF16 dot-product matmul (csrc/bf16_dp_gemm.c) bit for bit against its definition, and
gpt-oss's MXFP4 matmul (csrc/mxfp4_gemm.c) against the unpacked float64 matmul as in
tests/ops/test_mxfp4.py."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from gguf import quants

from tokenloom.disk_cache import cache_dir
from tokenloom.model import mxfp4
from tokenloom.model.rope import cos_sin_cache
from tokenloom.ops import amx, cpu_kernels, elementwise, quant
from tokenloom.ops.elementwise import apply_rope

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "avx512_emu"))
sys.path.insert(0, str(HERE.parent / "model"))
import emulator  # noqa: E402
import kquants  # noqa: E402
from test_amx import _dot_products_reference  # noqa: E402
from test_elementwise import _close_bf16, _rms_norm  # noqa: E402
from test_mxfp4 import check_close, random_mxfp4  # noqa: E402
from test_quant import BLOCK_SHAPES, FORMATS, K_SHAPES, _random_blocks, check_bounds  # noqa: E402

pytestmark = pytest.mark.skipif(emulator.unavailable() is not None,
                                reason=f"no AVX-512 emulator: {emulator.unavailable()}")

VNNI = 2  # csrc/quant_gemm.c's kernel level: AVX-512 VNNI
# test_quant's shapes, and 64 rows (a decode batch: several 16-row blocks of the kernel).
CASES = [(t, *s) for t in FORMATS[:4] for s in BLOCK_SHAPES] + \
        [(t, *s) for t in FORMATS[4:] for s in K_SHAPES] + \
        [(t, 64, 48, 256) for t in FORMATS]


@pytest.fixture(scope="module")
def image() -> emulator.Image:
    return emulator.Image.build(cache_dir("avx512_emu"))


def _case_blocks(qtype: Q, M: int, N: int, K: int, random_bytes: bool) -> np.ndarray:
    rng = np.random.default_rng(M * 1000 + N + K)
    if random_bytes:
        return _random_blocks(rng, qtype, N, K)
    return kquants.quantize(rng.standard_normal((N, K), dtype=np.float32), qtype)


@pytest.fixture(scope="module")
def emulated(image):
    """Every case at both activation levels in one emulator process: {(case, levels): (x, y)}."""
    cases = [(c, False) for c in CASES] + \
            [((t, 5, 37, 512), True) for t in FORMATS[4:]] + [((t, 66, 16, 256), True) for t in FORMATS[4:]]
    # the cap the kernel plan passes for TOKENLOOM_QUANT_ISA=avx512 (2), before any matmul
    buffers, calls, where = {}, [("tl_q_force_isa", [2])], {}
    for i, ((qtype, M, N, K), random_bytes) in enumerate(cases):
        raw = _case_blocks(qtype, M, N, K, random_bytes)
        tw = quant.tile_gguf(raw, qtype)
        buffers[f"w{i}"] = tw.data.numpy().tobytes()
        calls.append(("tl_q_isa", [tw.fmt]))
        isa_at = len(calls) - 1
        for levels in (1, 2):
            x = np.random.default_rng(K + levels).standard_normal((M, K), dtype=np.float32)
            key = f"{i}.{levels}"
            buffers[f"x{key}"] = x.tobytes()
            buffers[f"y{key}"] = bytes(4 * M * N)
            buffers[f"s{key}"] = bytes(quant._lib().tl_q_scratch_bytes(M, K) + 4096)
            calls.append(("tl_q_linear", [tw.fmt, emulator.Buf(f"w{i}"), N, K, emulator.Buf(f"x{key}"),
                                          K, M, emulator.Buf(f"y{key}"), N, 0, emulator.Buf(f"s{key}"), levels]))
            where[(qtype, M, N, K, random_bytes, levels)] = (raw, x, key, len(calls) - 1, isa_at)
    returns, out = image.run(calls, buffers)
    return {k: (raw, x, np.frombuffer(out[f"y{key}"], np.float32).reshape(x.shape[0], -1),
                returns[at], returns[isa_at])
            for k, (raw, x, key, at, isa_at) in where.items()}


def _check(result, qtype: Q, levels: int) -> None:
    raw, x, got, rc, isa = result
    assert isa == VNNI, "the emulated CPU did not run the AVX-512 VNNI kernel"
    assert rc == 0
    check_bounds(got.astype(np.float64), x, quants.dequantize(raw, qtype), levels)


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("qtype,M,N,K", CASES, ids=lambda v: v.name if isinstance(v, Q) else str(v))
def test_vnni_kernel_matches_float64_reference(emulated, qtype, M, N, K, levels):
    _check(emulated[(qtype, M, N, K, False, levels)], qtype, levels)


@pytest.mark.parametrize("levels", [1, 2])
@pytest.mark.parametrize("qtype", FORMATS[4:], ids=lambda t: t.name)
def test_vnni_k_quants_on_random_block_bytes(emulated, qtype, levels):
    _check(emulated[(qtype, 5, 37, 512, True, levels)], qtype, levels)
    _check(emulated[(qtype, 66, 16, 256, True, levels)], qtype, levels)


# ---- element-wise kernels (csrc/elementwise.c), each case a call on its own buffers
SILU = [(1, 1536), (3, 37), (64, 1536)]
ROPE = [(1, 12, 64), (9, 5, 36), (40, 4, 128)]
NORM = [(1, 576), (5, 100), (300, 576)]
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def _raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def _tensor(b: bytes, dtype: torch.dtype, shape) -> torch.Tensor:
    return torch.frombuffer(bytearray(b), dtype=torch.uint8).view(dtype).reshape(shape)


@pytest.fixture(scope="module")
def elementwise_run(image):
    """{case: (inputs, output)} for every case below, emulated in one process."""
    buffers, calls, cases = {}, [], {}
    Buf = emulator.Buf
    for sfx, dtype in DTYPES.items():
        for T, I in SILU:
            torch.manual_seed(I)
            gate_up = (torch.randn(T, 2 * I) * 4).to(dtype)
            gate_up[0, :4] = torch.tensor([-100.0, 100.0, -87.5, 0.0])  # exp saturates both ways
            key = f"silu.{sfx}.{T}.{I}"
            buffers[key + ".in"], buffers[key + ".out"] = _raw(gate_up), bytes(T * I * gate_up.element_size())
            calls.append((f"tl_silu_and_mul_{sfx}", [Buf(key + ".in"), 2 * I, Buf(key + ".out"), I, T, I]))
            cases[("silu", sfx, T, I)] = (key, gate_up, (T, I))
        for T, heads, D in ROPE:
            torch.manual_seed(D)
            table = cos_sin_cache(D, 4096, 10000.0, None)
            positions = torch.randint(0, 4096, (T,), dtype=torch.int64)
            qkv = torch.randn(T, (heads + 2) * D).to(dtype)  # rows strided: the heads are a prefix
            key = f"rope.{sfx}.{T}.{heads}.{D}"
            buffers[key + ".x"], buffers[key + ".pos"], buffers[key + ".cs"] = _raw(qkv), _raw(positions), _raw(table)
            calls.append((f"tl_rope_{sfx}", [Buf(key + ".x"), (heads + 2) * D, T, heads, D, Buf(key + ".pos"),
                                             Buf(key + ".cs"), table.stride(0)]))
            cases[("rope", sfx, T, heads, D)] = (key, (qkv, positions, table), (T, (heads + 2) * D))
        for T, H in NORM:
            for with_residual in (False, True):
                torch.manual_seed(T + H)
                x = (torch.randn(T, H) * 3).to(dtype)
                w = torch.randn(H).to(dtype)
                residual = torch.randn(T, H).to(dtype) if with_residual else None
                key = f"norm.{sfx}.{T}.{H}.{int(with_residual)}"
                buffers[key + ".x"], buffers[key + ".w"] = _raw(x), _raw(w)
                buffers[key + ".out"] = bytes(T * H * x.element_size())
                res = 0
                if residual is not None:
                    buffers[key + ".res"] = _raw(residual)
                    res = Buf(key + ".res")
                calls.append((f"tl_add_rms_norm_{sfx}", [Buf(key + ".x"), H, res, H if residual is not None else 0,
                                                         Buf(key + ".w"), Buf(key + ".out"), H, T, H,
                                                         emulator.F32(1e-5)]))
                cases[("norm", sfx, T, H, with_residual)] = (key, (x, w, residual), (T, H))
    _, out = image.run(calls, buffers)
    return {case: (inputs, shape, key, out) for case, (key, inputs, shape) in cases.items()}


@pytest.mark.parametrize("sfx", DTYPES)
@pytest.mark.parametrize("T,I", SILU)
def test_silu_and_mul_avx512(elementwise_run, sfx, T, I):
    gate_up, shape, key, out = elementwise_run[("silu", sfx, T, I)]
    got = _tensor(out[key + ".out"], DTYPES[sfx], shape)
    expected = F.silu(gate_up[:, :I]) * gate_up[:, I:]
    if sfx == "f32":
        torch.testing.assert_close(got, expected, rtol=3e-6, atol=1e-6)
    else:  # (the emulator's expf is not libmvec's: bf16 roundings may flip, as on AVX2)
        _close_bf16(got, expected, min_exact=0.97)


@pytest.mark.parametrize("sfx", DTYPES)
@pytest.mark.parametrize("T,heads,D", ROPE)
def test_rope_avx512(elementwise_run, sfx, T, heads, D):
    (qkv, positions, table), shape, key, out = elementwise_run[("rope", sfx, T, heads, D)]
    got = _tensor(out[key + ".x"], DTYPES[sfx], shape)
    cos, sin = table.index_select(0, positions).to(DTYPES[sfx]).unsqueeze(1).chunk(2, dim=-1)
    expected = apply_rope(qkv[:, :heads * D].reshape(T, heads, D).clone(), cos, sin)
    assert torch.equal(got[:, heads * D:], qkv[:, heads * D:])  # nothing past the heads touched
    if sfx == "f32":
        torch.testing.assert_close(got[:, :heads * D].reshape(T, heads, D), expected, rtol=1e-6, atol=2e-6)
    else:
        _close_bf16(got[:, :heads * D].reshape(T, heads, D), expected, min_exact=0.97)


@pytest.mark.parametrize("sfx", DTYPES)
@pytest.mark.parametrize("T,H", NORM)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_avx512(elementwise_run, sfx, T, H, with_residual):
    (x, w, residual), shape, key, out = elementwise_run[("norm", sfx, T, H, with_residual)]
    got = _tensor(out[key + ".out"], DTYPES[sfx], shape)
    summed = x if residual is None else x + residual
    if residual is not None:  # updated in place, exactly (one addition per element)
        assert torch.equal(_tensor(out[key + ".res"], DTYPES[sfx], shape), summed)
    if sfx == "f32":
        torch.testing.assert_close(got, _rms_norm(summed, w, 1e-5), rtol=2e-6, atol=2e-6)
    else:  # the PyTorch path's (transformers') bits, as on every ISA level
        with elementwise.torch_ops_only():
            expected = elementwise.rms_norm(x, w, 1e-5, None if residual is None else residual.clone())
        assert torch.equal(got, expected[0] if residual is not None else expected)


# ---- decode attention (csrc/paged_decode.c): float32, float32 over a bf16 cache, bfloat16
DECODE = [(16, 9, 3, 64), (32, 8, 8, 128), (16, 4, 4, 36)]  # block size, Hq, Hkv, head dim
SEQ_LENS = [1, 15, 17, 64, 300]  # a block's edges, one token, a context split across items
KINDS = {"f32": (torch.float32, torch.float32), "f32_bf16kv": (torch.float32, torch.bfloat16),
         "bf16": (torch.bfloat16, torch.bfloat16)}


def _decode_case(bs: int, hq: int, hkv: int, D: int, kind: str):
    q_dtype, kv_dtype = KINDS[kind]
    g = torch.Generator().manual_seed(bs * hq + D)
    B = len(SEQ_LENS)
    per_seq = [-(-n // bs) for n in SEQ_LENS]
    nblocks = sum(per_seq) + 3
    kv = torch.randn(2, nblocks, bs, hkv, D, generator=g).to(kv_dtype)
    perm = torch.randperm(nblocks, generator=g)  # blocks scattered through the cache
    table = torch.zeros(B, max(per_seq), dtype=torch.int32)
    at = 0
    for b, n in enumerate(per_seq):
        table[b, :n] = perm[at:at + n].to(torch.int32)
        at += n
    query = torch.randn(B, hq, D, generator=g).to(q_dtype)
    return query, kv, table, torch.tensor(SEQ_LENS, dtype=torch.int32)


def _decode_reference(query, kv, table, scale):
    out = []
    for b, n in enumerate(SEQ_LENS):
        blocks = table[b, :-(-n // kv.shape[2])].long()
        k = kv[0, blocks].reshape(-1, *kv.shape[3:])[:n].double()  # [n, Hkv, D]
        v = kv[1, blocks].reshape(-1, *kv.shape[3:])[:n].double()
        rep = query.shape[1] // kv.shape[3]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        p = torch.softmax(torch.einsum("hd,nhd->hn", query[b].double(), k) * scale, -1)
        out.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(out)


@pytest.fixture(scope="module")
def decode_run(image):
    buffers, calls, cases = {}, [], {}
    Buf = emulator.Buf
    for kind in KINDS:
        for bs, hq, hkv, D in DECODE:
            query, kv, table, seq_lens = _decode_case(bs, hq, hkv, D, kind)
            key = f"dec.{kind}.{bs}.{hq}.{hkv}.{D}"
            out = torch.zeros(query.shape, dtype=query.dtype)
            for name, t in (("q", query), ("kv", kv), ("bt", table), ("sl", seq_lens), ("out", out)):
                buffers[f"{key}.{name}"] = _raw(t)
            scale = D ** -0.5

            def args(out_name: str) -> list:
                return [Buf(key + ".q"), hq * D, Buf(key + ".kv"), Buf(key + ".kv", kv[0].numel() * kv.element_size()),
                        Buf(key + ".bt"), table.shape[1], Buf(key + ".sl"), Buf(out_name), hq * D,
                        len(SEQ_LENS), hq, hkv, D, bs, emulator.F32(scale), 0]
            calls.append((f"tl_paged_decode_{kind}", args(key + ".out")))
            cases[(kind, bs, hq, hkv, D)] = (key + ".out", query, kv, table, scale, len(calls) - 1)
            if kind == "bf16" and D % 16 == 0:  # MKL's AVX2 order: dot products, 8-lane loops
                for mode in (1, 2):
                    buffers[f"{key}.out{mode}"] = _raw(torch.zeros(query.shape, dtype=query.dtype))
                    calls.append(("tl_paged_decode_set_mkl_avx2_order", [mode]))
                    calls.append((f"tl_paged_decode_{kind}", args(f"{key}.out{mode}")))
                    cases[("mkl_avx2", mode, bs, hq, hkv, D)] = (f"{key}.out{mode}", query, kv, table, scale,
                                                                 len(calls) - 1)
                calls.append(("tl_paged_decode_set_mkl_avx2_order", [0]))
    returns, out = image.run(calls, buffers)
    return {c: (_tensor(out[name], q.dtype, q.shape), returns[i], q, kv, t, scale)
            for c, (name, q, kv, t, scale, i) in cases.items()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("bs,hq,hkv,D", DECODE)
def test_paged_decode_avx512(decode_run, kind, bs, hq, hkv, D):
    got, rc, query, kv, table, scale = decode_run[(kind, bs, hq, hkv, D)]
    assert rc == 0
    ref = _decode_reference(query, kv, table, scale)
    err = (got.double() - ref).abs().max().item()
    if kind == "bf16":  # tests/attention/test_cpu_kernels.py's bound: bfloat16 rounding
        assert err < 2 ** -7 * ref.abs().max().item() + 1e-3, err
    else:  # float32 sums (of bf16-exact values for the bf16 cache)
        assert err < 2e-5, err


@pytest.mark.parametrize("bs,hq,hkv,D", [c for c in DECODE if c[3] % 16 == 0])
def test_paged_decode_mkl_avx2_order_dot_products(decode_run, bs, hq, hkv, D):
    """A bfloat16 model's decode in MKL's AVX2 order (a Zen 4's MKL): the AVX512-BF16
    dot-product loops give the 8-lane loops' bits (tests/attention/test_cpu_kernels.py checks
    the same on such a CPU), within bfloat16 rounding of the reference."""
    got, rc, query, kv, table, scale = decode_run[("mkl_avx2", 1, bs, hq, hkv, D)]
    lanes8, rc8, *_ = decode_run[("mkl_avx2", 2, bs, hq, hkv, D)]
    assert rc == 0 and rc8 == 0
    assert torch.equal(got.view(torch.int16), lanes8.view(torch.int16))
    ref = _decode_reference(query, kv, table, scale)
    assert (got.double() - ref).abs().max().item() < 2 ** -7 * ref.abs().max().item() + 1e-3


# ---- the AVX512-BF16 matmul on AMX-packed weights (csrc/bf16_dp_gemm.c)
DP = [(1, 40, 64, 0), (13, 45, 37, 0), (25, 70, 576, 512), (3, 33, 1536, 1024)]


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the weights are packed by the native kernels")
def test_bf16_dot_products_avx512(image):
    """Row counts past one 12-row block, an odd K, partial 32-column blocks, a bias, K chunks:
    every output the definition's bits (test_amx's reference)."""
    buffers, calls, cases = {}, [], []
    Buf = emulator.Buf
    for M, N, K, kchunk in DP:
        g = torch.Generator().manual_seed(M + N + K)
        x = torch.randn(M, K, generator=g).bfloat16()
        w = (torch.randn(N, K, generator=g) * 0.05).bfloat16()
        b = torch.randn(N, generator=g)
        key = f"dp.{M}.{N}.{K}"
        buffers |= {key + ".x": _raw(x), key + ".w": _raw(amx.pack(w).data), key + ".b": _raw(b),
                    key + ".y": bytes(M * N * 2)}
        calls.append(("tl_bf16dp_linear", [Buf(key + ".x"), K, M, Buf(key + ".w"), N, K, Buf(key + ".b"),
                                           Buf(key + ".y"), N, kchunk]))
        cases.append((key, x, w, b, kchunk))
    returns, out = image.run(calls, buffers)
    assert returns == [0] * len(DP)
    for key, x, w, b, kchunk in cases:
        got = _tensor(out[key + ".y"], torch.bfloat16, (x.shape[0], w.shape[0]))
        assert torch.equal(got, _dot_products_reference(x, w, b, kchunk)), key


# ---- gpt-oss's MXFP4 matmul (csrc/mxfp4_gemm.c): its AVX-512 loops, row blocks whole and partial
MXFP4 = [(1, 5, 64), (8, 17, 96), (11, 9, 32)]


def test_mxfp4_avx512(image):
    buffers, calls, cases = {}, [("tl_mxfp4_isa", [])], []
    Buf = emulator.Buf
    for M, N, K in MXFP4:
        blocks, scales = random_mxfp4(N, K, seed=M + N + K)
        g = torch.Generator().manual_seed(K)
        x, bias = torch.randn(M, K, generator=g), torch.randn(N, generator=g)
        key = f"mx.{M}.{N}.{K}"
        buffers |= {key + ".b": _raw(blocks), key + ".s": _raw(scales), key + ".x": _raw(x),
                    key + ".bias": _raw(bias), key + ".y": bytes(4 * M * N)}
        calls.append(("tl_mxfp4_linear", [Buf(key + ".b"), Buf(key + ".s"), N, K, Buf(key + ".x"), K, M,
                                          Buf(key + ".y"), N, Buf(key + ".bias")]))
        cases.append((key, x, blocks, scales, bias))
    blocks, scales = random_mxfp4(64, 64, seed=3, exponents=(0, 256))
    buffers |= {"un.b": _raw(blocks), "un.s": _raw(scales), "un.f32": bytes(64 * 64 * 4), "un.bf16": bytes(64 * 64 * 2)}
    calls += [("tl_mxfp4_unpack", [Buf("un.b"), Buf("un.s"), 64, 64, Buf("un.f32"), 0]),
              ("tl_mxfp4_unpack", [Buf("un.b"), Buf("un.s"), 64, 64, Buf("un.bf16"), 1])]
    returns, out = image.run(calls, buffers)
    assert returns == [2] + [0] * (len(MXFP4) + 2)  # the AVX-512 loops
    for key, x, blocks_, scales_, bias in cases:
        got = _tensor(out[key + ".y"], torch.float32, (x.shape[0], blocks_.shape[0]))
        check_close(got, x, mxfp4.dequantize(blocks_, scales_), bias)
    for dtype, bits, name in ((torch.float32, torch.int32, "un.f32"), (torch.bfloat16, torch.int16, "un.bf16")):
        got, ref = _tensor(out[name], dtype, (64, 64)), mxfp4.dequantize(blocks, scales, dtype)
        nan = ref.isnan()  # (test_mxfp4's comparison)
        assert torch.equal(got.isnan(), nan) and torch.equal(got.view(bits)[~nan], ref.view(bits)[~nan]), dtype
