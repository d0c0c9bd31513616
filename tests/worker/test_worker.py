"""The worker's share of the machine: N ranks on one machine split its cores, so their spinning
OpenMP threads do not outnumber the cores (ops/cpu_threads)."""
from __future__ import annotations

from tokenloom.ops.cpu_threads import usable_cores
from tokenloom.worker.worker import threads_per_rank


def test_ranks_split_the_cores(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_NUM_THREADS", raising=False)
    cores = len(usable_cores())
    assert threads_per_rank(1) == cores
    assert threads_per_rank(2) == max(1, cores // 2)
    assert threads_per_rank(4 * cores) == 1  # never zero
    monkeypatch.setenv("TOKENLOOM_NUM_THREADS", "3")
    assert threads_per_rank(2) == 3  # a fixed count is per rank
