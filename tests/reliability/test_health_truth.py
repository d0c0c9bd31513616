"""Issue 46: /health tells the truth, and SIGTERM ends the server whatever its workers do.

On a real `tokenloom serve` with real signals and real requests:
- the engine core SIGSTOPped while a request waits: /health turns 503 (engine_unresponsive)
  within 5 s, and 200 again within 5 s of SIGCONT, after which the request completes;
- a long prefill (one step longer than the heartbeat timeout) never turns /health red;
- every tokenizer thread busy on one long job turns /health 503 (tokenizer_pool_saturated), and
  200 again once the work is done. The long jobs are real requests: a /v1/completions prompt of
  ~15 MB with `truncate_prompt_tokens`, which the server must tokenize in full before keeping its
  last tokens (seconds to tens of seconds of one thread each);
- SIGTERM while those jobs hold every tokenizer thread ends the process shortly after the drain,
  status 0, the requests answered 503 server_shutting_down, the engine core reaped and its socket
  directory removed.
"""
from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest
from reliability_helpers import MODEL, SMALL_SERVER_ARGS, ipc_dir_of, pid_alive, running_server, wait_until

from tokenloom.engine.async_llm import NUM_TOKENIZER_THREADS
from tokenloom.entrypoints.openai.api_server import DRAIN_S

# Prompts the server tokenizes in full (truncate_prompt_tokens keeps only their end), one after the
# other: ~3 MB each, seconds of one tokenizer thread each (and a bounded amount of memory).
_BIG_PROMPT = "The quick brown fox jumps over the lazy dog, 12345 times. " * 52_000


def _slow_body(num_prompts: int) -> dict:
    return {"model": MODEL, "prompt": [_BIG_PROMPT] * num_prompts, "truncate_prompt_tokens": 8, "max_tokens": 1,
            "temperature": 0}


def _health(srv) -> httpx.Response:
    return httpx.get(srv.url("/health"), timeout=30)


def _code(response: httpx.Response) -> str | None:
    try:
        return response.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return None


def _time_until(predicate, timeout: float, interval: float = 0.1) -> float | None:
    start = time.monotonic()
    return time.monotonic() - start if wait_until(predicate, timeout, interval) else None


@pytest.mark.serial
def test_health_sees_a_stopped_engine_core_and_its_return():
    with running_server(SMALL_SERVER_ARGS) as srv:
        core = srv.core_pid
        assert _health(srv).status_code == 200
        result: dict = {}
        first_chunk = threading.Event()

        def waiting_request() -> None:
            body = {"model": MODEL, "prompt": "Story:", "max_tokens": 64, "ignore_eos": True, "temperature": 0,
                    "stream": True}
            chunks, done = 0, False
            with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=120) as r:
                for line in r.iter_lines():
                    done = done or line == "data: [DONE]"
                    if line.startswith("data: ") and not done:
                        chunks += 1
                        first_chunk.set()
                result["status"], result["chunks"], result["done"] = r.status_code, chunks, done

        t = threading.Thread(target=waiting_request)
        t.start()
        try:
            assert first_chunk.wait(120), srv.log_text()
            os.kill(core, signal.SIGSTOP)
            red = _time_until(lambda: _health(srv).status_code == 503, 10)
            assert red is not None and red < 5, f"/health still 200 {red}s after SIGSTOP"
            print(f"/health 503 {red:.2f}s after SIGSTOP")
            stalled = _health(srv)
            assert stalled.status_code == 503 and _code(stalled) == "engine_unresponsive", stalled.text
            assert "heartbeat" in stalled.json()["error"]["message"]
            age = srv.metrics()["tokenloom:engine_heartbeat_age_seconds"]
            assert age > 3.0, age
            assert t.is_alive(), "the request finished while its engine core was stopped"
        finally:
            os.kill(core, signal.SIGCONT)
        green = _time_until(lambda: _health(srv).status_code == 200, 10)
        assert green is not None and green < 5, f"/health still 503 {green}s after SIGCONT"
        print(f"/health 200 {green:.2f}s after SIGCONT")
        t.join(120)
        assert result.get("status") == 200 and result["chunks"] == 64 and result["done"], result
        assert srv.metrics()["tokenloom:engine_heartbeat_age_seconds"] < 3.0


@pytest.mark.slow
@pytest.mark.serial
def test_a_long_prefill_never_turns_health_red():
    """A prompt of ~3,500 tokens prefilled in one step takes longer than the 1 s heartbeat timeout
    set here: heartbeats come from the core's output thread during the step, so /health stays 200
    throughout."""
    args = ["--max-model-len", "4096", "--max-num-batched-tokens", "4096", "--kv-cache-memory-bytes",
            str(256 * 1024**2), "--health-heartbeat-timeout", "1"]
    with running_server(args) as srv:
        prompt = "The quick brown fox jumps over the lazy dog. " * 350  # ~3,500 tokens
        results: list[tuple[int, float]] = []

        def request() -> None:
            t0 = time.monotonic()
            r = httpx.post(srv.url("/v1/completions"), timeout=300,
                           json={"model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0})
            results.append((r.status_code, time.monotonic() - t0))

        threads = [threading.Thread(target=request) for _ in range(2)]
        for t in threads:
            t.start()
        statuses = []
        with httpx.Client(timeout=30) as client:
            while any(t.is_alive() for t in threads):
                statuses.append(client.get(srv.url("/health")).status_code)
                time.sleep(0.2)
        assert [s for s, _ in results] == [200, 200], results
        assert min(took for _, took in results) > 1.0, f"the prefill was too short to show anything: {results}"
        print(f"requests took {[round(took, 1) for _, took in results]} s; {len(statuses)} probes, all 200")
        assert statuses and set(statuses) == {200}, statuses
        assert srv.metrics()["tokenloom:engine_heartbeat_age_seconds"] < 1.0


def _post_slow_requests(srv, results: list, num_prompts: int) -> list[threading.Thread]:
    """One completion of `num_prompts` big prompts per tokenizer thread, each posted from a
    thread of its own."""
    body = _slow_body(num_prompts)

    def post() -> None:
        try:
            r = httpx.post(srv.url("/v1/completions"), json=body, timeout=300)
            results.append((r.status_code, _code(r)))
        except httpx.HTTPError as e:
            results.append((None, repr(e)))

    threads = [threading.Thread(target=post) for _ in range(NUM_TOKENIZER_THREADS)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.slow
def test_a_saturated_tokenizer_pool_turns_health_red_with_the_reason():
    with running_server(SMALL_SERVER_ARGS + ["--health-tokenizer-pool-limit", "1"]) as srv:
        results: list = []
        # Three prompts (within the default 16 MiB body limit): seconds each, past the 1 s limit.
        threads = _post_slow_requests(srv, results, 3)
        responses: list[httpx.Response] = []
        assert wait_until(lambda: responses.append(_health(srv)) or responses[-1].status_code == 503, 60), (
            results, srv.log_text())
        r = responses[-1]
        assert _code(r) == "tokenizer_pool_saturated", r.text
        assert f"Every one of the {NUM_TOKENIZER_THREADS} tokenizer threads" in r.json()["error"]["message"]
        # Once the work is done, the server is healthy again and the requests were served.
        for t in threads:
            t.join(300)
        assert results == [(200, None)] * NUM_TOKENIZER_THREADS, results
        assert _health(srv).status_code == 200


@pytest.mark.slow
@pytest.mark.serial
def test_sigterm_ends_the_server_while_every_tokenizer_thread_is_busy():
    """Each request's 20 prompts keep a tokenizer thread busy far longer than the drain (over a
    minute on the 2-core test machine)."""
    args = SMALL_SERVER_ARGS + ["--health-tokenizer-pool-limit", "1", "--max-request-body-bytes", str(64 * 1024**2)]
    with running_server(args) as srv:
        core, ipc_dir = srv.core_pid, ipc_dir_of(srv.core_pid)
        results: list = []
        threads = _post_slow_requests(srv, results, 20)
        # Every thread has been on its job for over a second: the work is under way.
        assert wait_until(lambda: _code(_health(srv)) == "tokenizer_pool_saturated", 60), srv.log_text()
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        try:
            rc = srv.proc.wait(timeout=DRAIN_S + 60)
        except Exception:
            pytest.fail(f"the server did not exit after SIGTERM:\n{srv.log_text()}")
        took = time.monotonic() - t0
        for t in threads:
            t.join(30)
        print(f"SIGTERM ended the server in {took:.2f}s")
        # Within uvicorn's own graceful timeout (DRAIN_S + 5), which a server that left these
        # requests to their tokenizer threads had to wait out, and then cut them off unanswered.
        assert took < DRAIN_S + 5, f"SIGTERM took {took:.1f}s to end the server"
        assert rc == 0, srv.log_text()
        assert results == [(503, "server_shutting_down")] * NUM_TOKENIZER_THREADS, results
        assert wait_until(lambda: not pid_alive(core), 15), "the engine core outlived its server"
        assert not ipc_dir.exists(), f"{ipc_dir} was left behind"
        assert "Traceback" not in srv.log_text(), srv.log_text()


@pytest.mark.slow
@pytest.mark.serial
def test_a_stalled_data_parallel_replica_is_not_alive_for_routing():
    """-dp 2: one replica SIGSTOPped leaves /health 200 "degraded" without it, and new requests
    go to the other one; both stopped is a 503; SIGCONT brings them back."""
    args = ["-dp", "2", "--max-model-len", "256", "--num-kv-blocks", "64"]
    with running_server(args, num_cores=2) as srv:
        stopped, other = srv.core_pids
        # Which replica a pid is: the engine core's command line ends with RANK/SIZE.
        rank = {pid: int(open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")[-2].split(b"/")[0])
                for pid in srv.core_pids}
        try:
            os.kill(stopped, signal.SIGSTOP)
            assert wait_until(lambda: _health(srv).json().get("status") == "degraded", 10)
            body = _health(srv).json()
            assert body["replicas_alive"] == [rank[other]] and body["replicas_stalled"] == [rank[stopped]], body
            for i in range(4):  # all served, by the replica that answers
                r = httpx.post(srv.url("/v1/completions"), timeout=60,
                               json={"model": MODEL, "prompt": f"Hi {i}", "max_tokens": 2})
                assert r.status_code == 200, r.text
            os.kill(other, signal.SIGSTOP)
            assert wait_until(lambda: _health(srv).status_code == 503, 10)
            assert _code(_health(srv)) == "engine_unresponsive"
        finally:
            for pid in srv.core_pids:
                os.kill(pid, signal.SIGCONT)
        assert wait_until(lambda: _health(srv).status_code == 200 and _health(srv).json()["status"] == "ok", 10)
