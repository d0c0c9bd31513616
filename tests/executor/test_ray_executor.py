"""The same ranks as Ray actors (a local Ray instance, started by the executor's ray.init)."""
from __future__ import annotations

import pytest
from tp_helpers import assert_same, run

from tokenloom import LLM

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.tp]


def test_two_ray_ranks_match_one(tiny_model_dir):
    model = tiny_model_dir("llama")
    with LLM(model, dtype="float32", multiprocess=False) as whole:
        want = run(whole)
    # The engine core in this process: its ray.init (a local instance) ends with the test.
    import ray

    try:
        with LLM(model, dtype="float32", tensor_parallel_size=2, distributed_executor_backend="ray",
                 multiprocess=False) as split:
            assert split.llm_engine.engine_core.info.executor_backend == "ray"
            got = run(split)
    finally:
        ray.shutdown()
    assert_same(got, want)
