"""Large CPU tensors in their own anonymous mappings: zero-filled ones whose pages are committed
as they are first written, and both kinds on 2 MiB pages where the kernel grants them.

`torch.zeros` writes every byte, so a KV cache sized for the worst case is resident from the
start even when a run uses a tenth of it. An anonymous mapping is zero-filled by the kernel page
by page on first touch: the engine's resident memory then grows with the KV blocks actually
written (the block pool hands out blocks in LRU order, so a long-running server does reach the
full size). Reads of never-written pages see zeros, as with `torch.zeros`.

Huge pages: a decode step streams every weight and the whole KV cache once, hundreds of MB on
4 KiB pages, a TLB miss every 4 KiB and the hardware prefetchers stopping at each page's end.
Linux backs a mapping with transparent 2 MiB pages when asked (`madvise`, the usual setting of
/sys/kernel/mm/transparent_hugepage/enabled) or always; the packed weights (ops/amx) and the KV
cache ask (benchmarks/CHANGELOG.md). `TOKENLOOM_HUGEPAGES=0` turns it off.
"""
from __future__ import annotations

import ctypes
import functools
import math
import mmap
import re

import torch

from tokenloom import envs

_HUGE_PAGE = 2 << 20


@functools.cache
def _huge_pages_granted() -> bool:
    """Whether a mapping asking for transparent huge pages gets them (mode "always" or
    "madvise"), and they are not turned off."""
    if not envs.TOKENLOOM_HUGEPAGES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = re.search(r"\[(\w+)\]", f.read())
    except OSError:
        return False
    return mode is not None and mode.group(1) in ("always", "madvise")


def _mapped(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous tensor in its own zero-filled anonymous mapping (freed with the tensor), on
    huge pages where granted: then the mapping has room to start the tensor on a 2 MiB
    boundary, and the pages past it are never touched, so never resident."""
    count = math.prod(shape)
    nbytes = count * torch.empty((), dtype=dtype).element_size()
    huge = nbytes >= _HUGE_PAGE and _huge_pages_granted()
    buf = mmap.mmap(-1, nbytes + (_HUGE_PAGE if huge else 0),
                    flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `buf` alive as long as the tensor (or a view of it) lives.
    raw = torch.frombuffer(buf, dtype=torch.uint8)
    skip = -raw.data_ptr() % _HUGE_PAGE if huge else 0
    if huge:
        # Only the whole huge pages: a tail on one would be a resident 2 MiB for what may be a
        # few KiB of the tensor.
        buf.madvise(mmap.MADV_HUGEPAGE, skip, nbytes // _HUGE_PAGE * _HUGE_PAGE)
    return raw[skip:skip + nbytes].view(dtype).view(shape)


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros backed by its own anonymous mapping (freed with the
    tensor), on huge pages where granted."""
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=dtype)
    return _mapped(shape, dtype)


def empty_huge(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """`torch.empty` on huge pages where granted (and large enough to fill one): for weights a
    kernel streams, written once at load (every page is touched then)."""
    if math.prod(shape) * torch.empty((), dtype=dtype).element_size() < _HUGE_PAGE or not _huge_pages_granted():
        return torch.empty(shape, dtype=dtype)
    return _mapped(shape, dtype)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`torch.zeros`, committed lazily (`lazy_zeros`) when `device` is the CPU: for buffers sized
    for the worst case, such as the KV cache."""
    if device.type == "cpu":
        return lazy_zeros(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)


def release_freed_heap() -> None:
    """Returns the heap that loading freed (the float32 dequantized tensors, the plain weights
    the packed copies replaced) to the OS: glibc keeps freed arena memory mapped, ~320 MB of
    resident memory for SmolLM2 after load. No-op without glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass
