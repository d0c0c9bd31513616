"""The C decode kernel (ops/csrc/paged_decode.c) against the float64 reference, and how it is
built, cached and switched off. Skipped only where no C compiler exists; where one exists, a
kernel that fails to build fails these tests."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenloom.ops import cpu_kernels
from attn_helpers import (as_fused_qkv_views, make_batch, poison_outside_window,
                          poison_unused_slots, reference_attention)
from tokenloom.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.skipif(cpu_kernels._compiler() is None, reason="no C compiler here")

FP32_TOL = 2e-5


def run_backend(batch, use_cpu_kernel=True, layers=2):
    backend = TorchAttentionBackend(use_cpu_kernel=use_cpu_kernel)
    plan = backend.prepare(batch.meta)
    if use_cpu_kernel and batch.query.dtype == torch.float32:
        assert plan.decode is None or plan.decode.block_table_i32 is not None, "kernel not planned"
    outs = []
    for _ in range(layers):  # layers share the plan
        cache = batch.kv_cache.clone()
        outs.append(backend.forward(batch.query, batch.key, batch.value, cache, plan, batch.scale))
    return outs


def test_kernel_builds_here():
    assert os.environ.get("TOKENLOOM_CPU_KERNELS", "1") != "0"
    assert cpu_kernels.load() is not None


@pytest.mark.parametrize("slow", [0, 1])
def test_a_slow_threads_items_are_taken_over_once_each(slow):
    """The kernels' items (decode attention's, the quantized tiles' panels) start split into a
    contiguous run per thread; a thread done with its run takes items from the back of a slower
    one's (csrc/work_steal.h). With one thread slowed, every item is still taken exactly once, and
    with two threads some are taken over."""
    import ctypes

    lib = cpu_kernels.load()
    fn = lib.tl_work_steal_check
    fn.restype, fn.argtypes = ctypes.c_int64, [ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the kernels' OpenMP runtime is torch's
    try:
        for items in (1, 2, 7, 1000):
            counts = torch.zeros(items, dtype=torch.int32)
            stolen = fn(items, slow, counts.data_ptr())
            assert counts.eq(1).all(), (items, counts.tolist()[:20])
            if items == 1000 and len(os.sched_getaffinity(0)) >= 2:
                assert stolen > 0
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("block_size", [16, 32])
# GQA ratios 1, 3, 8, and more query heads than one work item takes (16): 32/8, 20/4.
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (16, 2), (32, 8), (20, 4)])
@pytest.mark.parametrize("head_dim", [64, 128, 80, 36])  # specialized, generic, not a multiple of 8
def test_decode_matches_reference(block_size, hq, hkv, head_dim):
    # Lengths crossing block boundaries, ending on one, mid-block, a single token, a long one.
    seq_lens = [1, 7, 15, 16, 17, 31, 32, 33, 64, 100, 257]
    batch = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, head_dim, block_size, seed=head_dim)
    poison_unused_slots(batch)  # reading past seq_lens or a stale block id gives NaN
    ref, _ = reference_attention(batch)
    for out in run_backend(batch):
        err = (out.double() - ref).abs().max().item()
        assert err < FP32_TOL, err


@pytest.mark.parametrize("hq,hkv", [(9, 3), (32, 8), (1, 1)])
def test_single_sequence_splits_its_heads(hq, hkv):
    """One decode: the kernel splits the heads into several work items so both threads work."""
    batch = make_batch([1], [300], hq, hkv, 64, 16, seed=hq)
    poison_unused_slots(batch)
    ref, _ = reference_attention(batch)
    [out] = run_backend(batch, layers=1)
    assert (out.double() - ref).abs().max().item() < FP32_TOL


def test_decode_matches_pytorch_path_in_mixed_batch():
    """Decodes between prefill chunks (token rows not contiguous: the index path), strided q/k/v
    views of a fused projection, and padding rows after the real tokens."""
    batch = make_batch([3, 1, 20, 1, 1], [40, 18, 20, 33, 1], 9, 3, 64, 16, seed=5,
                       num_padding_rows=3)
    as_fused_qkv_views(batch)
    ref, _ = reference_attention(batch)
    T = batch.meta.num_actual_tokens
    [fast] = run_backend(batch, layers=1)
    [slow] = run_backend(batch, use_cpu_kernel=False, layers=1)
    assert (fast[:T].double() - ref).abs().max().item() < FP32_TOL
    assert (fast[:T] - slow[:T]).abs().max().item() < FP32_TOL
    assert not fast[T:].any()


@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (32, 8, 128), (4, 4, 36)])
def test_decode_bf16_queries_and_cache(hq, hkv, head_dim):
    """A bfloat16 model: bfloat16 queries, cache and output, through the kernel (not the gather
    path), within bfloat16 rounding of the float64 reference on the same bf16 inputs."""
    seq_lens = [1, 15, 17, 64, 257]
    batch = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, head_dim, 16, seed=head_dim)
    batch.query, batch.key, batch.value = (t.bfloat16() for t in (batch.query, batch.key,
                                                                 batch.value))
    batch.kv_cache = batch.kv_cache.bfloat16()
    ref, _ = reference_attention(batch)
    backend = TorchAttentionBackend()
    plan = backend.prepare(batch.meta)
    assert plan.decode.block_table_i32 is not None, "kernel not planned"
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), plan,
                          batch.scale)
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs().max().item()
    assert err < 2 ** -7 * ref.abs().max().item() + 1e-3, err


def test_bf16_decode_is_transformers_sdpa_bit_for_bit():
    """A bfloat16 model's decode attention is, bit for bit, what transformers in bfloat16 gets
    from torch's SDPA (4-D bfloat16, one query, enable_gqa): the kernel follows its flash
    kernel's softmax (fexp_u20, its sums, bfloat16 probabilities) and the order of MKL's bf16
    gemm sums (csrc/paged_decode_chunk.inc), so greedy decoding follows transformers
    (tests/entrypoints/test_llm.py). Contexts within one 512-key split and across three, head
    sizes 64 and 128. MKL's order was read on CPUs with AVX512-BF16 and on AVX2-only ones, and
    the softmax follows torch's vector width: on other machines the two agree to rounding only
    (test_decode_bf16_queries_and_cache)."""
    lib = cpu_kernels.load()
    if not cpu_kernels.bf16_decode_follows_torch():
        pytest.skip("MKL's bf16 order is known for AVX512-BF16 and AVX2-only CPUs, with torch at "
                    "the kernel's width")
    hq, hkv, bs = 9, 3, 16
    g = torch.Generator().manual_seed(15)
    # Scores times 2, and times 8 (a sharp softmax, where a score's last bit reaches the output:
    # summing the AVX2 build's four partial sums in another order fails only there).
    for d, lens, sharp in ((64, [5, 17, 40, 121], 2), (64, [300, 513, 1100, 64], 2),
                           (64, [7, 100, 700, 1000], 8), (128, [1, 33, 900, 1100], 8)):
        b = len(lens)
        q = (torch.randn(b, hq, d, generator=g) * sharp).bfloat16()
        k = [(torch.randn(1, hkv, n, d, generator=g) * 2).bfloat16() for n in lens]
        v = [torch.randn(1, hkv, n, d, generator=g).bfloat16() for n in lens]
        nblk = [(n + bs - 1) // bs for n in lens]
        cache = torch.zeros(2, sum(nblk), bs, hkv, d, dtype=torch.bfloat16)
        table = torch.zeros(b, max(nblk), dtype=torch.int32)
        perm, at = torch.randperm(sum(nblk), generator=g), 0
        for i, n in enumerate(lens):
            blocks = perm[at:at + nblk[i]]
            at += nblk[i]
            table[i, :nblk[i]] = blocks.int()
            for kv, src in ((0, k[i]), (1, v[i])):
                rows = torch.zeros(nblk[i] * bs, hkv, d, dtype=torch.bfloat16)
                rows[:n] = src[0].transpose(0, 1)
                cache[kv, blocks] = rows.view(nblk[i], bs, hkv, d)
        out = torch.empty(b, hq, d, dtype=torch.bfloat16)
        cpu_kernels.paged_decode(lib, q, cache, table, torch.tensor(lens, dtype=torch.int32), out,
                                 d ** -0.5)
        for i in range(b):
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[i][None, :, None], k[i], v[i], scale=d ** -0.5, enable_gqa=True)[0, :, 0]
            assert torch.equal(out[i].view(torch.int16), ref.view(torch.int16)), (lens[i], i)


def _dp_built(lib) -> bool:
    return bool(getattr(lib, "tl_paged_decode_dp_built", lambda: 0)())


@pytest.mark.parametrize("hq,hkv,head_dim,bs", [(9, 3, 64, 16), (8, 4, 128, 16), (4, 4, 48, 8),
                                                (12, 2, 64, 32)])
@pytest.mark.parametrize("window", [0, 37])
def test_bf16_decode_dot_products_are_the_8_lane_sums(hq, hkv, head_dim, bs, window):
    """MKL's AVX2 order (a Zen 4's MKL) has two implementations in the AVX-512 build: AVX512-BF16
    dot products, two terms of a sum each, which the engine runs, and the 8-lane FMA loops, one
    term each. They add the same terms in the same order, so their outputs are the same bits:
    on contexts of every residue mod 4 and 8 (a last group of 1-3 rows), across the 512-key
    splits, for one, two and three query heads per KV head (9/3, 8/4, 4/4, 12/2 in groups of
    3), a head size with a 16-column tail (48), and a sliding window, whose first block starts
    mid-block. Runs on any CPU whose build has AVX512-BF16, whatever order MKL takes there."""
    lib = cpu_kernels.load()
    if not _dp_built(lib):
        pytest.skip("no AVX512-BF16 in this build")
    g = torch.Generator().manual_seed(hq * 100 + head_dim + window)
    lens = [1, 2, 3, 5, 8, 13, 30, 64, 127, 300, 513, 1100]
    nblk = [(n + bs - 1) // bs for n in lens]
    cache = (torch.randn(2, sum(nblk) + 2, bs, hkv, head_dim, generator=g) * 2).bfloat16()
    perm = torch.randperm(sum(nblk) + 2, generator=g).int()
    table = torch.zeros(len(lens), max(nblk), dtype=torch.int32)
    at = 0
    for i, n in enumerate(nblk):
        table[i, :n] = perm[at:at + n]
        at += n
    q = (torch.randn(len(lens), hq, head_dim, generator=g) * 4).bfloat16()
    sl = torch.tensor(lens, dtype=torch.int32)
    outs = []
    try:
        for mode in (1, 2):
            lib.tl_paged_decode_set_mkl_avx2_order(mode)
            out = torch.empty_like(q)
            cpu_kernels.paged_decode(lib, q, cache, table, sl, out, head_dim ** -0.5, window or None)
            outs.append(out)
    finally:
        cpu_kernels._follow_mkl_order(lib)
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))


@pytest.mark.parametrize("head_dim", [64, 128, 36])
def test_bfloat16_cache_under_float32_queries(head_dim, monkeypatch):
    """kv_cache_dtype=bfloat16 with a float32 model: the kernel widens the cached K/V as it reads
    them (the reference reads the same rounded values), and mixed with prefills the SDPA paths
    cast them the same way."""
    calls = []
    real = cpu_kernels.paged_decode
    monkeypatch.setattr(cpu_kernels, "paged_decode",
                        lambda *a, **k: (calls.append(a[2].dtype), real(*a, **k))[1])
    seq_lens = [1, 7, 16, 17, 33, 100, 257]
    batch = make_batch([1] * len(seq_lens), seq_lens, 9, 3, head_dim, 16, seed=7)
    batch.kv_cache = batch.kv_cache.to(torch.bfloat16)
    poison_unused_slots(batch)
    ref, _ = reference_attention(batch)
    outs = run_backend(batch)
    assert calls == [torch.bfloat16] * 2  # the kernel read the bfloat16 cache, both layers
    for out in outs:
        assert out.dtype == torch.float32
        assert (out.double() - ref).abs().max().item() < FP32_TOL
    # Prefill rows attend to this step's K/V as computed (float32, as vLLM does), the reference
    # to the rounded cache: those agree to bfloat16 precision; the decode rows (3 and 24) and
    # the kernel against the SDPA path agree to float32's.
    mixed = make_batch([3, 1, 20, 1], [40, 18, 20, 33], 9, 3, head_dim, 16, seed=8)
    mixed.kv_cache = mixed.kv_cache.to(torch.bfloat16)
    ref, _ = reference_attention(mixed)
    [fast] = run_backend(mixed, layers=1)
    [slow] = run_backend(mixed, use_cpu_kernel=False, layers=1)
    decode_rows = [3, 24]
    assert (fast - slow).abs().max().item() < FP32_TOL
    assert (fast[decode_rows].double() - ref[decode_rows]).abs().max().item() < FP32_TOL
    assert (fast.double() - ref).abs().max().item() < 3e-2


@pytest.mark.parametrize("window,block_size", [(512, 16), (10, 4), (16, 16), (17, 16)])
@pytest.mark.parametrize("hq,hkv,head_dim", [(4, 1, 256), (9, 3, 64), (4, 4, 36)])
def test_decode_sliding_window(window, block_size, hq, hkv, head_dim):
    """The kernel reads only the window: the blocks behind it hold NaN (as a freed block would be
    the null block), and the result is the windowed reference. Gemma 3's shape (4/1 heads,
    head_dim 256, window 512) and windows that start mid-block and on a block boundary."""
    seq_lens = [1, window - 1, window, window + 1, window + block_size, 3 * window + 5, 600]
    batch = make_batch([1] * len(seq_lens), seq_lens, hq, hkv, head_dim, block_size,
                       seed=window, sliding_window=window)
    poison_unused_slots(batch)
    poison_outside_window(batch)
    ref, _ = reference_attention(batch)
    for out in run_backend(batch):
        assert (out.double() - ref).abs().max().item() < FP32_TOL


def test_half_dtypes_keep_the_pytorch_path():
    batch = make_batch([1, 1], [17, 40], 9, 3, 64, 16, dtype=torch.bfloat16)
    ref, _ = reference_attention(batch)
    [out] = run_backend(batch, layers=1)
    assert (out.double() - ref).abs().max().item() < 5e-2


def _python(code: str, **env: str) -> str:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, check=True,
                          capture_output=True, text=True, timeout=120).stdout.strip()


@pytest.mark.slow
def test_switched_off_by_env_and_cached_build(tmp_path):
    code = ("from tokenloom.ops import cpu_kernels; lib = cpu_kernels.load(); "
            "print(lib is None or lib._name)")
    assert _python(code, TOKENLOOM_CPU_KERNELS="0", TOKENLOOM_CACHE_DIR=str(tmp_path)) == "True"
    assert not (tmp_path / "kernels").exists()
    # A build prunes builds of other sources older than a week, and only those (one compile
    # serves both checks: the cache starts with a stale and a recent build of other sources).
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    stale, recent = kernels / "tokenloom_cpu-0000.so", kernels / "paged_decode-1111.so"
    stale.write_bytes(b""), recent.write_bytes(b"")
    os.utime(stale, (0, 0))
    first = _python(code, TOKENLOOM_CACHE_DIR=str(tmp_path))
    assert first.startswith(str(kernels))
    assert not stale.exists() and recent.exists()
    assert sorted(p.name for p in kernels.iterdir()) == sorted([Path(first).name, recent.name])  # no leftovers
    mtime = os.stat(first).st_mtime_ns
    assert _python(code, TOKENLOOM_CACHE_DIR=str(tmp_path)) == first  # the build is reused
    assert os.stat(first).st_mtime_ns == mtime


def test_loading_does_not_flush_denormals():
    """-ffast-math code in a shared library can switch the whole process to flush-to-zero when
    it is loaded (gcc's crtfastmath.o); the kernel is linked without it."""
    code = ("import torch; from tokenloom.ops import cpu_kernels; assert cpu_kernels.load(); "
            "x = torch.tensor([1e-39], dtype=torch.float32); print(float((x * 1.5)[0]) > 0)")
    assert _python(code) == "True"


def _windowed_reference(batch, window: int) -> torch.Tensor:
    """float64 decode attention of each sequence's last position p = seq_len - 1 over the keys
    p - window < j <= p, read through the block table."""
    cache = batch.kv_cache.double()
    _, _, bs, hkv, _ = cache.shape
    q = batch.query.double()
    G = q.shape[1] // hkv
    out = torch.empty_like(q)
    bt = batch.meta.block_table.long()
    for i, L in enumerate(batch.meta.seq_lens.tolist()):
        pos = torch.arange(max(0, L - window), L)
        k = cache[0, bt[i, pos // bs], pos % bs]  # [S, Hkv, D]
        v = cache[1, bt[i, pos // bs], pos % bs]
        for h in range(q.shape[1]):
            p = torch.softmax(k[:, h // G] @ q[i, h] * batch.scale, dim=0)
            out[i, h] = p @ v[:, h // G]
    return out


@pytest.mark.parametrize("dtype,kv_dtype", [(torch.float32, torch.float32),
                                            (torch.float32, torch.bfloat16),
                                            (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("hq,hkv,head_dim", [(9, 3, 64), (4, 1, 256), (8, 2, 36)])
def test_sliding_window(dtype, kv_dtype, hq, hkv, head_dim):
    """A sliding-window layer (Gemma 3): keys before p - window + 1 are left out, and blocks
    wholly before the window are never read (here their table entries name a block of NaN).
    One sequence alone (its context split between the threads) and a batch."""
    lib = cpu_kernels.load()
    seq_lens = [1, 15, 16, 17, 40, 100, 257]
    for lens in ([257], seq_lens):
        batch = make_batch([1] * len(lens), lens, hq, hkv, head_dim, 16, seed=head_dim,
                           extra_blocks=1)
        batch.query = batch.query.to(dtype)
        batch.kv_cache = batch.kv_cache.to(kv_dtype)
        poison_unused_slots(batch)  # the spare block is all NaN
        nan_block = int((batch.kv_cache[0].view(batch.kv_cache.shape[1], -1).isnan().all(1))
                        .nonzero()[0])
        table = batch.meta.block_table
        for window in (1, 5, 16, 17, 40, 1000, 0):
            bt = table.clone()
            for i, L in enumerate(lens):
                if window > 0:
                    bt[i, :max(0, L - window) // 16] = nan_block
            batch.meta.block_table = bt
            out = torch.empty_like(batch.query)
            cpu_kernels.paged_decode(lib, batch.query, batch.kv_cache, bt, batch.meta.seq_lens,
                                     out, batch.scale, sliding_window=window)
            ref = _windowed_reference(batch, window if window > 0 else 10 ** 9)
            tol = FP32_TOL if dtype == torch.float32 else 2 ** -7 * ref.abs().max().item() + 1e-3
            err = (out.double() - ref).abs().max().item()
            assert err < tol, (lens, window, err)
