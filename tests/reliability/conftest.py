"""Faults, aborts, overload and bad input, on real parts: a `tokenloom serve` subprocess with its
engine-core child, real sockets, the `openai` and httpx clients, and an offline `LLM` whose core
runs in its own process.

Servers here are small (max_model_len 256, a 128 MiB KV cache) and every generation is a few
tokens, so each test is bounded even on a loaded 2-core machine.
"""
from __future__ import annotations

import os

import pytest
from reliability_helpers import API_KEY, SMALL_SERVER_ARGS, ServerProcess, kill_quietly, pid_alive, server_helpers, wait_until

server = server_helpers.server  # module-scoped: a module sets SERVER_ARGS (and SERVER_API_KEY)


@pytest.fixture(scope="package")
def shared_server():
    """One server for the modules that leave it healthy and idle (storm, bad input, schemathesis,
    security): an API key, the small limits above and the default max_num_seqs."""
    srv = ServerProcess(SMALL_SERVER_ARGS, API_KEY)
    core = srv.core_pid
    try:
        yield srv
    finally:
        srv.stop()
        orphan = not wait_until(lambda: not pid_alive(core), 10)
        kill_quietly(core)
        os.unlink(srv.log.name)
        assert not orphan, f"engine core {core} outlived its server"


@pytest.fixture(scope="package")
def offline_llm():
    """An offline LLM with a tiny KV cache (8 blocks of 16 tokens = 128 tokens) and one sequence
    at a time: for admission limits, FCFS order and the IPC checks."""
    from tokenloom import LLM

    llm = LLM(num_kv_blocks=8, max_num_seqs=1, max_model_len=256, enable_prefix_caching=False)
    try:
        yield llm
    finally:
        llm.shutdown()
