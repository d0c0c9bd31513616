"""Machine contention, measured: how long the engine's compute threads were runnable but not
running, per step, and how much of the machine other processes used meanwhile.

Wall time minus CPU time is not it: that also counts the waits on ZMQ, on I/O and at OpenMP
barriers. Linux measures it directly: `/proc/<pid>/task/<tid>/schedstat` holds, per thread,
the nanoseconds it ran on a CPU and the nanoseconds it waited on a run queue (`run_delay`), the
time the scheduler kept it off a core it asked for (other processes' threads on it, or in a
container the cgroup's CPU quota throttling it: a throttled thread waits on its queue too).

`StepCpuMeter` keeps one file descriptor open per compute thread of the engine-core process and
reads them with `os.pread` (one small read each, no open/close) at the end of every step:
- the compute threads are the thread that runs the steps and every thread of the process that
  Python did not start (OpenMP's and torch's pools); the input, output and grammar threads are
  left out. They are found once and looked for again every `REFRESH_S`, since OpenMP starts its
  pool on the first parallel region and the governor (ops/cpu_threads.py) changes its size;
- a step's contention is the largest `run_delay` any of them gathered over the step: a parallel
  region ends when its last thread does, so the step waited at least as long as its most delayed
  thread waited to run (its partners spin meanwhile, which is CPU time, not contention);
- its CPU time is the sum of their on-CPU time over the step;
- other processes' use of the cores this process may run on comes from /proc/stat (non-idle
  ticks of those cores minus this process's own CPU time, and the tensor-parallel ranks' that
  `add_cpu` reports), read at most every `LOAD_INTERVAL_S` (a tick is coarse; a step is short)
  with the governor's reader;
- in a container with a CPU quota, the time the quota throttled the engine (ops/cgroup_cpu.py):
  its cgroup's throttled time over the step, divided by the run queues it was summed over (the
  compute threads that ran or waited over the step, at most one per core). A throttled thread stays runnable on its (throttled)
  queue, so its run_delay already holds that wait (the kernel's sched-stats docs: run_delay is
  "time spent waiting on a runqueue"; checked on this project's kernel: a busy thread under a
  small quota gathers its throttled wait as run_delay). The step's contention is therefore the larger of the
  two, never their sum; the throttled share only says which cause it was (metrics/contention.py).

Tensor parallelism: each rank's worker process keeps its own meter (`machine=False`: no load or
cgroup reading) and sends its step's figures with its reply (executor/multiproc_executor.py); the
engine core books the largest run_delay of its own and the ranks' (the step ends with the slowest
rank) and the sum of their CPU time.
"""
from __future__ import annotations

import os
import threading

from tokenloom.ops.cgroup_cpu import CgroupThrottle
from tokenloom.ops.cpu_threads import _TICKS, _busy_ticks, usable_cores

REFRESH_S = 2.0
LOAD_INTERVAL_S = 0.5
# The steps' readings bracket the step; after a longer pause of the loop (idle, waiting for
# input) the meter reads once more as the next step starts, so the pause is not booked to it.
_STALE_S = 0.005


def _task_dir(pid: int) -> str:
    return f"/proc/{pid}/task"


def read_schedstat(fd: int) -> tuple[int, int] | None:
    """(ns on a CPU, ns runnable but waiting) of the thread whose schedstat `fd` holds; None
    once the thread is gone."""
    try:
        data = os.pread(fd, 64, 0)
    except OSError:
        return None
    fields = data.split()
    if len(fields) < 2:
        return None
    return int(fields[0]), int(fields[1])


class StepCpuMeter:
    """Per step: (CPU seconds of the compute threads, seconds the most delayed one waited to run);
    and, refreshed every `LOAD_INTERVAL_S`, the cores other processes used (see the module
    docstring). `available` is False where /proc has no schedstat (not Linux, or schedstats off).
    `throttled` is the last step's time throttled by the container's CPU quota (0 without one)."""

    def __init__(self, machine: bool = True) -> None:
        self.pid = os.getpid()
        self.cores = usable_cores()
        self.fds: dict[int, int] = {}  # tid -> open schedstat fd
        self.last: dict[int, tuple[int, int]] = {}
        self.available = os.path.exists(f"{_task_dir(self.pid)}/{self.pid}/schedstat")
        self._step_tid = 0
        self._next_refresh = 0.0
        self._last_read = 0.0
        self.other_cores = 0.0
        self._load_next = 0.0
        self._load_last: tuple[float, int | None, float] | None = None
        self.machine = machine
        self._extra_cpu = 0.0  # the tensor-parallel ranks' CPU seconds (add_cpu)
        self.throttle: CgroupThrottle | None = None  # found by _refresh
        self._throttled_ns: int | None = None
        self.throttled = 0.0

    def _refresh(self, t: float) -> None:
        self._next_refresh = t + REFRESH_S
        # The quota may be set, changed or lifted while the engine runs (docker update, a move
        # to another cgroup): looked for again with the threads.
        if self.throttle is not None and not self.throttle.refresh_quota():
            self.throttle.close()
            self.throttle = None
        if self.throttle is None and self.machine:
            self.throttle = CgroupThrottle.find()
            self._throttled_ns = self.throttle.throttled_ns() if self.throttle is not None else None
        python_threads = {th.native_id for th in threading.enumerate()}
        step_tid = threading.get_native_id()
        self._step_tid = step_tid
        try:
            tids = {int(x) for x in os.listdir(_task_dir(self.pid))}
        except OSError:
            tids = set()
        wanted = {tid for tid in tids if tid == step_tid or tid not in python_threads}
        for tid in list(self.fds):
            if tid not in wanted:
                self._drop(tid)
        for tid in wanted - set(self.fds):
            try:
                fd = os.open(f"{_task_dir(self.pid)}/{tid}/schedstat", os.O_RDONLY)
            except OSError:
                continue
            self.fds[tid] = fd
            reading = read_schedstat(fd)
            if reading is not None:
                self.last[tid] = reading

    def _drop(self, tid: int) -> None:
        os.close(self.fds.pop(tid))
        self.last.pop(tid, None)

    def begin(self, t: float) -> None:
        """At a step's start: reads again only when the loop paused since the last reading."""
        if self.available and t - self._last_read > _STALE_S:
            self.measure(t)

    def measure(self, t: float) -> tuple[float, float]:
        """(CPU seconds, run_delay seconds) of the compute threads since the last reading."""
        if not self.available:
            return 0.0, 0.0
        if t >= self._next_refresh or threading.get_native_id() != self._step_tid:
            self._refresh(t)
        self._last_read = t
        cpu_ns = 0
        delay_ns = 0
        active = 0  # threads that ran or waited to run over the step
        last = self.last
        gone = []
        for tid, fd in self.fds.items():
            reading = read_schedstat(fd)
            if reading is None:
                gone.append(tid)
                continue
            before = last.get(tid)
            last[tid] = reading
            if before is not None:
                cpu_ns += reading[0] - before[0]
                delay_ns = max(delay_ns, reading[1] - before[1])
                active += reading != before
        for tid in gone:
            self._drop(tid)
        delay = delay_ns * 1e-9
        if self.throttle is not None:
            self.throttled = self._read_throttled(active)
            delay = max(delay, self.throttled)  # run_delay holds the throttled wait: never both
        if self.machine:
            self._sample_load(t)
        return cpu_ns * 1e-9, delay

    def _read_throttled(self, active: int) -> float:
        assert self.throttle is not None
        now_ns = self.throttle.throttled_ns()
        before, self._throttled_ns = self._throttled_ns, now_ns
        if now_ns is None or before is None:
            return 0.0
        queues = max(1, min(active, len(self.cores)))
        return max(0, now_ns - before) * 1e-9 / queues

    def add_cpu(self, seconds: float) -> None:
        """CPU time this process's meter cannot see but the machine's load counts as the engine's
        (the tensor-parallel ranks' compute threads)."""
        self._extra_cpu += seconds

    def _sample_load(self, t: float) -> None:
        if t < self._load_next:
            return
        self._load_next = t + LOAD_INTERVAL_S
        busy = _busy_ticks(self.cores)
        times = os.times()
        sample = (t, busy, times.user + times.system + self._extra_cpu)
        last, self._load_last = self._load_last, sample
        if last is None or busy is None or last[1] is None or t <= last[0]:
            return
        ours = sample[2] - last[2]
        self.other_cores = max(0.0, ((busy - last[1]) / _TICKS - ours) / (t - last[0]))

    def close(self) -> None:
        for tid in list(self.fds):
            self._drop(tid)
        if self.throttle is not None:
            self.throttle.close()
            self.throttle = None
