"""How many threads the CPU model runs on, chosen from the cores this process may use and kept in
step with what other processes leave of them.

OpenMP threads (torch's, oneDNN's and the C kernels', which all share torch's OpenMP runtime and
its thread count) spin while they wait for each other, which is what makes a quiet machine fast:
at batch 1 a step has a few hundred parallel regions, and a passive wait (sleep, wake) on each
costs a large part of the decode rate there. On a core that another process keeps busy, the same
spinning is ruinous: the region's last thread is descheduled for a scheduler slice while its
partners spin, and batch-1 decode falls far below one thread's (benchmarks/CHANGELOG.md, the thread
policies in "what was tried").

So the engine starts with one thread per core of `os.sched_getaffinity(0)` and keeps the
default (spinning) wait policy, and `ThreadGovernor` watches the CPU time of those cores: every
half second it reads /proc/stat, subtracts this process's own CPU time, and if other processes
used about half a core or more of them it drops a thread per such core (never below one); when
they leave, the threads come back. `num_threads` (`--threads`, `-t`), or else
`TOKENLOOM_NUM_THREADS`, fixes the count and switches the governor off.

Processes running at a lower priority than ours (a positive nice value while we run at 0: batch
jobs, builds, test suites started with `nice`) do not count: the kernel's scheduler gives a nice-19
process a tiny share (its weight) of a core that one of our threads also wants, so it cannot hold a partner
thread off its core long enough to matter, and giving it a thread would halve our rate for
nothing. /proc/stat books their time separately (the `nice` column), which is what makes them
tellable apart. When this process is itself niced, everyone's time counts.
"""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from tokenloom import envs

logger = logging.getLogger(__name__)

# Other processes' use of our cores (in cores) from which one thread is given up: 0.4 leaves
# brief bursts (the caller's detokenizing, a shell) alone and reacts to one busy process, which
# gets about 2/3 of a core while our threads spin on both cores of a 2-core machine.
_GIVE_UP_FROM = 0.4
_INTERVAL_S = 0.5
# Our own use of the cores (in cores) below which a window counts as an idle pause of ours.
_IDLE_BELOW = 0.5
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def replica_cores(cores: list[int], rank: int, size: int) -> list[int]:
    """The cores data-parallel replica `rank` of `size` runs on: a contiguous share of `cores`
    (len(cores) // size each; the remainder goes to the first replicas), or one core shared
    round-robin when there are fewer cores than replicas. Disjoint shares keep M replicas from
    oversubscribing the machine: each one's OpenMP threads spin on cores nobody else computes
    on, and each one's ThreadGovernor watches only its own share."""
    if not 0 <= rank < size:
        raise ValueError(f"data-parallel rank must be in [0, {size}), got {rank}.")
    if len(cores) < size:
        return [cores[rank % len(cores)]]
    base, extra = divmod(len(cores), size)
    start = rank * base + min(rank, extra)
    return cores[start:start + base + (1 if rank < extra else 0)]


def pin_to_replica_share(rank: int, size: int) -> list[int]:
    """Restricts this process to its replica's cores (see replica_cores); a no-op for size 1."""
    cores = usable_cores()
    if size <= 1:
        return cores
    share = replica_cores(cores, rank, size)
    os.sched_setaffinity(0, share)
    return share


def fixed_num_threads(configured: int | None = None) -> int | None:
    """A fixed count (no governor): `configured` (the engine's num_threads, `--threads`), else
    TOKENLOOM_NUM_THREADS when set."""
    if configured is not None:
        return configured
    value = envs.TOKENLOOM_NUM_THREADS
    if not value:
        return None
    n = int(value)
    if n < 1:
        raise ValueError(f"TOKENLOOM_NUM_THREADS must be a positive integer, got {value!r}")
    return n


def set_compute_threads(configured: int | None = None) -> int:
    """Sets torch's (and so the C kernels') thread count at start-up: `configured` (num_threads),
    else TOKENLOOM_NUM_THREADS, else one per usable core. Returns it."""
    n = fixed_num_threads(configured) or len(usable_cores())
    torch.set_num_threads(n)
    return n


def _busy_ticks(cores: list[int], count_nice: bool = True) -> int | None:
    """Non-idle ticks (user, nice, system, irq, softirq, steal) of `cores` since boot; without the
    nice column when `count_nice` is false."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    wanted = {f"cpu{c}" for c in cores}
    busy = 0
    seen = 0
    for line in lines:
        name, _, rest = line.partition(" ")
        if name in wanted:
            f = [int(x) for x in rest.split()]
            busy += sum(f[:8]) - f[3] - f[4]  # minus idle and iowait
            if not count_nice:
                busy -= f[1]
            seen += 1
    return busy if seen == len(wanted) else None


class ThreadGovernor:
    """Adjusts torch's thread count between steps to what other processes leave of our cores
    (see the module docstring). `step()` is cheap when it is not yet time to look (a clock read)."""

    def __init__(self, interval_s: float = _INTERVAL_S, configured: int | None = None) -> None:
        self.cores = usable_cores()
        self.max_threads = torch.get_num_threads()
        self.enabled = (fixed_num_threads(configured) is None and self.max_threads > 1
                        and _busy_ticks(self.cores) is not None)
        self.threads = self.max_threads
        # At nice 0 (or below), niced processes' time is left out (see the module docstring).
        self.count_nice = os.getpriority(os.PRIO_PROCESS, 0) > 0
        self.interval_s = interval_s
        self.others_cores = 0.0  # the last measurement of other processes' use of our cores
        self._next = 0.0
        self._last: tuple[float, int, float] | None = None

    def describe(self) -> str:
        if not self.enabled:
            return "fixed"
        return (f"adaptive (one fewer per core other processes use, checked every "
                f"{self.interval_s:g} s)")

    def step(self) -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + self.interval_s
        busy = _busy_ticks(self.cores, self.count_nice)
        t = os.times()
        sample = (now, busy, t.user + t.system)
        last, self._last = self._last, sample
        if last is None or busy is None or last[1] is None:
            return
        wall = now - last[0]
        if wall <= 0:
            return
        ours = (sample[2] - last[2]) / wall
        # A window in which we computed less than half a core's worth spans an idle pause of ours
        # (no steps, so no checks): what others did meanwhile (a benchmark's other engine, run
        # between ours) says nothing of what they do now that we run, so it only starts the next
        # window. Running, our threads use a core or more, spinning even while they wait.
        if ours < _IDLE_BELOW:
            return
        others = ((busy - last[1]) / _TICKS - (sample[2] - last[2])) / wall
        self.others_cores = max(0.0, others)
        target = max(1, min(self.max_threads,
                            self.max_threads - int(self.others_cores + 1 - _GIVE_UP_FROM)))
        if target != self.threads:
            logger.info("other processes use %.2f of our %d cores: %d -> %d threads",
                        self.others_cores, len(self.cores), self.threads, target)
            torch.set_num_threads(target)
            self.threads = target
