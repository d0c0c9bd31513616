"""Helpers shared by the reliability tests (the fixtures are in conftest.py).

The server helpers are those of tests/entrypoints (its conftest, loaded by path, not copied).
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "tokenloom_tests_server_helpers", Path(__file__).resolve().parent.parent / "entrypoints" / "conftest.py"
)
assert _spec is not None and _spec.loader is not None
server_helpers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(server_helpers)

ServerProcess = server_helpers.ServerProcess
child_pids = server_helpers.child_pids
core_pids = server_helpers.core_pids
is_render_worker = server_helpers.is_render_worker
pid_alive = server_helpers.pid_alive

API_KEY = "reliability-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SMALL_SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(128 * 1024**2)]
MODEL = "SmolLM2-135M-Instruct"


@contextlib.contextmanager
def running_server(extra_args: list[str], api_key: str | None = None, num_cores: int = 1,
                   env: dict[str, str] | None = None) -> Iterator:
    """A `tokenloom serve` of its own for one test or module: stopped, its engine cores killed if
    they linger, and its log removed at the end. `num_cores`: its engine cores (-dp); `env`: extra
    environment variables."""
    srv = ServerProcess(extra_args, api_key, num_cores=num_cores, env=env)
    try:
        yield srv
    finally:
        srv.stop()
        for pid in srv.core_pids:
            kill_quietly(pid)
        os.unlink(srv.log.name)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def ipc_dir_of(core_pid: int) -> Path:
    """The private socket directory of an engine core, from its command line (ipc://DIR/input)."""
    args = Path(f"/proc/{core_pid}/cmdline").read_bytes().split(b"\0")
    (addr,) = [a.decode() for a in args if a.startswith(b"ipc://") and a.endswith(b"/input")]
    return Path(addr.removeprefix("ipc://")).parent


def kill_quietly(pid: int | None) -> None:
    if pid is not None and pid_alive(pid):
        os.kill(pid, signal.SIGKILL)


def success_count(metrics: dict[str, float], reason: str) -> float:
    """tokenloom:request_success_total for one finished_reason, summed over the other labels."""
    pattern = re.compile(r'^tokenloom:request_success_total\{.*finished_reason="' + reason + '"')
    return sum(v for k, v in metrics.items() if pattern.match(k))


def core_is_clean(metrics: dict[str, float]) -> bool:
    """No request in the scheduler or the model runner, every KV block free."""
    return (
        metrics["tokenloom:num_requests_running"] == 0
        and metrics["tokenloom:num_requests_waiting"] == 0
        and metrics["tokenloom:num_requests_in_engine_core"] == 0
        and metrics["tokenloom:num_requests_in_model_runner"] == 0
        and metrics["tokenloom:num_kv_blocks_used"] == 0
        and metrics["tokenloom:num_kv_blocks_free"] == metrics["tokenloom:num_kv_blocks_total"] > 0
    )


def wait_until_clean(srv, timeout: float = 60.0) -> bool:
    return wait_until(lambda: core_is_clean(srv.metrics()), timeout, interval=0.25)


def openai_error(response) -> dict:
    """The `error` object of an OpenAI-shaped error body (asserting the shape)."""
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


# Fields whose valid values set how long a request runs. Fuzzers may send any value, but a valid
# large one would only make a test slow, not find a bug: it is brought down to 2.
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens", "n", "best_of", "min_tokens")
_INT64_LIMIT = 1 << 63


def _as_int(value) -> int | None:
    """The int pydantic's lax mode would read from `value`, roughly (3, 3.0, "3")."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value) if value.is_integer() else None
    if isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return None
        return int(number) if number.is_integer() else None
    return None


def bound_lengths(body):
    """`body` with every valid-but-long length field brought down to 2, and a max_tokens of None
    (for chat also a missing one; max_output_tokens for /v1/responses), which means "up to
    max_model_len", set to 2. Returns body."""
    if not isinstance(body, dict):
        return body
    for name in LENGTH_FIELDS:
        number = _as_int(body.get(name))
        if number is not None and 2 < number < _INT64_LIMIT:
            body[name] = 2
    if "input" in body:  # /v1/responses: no max_output_tokens runs to the end of the context
        if body.get("max_output_tokens") is None:
            body["max_output_tokens"] = 2
        return body
    unlimited = body.get("max_tokens", None if "messages" in body else 16) is None
    if unlimited and body.get("max_completion_tokens") is None:
        body["max_tokens"] = 2
    return body


def probe_while_in_flight(srv, big_body: bytes | None, num_probes: int = 20, hz: float = 10.0, stream_tokens: int = 48) -> dict:
    """Issue 21's responsiveness check. A streamed completion runs; once its first chunk is in,
    `big_body` (a raw /v1/completions body, or None for the baseline) is posted back to back
    while `num_probes` GET /health calls go out at `hz`. Returns the /health latencies and
    statuses, the big requests' statuses and messages, and the stream's gaps between chunks."""
    import threading

    import httpx

    headers = {**(srv.headers or {}), "Content-Type": "application/json"}
    first_chunk = threading.Event()
    stop = threading.Event()
    chunk_times: list[float] = []
    big_results: list[tuple[int, str]] = []

    def stream() -> None:
        body = {"prompt": "Once upon a time", "max_tokens": stream_tokens, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", srv.url("/v1/completions"), json=body, headers=headers, timeout=300) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk_times.append(time.monotonic())
                    first_chunk.set()
        first_chunk.set()

    def post_big() -> None:
        with httpx.Client(timeout=300) as client:
            while not stop.is_set():
                r = client.post(srv.url("/v1/completions"), content=big_body, headers=headers)
                big_results.append((r.status_code, r.text[:300]))

    streamer = threading.Thread(target=stream)
    streamer.start()
    first_chunk.wait(300)
    poster = threading.Thread(target=post_big) if big_body is not None else None
    if poster is not None:
        poster.start()
        time.sleep(0.05)  # the first big body is on its way
    latencies: list[float] = []
    statuses: list[int] = []
    with httpx.Client(timeout=120) as client:
        start = time.monotonic()
        for i in range(num_probes):
            time.sleep(max(0.0, start + i / hz - time.monotonic()))
            t0 = time.monotonic()
            statuses.append(client.get(srv.url("/health")).status_code)
            latencies.append(time.monotonic() - t0)
    stop.set()
    if poster is not None:
        poster.join()
    streamer.join()
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:])]
    return {"health_latencies": latencies, "health_statuses": statuses, "big": big_results, "stream_gaps": gaps, "num_chunks": len(chunk_times)}
