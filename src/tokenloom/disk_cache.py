"""Where tokenloom keeps what it builds once and reuses across processes: compiled C kernels,
Gemma tokenizers' merge lists, dequantized exports for the vLLM baseline.

`$TOKENLOOM_CACHE_DIR` when set, else `~/.cache/tokenloom`. Everything under it can be deleted at
any time: each entry is named by a hash of what it was built from and is rebuilt when missing.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

from tokenloom import envs


def cache_dir(kind: str) -> Path:
    """The folder for one kind of entry (e.g. "kernels"); not created here."""
    root = envs.TOKENLOOM_CACHE_DIR
    return (Path(root) if root else Path.home() / ".cache" / "tokenloom") / kind


def write_atomically(path: Path, data: bytes) -> bool:
    """Writes `data` to `path` through a temporary file in the same folder, so a reader never sees
    half a file and concurrent writers of the same entry do not clash. False when the folder
    cannot be written (a read-only home): callers go on without the cache."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        return False
    return True
