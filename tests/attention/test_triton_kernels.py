"""Triton kernels and TritonAttentionBackend against the float64 reference and the torch backend.

Without a GPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py
before anything imports triton: triton reads it when it decorates its own library functions). With CUDA available and TRITON_INTERPRET unset or 0 they run natively
(benchmarks/gpu_check.sh does that). Sizes are kept small: the interpreter executes every
program instance in Python.
"""
from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
    os.environ["TRITON_INTERPRET"] = "1"  # conftest.py normally did this already
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"

triton = pytest.importorskip("triton")

# Triton's own library functions were decorated when triton was first imported; if that happened
# before TRITON_INTERPRET was set, interpreted kernels cannot call them. Say so instead of failing
# in every test with "Cannot call @triton.jit'd outside of the scope of a kernel".
if (type(triton.language.standard.max).__name__ == "InterpretedFunction") != INTERPRET:
    pytest.fail(f"triton was imported before TRITON_INTERPRET={int(INTERPRET)} took effect; run "
                "this module on its own or set TRITON_INTERPRET in the environment",
                pytrace=False)

from tokenloom.attention import triton_kernels as tk  # noqa: E402

# Another test module may have imported the kernels first, decorated for the other mode.
if (type(tk._kv_cache_write_kernel).__name__ == "InterpretedFunction") != INTERPRET:
    tk = importlib.reload(tk)

from tokenloom.attention import get_attn_backend  # noqa: E402
from attn_helpers import (  # noqa: E402
    as_fused_qkv_views,
    make_batch,
    poison_outside_window,
    poison_unused_slots,
    reference_attention,
)
from tokenloom.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from tokenloom.attention.triton_backend import TritonAttentionBackend  # noqa: E402

TOL = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 4e-2}
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
MAX_ERR: dict[tuple[str, str], float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_errors():
    yield
    print("\nmax abs error vs float64 reference (kernel, dtype):")
    for (kernel, dtype), err in sorted(MAX_ERR.items()):
        print(f"  {kernel:<10} {dtype:<9} {err:.3e}")


def run(query_lens, seq_lens, mode, hq=4, hkv=2, d=32, block_size=16, dtype=torch.float32,
        seed=0, num_padding_rows=0, fused_qkv=False, sliding_window=None, **backend_kw):
    batch = make_batch(query_lens, seq_lens, hq, hkv, d, block_size, dtype=dtype, seed=seed,
                       device=DEVICE, num_padding_rows=num_padding_rows,
                       sliding_window=sliding_window)
    if fused_qkv:
        as_fused_qkv_views(batch)
    if sliding_window is not None:
        # Blocks behind every window hold NaN: the kernels must skip them. (The torch backend's
        # padded prefill, compared below, reads and masks them: it gets zeros, as the null
        # block holds, in its own copy.)
        poison_outside_window(batch)
    ref, ref_cache = reference_attention(batch)
    T = batch.meta.num_actual_tokens
    backend_kw = {"tile_n": 16, "flash_block_m": 16, "split_partition_len": 16, **backend_kw}
    backend = TritonAttentionBackend(mode=mode, **backend_kw)
    plan = backend.prepare(batch.meta)
    cache = batch.kv_cache.clone()
    out = backend.forward(batch.query, batch.key, batch.value, cache, plan, batch.scale)
    assert out.shape == batch.query.shape and out.dtype == dtype
    # (nan_to_num: the blocks behind a window hold NaN on both sides.)
    assert torch.equal(cache.cpu().nan_to_num(), ref_cache.to(dtype).nan_to_num()), "KV cache write differs"
    if num_padding_rows:
        assert not out[T:].any()
    out = out[:T].cpu().double()
    err = (out - ref).abs().max().item()
    kernel = next(iter(plan.paths.values()))[0]
    MAX_ERR[(kernel, str(dtype).removeprefix("torch."))] = max(
        err, MAX_ERR.get((kernel, str(dtype).removeprefix("torch.")), 0.0))
    assert err < TOL[dtype], f"{kernel} {dtype}: max abs error {err}"

    # Same inputs through the torch backend: the two backends agree within both tolerances.
    torch_backend = TorchAttentionBackend()
    torch_cache = batch.kv_cache.clone()
    if sliding_window is not None:
        torch_cache = torch.nan_to_num(torch_cache, nan=0.0)
    torch_out = torch_backend.forward(batch.query, batch.key, batch.value, torch_cache,
                                      torch_backend.prepare(batch.meta), batch.scale)
    diff = (out - torch_out[:T].cpu().double()).abs().max().item()
    assert diff < 2 * TOL[dtype], f"triton vs torch backend: {diff}"
    return plan


# Lengths crossing block boundaries, ending exactly on one, mid-block, and a single token.
DECODE_SEQ_LENS = [1, 15, 16, 17, 33, 70]


def test_kv_cache_write_skips_negative_slots():
    batch = make_batch([1, 3, 1], [9, 3, 40], 4, 2, 32, 16, device=DEVICE, num_padding_rows=2)
    batch.meta.slot_mapping[1] = -1  # a skipped token inside the batch as well
    _, ref_cache = reference_attention(batch)
    cache = batch.kv_cache.clone()
    tk.kv_cache_write(batch.key, batch.value, cache, batch.meta.slot_mapping, batch.query.shape[0])
    assert torch.equal(cache.cpu(), ref_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["unified", "split_kv"])
def test_decode_only(mode, dtype):
    plan = run([1] * len(DECODE_SEQ_LENS), DECODE_SEQ_LENS, mode, dtype=dtype)
    assert next(iter(plan.paths.values()))[0] == mode


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])  # GQA ratios 1, 3, 8
@pytest.mark.parametrize("mode", ["unified", "split_kv"])
def test_decode_gqa(mode, hq, hkv):
    run([1, 1, 1], [5, 33, 48], mode, hq=hq, hkv=hkv)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["unified", "varlen"])
def test_prefill_only(mode, dtype):
    plan = run([5, 16, 33, 2], [5, 16, 33, 2], mode, dtype=dtype)
    assert next(iter(plan.paths.values()))[0] == mode


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
def test_varlen_gqa(hq, hkv):
    run([7, 20], [7, 20], "varlen", hq=hq, hkv=hkv)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mixed_with_chunked_context(dtype):
    # decodes, a fresh prefill, and prefill chunks whose context is already cached
    run([1, 9, 1, 12, 5, 1], [40, 9, 17, 44, 37, 1], "unified", dtype=dtype, num_padding_rows=2)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 1)])
@pytest.mark.parametrize("block_size", [16, 32])
def test_unified_gqa_block_sizes(block_size, hq, hkv):
    run([1, 6, 1, 10], [31, 6, 33, 45], "unified", hq=hq, hkv=hkv, block_size=block_size)


@pytest.mark.parametrize("mode", ["unified", "split_kv", "varlen"])
def test_strided_qkv_views(mode):
    q_lens, seq_lens = {"unified": ([1, 5, 1], [9, 12, 33]), "split_kv": ([1, 1], [9, 33]),
                        "varlen": ([5, 7], [5, 7])}[mode]
    run(q_lens, seq_lens, mode, hq=6, hkv=2, fused_qkv=True, num_padding_rows=1)


@pytest.mark.parametrize("d", [64, 80, 128])
def test_head_dims(d):
    run([1, 5, 1], [20, 26, 33], "unified", hq=3, hkv=1, d=d)
    run([1, 1], [20, 33], "split_kv", hq=3, hkv=1, d=d)
    run([6, 9], [6, 9], "varlen", hq=3, hkv=1, d=d)


def test_auto_path_selection():
    # prefill-only without context -> varlen; mixed -> unified; long few decodes -> split_kv
    assert next(iter(run([4, 6], [4, 6], "auto").paths.values()))[0] == "varlen"
    assert next(iter(run([1, 6], [9, 6], "auto").paths.values()))[0] == "unified"
    assert next(iter(run([1, 1], [30, 70], "auto", split_min_seq_len=64).paths.values()))[0] \
        == "split_kv"
    assert next(iter(run([1, 1], [30, 70], "auto", split_partition_len=512).paths.values()))[0] \
        == "unified"


def test_plan_shared_by_layers():
    batch = make_batch([1, 7, 1], [20, 7, 35], 4, 2, 32, 16, device=DEVICE)
    ref, _ = reference_attention(batch)
    backend = TritonAttentionBackend(tile_n=16)
    plan = backend.prepare(batch.meta)
    for _ in range(2):
        out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), plan,
                              batch.scale)
        assert (out.cpu().double() - ref).abs().max() < TOL[torch.float32]


@pytest.mark.parametrize("mode", ["unified", "split_kv", "varlen"])
def test_never_reads_outside_context(mode):
    # Slots no request owns (block tails past seq_len, stale block-table columns) hold NaN.
    prefill = mode == "varlen"
    q_lens, seq_lens = ([5, 18], [5, 18]) if prefill else ([1, 1, 1], [3, 17, 40])
    if mode == "unified":
        q_lens, seq_lens = [1, 6, 1], [3, 20, 40]
    batch = make_batch(q_lens, seq_lens, 4, 2, 32, 16, device=DEVICE)
    poison_unused_slots(batch)
    backend = TritonAttentionBackend(mode=mode, tile_n=16, flash_block_m=16,
                                     split_partition_len=16)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache,
                          backend.prepare(batch.meta), batch.scale)
    assert torch.isfinite(out).all()


# Sliding window of 20 with blocks of 8 and tiles of 16: windows that start mid-tile and
# mid-block, contexts shorter and longer than the window.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode,q_lens,seq_lens", [
    ("unified", [1, 1, 9, 30, 5, 1], [12, 60, 9, 30, 47, 21]),
    ("split_kv", [1, 1, 1, 1], [5, 20, 21, 90]),
    ("varlen", [45, 7, 33], [45, 7, 33]),
])
def test_sliding_window(mode, q_lens, seq_lens, dtype):
    plan = run(q_lens, seq_lens, mode, dtype=dtype, block_size=8, sliding_window=20,
               split_min_seq_len=16)
    assert plan.sliding_window == 20


def test_selector_triton():
    assert get_attn_backend("triton", DEVICE).name == "triton"
