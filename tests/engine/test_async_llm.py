"""AsyncLLM on the real model: streaming, n > 1, aborts by close / cancel / abort(), utility calls,
metrics, and a dying engine core that every in-flight generator hears about."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from tokenloom.config import EngineConfig
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.core_client import EngineDeadError
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

KV_BYTES = 64 * 1024**2
DELTA = RequestOutputKind.DELTA
FINAL = RequestOutputKind.FINAL_ONLY


@pytest.fixture(scope="module")
def loop():
    # One loop for the module: AsyncLLM's sockets and output handler belong to the loop they
    # first ran on.
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(scope="module")
def engine(loop):
    llm = AsyncLLM(EngineConfig(kv_cache_memory_bytes=KV_BYTES, max_model_len=256))
    yield llm
    llm.shutdown()
    loop.run_until_complete(asyncio.sleep(0))


async def _wait_idle(llm: AsyncLLM, timeout: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        state = await llm.get_state(timeout=10)
        idle = state["num_requests"] == 0 and state["num_free_blocks"] == state["num_total_blocks"]
        if idle or time.monotonic() > deadline:
            return state
        await asyncio.sleep(0.1)


async def _collect(llm: AsyncLLM, prompt, params: SamplingParams, request_id: str) -> list:
    return [out async for out in llm.generate(prompt, params, request_id)]


def test_delta_stream_equals_final_and_concurrent_requests(engine, loop):
    async def run():
        greedy = dict(max_tokens=6, temperature=0, ignore_eos=True)
        delta, final, *others = await asyncio.gather(
            _collect(engine, "The capital of France is", SamplingParams(output_kind=DELTA, **greedy), "delta"),
            _collect(engine, "The capital of France is", SamplingParams(output_kind=FINAL, **greedy), "final"),
            *(_collect(engine, f"{i} + {i} =", SamplingParams(output_kind=FINAL, **greedy), f"other-{i}") for i in range(4)),
        )
        return delta, final, others

    delta, final, others = loop.run_until_complete(run())
    assert len(final) == 1 and final[0].finished and final[0].outputs[0].finish_reason == "length"
    assert len(delta) >= 2 and [o.finished for o in delta] == [False] * (len(delta) - 1) + [True]
    assert "".join(o.outputs[0].text for o in delta) == final[0].outputs[0].text
    assert sum(len(o.outputs[0].token_ids) for o in delta) == 6
    assert all(len(o[0].outputs[0].token_ids) == 6 for o in others)
    assert engine.get_num_unfinished_requests() == 0
    state = loop.run_until_complete(_wait_idle(engine))
    assert set(state) >= {"num_running", "num_waiting", "num_requests", "num_free_blocks", "num_total_blocks"}
    assert state["num_free_blocks"] == state["num_total_blocks"]


def test_n2_and_duplicate_id(engine, loop):
    async def run():
        params = SamplingParams(n=2, max_tokens=3, temperature=1.0, seed=5, output_kind=FINAL)
        stream = await engine.add_request("dup", "Hello", params)
        with pytest.raises(ValueError, match="already in flight"):
            await engine.add_request("dup", "Hello", params)
        return [out async for out in engine.stream_outputs(stream)]

    (out,) = loop.run_until_complete(run())
    assert out.finished and sorted(c.index for c in out.outputs) == [0, 1]
    assert all(len(c.token_ids) == 3 for c in out.outputs)


def test_aclose_cancel_and_abort_free_blocks(engine, loop):
    long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA)

    async def run():
        # 1. The consumer stops iterating.
        gen = engine.generate("Count: 1, 2, 3,", long, "closed")
        await gen.__anext__()
        await gen.aclose()
        # 2. The consuming task is cancelled (an HTTP client disconnect).
        started = asyncio.Event()

        async def consume():
            async for _ in engine.generate("Count: 4, 5, 6,", long, "cancelled"):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # 3. abort(): a consumer still waiting gets a final output with finish_reason "abort".
        gen = engine.generate("Count: 7, 8, 9,", long, "aborted")
        await gen.__anext__()
        await engine.abort("aborted")
        rest = [out async for out in gen]
        assert rest and rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
        assert engine.get_num_unfinished_requests() == 0
        return await _wait_idle(engine)

    state = loop.run_until_complete(run())
    assert state["num_requests"] == 0 and state["num_running"] == 0
    assert state["num_free_blocks"] == state["num_total_blocks"]


def test_bad_request_raises_value_error(engine, loop):
    async def run():
        with pytest.raises(ValueError, match="max_model_len"):
            await engine.add_request("long", "hello " * 400, SamplingParams(max_tokens=2))
        assert engine.get_num_unfinished_requests() == 0

    loop.run_until_complete(run())


def test_metrics_are_fed(engine, loop):
    loop.run_until_complete(_collect(engine, "Hi", SamplingParams(max_tokens=2), "metrics"))
    loop.run_until_complete(engine.refresh_metrics())
    text = engine.metrics.render().decode()
    assert "tokenloom:time_to_first_token_seconds_count" in text
    assert 'tokenloom:num_requests_running{model_name="SmolLM2-135M-Instruct"} 0.0' in text
    assert 'tokenloom:request_success_total{finished_reason="length"' in text


def test_engine_core_death():
    loop = asyncio.new_event_loop()
    llm = AsyncLLM(EngineConfig(kv_cache_memory_bytes=KV_BYTES, max_model_len=256))
    try:

        async def run():
            params = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=DELTA)
            gens = [llm.generate(f"Story {i}:", params, f"r{i}") for i in range(3)]
            for gen in gens:
                await gen.__anext__()
            os.kill(llm.engine_core.info.pid, signal.SIGKILL)
            t0 = time.monotonic()
            for gen in gens:
                with pytest.raises(EngineDeadError):
                    async for _ in gen:
                        pass
            assert time.monotonic() - t0 < 10
            assert llm.is_dead
            t1 = time.monotonic()
            with pytest.raises(EngineDeadError):
                await llm.add_request("late", "Hi", SamplingParams(max_tokens=2))
            with pytest.raises(EngineDeadError):
                await llm.get_state()
            assert time.monotonic() - t1 < 1  # fail fast
            assert llm.get_num_unfinished_requests() == 0

        loop.run_until_complete(run())
    finally:
        llm.shutdown()
        loop.close()


def test_engine_core_death_while_idle_fails_the_next_request_fast():
    # The core dies before anything listens for it: the first send must notice, not wait for a
    # peer that will never connect again.
    loop = asyncio.new_event_loop()
    llm = AsyncLLM(EngineConfig(kv_cache_memory_bytes=KV_BYTES, max_model_len=256))
    try:
        pid = llm.engine_core.info.pid
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split()[2] != "Z" \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)

        async def run():
            t0 = time.monotonic()
            with pytest.raises(EngineDeadError, match=f"{pid} exited"):
                await asyncio.wait_for(llm.add_request("late", "Hi", SamplingParams(max_tokens=2)), 10)
            assert time.monotonic() - t0 < 5

        loop.run_until_complete(run())
    finally:
        llm.shutdown()
        loop.close()
