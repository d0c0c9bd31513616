"""The engine's thread governor (ops/cpu_threads.py) on this machine's real cores and /proc: with
another process spinning on one of our cores it gives up a thread, and it never goes below one
or above the cores it started with. Needs at least two usable cores and Linux's /proc/stat."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from tokenloom.ops.cpu_features import detect
from tokenloom.ops.cpu_threads import ThreadGovernor, _busy_ticks, usable_cores

pytestmark = pytest.mark.skipif(
    len(usable_cores()) < 2 or _busy_ticks(usable_cores()) is None,
    reason="needs two usable cores and /proc/stat")


@pytest.fixture
def two_threads(monkeypatch):
    monkeypatch.delenv("TOKENLOOM_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _step_beside_busy_process(gov: ThreadGovernor, prefix: list[str], seconds: float,
                              until=lambda: False) -> None:
    """Steps `gov` while a process (`prefix` + a Python spin loop) keeps our last core busy, for
    `seconds` or until `until()`."""
    busy = subprocess.Popen([*prefix, sys.executable, "-c", "while True: pass"])
    try:
        os.sched_setaffinity(busy.pid, {usable_cores()[-1]})
        deadline = time.monotonic() + seconds
        while not until() and time.monotonic() < deadline:
            _engine_step(gov)
    finally:
        busy.kill()
        busy.wait()


def _engine_step(gov: ThreadGovernor, seconds: float = 0.05) -> None:
    """What a running engine does between the governor's looks: a step's worth of matmuls on
    our threads (which use a core or more, so the window counts; the other process still shows)."""
    gov.step()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        torch.mm(torch.randn(256, 256), torch.randn(256, 256))


@pytest.mark.serial
def test_gives_up_a_thread_to_a_busy_process(two_threads, quiet_cores):
    gov = ThreadGovernor(interval_s=0.3)
    assert gov.enabled and gov.max_threads == 2 and "adaptive" in gov.describe()
    _step_beside_busy_process(gov, [], seconds=10, until=lambda: gov.threads != 2)
    assert gov.others_cores >= 0.4
    assert gov.threads == 1 and torch.get_num_threads() == 1


@pytest.mark.serial
@pytest.mark.skipif(os.getpriority(os.PRIO_PROCESS, 0) > 0,
                    reason="this process is niced itself, so niced processes compete equally")
def test_keeps_its_threads_beside_a_niced_process(two_threads, quiet_cores):
    """A batch job started with `nice -n 19` gets ~1.5% of a core our threads want: giving it a
    thread would halve our rate for nothing."""
    gov = ThreadGovernor(interval_s=0.3)
    assert not gov.count_nice
    _step_beside_busy_process(gov, ["nice", "-n", "19"], seconds=2.5)
    assert gov.threads == 2 and torch.get_num_threads() == 2


@pytest.mark.serial
def test_a_pause_of_ours_does_not_count_what_others_did_meanwhile(two_threads, quiet_cores):
    """Between two of our runs another process had both cores (a benchmark's other engine): the
    window over that pause must not cost us a thread once we run again on an idle machine."""
    gov = ThreadGovernor(interval_s=0.3)
    _engine_step(gov, 0.4)
    _engine_step(gov, 0.1)  # a first full window: we ran, nobody else did
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        time.sleep(1.5)  # we are idle: no steps, no looks
    finally:
        for p in busy:
            p.kill()
            p.wait()
    seen = []
    for _ in range(15):  # ~0.75 s of steps: two more windows
        _engine_step(gov)
        seen.append(gov.threads)
    assert seen == [2] * len(seen) and torch.get_num_threads() == 2


def test_fixed_count_switches_it_off(two_threads, monkeypatch):
    monkeypatch.setenv("TOKENLOOM_NUM_THREADS", "2")
    gov = ThreadGovernor()
    assert not gov.enabled and gov.describe() == "fixed"
    gov.step()
    assert torch.get_num_threads() == 2


def test_configured_count_fixes_it_and_overrides_the_environment(two_threads, monkeypatch):
    """num_threads (--threads, -t): a fixed count, ahead of TOKENLOOM_NUM_THREADS."""
    from tokenloom.ops.cpu_threads import fixed_num_threads, set_compute_threads

    monkeypatch.setenv("TOKENLOOM_NUM_THREADS", "2")
    assert fixed_num_threads(1) == 1 and fixed_num_threads() == 2
    assert set_compute_threads(1) == 1 and torch.get_num_threads() == 1
    monkeypatch.delenv("TOKENLOOM_NUM_THREADS")
    torch.set_num_threads(2)
    assert ThreadGovernor().enabled
    gov = ThreadGovernor(configured=2)
    assert not gov.enabled and gov.describe() == "fixed"


def test_cpu_features_name_this_cpu():
    f = detect()
    assert f.num_cores == len(os.sched_getaffinity(0))
    assert f.isa in ("avx512", "avx2", "scalar")
    if f.isa == "avx512":
        assert {"avx512f", "avx512bw", "avx512vl"} <= f.flags
    assert f.model_name in f.summary()
