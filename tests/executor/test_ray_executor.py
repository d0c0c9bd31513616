"""The same ranks as Ray actors (a local Ray instance, started by the executor's ray.init)."""
from __future__ import annotations

import os

import pytest
from tp_helpers import PROMPTS, assert_same, run

from tokenloom import LLM, SamplingParams

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.tp]


def _cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_two_ray_ranks_match_one_and_report_their_cpu(tiny_model_dir, tmp_path):
    """Greedy tokens and logprobs as one rank's; with the ledger on, each actor measures its compute
    threads and the steps' CPU seconds hold the actors' (as under the multiproc executor)."""
    from tokenloom.metrics.trace import load_trace, trace_steps

    model = tiny_model_dir("llama")
    with LLM(model, dtype="float32", multiprocess=False) as whole:
        want = run(whole)
    # The engine core in this process: its ray.init (a local instance) ends with the test.
    import ray

    path = tmp_path / "trace.json"
    try:
        with LLM(model, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
                 multiprocess=False, trace_path=str(path)) as split:
            assert split.llm_engine.engine_core.info.executor_backend == "ray"
            got = run(split)
            executor = split.llm_engine.engine_core.engine_core.executor
            ranks = [info.pid for info in executor.collective_rpc("get_info")]
            before = sum(_cpu_seconds(p) for p in ranks)
            split.generate(PROMPTS * 4, SamplingParams(max_tokens=24, ignore_eos=True), use_tqdm=False)
            ranks_cpu = sum(_cpu_seconds(p) for p in ranks) - before
            split.flush_trace()
    finally:
        ray.shutdown()
    assert_same(got, want)
    steps = [s for s in trace_steps(load_trace(path)) if s.get("cores")]
    assert steps and all(s["run_delay_s"] >= 0 and s["cpu_s"] >= 0 for s in steps)
    booked = sum(s["cpu_s"] for s in steps)
    assert booked >= 0.5 * ranks_cpu > 0, (booked, ranks_cpu)
