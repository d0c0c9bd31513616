"""The container's CPU quota and the time it throttled the engine (cgroup CPU bandwidth control).

A cgroup with a CPU quota (cgroup v2 `cpu.max` "QUOTA PERIOD"; v1 `cpu.cfs_quota_us` and
`cpu.cfs_period_us`) may run QUOTA microseconds of CPU per PERIOD; once they are spent its threads
wait, runnable, until the next period. Its `cpu.stat` counts that wait: v2 `throttled_usec`
(microseconds), v1 `throttled_time` (nanoseconds), each summed over the CPUs whose run queue was
throttled. `CgroupThrottle` finds the cgroup of this process from /proc/self/cgroup (the first one,
leaf first, that sets a quota), keeps its cpu.stat open and reads it with `os.pread`; where no
quota is set nothing is read per step.
"""
from __future__ import annotations

import os

ROOT = "/sys/fs/cgroup"


def parse_proc_cgroup(text: str) -> tuple[int, str, str] | None:
    """(version, mount folder name, path) of the cgroup holding the CPU controller in a
    /proc/<pid>/cgroup text: v1's line naming `cpu` ("4:cpu,cpuacct:/docker/abc" -> (1,
    "cpu,cpuacct", "/docker/abc")), else v2's "0::/path" -> (2, "", "/path"); None without either."""
    v2 = None
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hid == "0" and controllers == "":
            v2 = (2, "", path or "/")
        elif "cpu" in controllers.split(","):
            return 1, controllers, path or "/"
    return v2


def parse_quota(version: int, cpu_max: str, period: str = "") -> tuple[int, int] | None:
    """(quota µs, period µs) from v2's cpu.max text, or v1's cfs_quota_us and cfs_period_us
    texts; None when no quota is set ("max" / -1)."""
    if version == 2:
        fields = cpu_max.split()
        if len(fields) != 2 or fields[0] == "max":
            return None
        return int(fields[0]), int(fields[1])
    quota = int(cpu_max.strip())
    return None if quota < 0 else (quota, int(period.strip()))


def parse_throttled_ns(version: int, cpu_stat: bytes | str) -> int | None:
    """The cumulative throttled time in a cpu.stat text, in nanoseconds (v2 `throttled_usec`,
    v1 `throttled_time`); None when the field is missing."""
    key = b"throttled_usec" if version == 2 else b"throttled_time"
    data = cpu_stat.encode() if isinstance(cpu_stat, str) else cpu_stat
    for line in data.splitlines():
        name, _, value = line.partition(b" ")
        if name == key:
            return int(value) * (1000 if version == 2 else 1)
    return None


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _mount(version: int, controllers: str, root: str) -> str | None:
    if version == 2:
        # A unified hierarchy is mounted at the root itself; a hybrid one mounts it at unified/.
        for folder in (root, f"{root}/unified"):
            if os.path.exists(f"{folder}/cgroup.controllers"):
                return folder
        return None
    for name in (controllers, "cpu,cpuacct", "cpu"):
        if os.path.isdir(f"{root}/{name}"):
            return f"{root}/{name}"
    return None


def _quota_of(version: int, folder: str) -> tuple[int, int] | None:
    if version == 2:
        text = _read(f"{folder}/cpu.max")
        return None if text is None else parse_quota(2, text)
    quota, period = _read(f"{folder}/cpu.cfs_quota_us"), _read(f"{folder}/cpu.cfs_period_us")
    return None if quota is None or period is None else parse_quota(1, quota, period)


class CgroupThrottle:
    """The cgroup whose CPU quota binds this process, its quota and its cumulative throttled
    time. `find()` returns None where there is no cgroup file system or no quota."""

    def __init__(self, version: int, folder: str, quota: tuple[int, int]) -> None:
        self.version = version
        self.folder = folder
        self.quota_us, self.period_us = quota
        self.fd = os.open(f"{folder}/cpu.stat", os.O_RDONLY)

    @classmethod
    def find(cls, proc_cgroup: str = "/proc/self/cgroup", root: str = ROOT) -> CgroupThrottle | None:
        text = _read(proc_cgroup)
        where = None if text is None else parse_proc_cgroup(text)
        if where is None:
            return None
        version, controllers, path = where
        mount = _mount(version, controllers, root)
        if mount is None:
            return None
        # The quota may sit on an ancestor (a pod's cgroup above its container's); the nearest wins.
        parts = [p for p in path.split("/") if p]
        for depth in range(len(parts), -1, -1):
            folder = "/".join([mount, *parts[:depth]])
            quota = _quota_of(version, folder)
            if quota is not None and os.path.exists(f"{folder}/cpu.stat"):
                try:
                    return cls(version, folder, quota)
                except OSError:
                    return None
        return None

    @property
    def describe(self) -> str:
        """The quota as its file says it: "cpu.max 20000/100000" (v1: cpu.cfs_quota_us/period)."""
        name = "cpu.max" if self.version == 2 else "cpu.cfs_quota_us/cfs_period_us"
        return f"{name} {self.quota_us}/{self.period_us}"

    @property
    def cores(self) -> float:
        return self.quota_us / self.period_us

    def refresh_quota(self) -> bool:
        """Reads the quota again (`docker update` changes it live); False once it is gone."""
        quota = _quota_of(self.version, self.folder)
        if quota is None:
            return False
        self.quota_us, self.period_us = quota
        return True

    def throttled_ns(self) -> int | None:
        try:
            return parse_throttled_ns(self.version, os.pread(self.fd, 512, 0))
        except OSError:
            return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
