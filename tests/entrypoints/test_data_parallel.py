"""`tokenloom serve -dp 2`, driven by `tokenloom bench serve`: every request completes once and both
replicas work; kill -9 of one replica fails only its requests in flight, and the other replica
keeps serving. Once with local processes, once with the replicas as Ray actors."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from conftest import TOKENLOOM, ServerProcess, child_pids  # noqa: E402 - tests/entrypoints/conftest.py

pytestmark = pytest.mark.slow

DP_ARGS = ["-dp", "2", "--max-model-len", "256", "--num-kv-blocks", "64", "--max-num-seqs", "32"]
NUM_PROMPTS = 32  # 16 per replica: about one wave each (64 KV blocks hold ~16 requests of 16 + 48 tokens)


def bench_serve(srv: ServerProcess, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(TOKENLOOM), "bench", "serve", "--base-url", srv.base_url, "--num-prompts", str(NUM_PROMPTS),
         "--input-len", "16", "--json", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result_of(bench: subprocess.Popen) -> dict:
    out, err = bench.communicate(timeout=300)
    assert out.strip(), err
    return json.loads(out.strip().splitlines()[-1])


def replica_value(metrics: dict[str, float], name: str, engine: int) -> float:
    return sum(v for k, v in metrics.items() if k.startswith(f"tokenloom:{name}{{") and f'engine="{engine}"' in k)


def wait_for(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def ray_actor_pids(server_pid: int) -> list[int]:
    """The worker processes of the server's Ray engine-core actors: descendants of its own Ray
    instance's raylet, whose process title names the actor class."""
    pids, todo = [], [server_pid]
    while todo:
        for child in child_pids(todo.pop()):
            todo.append(child)
            try:
                if b"EngineCoreActor" in Path(f"/proc/{child}/cmdline").read_bytes():
                    pids.append(child)
            except OSError:
                pass
    return pids


def check_balanced_run(srv: ServerProcess) -> None:
    result = result_of(bench_serve(srv, "--output-len", "8"))
    assert result["completed"] == NUM_PROMPTS and result["failed"] == 0, result
    m = srv.metrics()
    finished = [replica_value(m, "replica_requests_finished_total", e) for e in (0, 1)]
    assert all(f > 0 for f in finished), finished  # both replicas did work
    assert sum(finished) == NUM_PROMPTS
    # Exactly once: the unlabelled totals count each request one time.
    assert m['tokenloom:request_success_total{finished_reason="length",model_name="SmolLM2-135M-Instruct"}'] == NUM_PROMPTS
    assert httpx.get(srv.url("/health")).json() == {"status": "ok", "data_parallel_size": 2, "replicas_alive": [0, 1]}


def check_kill_one(srv: ServerProcess, victim_pid: int) -> None:
    bench = bench_serve(srv, "--output-len", "48")
    # Kill once both replicas are busy, so the victim dies with requests in flight.
    assert wait_for(lambda: all(replica_value(srv.metrics(), "replica_num_requests_running", e) > 0 for e in (0, 1)))
    os.kill(victim_pid, signal.SIGKILL)
    result = result_of(bench)
    assert result["completed"] + result["failed"] == NUM_PROMPTS, result
    assert result["failed"] > 0 and result["completed"] > 0, result
    assert all("engine core is dead" in e and "data-parallel replica" in e for e in result["errors"]), result["errors"]
    health = httpx.get(srv.url("/health"))
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    (alive,) = health.json()["replicas_alive"]
    dead = 1 - alive
    m = srv.metrics()
    assert replica_value(m, "replica_up", dead) == 0 and replica_value(m, "replica_up", alive) == 1
    # Only its requests in flight failed, and the error count says so per replica.
    assert replica_value(m, "replica_requests_failed_total", dead) == result["failed"]
    assert replica_value(m, "replica_requests_failed_total", alive) == 0
    # The survivor keeps answering, and new requests go only to it.
    client = srv.client()
    for _ in range(3):
        out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=4)
        assert out.choices[0].finish_reason == "length"
    assert srv.proc.poll() is None


def test_dp2_processes_balance_and_survive_a_dead_replica():
    srv = ServerProcess(DP_ARGS, None, num_cores=2)
    try:
        check_balanced_run(srv)
        victim = next(p for p in srv.core_pids if Path(f"/proc/{p}/cmdline").read_bytes().endswith(b"1/2\0"))
        check_kill_one(srv, victim)
    finally:
        srv.stop()


@pytest.mark.ray
def test_dp2_ray_actors_balance_and_survive_a_dead_replica():
    pytest.importorskip("ray")
    # A Ray instance of its own (RAY_ADDRESS=local), never a cluster someone else started here.
    srv = ServerProcess([*DP_ARGS, "--distributed-executor-backend", "ray"], None, num_cores=None,
                        env={"RAY_ADDRESS": "local"})
    try:
        check_balanced_run(srv)
        pids = ray_actor_pids(srv.proc.pid)
        assert len(pids) == 2, pids
        check_kill_one(srv, pids[0])
    finally:
        srv.stop()
