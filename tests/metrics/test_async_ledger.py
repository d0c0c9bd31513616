"""The ledger behind the server: AsyncLLM's outputs carry the decomposition, its Prometheus
registry (what `/metrics` renders) holds the ledger's metrics, and shutdown writes the trace."""
from __future__ import annotations

import asyncio
import json
import time
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
            # Of its prefill step, what the machine's other work or the engine's first step took is
            # booked apart (machine_contention, first_step): the step is there, in one part or another.
            computed = sum(m.parts.get(p, 0.0) for p in ("prefill", "machine_contention", "first_step"))
            assert computed > 0 and m.parts["decode"] + m.parts.get("machine_contention", 0.0) > 0
            assert len(m.inter_token_latencies) == 3
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


@pytest.mark.slow
@pytest.mark.serial
def test_planted_slow_front_end(quiet_cores, tmp_path, check_plot):
    """A front end that cannot keep up: 6 requests of n=4 children with 20 logprobs per token,
    streamed, whose consumers each format the logprobs and then hold the event loop for 200 ms
    per output they read (a synchronous handler: a blocking write of a heavy body, a blocking
    log call). It blocks without using a CPU, so the engine core runs at full speed on a small
    machine. While the loop is blocked the core's outputs wait in the socket, so the requests'
    time goes to the front end, and `explain` says frontend-bound."""
    from tokenloom.engine.async_llm import AsyncLLM
    from tokenloom.analysis.explain import analyze, format_report
    from tokenloom.metrics.timeline import VERDICT_HEADLINES

    trace = tmp_path / "frontend.json"
    with pytest.MonkeyPatch.context() as mp:  # see conftest.make_llm
        mp.setenv("OMP_NUM_THREADS", "1")
        engine = AsyncLLM(EngineConfig(kv_cache_memory_bytes=64 * 1024**2, max_model_len=256, trace_path=str(trace)))
    loop = asyncio.new_event_loop()

    async def consume(i: int, max_tokens: int, busy_s: float) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=4, temperature=1.0, seed=i, logprobs=20,
                                output_kind=RequestOutputKind.DELTA)
        async for out in engine.generate([1000 + 31 * i + j for j in range(24)], params, f"r{i}"):
            body = json.dumps([[{str(t): lp.logprob for t, lp in pos.items()} for pos in c.logprobs or []]
                               for c in out.outputs])
            assert body
            time.sleep(busy_s)  # the rest of a slow handler, on the loop

    async def run_all():
        await asyncio.gather(*(consume(i, 6, 0.2) for i in range(6)))  # 6 tokens: ~7 s of a blocked loop

    try:
        loop.run_until_complete(consume(99, 1, 0.0))  # a fresh engine's first step is slow: not this test's point
        loop.run_until_complete(run_all())
    finally:
        engine.shutdown()
        loop.run_until_complete(asyncio.sleep(0))
        loop.close()
    data = load_trace(trace)
    report = analyze(data, top=3)
    assert report["verdict"] == "frontend-bound", format_report(report)
    assert VERDICT_HEADLINES["frontend-bound"] in format_report(report)
    check_plot(data, report, "frontend-bound", tmp_path)
