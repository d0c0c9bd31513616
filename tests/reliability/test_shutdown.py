"""Stopping `tokenloom serve` as supervisors and people stop it: SIGTERM with requests in flight
(they get a few seconds, then a clean end rather than a cut connection), Ctrl-C (a clean exit,
status 0, no traceback), and a port already taken (refused before the engine starts)."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import openai
from reliability_helpers import MODEL, SMALL_SERVER_ARGS, child_pids, core_pids, pid_alive, running_server, wait_until

from tokenloom.entrypoints.openai.api_server import DRAIN_S

TOKENLOOM = Path(sys.executable).with_name("tokenloom")
# Long enough to outlast the drain on any machine: 2,000 tokens.
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
LONG_SERVER_ARGS = ["--max-model-len", "2048", "--kv-cache-memory-bytes", str(128 * 1024**2)]


def test_sigterm_gives_requests_the_drain_then_ends_them_cleanly():
    with running_server(LONG_SERVER_ARGS) as srv:
        core = srv.core_pid
        stream_lines: list[str] = []
        plain: dict = {}
        first_chunk = threading.Event()

        def streamed() -> None:
            body = {"model": MODEL, "prompt": "Story:", "stream": True, **LONG}
            with httpx.stream("POST", srv.url("/v1/completions"), json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if line:
                        stream_lines.append(line)
                        first_chunk.set()

        def not_streamed() -> None:
            try:
                srv.client().completions.create(model=MODEL, prompt="Poem:", extra_body=LONG)
            except openai.APIStatusError as e:
                plain["error"] = e

        threads = [threading.Thread(target=streamed), threading.Thread(target=not_streamed)]
        for t in threads:
            t.start()
        assert first_chunk.wait(300), srv.log_text()
        srv.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=DRAIN_S + 60)
        # The stream ran on through the drain, then ended with the error event and [DONE].
        assert stream_lines[-1] == "data: [DONE]", stream_lines[-3:]
        error = json.loads(stream_lines[-2].removeprefix("data: "))["error"]
        assert error["code"] == "server_shutting_down", error
        assert len(stream_lines) > 3
        e = plain["error"]
        assert e.status_code == 503 and e.response.json()["error"]["code"] == "server_shutting_down"
        assert srv.proc.wait(timeout=30) == 0  # a stop someone asked for: a clean exit, as vLLM's
        assert wait_until(lambda: not pid_alive(core), 15), "the engine core outlived its server"
        log = srv.log_text()
        assert "Traceback" not in log and "ending 2 request(s) still running" in log, log


def _serve_in_own_session(args: list[str], log) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen([str(TOKENLOOM), "serve", "--port", str(port), *args], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its own process group, as a terminal gives it
    return proc, port


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ctrl_c_is_a_clean_stop():
    """A terminal's Ctrl-C signals the whole process group, the engine core included: the server
    exits with status 0 and logs no error or traceback."""
    with tempfile.NamedTemporaryFile(prefix="tokenloom-ctrl-c-", suffix=".log") as log:
        proc, port = _serve_in_own_session(SMALL_SERVER_ARGS, log)
        try:
            def ready() -> bool:
                try:
                    return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                except httpx.HTTPError:
                    return proc.poll() is not None
            assert wait_until(ready, 300, interval=0.5) and proc.poll() is None
            (core,) = core_pids(proc.pid)
            os.killpg(proc.pid, signal.SIGINT)
            rc = proc.wait(timeout=60)
            text = Path(log.name).read_text()
            assert rc == 0, text
            assert "Traceback" not in text and " ERROR " not in text and "ERROR:" not in text, text
            assert wait_until(lambda: not pid_alive(core), 15)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def test_a_port_in_use_is_refused_before_the_engine_starts():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        proc = subprocess.Popen([str(TOKENLOOM), "serve", "--port", str(port), *SMALL_SERVER_ARGS],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        children: set[int] = set()
        while proc.poll() is None:  # an engine core would live for seconds: it is never started
            children |= set(child_pids(proc.pid))
            time.sleep(0.02)
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2, err
    assert err.strip() == f"tokenloom: error: cannot listen on 127.0.0.1:{port}: Address already in use", err
    assert not children, "the engine core was started before the port was known to be free"
