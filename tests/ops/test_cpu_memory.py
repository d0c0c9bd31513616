"""ops/cpu_memory: the KV cache's lazily committed zeros and the huge-page buffers of the packed
weights, read back from the kernel's own accounts (/proc/self/smaps)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tokenloom.ops import amx, cpu_memory

MiB = 1 << 20


def _mapping_kb(ptr: int, field: str) -> int:
    """`field` (kB) of the mapping of this process that holds address `ptr`."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= ptr < hi
            elif inside and head == field + ":":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {ptr:#x}")


def test_lazy_zeros_are_zeros_committed_as_written():
    t = cpu_memory.lazy_zeros((64, MiB // 2), torch.bfloat16)  # 64 MiB
    assert t.shape == (64, MiB // 2) and t.is_contiguous() and t.dtype == torch.bfloat16
    assert _mapping_kb(t.data_ptr(), "Rss") < 8 * 1024  # nothing written: (almost) nothing resident
    assert not t[::7].any()  # reads see zeros (and commit no more than the zero page)
    t[:16] = 1
    assert _mapping_kb(t.data_ptr(), "Rss") >= 16 * 1024
    assert t[:16].eq(1).all() and not t[16:].any()


@pytest.fixture
def granted():
    cpu_memory._huge_pages_granted.cache_clear()
    if not cpu_memory._huge_pages_granted():
        pytest.skip("transparent huge pages not granted here (mode never, or not Linux)")
    yield
    cpu_memory._huge_pages_granted.cache_clear()


def test_weights_sit_on_huge_pages(granted):
    """A buffer written once at load (the packed weights) starts on a 2 MiB boundary, in a
    mapping the kernel backs with huge pages; its contents are what was written."""
    t = cpu_memory.empty_huge((32 * MiB,), torch.bfloat16)  # 64 MiB
    assert t.data_ptr() % (2 * MiB) == 0
    src = torch.randn(32 * MiB).bfloat16()
    t.copy_(src)
    assert torch.equal(t, src)
    assert _mapping_kb(t.data_ptr(), "AnonHugePages") >= 16 * 1024  # most of it (compaction may lag)


def test_packed_weights_and_kv_cache_ask_for_huge_pages(granted):
    z = cpu_memory.lazy_zeros((8, MiB), torch.float32)
    assert z.data_ptr() % (2 * MiB) == 0
    z.fill_(1.0)
    assert _mapping_kb(z.data_ptr(), "AnonHugePages") > 0
    if amx.available():
        w = torch.randn(3072, 576).bfloat16()
        packed = amx.pack(w)
        assert packed.data.data_ptr() % (2 * MiB) == 0
        assert torch.equal(amx.linear(torch.eye(576).bfloat16(), packed), w.t().contiguous())


# Run in a fresh process: in a long-lived one (a test worker), malloc may hand back memory that an
# earlier test's buffer had asked huge pages for, and /proc/self/smaps then counts that mapping's.
_TURNED_OFF = """
import sys
import torch
sys.path.insert(0, sys.argv[1])
from test_cpu_memory import MiB, _mapping_kb
from tokenloom.ops import cpu_memory
assert not cpu_memory._huge_pages_granted()
t = cpu_memory.empty_huge((16 * MiB,), torch.float32)
t.fill_(2.0)
z = cpu_memory.lazy_zeros((4, MiB), torch.float32)
assert not z.any()
print(_mapping_kb(t.data_ptr(), "AnonHugePages"))
"""


def test_huge_pages_can_be_turned_off():
    env = {**os.environ, "TOKENLOOM_HUGEPAGES": "0"}
    out = subprocess.run([sys.executable, "-c", _TURNED_OFF, str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        asked_only = "[madvise]" in f.read()  # ("always": every large mapping gets them)
    if asked_only:
        assert int(out.stdout.split()[-1]) == 0
