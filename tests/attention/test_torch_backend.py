"""TorchAttentionBackend against a dense float64 reference (tests/attention/attn_helpers.py)."""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenloom.attention import get_attn_backend
from attn_helpers import as_fused_qkv_views, make_batch, poison_outside_window, reference_attention
from tokenloom.attention.torch_backend import TorchAttentionBackend

TOL = {torch.float32: 2e-5, torch.bfloat16: 5e-2, torch.float16: 5e-3}
MODES = ["auto", "padded", "per_request"]


def check(query_lens, seq_lens, hq=6, hkv=2, d=32, block_size=16, dtype=torch.float32,
          mode="auto", seed=0, num_padding_rows=0, layers=2, fused_qkv=False):
    batch = make_batch(query_lens, seq_lens, hq, hkv, d, block_size, dtype=dtype, seed=seed,
                       num_padding_rows=num_padding_rows)
    if fused_qkv:
        as_fused_qkv_views(batch)
    ref, ref_cache = reference_attention(batch)
    backend = TorchAttentionBackend(prefill_mode=mode)
    plan = backend.prepare(batch.meta)
    # Several "layers" share one plan (and the decode buffer); each must be independent.
    for _ in range(layers):
        cache = batch.kv_cache.clone()
        out = backend.forward(batch.query, batch.key, batch.value, cache, plan, batch.scale)
        T = batch.meta.num_actual_tokens
        assert out.shape == batch.query.shape and out.dtype == dtype
        err = (out[:T].double() - ref).abs().max().item()
        assert err < TOL[dtype], f"max abs error {err}"
        assert torch.equal(cache, ref_cache.to(cache.dtype)), "KV cache write differs"
        if num_padding_rows:
            assert not out[T:].any()
    return err


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (16, 2)])  # GQA ratios 1, 3, 8
def test_decode_only(block_size, hq, hkv):
    # Lengths crossing block boundaries, ending exactly on one, mid-block, and a single token.
    seq_lens = [1, 15, 16, 17, 31, 32, 33, 64, 100]
    check([1] * len(seq_lens), seq_lens, hq=hq, hkv=hkv, block_size=block_size)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_prefill_only(mode, block_size):
    check([5, 16, 33, 2], [5, 16, 33, 2], block_size=block_size, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_prefill_uniform(mode):
    check([24] * 4, [24] * 4, hq=9, hkv=3, mode=mode)


@pytest.mark.parametrize("mode", MODES)
def test_chunked_prefill_with_context(mode):
    # Later chunks of long prompts: the query sits at the end of a context already cached.
    check([16, 7, 32], [48, 40, 33], block_size=16, mode=mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3), (16, 2)])
def test_mixed(mode, hq, hkv):
    check([1, 9, 1, 20, 1, 3], [40, 9, 17, 52, 1, 35], hq=hq, hkv=hkv, mode=mode)


def test_decodes_not_first():
    # Decode tokens interleaved with prefills: non-contiguous token index paths.
    check([3, 1, 6, 1, 1], [10, 20, 6, 1, 70], mode="padded")


@pytest.mark.parametrize("mode", MODES)
def test_strided_qkv_views(mode):
    check([1, 5, 1, 5], [9, 5, 33, 12], hq=9, hkv=3, mode=mode, fused_qkv=True)


def test_padding_rows():
    check([1, 5, 1], [9, 12, 33], num_padding_rows=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_dtypes(dtype):
    check([1, 7, 1, 12], [30, 7, 70, 40], dtype=dtype, hq=9, hkv=3, d=64)


@pytest.mark.parametrize("d", [64, 80, 128])
def test_head_dims(d):
    check([1, 6, 1], [20, 26, 49], hq=9, hkv=3, d=d)


def test_selector():
    assert get_attn_backend("auto", "cpu").name == "torch"
    assert get_attn_backend("torch").name == "torch"
    with pytest.raises(ValueError):
        get_attn_backend("nope")


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    query_lens, seq_lens = [], []
    for _ in range(n):
        kind = draw(st.sampled_from(["decode", "prefill", "chunk"]))
        if kind == "decode":
            q, s = 1, draw(st.integers(1, 80))
        elif kind == "prefill":
            q = draw(st.integers(2, 40))
            s = q
        else:
            q = draw(st.integers(2, 30))
            s = q + draw(st.integers(1, 50))
        query_lens.append(q)
        seq_lens.append(s)
    hkv = draw(st.sampled_from([1, 2, 3]))
    group = draw(st.sampled_from([1, 3, 8]))
    return dict(query_lens=query_lens, seq_lens=seq_lens, hq=hkv * group, hkv=hkv,
                block_size=draw(st.sampled_from([16, 32])), mode=draw(st.sampled_from(MODES)),
                seed=draw(st.integers(0, 1000)), num_padding_rows=draw(st.integers(0, 2)))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches())
def test_random_batches(kw):
    check(d=16, layers=1, **kw)


# ------------------------------------------------------------------------- sliding window
# A batch of every kind around a window of 10 with blocks of 4: decodes whose context is shorter
# than, equal to and longer than the window, a fresh prefill longer than the window, and chunks
# whose context reaches back past it.
WINDOW_Q_LENS = [1, 1, 1, 1, 23, 6, 12, 1]
WINDOW_SEQ_LENS = [7, 10, 11, 45, 23, 30, 40, 2]


def check_window(mode, use_cpu_kernel, dtype=torch.float32, block_size=4, window=10,
                 poison=float("nan"), **kw):
    batch = make_batch(WINDOW_Q_LENS, WINDOW_SEQ_LENS, 6, 2, 32, block_size, dtype=dtype,
                       sliding_window=window, **kw)
    # The blocks wholly behind every window hold NaN where they are never read.
    assert poison_outside_window(batch, poison) > 0
    ref, _ = reference_attention(batch)
    backend = TorchAttentionBackend(prefill_mode=mode, use_cpu_kernel=use_cpu_kernel)
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(),
                          backend.prepare(batch.meta), batch.scale)
    err = (out[:batch.meta.num_actual_tokens].double() - ref).abs().max().item()
    assert err < TOL[dtype], f"max abs error {err}"


@pytest.mark.parametrize("use_cpu_kernel", [True, False])
def test_sliding_window_never_reads_behind_the_window(use_cpu_kernel):
    """Decodes and per-request prefills read only their window's blocks (a freed block behind it
    may be the null block)."""
    check_window("per_request", use_cpu_kernel)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sliding_window_padded_prefill_masks(dtype):
    """The padded prefill reads the whole context and masks what lies behind each window (the
    null block's content is zeros; any finite value must not matter)."""
    check_window("padded", True, dtype=dtype, poison=1e4)


def test_window_longer_than_every_context_is_full_attention():
    batch = make_batch([1, 5], [9, 12], 4, 2, 32, 4, sliding_window=64)
    ref, _ = reference_attention(batch)
    backend = TorchAttentionBackend()
    plan = backend.prepare(batch.meta)
    assert plan.decode.sliding_window is None  # planned as full attention: nothing to pay
    out = backend.forward(batch.query, batch.key, batch.value, batch.kv_cache.clone(), plan, batch.scale)
    assert (out[:6].double() - ref).abs().max() < TOL[torch.float32]


@pytest.mark.parametrize("mode", MODES)
def test_prefill_in_a_bfloat16_caches_dtype(mode):
    """Float32 queries over a bfloat16 cache (the quantized CPU path's default): with
    `prefill_in_cache_dtype` the prefill rows are attended in bfloat16 (within bfloat16's error
    of the float64 reference, and not the float32 result), the decode rows as before (the C
    kernel, float32 queries), and the cache holds the same rounded K/V either way."""
    batch = make_batch([1, 9, 1, 20, 6], [40, 9, 17, 20, 30], 9, 3, 64, 16, seed=3)
    ref, ref_cache = reference_attention(batch)
    T = batch.meta.num_actual_tokens
    outs, caches = [], []
    for flag in (False, True):
        backend = TorchAttentionBackend(prefill_mode=mode)
        backend.prefill_in_cache_dtype = flag
        cache = batch.kv_cache.to(torch.bfloat16)
        out = backend.forward(batch.query, batch.key, batch.value, cache,
                              backend.prepare(batch.meta), batch.scale)
        assert out.dtype == torch.float32
        assert (out[:T].double() - ref).abs().max().item() < TOL[torch.bfloat16]
        outs.append(out[:T])
        caches.append(cache)
    assert torch.equal(caches[0], caches[1]) and torch.equal(caches[0], ref_cache.to(torch.bfloat16))
    decode_rows = torch.tensor([0, 10])  # the two decodes' rows (query lengths 1, 9, 1, ...)
    prefill_rows = torch.tensor([i for i in range(T) if i not in (0, 10)])
    assert torch.equal(outs[0][decode_rows], outs[1][decode_rows])
    assert not torch.equal(outs[0][prefill_rows], outs[1][prefill_rows])


def test_bfloat16_prefill_does_not_depend_on_the_neighbours():
    """With `prefill_in_cache_dtype`, prompts of different lengths are attended one request per
    call ("auto" gives exactly "per_request"'s bits): a padded bfloat16 call sums a request's
    rows in chunks that depend on the longest neighbour, so its reply could change with the batch."""
    # lengths close enough that float32 prefills would be padded into one call
    batch = make_batch([40, 50, 45, 60], [40, 50, 45, 60], 9, 3, 64, 16, seed=5)
    outs = {}
    for mode in ("auto", "per_request", "padded"):
        backend = TorchAttentionBackend(prefill_mode=mode)
        backend.prefill_in_cache_dtype = True
        cache = batch.kv_cache.to(torch.bfloat16)
        outs[mode] = backend.forward(batch.query, batch.key, batch.value, cache,
                                     backend.prepare(batch.meta), batch.scale)
    assert torch.equal(outs["auto"], outs["per_request"])
    assert not torch.equal(outs["padded"], outs["per_request"])  # what "auto" must not do


def test_bfloat16_prefill_batches_the_prompts_of_one_length():
    """Under `prefill_in_cache_dtype`, the largest group of this step's prompts that share a length
    and have no context is attended in one call (it pads nothing: bit-identical to one call
    each), the others one by one, as a step that admits whole prompts beside a chunked one has."""
    # three prompts of 48 tokens, one of 64, a chunk of 32 after 32 cached tokens, one of 48 with
    # context (a later chunk: not in the group)
    batch = make_batch([48, 64, 48, 32, 48, 48], [48, 64, 48, 64, 48, 80], 9, 3, 64, 16, seed=7)
    outs = {}
    for mode in ("auto", "per_request"):
        backend = TorchAttentionBackend(prefill_mode=mode)
        backend.prefill_in_cache_dtype = True
        plan = backend.prepare(batch.meta)
        if mode == "auto":
            assert plan.padded_prefill is not None and plan.padded_prefill.num_prefills == 3
            assert [(rp.start, rp.end) for rp in plan.request_prefills] == [(48, 112), (160, 192), (240, 288)]
        cache = batch.kv_cache.to(torch.bfloat16)
        outs[mode] = backend.forward(batch.query, batch.key, batch.value, cache, plan, batch.scale)
    assert torch.equal(outs["auto"], outs["per_request"])


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_attention_sinks_are_transformers(kv_heads):
    """gpt-oss's sinks (a logit per query head in each softmax's denominator), causal and
    under a window, as transformers' GptOss eager attention computes them (float32)."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    from tokenloom.attention.torch_backend import _sdpa

    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, 9, 16, generator=g)
    k, v = torch.randn(2, kv_heads, 9, 16, generator=g), torch.randn(2, kv_heads, 9, 16, generator=g)
    sinks = 2 * torch.randn(4, generator=g)
    module = SimpleNamespace(num_key_value_groups=4 // kv_heads, sinks=sinks, training=False)
    causal = torch.ones(9, 9, dtype=torch.bool).tril()
    for keep in (None, causal & ~causal.tril(-4)):  # causal from 0, and a window of 4
        additive = torch.zeros(9, 9).masked_fill(~(causal if keep is None else keep), float("-inf"))
        ref, _ = eager_attention_forward(module, q, k, v, additive, scaling=0.25)
        torch.testing.assert_close(_sdpa(q, k, v, keep, 0.25, sinks=sinks).transpose(1, 2), ref)
