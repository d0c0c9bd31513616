"""`tokenloom serve` under a burst it must refuse (503 past --max-waiting-requests), and after its
engine core dies (503 everywhere, /health included)."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import openai

# Kept up after its engine core dies (the default is to exit, see tests/reliability/test_engine_death.py).
SERVER_ARGS = ["--max-num-seqs", "2", "--max-waiting-requests", "1", "--max-model-len", "128", "--kv-cache-memory-bytes", str(32 * 1024**2), "--keep-alive-on-engine-death"]


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


def test_503_when_too_many_would_wait(server):
    async def one(aclient, i: int):
        try:
            r = await aclient.completions.create(prompt=f"{i} apples and", model="SmolLM2-135M-Instruct", max_tokens=4, extra_body={"ignore_eos": True})
            return r.choices[0].finish_reason
        except openai.APIStatusError as e:
            return e

    async def burst():
        async with server.async_client() as aclient:
            return await asyncio.gather(*(one(aclient, i) for i in range(10)))

    results = asyncio.run(burst())
    refused = [r for r in results if isinstance(r, openai.APIStatusError)]
    done = [r for r in results if r == "length"]
    assert len(done) + len(refused) == 10
    # 2 may run and 1 may wait: at least 3 are admitted; a burst of 10 cannot all be.
    assert len(done) >= 3 and refused
    for e in refused:
        assert e.status_code == 503
        err = _error(e)
        assert err["code"] == "server_overloaded" and "--max-waiting-requests" in err["message"]
    m = server.wait_idle()
    assert m["tokenloom:num_kv_blocks_used"] == 0


def test_engine_core_death_gives_503(server):
    client = server.client()

    async def in_flight():
        async with server.async_client() as aclient:
            stream = await aclient.completions.create(
                model="SmolLM2-135M-Instruct", prompt="Count to a hundred:", max_tokens=100, stream=True, extra_body={"ignore_eos": True}
            )
            got = 0
            try:
                async for _ in stream:
                    got += 1
                    if got == 1:
                        os.kill(server.core_pid, signal.SIGKILL)
            except openai.APIError as e:  # the error event at the end of the stream
                return got, e
            return got, None

    t0 = time.monotonic()
    got, error = asyncio.run(in_flight())
    assert got >= 1 and error is not None and "dead" in str(error).lower()
    assert time.monotonic() - t0 < 60

    r = httpx.get(server.url("/health"))
    assert r.status_code == 503 and r.json()["error"]["code"] == "engine_dead"
    try:
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
    except openai.APIStatusError as e:
        assert e.status_code == 503 and _error(e)["code"] == "engine_dead"
    else:
        raise AssertionError("a request to a dead engine succeeded")
    server.core_pid = None  # already dead: nothing to check for orphans
