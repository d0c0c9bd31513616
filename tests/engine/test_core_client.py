"""The process boundary: the engine core in a child process dies loudly and never alone."""
from __future__ import annotations

import ctypes
import os
import platform
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.engine.core_client import EngineDeadError


# tgkill(2)'s number: a signal to one thread of a process.
_SYS_TGKILL = {"x86_64": 234, "aarch64": 131}.get(platform.machine())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purposes (it holds no memory, runs nothing).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_killing_engine_core_during_generate_raises_quickly():
    llm = LLM(kv_cache_memory_bytes=64 * 1024**2)
    pid = llm.llm_engine.engine_core.info.pid
    assert pid != os.getpid() and _alive(pid)
    killed_at: list[float] = []

    def kill_soon() -> None:
        time.sleep(1.5)
        killed_at.append(time.monotonic())
        os.kill(pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    params = SamplingParams(temperature=0.0, max_tokens=2000, ignore_eos=True)
    with pytest.raises(EngineDeadError, match="engine core"):
        llm.generate(["Tell me a long story."] * 4, params, use_tqdm=False)
    assert time.monotonic() - killed_at[0] < 5.0
    # Later calls fail fast with the same error instead of hanging.
    with pytest.raises(EngineDeadError):
        llm.generate("hello", params, use_tqdm=False)
    llm.shutdown()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)


def _wait_dead(pid: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_engine_core_death_while_idle_fails_the_next_call_fast():
    """Nothing is receiving while the LLM is idle; the next call's send must notice the death (a
    PUSH socket without a peer would otherwise block it forever). A send that learns of the exit
    after another thread has marked the core dead and the sockets were closed (the async client's
    output side, then a shutdown) gets the EngineDeadError too, not the closed socket's ZMQError
    (seen once in a full run of the suite)."""
    llm = LLM(kv_cache_memory_bytes=64 * 1024**2)
    params = SamplingParams(temperature=0.0, max_tokens=4)
    assert llm.generate("Hello", params, use_tqdm=False)[0].outputs[0].token_ids
    pid = llm.llm_engine.engine_core.info.pid
    os.kill(pid, signal.SIGKILL)
    _wait_dead(pid)
    time.sleep(0.5)  # the socket's peer is gone too
    for call in (lambda: llm.generate("Hello", params, use_tqdm=False), llm.reset_prefix_cache):
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match=f"{pid} exited"):
            call()
        assert time.monotonic() - t0 < 5.0
    client = llm.llm_engine.engine_core
    client._dead_reason = None  # as if no call had found the death yet
    client._finalizer()  # the sockets closed, as a shutdown by another thread closes them
    with pytest.raises(EngineDeadError, match=f"{pid} exited"):
        client._check_process()
    client._dead_reason = "found first by the output thread"
    with pytest.raises(EngineDeadError, match="found first by the output thread"):
        client._check_process()
    llm.shutdown()


@pytest.mark.skipif(_SYS_TGKILL is None, reason="tgkill's number is known for x86_64 and aarch64 only")
def test_sigint_to_any_core_thread_ends_an_idle_core():
    # The kernel may hand a process's SIGINT to any of its threads; Python acts on it only in the
    # main thread, which must not sleep through it (the keep-alive server sends nothing more).
    llm = LLM(kv_cache_memory_bytes=64 * 1024**2)
    assert llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)[0].outputs[0].token_ids
    pid = llm.llm_engine.engine_core.info.pid
    other = next(int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.syscall(_SYS_TGKILL, pid, other, signal.SIGINT) == 0  # to that one thread
    _wait_dead(pid, timeout=10)
    # Long enough for the client's socket to drop the dead peer: the next send then finds no one
    # to send to, while the core's own account of its death still waits unread.
    time.sleep(1.0)
    with pytest.raises(EngineDeadError, match="engine core stopped by SIGINT"):
        llm.generate("Hi", SamplingParams(max_tokens=1), use_tqdm=False)
    llm.shutdown()


def _children(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def test_ctrl_c_while_the_engine_core_starts_exits_and_leaves_no_process():
    # Ctrl-C reaches the whole process group: the core dies before it ever connects, and the
    # caller must not wait on a socket nobody will read.
    script = textwrap.dedent(
        """
        from tokenloom import LLM
        print("starting", flush=True)
        LLM(kv_cache_memory_bytes=64 * 1024**2)
        print("ready", flush=True)
        """
    )
    # As from a terminal: SIGINT at its default. A pytest worker may have come to ignore it (an
    # earlier test in the same process), and an ignored SIGINT is inherited: the caller would then
    # start the engine regardless and exit 0 (seen in 2 of 3 full runs).
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              start_new_session=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert caller.stdout.readline().strip() == "starting"
        deadline = time.monotonic() + 30
        while not (kids := _children(caller.pid)) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert kids, "the engine core was not started"
        time.sleep(0.3)  # importing torch: the core has not connected yet
        os.killpg(caller.pid, signal.SIGINT)
        caller.wait(timeout=20)
        assert caller.returncode != 0
        for kid in kids:
            _wait_dead(kid)
    finally:
        if caller.poll() is None:
            os.killpg(caller.pid, signal.SIGKILL)


def test_engine_core_exits_when_caller_is_killed(tmp_path):
    script = textwrap.dedent(
        """
        import sys, time
        from tokenloom import LLM
        llm = LLM(kv_cache_memory_bytes=64 * 1024**2)
        print(llm.llm_engine.engine_core.info.pid, flush=True)
        time.sleep(600)
        """
    )
    caller = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child_pid = int(caller.stdout.readline())
        assert _alive(child_pid)
        caller.send_signal(signal.SIGKILL)
        caller.wait(timeout=10)
        deadline = time.monotonic() + 10
        while _alive(child_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child_pid), "engine core outlived its parent"
    finally:
        if caller.poll() is None:
            caller.kill()
