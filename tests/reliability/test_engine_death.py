"""Process death, on the server: nothing hangs and nothing is left behind.

- The engine core is SIGKILLed mid-run: every request in flight (streamed or not, completions and
  responses) ends with an error the client sees, and the server shuts itself down and exits with status 1 (vLLM's policy;
  `--keep-alive-on-engine-death` keeps it up answering 503, tested in
  tests/entrypoints/test_openai_overload.py). Until it is gone, /health and new requests get 503.
- The server is SIGKILLed: its engine core notices (PDEATHSIG, and a parent watchdog) and exits.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import httpx
import openai
import pytest
from reliability_helpers import MODEL, SMALL_SERVER_ARGS, core_pids, ipc_dir_of, pid_alive, running_server, wait_until

LONG = {"max_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.fixture
def fresh_server():
    with running_server(SMALL_SERVER_ARGS) as srv:
        yield srv


def test_engine_core_killed_mid_run(fresh_server):
    srv = fresh_server
    core, ipc_dir = srv.core_pid, ipc_dir_of(srv.core_pid)
    assert ipc_dir.is_dir()

    async def run() -> tuple[list, list, float]:
        async with srv.async_client() as client:
            first_chunk = asyncio.Event()
            response_started = asyncio.Event()

            async def streamed(i: int):
                stream = await client.completions.create(model=MODEL, prompt=f"Story {i}:", stream=True, extra_body=LONG)
                chunks = 0
                try:
                    async for _ in stream:
                        chunks += 1
                        first_chunk.set()
                except openai.APIError as e:  # the error event that ends the stream
                    return chunks, e
                return chunks, None

            async def plain(i: int):
                try:
                    await client.completions.create(model=MODEL, prompt=f"Poem {i}:", extra_body=LONG)
                except openai.APIStatusError as e:
                    return e
                return None

            async def response_streamed():  # /v1/responses: its stream ends with response.failed
                stream = await client.responses.create(model=MODEL, input="A story:", stream=True,
                                                       max_output_tokens=200, temperature=0,
                                                       extra_body={"ignore_eos": True})
                last = None
                async for event in stream:
                    last = event
                    response_started.set()
                return last

            async def response_plain():
                try:
                    await client.responses.create(model=MODEL, input="A poem:", max_output_tokens=200,
                                                  extra_body={"ignore_eos": True})
                except openai.APIStatusError as e:
                    return e
                return None

            tasks = [asyncio.ensure_future(streamed(i)) for i in range(2)]
            tasks += [asyncio.ensure_future(plain(i)) for i in range(2)]
            tasks += [asyncio.ensure_future(response_streamed()), asyncio.ensure_future(response_plain())]
            # Killed once the streams are under way (the response's chat template renders first).
            await asyncio.wait_for(first_chunk.wait(), 300)
            await asyncio.wait_for(response_started.wait(), 300)
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return results[:2], results[2:4] + results[5:], results[4], time.monotonic() - killed

    streams, plains, response_events, took = asyncio.run(run())
    assert response_events.type == "response.failed", response_events
    assert response_events.response.status == "failed" and response_events.response.error.code == "engine_dead"
    for chunks, error in streams:
        assert chunks >= 0 and error is not None and "dead" in str(error).lower(), (chunks, error)
    for error in plains:
        assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
        assert error.response.json()["error"]["code"] == "engine_dead"
    assert took < 60, f"in-flight requests took {took:.1f}s to fail"

    # Until it is gone the server answers 503 (or already refuses connections); then it exits 1.
    try:
        r = httpx.get(srv.url("/health"), timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    except httpx.TransportError:
        pass
    try:
        srv.proc.wait(timeout=60)
    except Exception:
        pytest.fail(f"the server did not exit after its engine core died:\n{srv.log_text()}")
    assert srv.proc.returncode == 1, srv.log_text()
    assert "engine core is dead" in srv.log_text()
    # Nothing left behind: no process, no socket directory.
    assert not pid_alive(core)
    assert not ipc_dir.exists(), f"{ipc_dir} was left behind"


@pytest.mark.slow
def test_embedding_requests_in_flight_fail_with_503_when_the_core_dies():
    """An embedding server (--runner pooling) loses its engine core while requests are being
    pooled: each ends with 503 engine_dead, none hangs."""
    # 24 inputs of ~250 tokens under a 64-token budget: ~100 steps, long enough to be caught.
    with running_server(SMALL_SERVER_ARGS + ["--runner", "pooling", "--max-num-batched-tokens", "64"]) as srv:
        text = "The quick brown fox jumps over the lazy dog. " * 24

        async def run() -> list:
            async with srv.async_client() as client:
                async def embed(i: int):
                    try:
                        await client.embeddings.create(model=MODEL, input=[f"{i} {text}"] * 4)
                    except openai.APIStatusError as e:
                        return e
                    return None

                tasks = [asyncio.ensure_future(embed(i)) for i in range(6)]
                running = "tokenloom:num_requests_running"
                assert await asyncio.to_thread(wait_until, lambda: srv.metrics().get(running, 0) > 0, 60)
                os.kill(srv.core_pid, signal.SIGKILL)
                return await asyncio.wait_for(asyncio.gather(*tasks), 120)

        for error in asyncio.run(run()):
            assert isinstance(error, openai.APIStatusError) and error.status_code == 503, error
            assert error.response.json()["error"]["code"] == "engine_dead"
        srv.proc.wait(timeout=60)
        assert srv.proc.returncode == 1, srv.log_text()


def test_engine_core_exits_when_server_is_killed(fresh_server):
    srv = fresh_server
    core, ipc_dir = srv.core_pid, ipc_dir_of(srv.core_pid)
    assert core_pids(srv.proc.pid) == [core]
    srv.proc.send_signal(signal.SIGKILL)
    srv.proc.wait(timeout=30)
    try:
        assert wait_until(lambda: not pid_alive(core), 15), "the engine core outlived its server"
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)  # nobody is left to remove it after a SIGKILL
