"""Big requests never freeze the server (issue 21: a 5 MB prompt held /health for 11 s, a 20 MB one
made it time out, because the prompt was tokenized on the event loop before its length was
checked, and no body size was limited).

- A body over --max-request-body-bytes gets a 413 before it is read (Content-Length) or as soon
  as its chunks pass the limit (chunked transfer).
- A prompt too long for max_model_len is refused by its character count, before tokenizing (no
  token of the tokenizer spans more than a few dozen characters).
- What is tokenized (or rendered by a chat template) is done on a thread pool.
- With a 20 MB prompt in flight, /health and a concurrent stream keep answering. Timings are
  machine-dependent, so they are printed, not asserted; benchmarks/responsive_loop.py records
  them (benchmarks/README.md).
"""
from __future__ import annotations

import json
import statistics

import httpx
import pytest
from reliability_helpers import SMALL_SERVER_ARGS, probe_while_in_flight, running_server, wait_until_clean

LIMIT = 25_000_000
BIG_PROMPT = json.dumps({"prompt": "hello " * (20_000_000 // 6), "max_tokens": 4}).encode()  # 20 MB


@pytest.fixture(scope="module")
def srv():
    with running_server([*SMALL_SERVER_ARGS, "--max-request-body-bytes", str(LIMIT)]) as server:
        yield server


def test_the_default_body_limit_is_16_mib():
    from tokenloom.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve"]).max_request_body_bytes == 16 * 1024 * 1024


def test_a_body_over_the_limit_is_a_413(srv):
    body = b'{"prompt": "' + b"x" * LIMIT + b'"}'
    r = httpx.post(srv.url("/v1/completions"), content=body, headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code == 413, r.text
    err = r.json()["error"]
    assert err["code"] == "request_too_large" and str(LIMIT) in err["message"] and "--max-request-body-bytes" in err["message"]


def test_a_chunked_body_over_the_limit_is_a_413(srv):
    def chunks():  # no Content-Length: the limit is found while reading
        yield b'{"messages": [{"role": "user", "content": "'
        for _ in range(LIMIT // 1_000_000 + 2):
            yield b"y" * 1_000_000
        yield b'"}]}'

    r = httpx.post(srv.url("/v1/chat/completions"), content=chunks(), headers={"Content-Type": "application/json"}, timeout=120)
    assert r.status_code == 413, r.text
    assert httpx.get(srv.url("/health"), timeout=30).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello " * 5000, "max_tokens": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello " * 5000}], "max_tokens": 2}),
])  # fmt: skip
def test_a_prompt_too_long_by_its_characters_is_refused_before_tokenizing(srv, path, body):
    r = httpx.post(srv.url(path), json=body, timeout=120)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    # The message counts characters: the prompt was never tokenized.
    assert err["param"] in ("prompt", "messages") and "30000 characters" in err["message"], err
    assert "at most 255 tokens" in err["message"], err


def test_health_and_a_stream_keep_going_with_a_20_mb_prompt_in_flight(srv):
    baseline = probe_while_in_flight(srv, None, stream_tokens=100)
    loaded = probe_while_in_flight(srv, BIG_PROMPT, stream_tokens=100)
    print(
        f"\n/health latency ms (baseline / 20 MB in flight): "
        f"max {max(baseline['health_latencies']) * 1e3:.1f} / {max(loaded['health_latencies']) * 1e3:.1f}, "
        f"median {statistics.median(baseline['health_latencies']) * 1e3:.1f} / "
        f"{statistics.median(loaded['health_latencies']) * 1e3:.1f}; "
        f"stream max gap ms {max(baseline['stream_gaps']) * 1e3:.0f} / {max(loaded['stream_gaps']) * 1e3:.0f}; "
        f"big requests {len(loaded['big'])}"
    )
    assert loaded["health_statuses"] == [200] * 20
    assert loaded["big"], "no 20 MB request was sent"
    for status, text in loaded["big"]:
        assert status == 400 and "characters" in text, (status, text)
    assert loaded["num_chunks"] == baseline["num_chunks"] >= 100  # the stream lost nothing
    assert wait_until_clean(srv), srv.metrics()
