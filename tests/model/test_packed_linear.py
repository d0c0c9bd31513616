"""oneDNN-packed linear weights (model/packed_linear.py), the CPU fast path (float32, and bfloat16
where the CPU multiplies it natively)."""
from __future__ import annotations

import pytest
import torch

from tokenloom.model import packed_linear
from tokenloom.model.llama import Linear
from tokenloom.model.packed_linear import (pack_linear_weights, packed_linear_available,
                                           release_plain_weights)
from tokenloom.ops import cpu_features

pytestmark = pytest.mark.skipif(not packed_linear_available(torch.float32),
                                reason="this torch build has no oneDNN packed linear")


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_packed_linear_matches_f_linear(rows, bias):
    torch.manual_seed(0)
    layer = Linear(96, 160, bias=bias)
    layer.weight.data.normal_()
    if bias:
        layer.bias.data.normal_()
    x = torch.randn(rows, 96)
    expected = torch.nn.functional.linear(x, layer.weight, layer.bias)
    assert pack_linear_weights(layer) == 1 and layer.packed_weight is not None
    got = layer(x)
    assert got.shape == expected.shape and got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    # Strided input (a column slice, as a fused projection hands over) is made contiguous.
    wide = torch.randn(rows, 200)
    torch.testing.assert_close(layer(wide[:, 10:106]),
                               torch.nn.functional.linear(wide[:, 10:106], layer.weight, layer.bias),
                               rtol=1e-5, atol=1e-4)


def _tiny_model(tied: bool, **shape):
    from tokenloom.model.config import ModelArchConfig
    from tokenloom.model.llama import LlamaForCausalLM

    arch = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=96, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=300) | shape
    cfg = ModelArchConfig(architecture="llama", rms_norm_eps=1e-5, rope_theta=10000.0,
                          max_position_embeddings=128, tie_word_embeddings=tied, **arch)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_logits_and_dtype_change(tied):
    model = _tiny_model(tied)
    hidden = torch.randn(5, 64)
    expected = model.compute_logits(hidden)
    mlp_in = torch.randn(3, 64)
    expected_mlp = model.layers[0].mlp(mlp_in)
    # 2 layers x (qkv, o, gate_up, down); an untied lm_head is packed once, as packed_lm_head.
    assert pack_linear_weights(model) == 8
    assert model.packed_lm_head is not None
    if not tied:
        assert model.lm_head.packed_weight is None
    torch.testing.assert_close(model.compute_logits(hidden), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model.layers[0].mlp(mlp_in), expected_mlp, rtol=1e-5, atol=1e-5)
    # Packed copies belong to their dtype: a model converted after packing computes with its
    # (converted) plain weights, not the stale float32 copies; bf16 is packed only where the CPU
    # multiplies bf16 natively.
    model.to(torch.bfloat16)
    plain = torch.nn.functional.linear(hidden.bfloat16(), model.lm_head_weight).float()
    assert torch.equal(model.compute_logits(hidden.bfloat16()), plain)
    native = cpu_features.detect().native_bf16
    assert packed_linear_available(torch.bfloat16) == native
    assert pack_linear_weights(model) == (8 if native else 0)
    if native:
        expected = expected.bfloat16().float()
        torch.testing.assert_close(model.compute_logits(hidden.bfloat16()), expected,
                                   rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("panels", ["on", "off"])
def test_release_plain_weights_keeps_results(panels, monkeypatch):
    """The runner frees the plain float32 weights where the packed copies replace them at every
    row count (also prefill-sized inputs): on AVX-512 CPUs oneDNN's, on AVX2 ones the panels
    (csrc/f32_panel.c). The tied embedding stays for lookups, but beside panels it looks its rows
    up in the LM head's panels instead (`PanelEmbedding`), the same values. With the panels turned
    off, AVX2 keeps the plain weights (the C GEMV and MKL's prefill read them)."""
    if panels == "off":
        monkeypatch.setenv("TOKENLOOM_F32_PANEL", "0")
    model = _tiny_model(tied=True)
    x_small, x_big = torch.randn(3, 64), torch.randn(700, 64)
    # every id, in an order and shape a prefill and a batch hand over; 300 rows are not a
    # whole number of 16-row panels, so the last one is padded
    ids = torch.randperm(300).view(20, 15)
    layer = model.layers[0].mlp
    expected = [layer(x_small), layer(x_big), model.compute_logits(x_small)]
    expected_rows = model.embed_tokens(ids)
    assert pack_linear_weights(model) == 8
    freed = release_plain_weights(model)
    if cpu_features.detect().isa != "avx512" and not packed_linear.panels_in_use(model):
        assert freed == 0
        return
    # 2 layers x float32 x (qkv 128x64, o 64x64, gate_up 192x64, down 64x96)
    layers = 2 * 4 * (128 * 64 + 64 * 64 + 192 * 64 + 64 * 96)
    assert layer.gate_up_proj.weight.numel() == 0
    if packed_linear.panels_in_use(model):
        assert freed == layers + 4 * 300 * 64  # and the embedding's table
        assert isinstance(model.embed_tokens, packed_linear.PanelEmbedding)
        for bad in (300, 303, -1):  # past the vocabulary, in the last panel's padding, negative
            with pytest.raises(IndexError, match="out of the embedding's range"):
                model.embed_tokens(torch.tensor([5, bad]))
    else:
        assert freed == layers
        assert model.embed_tokens.weight.shape == (300, 64)
    assert torch.equal(model.embed_tokens(ids), expected_rows)
    assert model.embed_tokens(ids[:0]).shape == (0, 15, 64)
    got = [layer(x_small), layer(x_big), model.compute_logits(x_small)]
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_plain_weights_released_while_packing():
    """The runner frees each plain weight as soon as its packed copy is made (so that it never
    holds two copies of every weight: the peak resident memory), the same ones
    `release_plain_weights` frees afterwards; the tied embedding waits for the LM head's copy."""
    after, during = _tiny_model(tied=True), _tiny_model(tied=True)
    pack_linear_weights(after)
    release_plain_weights(after)
    pack_linear_weights(during, release_plain=True)
    sizes = lambda m: [p.numel() for p in m.parameters()]  # noqa: E731
    freed_layers = [n for n, p in after.named_parameters() if p.numel() == 0 and "embed" not in n]
    assert [n for n, p in during.named_parameters() if p.numel() == 0] == freed_layers
    assert during.embed_tokens.weight.shape == (300, 64)  # still plain: the head was packed from it
    release_plain_weights(during)
    assert sizes(during) == sizes(after)
    x = torch.randn(4, 64)
    assert torch.equal(during.compute_logits(x), after.compute_logits(x))


def test_untied_embedding_keeps_its_table():
    """An untied model's embedding is its own weight, not the LM head's: it stays as it is."""
    model = _tiny_model(tied=False)
    embed = model.embed_tokens
    pack_linear_weights(model)
    release_plain_weights(model)
    assert model.embed_tokens is embed and embed.weight.shape == (300, 64)


@pytest.mark.parametrize("shape", [(0, 64), (3, 64), (2, 3, 64), (0, 3, 64)])
def test_packed_linear_any_leading_shape(shape):
    """The packed path takes what F.linear takes: no rows (a step that samples nothing) and
    3-D input, also once the plain weight is released."""
    model = _tiny_model(tied=True)
    layer = model.layers[0].mlp.down_proj
    x = torch.randn(*shape[:-1], 96)
    expected = layer(x)
    pack_linear_weights(model)
    release_plain_weights(model)
    got = layer(x)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_bf16_lm_head_rows_as_if_alone():
    """On the AMX bf16 path a prefill-sized matmul sums K in oneDNN's chunks (ops/amx), but the
    LM head gives every row the logits it would get alone, as transformers' generate computes
    them one row per sequence: a 48-row step's logits are the 1-row ones bit for bit."""
    from tokenloom.ops import amx

    if not amx.available():
        pytest.skip("no AMX-BF16 on this CPU (or not granted)")
    # SmolLM2's hidden size (576: oneDNN sums it in two chunks from 33 rows), one small layer;
    # 48 x 4096 logits, of which the chunked order rounds a few differently
    model = _tiny_model(True, num_hidden_layers=1, hidden_size=576, intermediate_size=64,
                        num_attention_heads=9, num_key_value_heads=3, head_dim=64, vocab_size=4096)
    model = model.to(torch.bfloat16)
    pack_linear_weights(model)
    hidden = torch.randn(48, 576).bfloat16()
    rows = torch.cat([model.compute_logits(hidden[i:i + 1]) for i in range(48)])
    assert torch.equal(model.compute_logits(hidden), rows)


@pytest.mark.parametrize("tied", [True, False])
def test_weight_bytes_per_token_counts_packed_copies(tied):
    """`bench`'s "weights read / token" counts what a decode step reads: the packed copies once
    the runner has released the plain weights (and the tied head's, also behind a PanelEmbedding),
    padding to whole panels or tiles included."""
    from tokenloom.model.packed_linear import prepare_cpu_weights
    from tokenloom.model.quant_linear import weight_bytes_per_token

    model = _tiny_model(tied=tied)
    before = weight_bytes_per_token(model)
    assert before == 4 * (2 * 64 * (128 + 64 + 192) + 2 * 96 * 64 + 300 * 64)
    prepare_cpu_weights(model)
    assert before <= weight_bytes_per_token(model) <= before * 1.05
