"""`--keep-alive-on-engine-death` does what the README says (issue 21): once the engine core is
dead, every route answers 503 (`engine_dead`), /version, /metrics and /v1/models included, and
the dead core is reaped (no `<defunct>` zombie) and its socket directory removed, while the server
stays up until it is stopped by hand.

The core is made to die of an exception (SIGINT raises KeyboardInterrupt in its busy loop): it
then reports `engine_error` before exiting, the path that used to leave the zombie, since the
server learned of the death from the message and never waited for the process.
"""
from __future__ import annotations

import os
import signal
from pathlib import Path

import httpx
import pytest
from reliability_helpers import SMALL_SERVER_ARGS, ipc_dir_of, pid_alive, running_server, wait_until

ROUTES = [
    ("GET", "/health"), ("GET", "/version"), ("GET", "/metrics"), ("GET", "/v1/models"),
    ("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/no/such/route"),
]  # fmt: skip


def _zombie_or_alive(pid: int) -> bool:
    """True while /proc still lists the process, zombie or not (pid_alive ignores zombies)."""
    return Path(f"/proc/{pid}").exists()


@pytest.fixture
def keep_alive_server():
    with running_server([*SMALL_SERVER_ARGS, "--keep-alive-on-engine-death"]) as srv:
        yield srv


def test_every_route_is_a_503_and_the_dead_core_is_reaped(keep_alive_server):
    srv = keep_alive_server
    core, ipc_dir = srv.core_pid, ipc_dir_of(srv.core_pid)
    for method, path in ROUTES[:4]:
        assert httpx.request(method, srv.url(path), timeout=30).status_code == 200, path
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 1}, timeout=120)
    assert r.status_code == 200, r.text

    os.kill(core, signal.SIGINT)
    assert wait_until(lambda: httpx.get(srv.url("/health"), timeout=30).status_code == 503, 60)
    body = {"prompt": "Hi", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    for method, path in ROUTES:
        r = httpx.request(method, srv.url(path), json=body if method == "POST" else None, timeout=30)
        assert r.status_code == 503, (path, r.status_code, r.text)
        assert r.json()["error"]["code"] == "engine_dead", (path, r.text)

    # Reaped (gone from /proc, not a <defunct> child of the server) and its sockets removed.
    assert wait_until(lambda: not _zombie_or_alive(core), 30), Path(f"/proc/{core}/stat").read_text()
    assert wait_until(lambda: not ipc_dir.exists(), 30), list(ipc_dir.iterdir())
    assert srv.proc.poll() is None and not pid_alive(core)  # the server itself stays up
