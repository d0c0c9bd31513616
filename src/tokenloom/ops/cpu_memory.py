"""Large zero-filled CPU tensors whose pages are committed as they are first written.

`torch.zeros` writes every byte, so a KV cache sized for the worst case is resident from the
start even when a run uses a tenth of it. An anonymous mapping is zero-filled by the kernel page
by page on first touch: the engine's resident memory then grows with the KV blocks actually
written (the block pool hands out blocks in LRU order, so a long-running server does reach the
full size). Reads of never-written pages see zeros, as with `torch.zeros`.
"""
from __future__ import annotations

import ctypes
import math
import mmap

import torch


def lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A contiguous CPU tensor of zeros backed by its own anonymous mapping (freed with the
    tensor)."""
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # frombuffer keeps `buf` alive as long as the tensor (or a view of it) lives.
    return torch.frombuffer(buf, dtype=dtype, count=math.prod(shape)).view(shape)


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
