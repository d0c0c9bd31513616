"""AsyncLLM on the real model: streaming, n > 1, aborts by close / cancel / abort(), utility calls,
metrics, and a dying engine core that every in-flight generator hears about."""
from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tokenloom.config import EngineConfig
from tokenloom.lora_request import LoRARequest
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


def test_vllm_surface_and_a_second_event_loop_then_shutdown():
    """As vLLM code uses an AsyncLLM: built outside any loop, driven by one `asyncio.run` and then
    another (a notebook, a test per loop), with vLLM's extra arguments as None and its health
    checks; after shutdown, a request is refused as a dead engine's, not with a closed pool's or
    socket's error."""
    llm = AsyncLLM(EngineConfig(kv_cache_memory_bytes=KV_BYTES, max_model_len=256))
    greedy = SamplingParams(max_tokens=4, temperature=0, output_kind=FINAL)

    async def once(request_id: str) -> str:
        outs = [out async for out in llm.generate("Hello", greedy, request_id, lora_request=None,
                                                  trace_headers=None, tokenization_kwargs=None)]
        return outs[-1].outputs[0].text

    try:
        first = asyncio.run(once("a"))
        # The first loop is closed; the second takes the engine over (it hung before).
        assert asyncio.run(asyncio.wait_for(once("b"), 120)) == first
        assert llm.is_running and not llm.errored and llm.get_tokenizer() is llm.tokenizer
        asyncio.run(llm.check_health())

        async def with_lora(lora):
            return [out async for out in llm.generate("Hi", greedy, "c", lora_request=lora)]

        with pytest.raises(TypeError, match="lora_request must be a tokenloom.LoRARequest"):
            asyncio.run(with_lora(object()))
        with pytest.raises(ValueError, match="enable_lora=True"):  # an adapter on an engine without LoRA
            asyncio.run(with_lora(LoRARequest("a", 1, "/nowhere")))
    finally:
        llm.shutdown()
    assert llm.errored and not llm.is_running
    with pytest.raises(EngineDeadError, match="the engine was shut down"):
        asyncio.run(once("after"))
    with pytest.raises(EngineDeadError):
        asyncio.run(llm.check_health())


def test_an_engine_dropped_without_shutdown_is_collected():
    """`del engine` without shutdown(), then a garbage collection (which may come at any
    allocation): the collector frees the engine and its core without blocking (it blocked forever
    in zmq's context termination, the sockets left open)."""
    script = textwrap.dedent(
        """
        import asyncio, gc, os, time
        from tokenloom.config import EngineConfig
        from tokenloom.engine.async_llm import AsyncLLM
        from tokenloom.sampling_params import SamplingParams

        engine = AsyncLLM(EngineConfig(kv_cache_memory_bytes=64 * 1024**2, max_model_len=256))
        pid = engine.engine_core.info.pid

        async def main():
            async for _ in engine.generate("Hi", SamplingParams(max_tokens=2), "x"):
                pass

        asyncio.run(main())
        del engine
        gc.collect()
        print("collected", pid, flush=True)
        """
    )
    # The bound is for a collector that blocks forever; it covers the engine's start-up too, which
    # takes minutes on a loaded 2-core machine (as tests/entrypoints/conftest.py allows a server).
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("collected"), proc.stderr[-2000:]
    pid = int(proc.stdout.split()[1])
    assert not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z"
