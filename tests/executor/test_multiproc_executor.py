"""Tensor parallelism with one worker process per rank (the default backend for N > 1), through
LLM.generate with the engine core in its own process: the split model computes what the whole
one computes."""
from __future__ import annotations

import os

import pytest
from tp_helpers import PROMPTS, assert_same, run

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


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_ranks_report_their_contention_and_cpu(tiny_model_dir, tmp_path):
    """Each rank's compute threads are measured (ops/schedstat.py) and reported with its reply:
    every request's machine_contention part is there and non-negative, the parts still sum to
    e2e, and the steps' CPU seconds hold the ranks' (the engine core itself computes nothing)."""
    from tokenloom.metrics.timeline import PART_NAMES
    from tokenloom.metrics.trace import load_trace, trace_steps

    path = tmp_path / "trace.json"
    with LLM(tiny_model_dir("llama"), dtype="float32", tensor_parallel_size=2, trace_path=str(path)) as llm:
        core = llm.llm_engine.engine_core.info.pid
        children = [int(p) for t in os.listdir(f"/proc/{core}/task")
                    for p in open(f"/proc/{core}/task/{t}/children").read().split()]
        # The rank processes (multiprocessing's resource tracker is a child too).
        ranks = [p for p in children if b"spawn_main" in open(f"/proc/{p}/cmdline", "rb").read()]
        assert len(ranks) == 2, ranks
        before = sum(_cpu_seconds(p) for p in ranks)
        outs = llm.generate(PROMPTS * 4, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
        ranks_cpu = sum(_cpu_seconds(p) for p in ranks) - before
        llm.flush_trace()
    for out in outs:
        parts, e2e = out.metrics.parts, out.metrics.e2e_latency
        assert list(parts) == list(PART_NAMES) and "machine_contention" in parts
        assert all(v >= 0 for v in parts.values()), parts
        assert abs(sum(parts.values()) - e2e) <= max(1e-3, 0.01 * e2e), (sum(parts.values()), e2e)
    steps = [s for s in trace_steps(load_trace(path)) if s.get("cores")]
    assert steps and all(s["run_delay_s"] >= 0 and s["cpu_s"] >= 0 for s in steps)
    booked = sum(s["cpu_s"] for s in steps)
    print(f"steps' CPU {booked:.3f} s, the ranks' processes' {ranks_cpu:.3f} s")
    assert booked >= 0.5 * ranks_cpu > 0, (booked, ranks_cpu)
