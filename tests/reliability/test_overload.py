"""Overload and resource bounds on a real server: a burst beyond --max-waiting-requests gets fast
503s while the admitted requests finish, memory stays bounded, and a prompt that can never fit the
KV cache is refused at once with a 400 naming the limit instead of waiting forever."""
from __future__ import annotations

import asyncio
import statistics
import time

import httpx
from reliability_helpers import MODEL, child_pids, openai_error, rss_bytes, wait_until_clean

MAX_NUM_SEQS, MAX_WAITING = 2, 4
NUM_KV_BLOCKS, BLOCK_SIZE = 8, 16  # the whole KV cache holds 128 tokens
SERVER_ARGS = [
    "--max-model-len", "256", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--block-size", str(BLOCK_SIZE),
    "--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting-requests", str(MAX_WAITING),
]  # fmt: skip
BURST = 60
RSS_GROWTH_LIMIT = 300 * 1024**2


def _rss(srv) -> int:
    return sum(rss_bytes(pid) for pid in [srv.proc.pid, *child_pids(srv.proc.pid)])


def test_burst_beyond_max_waiting_requests_gets_fast_503s(server):
    rss_before = _rss(server)

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float, dict]:
        t0 = time.monotonic()
        r = await client.post(
            "/v1/completions",
            json={"model": MODEL, "prompt": f"{i} apples and", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
        )
        return r.status_code, time.monotonic() - t0, r.json()

    async def burst():
        limits = httpx.Limits(max_connections=BURST, max_keepalive_connections=BURST)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(BURST)))

    results = asyncio.run(burst())
    rss_after = _rss(server)
    ok = [(t, body) for status, t, body in results if status == 200]
    refused = [(t, body) for status, t, body in results if status == 503]
    print(
        f"\nburst of {BURST}: {len(ok)} served, {len(refused)} refused; "
        f"503 latency median {statistics.median(t for t, _ in refused) * 1000:.0f} ms, "
        f"served median {statistics.median(t for t, _ in ok) * 1000:.0f} ms; "
        f"RSS server+core {rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB"
    )
    assert len(ok) + len(refused) == BURST, [s for s, _, _ in results]
    # max_num_seqs may run and MAX_WAITING may wait: at least that many are admitted.
    assert len(ok) >= MAX_NUM_SEQS + MAX_WAITING and refused
    for _, body in ok:
        assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 4
    for _, body in refused:
        err = body["error"]
        assert err["code"] == "server_overloaded" and "--max-waiting-requests" in err["message"], body
    # Refusing costs no engine time: a 503 comes back sooner than a served request.
    assert statistics.median(t for t, _ in refused) < statistics.median(t for t, _ in ok)
    assert rss_after - rss_before < RSS_GROWTH_LIMIT
    assert wait_until_clean(server), server.metrics()


def test_prompt_larger_than_the_kv_cache_is_refused_at_once(server):
    capacity = NUM_KV_BLOCKS * BLOCK_SIZE
    too_long = [504 + i % 1000 for i in range(capacity + 72)]  # 200 tokens: < max_model_len, > the cache
    t0 = time.monotonic()
    r = httpx.post(server.url("/v1/completions"), json={"model": MODEL, "prompt": too_long, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400, r.text
    err = openai_error(r)
    assert err["param"] == "prompt" and "KV cache" in err["message"] and str(capacity) in err["message"], err
    assert time.monotonic() - t0 < 30

    chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 180}], "max_tokens": 1}
    r = httpx.post(server.url("/v1/chat/completions"), json=chat, timeout=60)
    assert r.status_code == 400, r.text
    err = openai_error(r)
    assert err["param"] == "messages" and "KV cache" in err["message"], err

    # A prompt that fits runs, and stops where the cache ends rather than at max_tokens.
    fits = too_long[: capacity - 4]
    r = httpx.post(
        server.url("/v1/completions"),
        json={"model": MODEL, "prompt": fits, "max_tokens": 50, "temperature": 0, "ignore_eos": True},
        timeout=300,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and body["usage"]["total_tokens"] == capacity
    assert wait_until_clean(server), server.metrics()
