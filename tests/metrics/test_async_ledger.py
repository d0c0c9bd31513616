"""The ledger behind the server: AsyncLLM's outputs carry the decomposition, its Prometheus
registry (what `/metrics` renders) holds the ledger's metrics, and shutdown writes the trace."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import jsonschema
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tokenloom.config import EngineConfig
from tokenloom.metrics.trace import load_trace
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

SCHEMA = json.loads((Path(__file__).parent / "chrome_trace.schema.json").read_text())


def test_async_llm_ledger(tmp_path):
    from tokenloom.engine.async_llm import AsyncLLM

    trace = tmp_path / "serve.json"
    with pytest.MonkeyPatch.context() as mp:  # see conftest.make_llm
        mp.setenv("OMP_NUM_THREADS", "1")
        engine = AsyncLLM(EngineConfig(kv_cache_memory_bytes=64 * 1024**2, max_model_len=256, trace_path=str(trace)))
    loop = asyncio.new_event_loop()

    async def collect(prompt: str, request_id: str):
        params = SamplingParams(max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        return [out async for out in engine.generate(prompt, params, request_id)]

    try:
        async def run_all():
            return await asyncio.gather(*(collect(f"{i} + {i} =", f"r{i}") for i in range(3)))

        results = loop.run_until_complete(run_all())
        for outs in results:
            m = outs[-1].metrics
            assert outs[-1].finished and m.core is not None and m.returned_time is not None
            assert all(v >= 0 for v in m.parts.values())
            assert sum(m.parts.values()) == pytest.approx(m.e2e_latency, abs=1e-6)
            assert m.parts["prefill"] > 0 and m.parts["decode"] > 0 and len(m.inter_token_latencies) == 3
        loop.run_until_complete(engine.refresh_metrics())
        families = {f.name: f for f in text_string_to_metric_families(engine.metrics.render().decode())}
        for name in ("tokenloom:request_wait_seconds", "tokenloom:request_part_seconds",
                     "tokenloom:step_budget_tokens", "tokenloom:kv_blocks", "tokenloom:e2e_request_latency_seconds"):
            assert name in families, name
        decode_count = next(s.value for s in families["tokenloom:request_decode_time_seconds"].samples
                            if s.name.endswith("_count"))
        assert decode_count == 3
        blocks = {s.labels["state"]: s.value for s in families["tokenloom:kv_blocks"].samples}
        assert blocks["used"] == 0 and blocks["free"] + blocks["cached"] > 0
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    data = load_trace(trace)
    jsonschema.validate(data, SCHEMA)
    assert sorted(e["args"]["request_id"] for e in data["traceEvents"] if e.get("cat") == "request") == ["r0", "r1", "r2"]
