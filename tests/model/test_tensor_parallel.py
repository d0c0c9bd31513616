"""The tensor-parallel cut of one layer, without processes: a rank's column-parallel rows are the
full layer's rows, and the ranks' row-parallel partial products add up to the full product; the
quantized tiles are cut where a tile or block allows and fall back to float elsewhere."""
from __future__ import annotations

import pytest
import torch

from tokenloom.model.config import ModelArchConfig
from tokenloom.model.loader import load_model_config
from tokenloom.model.quant_linear import QuantLinear
from tokenloom.model.tensor_parallel import (check_tensor_parallel, kv_heads_of_rank, take_cols, take_rows,
                                             vocab_range)
from tokenloom.ops import quant
from tokenloom.ops.quant import TiledQuantWeight


def _cfg(heads: int, kv: int, inter: int = 96) -> ModelArchConfig:
    return ModelArchConfig(architecture="llama", num_hidden_layers=1, hidden_size=64, intermediate_size=inter,
                           num_attention_heads=heads, num_key_value_heads=kv, head_dim=16, vocab_size=100,
                           rms_norm_eps=1e-5, rope_theta=1e4, max_position_embeddings=64, tie_word_embeddings=True)


def test_kv_heads_split_then_replicated():
    assert [kv_heads_of_rank(_cfg(4, 2), r, 2) for r in range(2)] == [(0, 1), (1, 1)]
    assert [kv_heads_of_rank(_cfg(8, 4), r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    # SmolLM2-135M: 9 query heads, 3 KV heads; at 9 ranks each KV head serves 3 ranks.
    assert [kv_heads_of_rank(_cfg(9, 3), r, 3) for r in range(3)] == [(0, 1), (1, 1), (2, 1)]
    assert [kv_heads_of_rank(_cfg(9, 3), r, 9)[0] for r in range(9)] == [0, 0, 0, 1, 1, 1, 2, 2, 2]


def test_vocab_slices_cover_the_vocabulary_once():
    slices = [vocab_range(49153, r, 3) for r in range(3)]
    assert slices[0][0] == 0 and slices[-1][1] == 49153
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:]))
    assert all(per % 16 == 0 and end - start <= per for start, end, per in slices)


def test_bad_size_names_the_field(smollm2_path):
    cfg = load_model_config(smollm2_path)
    # The sizes offered instead pass every check: 9 divides the heads but not intermediate_size.
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide num_attention_heads=9 .* use one of \[1, 3\]\.$"):
        check_tensor_parallel(cfg, 2)
    with pytest.raises(ValueError, match=r"num_key_value_heads=2"):
        check_tensor_parallel(_cfg(6, 2), 3)
    with pytest.raises(ValueError, match=r"intermediate_size=90"):
        check_tensor_parallel(_cfg(4, 2, inter=90), 4)
    check_tensor_parallel(cfg, 3)
    with pytest.raises(ValueError, match=r"intermediate_size=1536"):  # 9 heads, but 1536 % 9 != 0
        check_tensor_parallel(cfg, 9)


def _q8(rows: int, cols: int, seed: int) -> TiledQuantWeight:
    g = torch.Generator().manual_seed(seed)
    return quant.quantize_q8(torch.randn(rows, cols, generator=g) * 0.1)


@pytest.mark.parametrize("cut", [(16, 48), (8, 40)], ids=["whole-tiles", "inside-a-tile"])
def test_column_cut_is_the_layers_rows(cut):
    w = _q8(64, 96, 0)
    full = QuantLinear([w])
    x = torch.randn(5, 96)
    ranges = [cut, (48, 64)]
    part = take_rows(QuantLinear([w]), ranges, "test.qkv_proj")
    quantized = all(isinstance(p, TiledQuantWeight) for p in part.parts)
    assert quantized == (cut[0] % 16 == 0)  # a cut inside a tile falls back to float
    want = torch.cat([full(x)[:, a:b] for a, b in ranges], dim=1)
    torch.testing.assert_close(part(x), want, atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize("tp", [2, 3])
def test_row_cut_partials_add_up(tp):
    """Whole 32-weight blocks: each rank's share stays quantized, and the all-reduce's sum is the
    full product (the activations are quantized per block, so the partials see the same blocks)."""
    K = 32 * tp * 2  # whole blocks per rank
    w = _q8(48, K, 1)
    x = torch.randn(3, K)
    full = QuantLinear([w])(x)
    step = K // tp
    parts = [take_cols(QuantLinear([w]), r * step, (r + 1) * step, r == 0, "test.o_proj") for r in range(tp)]
    assert all(isinstance(p.parts[0], TiledQuantWeight) for p in parts)
    total = sum(p(x[:, r * step:(r + 1) * step]) for r, p in enumerate(parts))
    torch.testing.assert_close(total, full, atol=1e-4, rtol=1e-4)


def test_architecture_without_tensor_parallelism_is_refused():
    # OLMo 2 norms q and k over all heads at once: the registry says no, and the check names it.
    import dataclasses

    olmo2 = dataclasses.replace(_cfg(4, 2), architecture="olmo2")
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2: Olmo2ForCausalLM \(olmo2\) does not run under "
                                         r"tensor parallelism"):
        check_tensor_parallel(olmo2, 2)
    check_tensor_parallel(olmo2, 1)
