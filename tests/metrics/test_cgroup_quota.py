"""A container's CPU quota in the ledger: its cgroup's cpu.stat read per step (ops/cgroup_cpu.py),
the throttled time booked as machine contention (never on top of run_delay, which holds it), and
the verdict naming the quota and what to change."""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest

from tokenloom import SamplingParams
from tokenloom.analysis.explain import analyze, format_report
from tokenloom.metrics.contention import (CONTENDED, THROTTLED_HEADLINE, contention_sentence, machine_summary,
                                          throttled)
from tokenloom.metrics.live import live_view
from tokenloom.ops.cgroup_cpu import CgroupThrottle, parse_proc_cgroup, parse_quota, parse_throttled_ns
from tokenloom.ops.schedstat import REFRESH_S

from machine_helpers import quiet_machine  # this folder is on the path
from test_ledger import check_parts, check_trace_file, prompt  # this folder is on the path (rootdir-less)

# The files as the kernel writes them (cgroup v2 and v1, Docker-style paths).
V2_STAT = ("usage_usec 7313391\nuser_usec 6051018\nsystem_usec 1262373\ncore_sched.force_idle_usec 0\n"
           "nr_periods 1450\nnr_throttled 312\nthrottled_usec 25317461\nnr_bursts 0\nburst_usec 0\n")
V1_STAT = "nr_periods 21\nnr_throttled 20\nthrottled_time 1075885184\nnr_bursts 0\nburst_time 0\n"
V2_PROC = "0::/system.slice/docker-4f1c.scope\n"
V1_PROC = ("12:pids:/docker/4f1c\n4:cpu,cpuacct:/docker/4f1c\n3:cpuset:/docker/4f1c\n"
           "1:name=systemd:/docker/4f1c\n0::/docker/4f1c\n")


def test_parsers_read_the_kernels_formats():
    assert parse_proc_cgroup(V2_PROC) == (2, "", "/system.slice/docker-4f1c.scope")
    assert parse_proc_cgroup(V1_PROC) == (1, "cpu,cpuacct", "/docker/4f1c")  # v1's cpu wins in a hybrid
    assert parse_proc_cgroup("1:name=systemd:/\n") is None
    assert parse_quota(2, "max 100000\n") is None
    assert parse_quota(2, "150000 100000\n") == (150000, 100000)
    assert parse_quota(1, "-1\n", "100000\n") is None
    assert parse_quota(1, "20000\n", "100000\n") == (20000, 100000)
    assert parse_throttled_ns(2, V2_STAT) == 25317461 * 1000  # microseconds
    assert parse_throttled_ns(1, V1_STAT.encode()) == 1075885184  # nanoseconds
    assert parse_throttled_ns(2, V1_STAT) is None


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_finds_v2_quota_on_an_ancestor(tmp_path):
    """A pod's quota sits above its container's cgroup: the nearest folder with one is read."""
    root = tmp_path / "cg"
    _write(root / "cgroup.controllers", "cpu memory\n")
    _write(tmp_path / "proc", "0::/kubepods/pod1/ctr\n")
    _write(root / "kubepods/pod1/cpu.max", "50000 100000\n")
    _write(root / "kubepods/pod1/cpu.stat", V2_STAT)
    _write(root / "kubepods/pod1/ctr/cpu.max", "max 100000\n")
    _write(root / "kubepods/pod1/ctr/cpu.stat", V2_STAT.replace("25317461", "1"))
    found = CgroupThrottle.find(str(tmp_path / "proc"), str(root))
    assert found is not None
    try:
        assert found.folder.endswith("kubepods/pod1") and found.describe == "cpu.max 50000/100000"
        assert found.cores == 0.5 and found.throttled_ns() == 25317461000
        # Read again in place (pread): a later value of the same open file.
        (root / "kubepods/pod1/cpu.stat").write_text(V2_STAT.replace("25317461", "25317500"))
        assert found.throttled_ns() == 25317500000
        (root / "kubepods/pod1/cpu.max").write_text("max 100000\n")  # the quota lifted
        assert not found.refresh_quota()
    finally:
        found.close()


def test_finds_v1_quota_and_none_without_one(tmp_path):
    root = tmp_path / "cg"
    _write(tmp_path / "proc", V1_PROC)
    folder = root / "cpu,cpuacct/docker/4f1c"
    _write(folder / "cpu.cfs_quota_us", "20000\n")
    _write(folder / "cpu.cfs_period_us", "100000\n")
    _write(folder / "cpu.stat", V1_STAT)
    found = CgroupThrottle.find(str(tmp_path / "proc"), str(root))
    assert found is not None
    try:
        assert found.describe == "cpu.cfs_quota_us/cfs_period_us 20000/100000"
        assert found.throttled_ns() == 1075885184
    finally:
        found.close()
    (folder / "cpu.cfs_quota_us").write_text("-1\n")  # no quota: nothing to read per step
    assert CgroupThrottle.find(str(tmp_path / "proc"), str(root)) is None


def test_throttled_verdict_names_the_quota():
    """The quota is named when its throttling is most of the wait; otherwise the other processes."""
    steps = [{"dur": 1.0, "run_delay_s": 0.8, "throttled_s": 0.7, "quota": "cpu.max 20000/100000",
              "cpu_s": 0.2, "other_cores": 0.1, "cores": 2}]
    machine = machine_summary(steps)
    assert throttled(machine)
    sentence = contention_sentence(machine)
    assert "throttled by the container's CPU quota (cpu.max 20000/100000, 0.2 cores)" in sentence
    assert "70% of its step time" in sentence
    steps[0]["throttled_s"] = 0.2  # mostly other processes
    machine = machine_summary(steps)
    assert not throttled(machine) and "other processes used" in contention_sentence(machine)
    steps[0]["throttled_s"] = 5.0  # never more than the wait it is part of
    assert machine_summary(steps)["throttled_s"] == 0.8


# ---- a real quota -------------------------------------------------------------------------------

_QUOTA = (15000, 100000)  # 0.15 of a core for a one-thread engine core


def _child_cgroup() -> tuple[Path, Path, str]:
    """(the new child cgroup, the cgroup to move back to, the quota's text) under this process's
    own CPU cgroup, v2 or v1; skips where there is none or it may not be written."""
    found = parse_proc_cgroup(Path("/proc/self/cgroup").read_text())
    if found is None:
        pytest.skip("no CPU cgroup in /proc/self/cgroup")
    version, controllers, path = found
    root = Path("/sys/fs/cgroup")
    if version == 2:
        mount = root if (root / "cgroup.controllers").exists() else root / "unified"
    else:
        mount = next((root / n for n in (controllers, "cpu,cpuacct", "cpu") if (root / n).is_dir()), root / "cpu")
    parent = mount / path.lstrip("/")
    if version == 2 and "cpu" not in (parent / "cgroup.subtree_control").read_text().split():
        pytest.skip(f"cgroup v2 at {parent} does not hand the cpu controller to children (cgroup.subtree_control)")
    if not os.access(parent, os.W_OK):
        pytest.skip(f"cannot create a child cgroup in {parent} (not writable)")
    child = parent / f"tokenloom-quota-{os.getpid()}"
    try:
        child.mkdir()
        # The child cgroup competes with the other processes as one entity of its weight (the
        # engine's nice no longer counts): the highest weight, so the quota is what holds it.
        if version == 2:
            (child / "cpu.weight").write_text("10000")
            (child / "cpu.max").write_text(f"{_QUOTA[0]} {_QUOTA[1]}")
            text = f"cpu.max {_QUOTA[0]}/{_QUOTA[1]}"
        else:
            (child / "cpu.shares").write_text("262144")
            (child / "cpu.cfs_period_us").write_text(str(_QUOTA[1]))
            (child / "cpu.cfs_quota_us").write_text(str(_QUOTA[0]))
            text = f"cpu.cfs_quota_us/cfs_period_us {_QUOTA[0]}/{_QUOTA[1]}"
    except OSError as e:
        with contextlib.suppress(OSError):
            child.rmdir()
        pytest.skip(f"cannot set a CPU quota on a child cgroup of {parent}: {e}")
    return child, parent, text


@pytest.mark.slow
@pytest.mark.serial
def test_engine_under_a_cpu_quota_is_named_throttled(make_llm, tmp_path):
    """The engine core moved into a cgroup with 0.15 of a core: the verdict is "contended",
    names the quota as the cause and says to raise it; the parts still sum to e2e."""
    child, parent, quota = _child_cgroup()
    path = tmp_path / "trace.json"
    llm = make_llm(trace_path=str(path), warmup=True)
    pid = llm.llm_engine.engine_core.info.pid
    recorder = llm.llm_engine.ledger.trace
    recorder.steps.clear()
    recorder.requests.clear()
    try:
        with quiet_machine(pid):  # other sessions' work must not be what the engine waits for
            (child / "cgroup.procs").write_text(str(pid))
            time.sleep(REFRESH_S)  # the meter looks for a quota again every REFRESH_S
            outputs = llm.generate([prompt(i, 16) for i in range(4)],
                                   SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False)
    finally:
        (parent / "cgroup.procs").write_text(str(pid))
        time.sleep(0.05)
        with contextlib.suppress(OSError):
            child.rmdir()
    for out in outputs:
        check_parts(out)
    llm.flush_trace()
    report = analyze(check_trace_file(path), top=2)
    text = format_report(report)
    live = live_view(recorder, [], [], time.monotonic())
    print(report["headline"], report["machine"])
    assert report["verdict"] == CONTENDED, (report["group_shares"], report["machine"])
    assert report["headline"].startswith(THROTTLED_HEADLINE)
    assert f"throttled by the container's CPU quota ({quota}" in report["headline"]
    assert "raise the container's CPU quota" in report["advice"] and "fewer threads" in report["advice"]
    assert "throttled by the container's CPU quota" in text
    assert "throttled by the container's CPU quota" in live["verdict"]["headline"]
    assert 0 < report["machine"]["throttled_s"] <= report["machine"]["run_delay_s"]
