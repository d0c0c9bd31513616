"""The process boundary: the engine core in a child process dies loudly and never alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from tokenloom import LLM, SamplingParams
from tokenloom.engine.core_client import EngineDeadError


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


def test_shutdown_leaves_no_process():
    llm = LLM(kv_cache_memory_bytes=64 * 1024**2)
    pid = llm.llm_engine.engine_core.info.pid
    out = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) >= 1
    llm.shutdown()
    deadline = time.monotonic() + 5
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid)
