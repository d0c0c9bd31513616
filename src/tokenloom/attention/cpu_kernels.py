"""The CPU decode kernel (csrc/paged_decode.c): built on first use, loaded with ctypes.

The torch backend's decode path gathers every sequence's K/V blocks into a padded buffer and runs
SDPA on it; at batch 64 with 128-256 tokens of context that costs ~4 ms per layer on 2 cores
(the flash kernel is built for long query blocks, a decode query has `group` rows), 30% of a
decode step. The C kernel reads the blocks in place through the block table, so a layer's
decode attention costs about one pass over its KV cache (see benchmarks/README.md).

The library is compiled with the system C compiler (`$CC`, else `cc`) into
`$TOKENLOOM_CACHE_DIR/kernels` (default `~/.cache/tokenloom/kernels`), named by a hash of the
source, the flags and the compiler, so a changed source or machine builds anew; the build takes
about a second and is written atomically (concurrent engines may race to build it). It links
against the OpenMP runtime torch already loaded (same soname), so the kernel's threads are torch's.
Without a compiler, or with `TOKENLOOM_CPU_KERNELS=0`, `load()` returns None and the torch
backend keeps its pure-PyTorch path; the kernel is float32 only.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_COMPILE_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC"]
_LINK_FLAGS = ["-shared", "-fopenmp"]
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False

_c_i64, _c_i32, _c_p, _c_f = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p, ctypes.c_float


def _cache_dir() -> Path:
    root = os.environ.get("TOKENLOOM_CACHE_DIR")
    return (Path(root) if root else Path.home() / ".cache" / "tokenloom") / "kernels"


def _compiler() -> str | None:
    cc = os.environ.get("CC", "cc")
    return shutil.which(cc)


def _build(cc: str) -> Path:
    version = subprocess.run([cc, "--version"], capture_output=True, text=True, check=True).stdout
    cpu = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    flags_line = next((ln for ln in cpu.splitlines() if ln.startswith("flags")), "")
    key = hashlib.sha256("\0".join([_SOURCE.read_text(), " ".join(_COMPILE_FLAGS + _LINK_FLAGS),
                                    version, flags_line]).encode()).hexdigest()[:16]
    out_dir = _cache_dir()
    target = out_dir / f"paged_decode-{key}.so"
    if target.exists():
        return target
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        obj, lib = Path(tmp) / "paged_decode.o", Path(tmp) / "paged_decode.so"
        # Compile with -ffast-math but link without it: gcc would otherwise link crtfastmath.o,
        # which turns on flush-to-zero for the whole process when the library is loaded.
        subprocess.run([cc, *_COMPILE_FLAGS, "-c", str(_SOURCE), "-o", str(obj)],
                       check=True, capture_output=True, text=True)
        subprocess.run([cc, *_LINK_FLAGS, str(obj), "-o", str(lib), "-lm"],
                       check=True, capture_output=True, text=True)
        os.replace(lib, target)
    return target


def load() -> ctypes.CDLL | None:
    """The compiled kernel library, or None when it is disabled or cannot be built here."""
    global _lib, _tried
    if _tried:
        return _lib
    with _lock:
        if _tried:
            return _lib
        _tried = True
        if os.environ.get("TOKENLOOM_CPU_KERNELS", "1") == "0":
            return None
        cc = _compiler()
        if cc is None:
            logger.warning("no C compiler found ($CC or cc): CPU decode attention uses the "
                           "slower PyTorch path")
            return None
        try:
            path = _build(cc)
            lib = ctypes.CDLL(str(path))
        except (OSError, subprocess.CalledProcessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            logger.warning("building the CPU decode kernel failed, using the PyTorch path: %s",
                           detail)
            return None
        fn = lib.tl_paged_decode_f32
        fn.restype = _c_i32
        fn.argtypes = [_c_p, _c_i64, _c_p, _c_p, _c_p, _c_i64, _c_p, _c_p, _c_i64,
                       _c_i32, _c_i32, _c_i32, _c_i32, _c_i32, _c_f]
        _lib = lib
        return _lib


def paged_decode(lib: ctypes.CDLL, query: torch.Tensor, kv_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor,
                 scale: float) -> None:
    """Decode attention of `query` [B, Hq, D] (rows may be strided) over the paged cache
    `kv_cache` [2, num_blocks, block_size, Hkv, D] into `out` [B, Hq, D].

    `block_table` [B, >= max blocks] and `seq_lens` [B] are contiguous int32 CPU tensors; every
    tensor is float32 on the CPU, and the head/row layout inside a row contiguous. The caller
    checks these once per step (the torch backend's plan), not here."""
    B, Hq, D = query.shape
    _, _, bs, Hkv, _ = kv_cache.shape
    rc = lib.tl_paged_decode_f32(
        query.data_ptr(), query.stride(0), kv_cache[0].data_ptr(), kv_cache[1].data_ptr(),
        block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(),
        out.data_ptr(), out.stride(0), B, Hq, Hkv, D, bs, scale)
    if rc != 0:
        raise ValueError(f"CPU decode kernel rejected the shapes (code {rc}): heads {Hq}/{Hkv}, "
                         f"head_dim {D}, block_size {bs}")
