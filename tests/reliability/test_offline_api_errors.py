"""Clear errors for the offline API's wrong argument types, and a metrics refresh that says why it
failed and how stale /metrics is (issue 21)."""
from __future__ import annotations

import asyncio
import logging

import pytest
from reliability_helpers import MODEL

from tokenloom.sampling_params import SamplingParams


@pytest.mark.parametrize("prompts", [123, 4.5, None, object()], ids=["int", "float", "None", "object"])
def test_generate_with_a_prompt_of_the_wrong_type_names_the_argument(offline_llm, prompts):
    with pytest.raises(TypeError, match=r"^prompts must be .*got " + type(prompts).__name__):
        offline_llm.generate(prompts, use_tqdm=False)


def test_generate_with_a_dict_for_sampling_params_names_the_argument(offline_llm):
    with pytest.raises(TypeError, match=r"^sampling_params must be a SamplingParams .*got dict .*SamplingParams\(\*\*"):
        offline_llm.generate("Hi", {"temperature": 0.0, "max_tokens": 2}, use_tqdm=False)
    with pytest.raises(TypeError, match=r"^sampling_params\[1\] must be a SamplingParams, got dict"):
        offline_llm.generate(["Hi", "Ho"], [SamplingParams(max_tokens=1), {"max_tokens": 1}], use_tqdm=False)
    # Nothing was queued, and the engine works.
    out = offline_llm.generate("Hi", SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)
    assert out[0].outputs[0].finish_reason == "length"


def test_a_failed_metrics_refresh_logs_its_reason_and_the_staleness_is_exported(caplog):
    from tokenloom.config import EngineConfig
    from tokenloom.engine.async_llm import AsyncLLM

    def gauge(engine) -> float:
        line = next(l for l in engine.metrics.render().decode().splitlines() if l.startswith("tokenloom:metrics_staleness_seconds{"))
        return float(line.rsplit(" ", 1)[1])

    async def run() -> tuple[float, float]:
        engine = AsyncLLM(EngineConfig(max_model_len=256, num_kv_blocks=8), model_name=MODEL)
        try:
            await engine.refresh_metrics()
            fresh = gauge(engine)
            await asyncio.sleep(0.2)
            with caplog.at_level(logging.WARNING, logger="tokenloom.engine.async_llm"):
                await engine.refresh_metrics(timeout=0)  # the core cannot answer in no time
            return fresh, gauge(engine)
        finally:
            engine.shutdown()

    fresh, stale = asyncio.run(run())
    assert fresh < 0.1 <= stale, (fresh, stale)
    warnings = [r.getMessage() for r in caplog.records if "could not refresh metrics" in r.getMessage()]
    assert warnings and "TimeoutError" in warnings[0], warnings  # a reason, not an empty string
