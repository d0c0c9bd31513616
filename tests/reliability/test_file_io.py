"""run_file_io (entrypoints/openai/file_io.py): a read that blocks is given up on after its
timeout with a 504 naming the path, its thread is counted as stuck until it returns, and while
too many are stuck new reads are refused at once instead of taking more threads."""
from __future__ import annotations

import asyncio
import threading

import pytest

from tokenloom.entrypoints.openai import file_io
from tokenloom.entrypoints.openai.protocol import OpenAIServingError


def test_a_blocked_read_times_out_and_is_counted_until_it_returns():
    release = threading.Event()

    async def run() -> None:
        assert await file_io.run_file_io(len, "abc", path="/x", param="p") == 3
        with pytest.raises(ValueError, match="bad"):
            await file_io.run_file_io(int, "bad", path="/x", param="p")
        for i in range(file_io.MAX_STUCK_READS):
            with pytest.raises(OpenAIServingError) as e:
                await file_io.run_file_io(release.wait, path=f"/mnt/hung/{i}", param="lora_path", timeout=0.05)
            assert e.value.status_code == 504 and e.value.param == "lora_path" and f"/mnt/hung/{i}" in e.value.message
        assert file_io.num_stuck_reads() == file_io.MAX_STUCK_READS
        with pytest.raises(OpenAIServingError) as e:  # refused at once: no thread more
            await file_io.run_file_io(len, "abc", path="/mnt/hung/next", param="lora_path")
        assert e.value.status_code == 503 and "/mnt/hung/next" in e.value.message

    try:
        asyncio.run(run())
    finally:
        release.set()
    for _ in range(100):
        if file_io.num_stuck_reads() == 0:
            break
        threading.Event().wait(0.02)
    assert file_io.num_stuck_reads() == 0
