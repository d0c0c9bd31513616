"""The planted ledger tests' hold on the machine: a quiet run that other sessions' work cannot
disturb (the engine core's priority raised), and a CPU hog beside the engine."""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import pytest

_HOG = "while True: pass"


def set_nice(pid: int, nice: int) -> bool:
    """Sets every thread of `pid` to `nice` (Linux keeps a nice value per thread); False when not
    allowed (raising a priority needs root)."""
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    except (PermissionError, FileNotFoundError):
        return False
    return True


# The planted test's engine core and its hog run at this nice value, and so does their session's
# autogroup (with kernel.sched_autogroup_enabled the scheduler shares the cores between sessions
# first, by the autogroup's nice, then by each thread's nice within one): the other work on a
# shared machine then gets a small share of a core the engine wants (its scheduler weight), so
# the run without the hog is quiet however busy the machine is, and the hog competes as an equal.
_PLANTED_NICE = -15


@contextlib.contextmanager
def quiet_machine(pid: int):
    """Raises the engine core's priority (threads and autogroup) for the planted test, then puts
    its autogroup back; skips the test where that is not allowed."""
    if not set_nice(pid, _PLANTED_NICE):
        pytest.skip("raising the engine core's priority (to keep the others' work out of the quiet run) needs root")
    group = f"/proc/{pid}/autogroup"
    old = None
    try:
        with open(group) as f:
            old = f.read().split("nice")[-1].strip()
        with open(group, "w") as f:
            f.write(str(_PLANTED_NICE))
    except (OSError, IndexError):
        old = None
    try:
        yield
    finally:
        if old is not None:
            with open(group, "w") as f:
                f.write(old)


@contextlib.contextmanager
def cpu_hog(per_core: int = 2, cores: list[int] | None = None, nice: int | None = None):
    """`per_core` busy processes on each of `cores` (default: every core this process may use),
    at `nice` when given."""
    cores = sorted(os.sched_getaffinity(0)) if cores is None else cores
    procs = []
    try:
        for core in cores:
            for _ in range(per_core):
                p = subprocess.Popen([sys.executable, "-c", _HOG], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
                os.sched_setaffinity(p.pid, [core])
                if nice is not None:
                    set_nice(p.pid, nice)
                procs.append(p)
        time.sleep(0.3)
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()
