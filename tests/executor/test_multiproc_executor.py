"""Tensor parallelism with one worker process per rank (the default backend for N > 1), through
LLM.generate with the engine core in its own process: the split model computes what the whole
one computes."""
from __future__ import annotations

import pytest
from tp_helpers import assert_same, run

from tokenloom import LLM, SamplingParams

pytestmark = pytest.mark.tp


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_two_ranks_match_one(kind, tiny_model_dir):
    model = tiny_model_dir(kind)
    with LLM(model, dtype="float32", multiprocess=False) as whole:
        want = run(whole)
    with LLM(model, dtype="float32", tensor_parallel_size=2) as split:
        info = split.llm_engine.engine_core.info
        assert (info.tensor_parallel_size, info.executor_backend) == (2, "mp")
        assert "rank 0 of 2" in info.cpu  # each rank has its share of the cores
        got = run(split)
    assert_same(got, want)


# Two of the chat prompts of tests/entrypoints/test_llm.py.
CHAT = ["Who wrote Hamlet?", "Give me a haiku about autumn leaves."]


@pytest.mark.slow
def test_smollm2_three_ranks_same_greedy_answers(smollm2_path, monkeypatch):
    """SmolLM2-135M (9 query heads, 3 KV heads: one KV head per rank) on its shipped Q4_1
    weights: the quantized tiles are cut per rank, and the answers do not change.

    On the int8 kernels: a split K reorders float additions on either kernel, but the int8 ones
    add only each output's ~18 block terms in float (a block's own sum is an exact integer),
    while the bf16 tiles (AMX-BF16 CPUs, from 16 rows) add every pair of products in float32;
    with theirs a near-tie of these prompts went the other way (the float32 panels of AVX2 CPUs,
    from 16 rows, add them alike: off too). tests/ops/test_quant.py checks
    the tiles against a float64 reference. Over a float32 KV cache for the same reason: the
    path's default bfloat16 one rounds the split sums' last bits into K and V (and attends
    prefills in bfloat16), which flipped another near-tie."""
    from tokenloom.ops import quant

    for env in ("TOKENLOOM_QUANT_BF16_ROWS", "TOKENLOOM_QUANT_F32_ROWS"):  # the ranks' processes
        monkeypatch.setenv(env, "0")
    old, old_f32 = quant.set_amx_bf16_rows(0), quant.set_f32_panel_rows(0)  # this one
    params = SamplingParams(max_tokens=24, temperature=0)
    messages = [[{"role": "user", "content": q}] for q in CHAT]
    try:
        with LLM(smollm2_path, multiprocess=False, kv_cache_dtype="float32") as whole:
            want = [o.outputs[0].token_ids for o in whole.chat(messages, params, use_tqdm=False)]
    finally:
        quant.set_amx_bf16_rows(old)
        quant.set_f32_panel_rows(old_f32)
    with LLM(smollm2_path, tensor_parallel_size=3, kv_cache_dtype="float32") as split:
        assert split.llm_engine.engine_core.info.quantization.startswith("gguf Q4_1")
        got = [o.outputs[0].token_ids for o in split.chat(messages, params, use_tqdm=False)]
    assert got == want


def test_bad_size_is_a_clear_error(smollm2_path):
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 must divide num_attention_heads=9"):
        LLM(smollm2_path, tensor_parallel_size=2, multiprocess=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be a positive integer, got 0"):
        LLM(smollm2_path, tensor_parallel_size=0, multiprocess=False)
    with pytest.raises(ValueError, match=r"distributed_executor_backend='uni' .* tensor_parallel_size=2"):
        LLM(smollm2_path, tensor_parallel_size=2, distributed_executor_backend="uni", multiprocess=False)
