"""Data parallelism's front end: the load balancer on its own (no model), and
`LLM(data_parallel_size=2)` giving DP=1's greedy answers."""
from __future__ import annotations

import pytest

from tokenloom.engine.dp_client import LoadBalancer, merge_results
from tokenloom.messages import EngineCoreOutput, EngineCoreOutputs, SchedulerStats
from tokenloom.ops.cpu_threads import replica_cores


def _finished(*ids: str) -> EngineCoreOutputs:
    return EngineCoreOutputs(outputs=[EngineCoreOutput(request_id=i, new_token_ids=[1], finish_reason=1) for i in ids])


def test_a_burst_is_spread_before_any_stats_arrive():
    lb = LoadBalancer(2)
    chosen = []
    for k in range(6):
        i = lb.choose(lambda _: True)
        lb.sent(i, [f"r{k}"])
        chosen.append(i)
    assert sorted(chosen) == [0, 0, 0, 1, 1, 1]


def test_fewest_running_plus_waiting_wins_and_finishes_count():
    lb = LoadBalancer(2)
    lb.sent(0, ["a", "b"])
    lb.received(1, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=3, num_waiting_reqs=2)))
    assert lb.choose(lambda _: True) == 0  # 2 sent vs 5 reported
    lb.received(0, _finished("a", "b"))
    lb.received(1, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=0, num_waiting_reqs=0)))
    lb.sent(1, ["c"])
    assert lb.choose(lambda _: True) == 0
    assert lb.replicas[0].num_finished == 2 and lb.owner == {"c": 1}


def test_a_dead_replica_hands_back_only_its_requests_and_gets_no_more():
    lb = LoadBalancer(2)
    lb.sent(0, ["a"])
    lb.sent(1, ["b", "c"])
    assert lb.forget(["c"]) == {1: ["c"]}
    assert lb.mark_dead(1) == ["b"]
    assert lb.owner == {"a": 0}
    assert {lb.choose(lambda _: True) for _ in range(4)} == {0}
    assert lb.choose(lambda i: i == 0) == 0


def test_utility_answers_merge_and_cores_split():
    assert merge_results([{"num_running": 2, "x": 1.5}, {"num_running": 3, "x": 0.5}]) == {"num_running": 5, "x": 2.0}
    assert merge_results([[1], [2, 3]]) == [1, 2, 3]
    assert merge_results([True, False]) is False
    assert [replica_cores([0, 1, 2, 3, 4], r, 2) for r in (0, 1)] == [[0, 1, 2], [3, 4]]
    assert [replica_cores([0, 1], r, 3) for r in (0, 1, 2)] == [[0], [1], [0]]
    with pytest.raises(ValueError, match="data_parallel_size must be a positive integer"):
        from tokenloom.config import EngineConfig

        EngineConfig(data_parallel_size=0).validate()


@pytest.mark.slow
def test_llm_dp2_greedy_matches_dp1(smollm2_path, monkeypatch):
    """Each replica batches half the prompts. On the int8 kernels: on AMX-BF16 CPUs the GGUF
    path's matmuls of 16 rows and more run on bf16 tiles, so a replica's 3-prompt prefill (under
    16 tokens) and the 6-prompt one would round differently, and a near-tie of these prompts
    went the other way once prefill attention ran in bfloat16 (tests/ops/test_quant.py checks
    both kernels against a float64 reference). The float32 panels of AVX2 CPUs (from 16 rows)
    are turned off alike."""
    from tokenloom import LLM, SamplingParams
    from tokenloom.ops import quant

    prompts = ["The capital of France is", "Hello, my name is", "Count to five:", "Water boils at",
               "The opposite of hot is", "Once upon a time"]
    sp = SamplingParams(temperature=0.0, max_tokens=12)
    for env in ("TOKENLOOM_QUANT_BF16_ROWS", "TOKENLOOM_QUANT_F32_ROWS"):  # the replicas' processes
        monkeypatch.setenv(env, "0")
    old, old_f32 = quant.set_amx_bf16_rows(0), quant.set_f32_panel_rows(0)  # this one
    try:
        reference = LLM(num_kv_blocks=64, multiprocess=False)
        expected = [o.outputs[0].text for o in reference.generate(prompts, sp, use_tqdm=False)]
    finally:
        quant.set_amx_bf16_rows(old)
        quant.set_f32_panel_rows(old_f32)
    llm = LLM(num_kv_blocks=64, data_parallel_size=2)
    try:
        got = [o.outputs[0].text for o in llm.generate(prompts, sp, use_tqdm=False)]
        replicas = llm.llm_engine.engine_core.balancer.replicas
        assert got == expected
        assert [r.num_finished for r in replicas] == [3, 3]  # both did work
    finally:
        llm.llm_engine.shutdown()
