"""The private directory that holds an engine core's two ZMQ sockets, and the sweep of the ones
left behind.

Each `MPClient` creates `$TMPDIR/tokenloom-XXXXXXXX` with `mkdtemp` (mode 0700: only this user can
reach the sockets) and removes it when it shuts down. A caller killed with SIGKILL removes
nothing, so the directory records its owner: `owner.pid` holds the owner's pid and its start time
(from /proc, so a recycled pid is not mistaken for the owner). Every new client first sweeps the
directories whose owner is gone. Only directories that are certainly ours are touched: the
`tokenloom-` prefix, a real directory (not a symlink) owned by this uid, holding a well-formed
`owner.pid` that is a regular file.
"""
from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

PREFIX = "tokenloom-"
OWNER_FILE = "owner.pid"


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot, or None when it does not exist (or is
    a zombie: dead, waiting to be reaped)."""
    try:
        stat_line = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may hold spaces and parentheses: split after its last ")".
    fields = stat_line[stat_line.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])  # field 22 of the whole line


def make_ipc_dir() -> str:
    """Sweeps stale directories, then creates this process's own, recording it as the owner."""
    sweep_stale_ipc_dirs()
    path = tempfile.mkdtemp(prefix=PREFIX)
    pid = os.getpid()
    tmp = os.path.join(path, OWNER_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(f"{pid} {_start_time(pid) or 0}\n")
    os.replace(tmp, os.path.join(path, OWNER_FILE))  # a sweeper never reads half a file
    return path


def _owner(path: Path) -> tuple[int, int] | None:
    """(pid, start time) from a directory that is ours, or None if it is not clearly ours."""
    try:
        st = path.lstat()
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            return None
        owner_file = path / OWNER_FILE
        fst = owner_file.lstat()
        if not stat.S_ISREG(fst.st_mode) or fst.st_uid != os.getuid() or fst.st_size > 64:
            return None
        pid_text, start_text = owner_file.read_text().split()
        return int(pid_text), int(start_text)
    except (OSError, ValueError):
        return None


def sweep_stale_ipc_dirs(tmpdir: str | None = None) -> list[str]:
    """Removes the `tokenloom-*` directories (of this user, with an owner file) whose owner
    process is gone. Returns the paths removed."""
    removed: list[str] = []
    root = Path(tmpdir or tempfile.gettempdir())
    try:
        candidates = [p for p in root.iterdir() if p.name.startswith(PREFIX)]
    except OSError:
        return removed
    for path in candidates:
        owner = _owner(path)
        if owner is None:
            continue
        pid, start = owner
        alive = _start_time(pid)
        if alive is not None and (start == 0 or alive == start):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            removed.append(str(path))
    if removed:
        logger.info("removed %d stale engine-core socket directories: %s", len(removed), removed[:5])
    return removed
