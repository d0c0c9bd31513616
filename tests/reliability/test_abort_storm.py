"""An abort storm against a real server: 500 requests (TOKENLOOM_STORM_REQUESTS), at most 32 in
flight, a third to a half of them abandoned at random moments, and nothing is lost: every request
that is not abandoned returns exactly what a quiet run of the same prompt returns, and afterwards
the engine core holds no request, no KV block and no persistent-batch row.

Ways a request ends early here (each turns into an abort in the engine core):
- a stream closed by the client after k chunks (`response.aclose()`, the explicit abort an HTTP
  client has), or before its first chunk;
- a streamed or non-streamed request whose task is cancelled after a random delay (the TCP
  connection is dropped mid-request: a disconnect).
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time

import httpx
import pytest

from reliability_helpers import AUTH, MODEL, success_count, wait_until_clean

NUM_REQUESTS = int(os.environ.get("TOKENLOOM_STORM_REQUESTS", "500"))
MAX_IN_FLIGHT = 32
STORM_TIMEOUT_S = 900.0  # a bound, not an expectation: a few tens of seconds on a quiet machine
# (prompt, max_tokens): every request for a prompt asks for the same length, so one quiet run per
# prompt is its reference.
PROMPTS = [
    ("The capital of France is", 8),
    ("1, 2, 3, 4,", 6),
    ("Once upon a time", 4),
    ("def add(a, b):", 7),
    ("The sky is", 1),
    ("Water boils at", 5),
    ("My favourite colour is", 3),
    ("Hello! How", 2),
]
MODES = ("stream", "nonstream", "close_early", "close_at_once", "cancel_stream", "cancel_nonstream")


def _body(prompt: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}


async def _stream_text(response: httpx.Response, stop_after: int | None = None) -> tuple[str, str | None, bool]:
    """(text, finish_reason, saw [DONE]) of an SSE completion; closes after `stop_after` chunks."""
    text, finish, done, chunks = "", None, False, 0
    async for line in response.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        assert "error" not in event, event
        for choice in event["choices"]:
            text += choice["text"]
            finish = choice["finish_reason"] or finish
        chunks += 1
        if stop_after is not None and chunks >= stop_after:
            await response.aclose()
            return text, finish, False
    return text, finish, done


async def _one(client: httpx.AsyncClient, sem: asyncio.Semaphore, i: int) -> tuple[str, int, str | None, str | None]:
    """(mode, prompt index, text or None when abandoned, finish_reason)."""
    rng = random.Random(i)
    p = i % len(PROMPTS)
    prompt, max_tokens = PROMPTS[p]
    mode = rng.choice(MODES)
    async with sem:
        if mode in ("stream", "close_early", "close_at_once"):
            async with client.stream("POST", "/v1/completions", json=_body(prompt, max_tokens, True)) as r:
                assert r.status_code == 200, await r.aread()
                if mode == "close_at_once":
                    await r.aclose()
                    return mode, p, None, None
                stop_after = rng.randint(1, max(1, max_tokens - 1)) if mode == "close_early" else None
                text, finish, done = await _stream_text(r, stop_after)
                if stop_after is not None:
                    return mode, p, None, None
                assert done
                return mode, p, text, finish
        if mode == "nonstream":
            r = await client.post("/v1/completions", json=_body(prompt, max_tokens, False))
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            return mode, p, choice["text"], choice["finish_reason"]

        # cancel_*: the request's task is cancelled after a random delay, dropping its connection.
        async def request() -> tuple[str, str | None]:
            if mode == "cancel_stream":
                async with client.stream("POST", "/v1/completions", json=_body(prompt, max_tokens, True)) as r:
                    text, finish, _ = await _stream_text(r)
                    return text, finish
            r = await client.post("/v1/completions", json=_body(prompt, max_tokens, False))
            choice = r.json()["choices"][0]
            return choice["text"], choice["finish_reason"]

        task = asyncio.ensure_future(request())
        done, _ = await asyncio.wait({task}, timeout=rng.uniform(0.0, 0.5))
        if task in done:  # it beat the cancellation: it must be right too
            text, finish = task.result()
            return mode, p, text, finish
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass
        return mode, p, None, None


@pytest.mark.slow
def test_abort_storm_loses_nothing(shared_server):
    srv = shared_server

    async def run() -> tuple[dict[int, str], list, float]:
        limits = httpx.Limits(max_connections=MAX_IN_FLIGHT * 2, max_keepalive_connections=MAX_IN_FLIGHT)
        async with httpx.AsyncClient(base_url=srv.base_url, headers=AUTH, timeout=300, limits=limits) as client:
            # The quiet run: one request at a time.
            quiet: dict[int, str] = {}
            for p, (prompt, max_tokens) in enumerate(PROMPTS):
                r = await client.post("/v1/completions", json=_body(prompt, max_tokens, False))
                assert r.status_code == 200, r.text
                quiet[p] = r.json()["choices"][0]["text"]
            sem = asyncio.Semaphore(MAX_IN_FLIGHT)
            t0 = time.monotonic()
            results = await asyncio.wait_for(
                asyncio.gather(*(_one(client, sem, i) for i in range(NUM_REQUESTS))), STORM_TIMEOUT_S
            )
            return quiet, results, time.monotonic() - t0

    before = srv.metrics()
    quiet, results, elapsed = asyncio.run(run())
    survivors = [(mode, p, text, finish) for mode, p, text, finish in results if text is not None]
    abandoned = len(results) - len(survivors)
    print(f"\nstorm: {NUM_REQUESTS} requests in {elapsed:.1f}s, {len(survivors)} completed, {abandoned} abandoned")
    assert len(results) == NUM_REQUESTS
    assert abandoned >= NUM_REQUESTS // 5 and len(survivors) >= NUM_REQUESTS // 5
    wrong = [(mode, PROMPTS[p][0], text, quiet[p]) for mode, p, text, finish in survivors if text != quiet[p] or finish != "length"]
    assert not wrong, f"{len(wrong)} outputs differ from the quiet run, e.g. {wrong[:3]}"

    # Nothing remains: no request in the scheduler or the model runner, every KV block free.
    assert wait_until_clean(srv), srv.metrics()
    after = srv.metrics()
    finished = sum(success_count(after, r) - success_count(before, r) for r in ("stop", "length", "abort", "error"))
    assert success_count(after, "error") == success_count(before, "error")
    assert success_count(after, "abort") - success_count(before, "abort") >= 1
    # One final output per request the server saw: every survivor and quiet request, and at most
    # every request sent (a request cancelled before its body reached the server never started).
    assert len(survivors) + len(PROMPTS) <= finished <= NUM_REQUESTS + len(PROMPTS), (finished, len(survivors))

    # And the server still serves.
    r = httpx.post(srv.url("/v1/completions"), headers=AUTH, json=_body(*PROMPTS[0], False), timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == quiet[0]

