"""Blocking file work for a route, kept off the event loop and off the shared pools.

A read on a hung network mount can block forever. On the event loop that would stop every route
(/health included); on the tokenizer pool it would take a thread every request needs. So each
read runs on a thread of its own, the route waits for it at most `timeout` seconds (then a 504
naming the path), and while too many such threads are still stuck new reads are refused (503)
instead of piling up threads.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from tokenloom.entrypoints.openai.protocol import OpenAIServingError

T = TypeVar("T")

# How long a route waits for one file read; a local config file takes milliseconds.
FILE_IO_TIMEOUT_S = 10.0
# Threads whose read outlived its route, at most: past this, new reads are refused.
MAX_STUCK_READS = 4

_lock = threading.Lock()
_stuck = 0


def num_stuck_reads() -> int:
    """Reads given up on by their route whose thread is still blocked."""
    return _stuck


def _settle(future: asyncio.Future, ok: bool, value: Any) -> None:
    if future.done():
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


async def run_file_io(fn: Callable[..., T], *args: Any, path: str, param: str | None,
                      timeout: float = FILE_IO_TIMEOUT_S) -> T:
    """`fn(*args)` on a thread of its own, awaited for at most `timeout` seconds. Its exceptions
    are raised here; a timeout is a 504 whose message names `path` (`param`: the request field
    that gave it)."""
    global _stuck
    if _stuck >= MAX_STUCK_READS:
        raise OpenAIServingError(f"Cannot read {path} now: {_stuck} earlier file reads are still blocked (a hung "
                                 "file system?). Retry later.", 503, "service_unavailable_error", param,
                                 "file_io_stuck")
    loop = asyncio.get_running_loop()
    future: asyncio.Future = loop.create_future()
    state = ["running"]  # then "settled" (the thread handed its result over) or "abandoned" (timed out)

    def work() -> None:
        global _stuck
        try:
            ok, value = True, fn(*args)
        except BaseException as e:  # noqa: BLE001 - handed to the awaiting route
            ok, value = False, e
        with _lock:
            if state[0] == "abandoned":
                _stuck -= 1
                return
            state[0] = "settled"
        try:
            loop.call_soon_threadsafe(_settle, future, ok, value)
        except RuntimeError:  # the loop closed meanwhile: nobody waits
            pass

    threading.Thread(target=work, name="tokenloom-file-io", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except asyncio.TimeoutError:
        with _lock:
            settled = state[0] == "settled"
            if not settled:
                state[0] = "abandoned"
                _stuck += 1
        if settled:  # finished just as the wait ended: its result is on its way
            return await future
        raise OpenAIServingError(f"Reading {path} did not finish within {timeout:g}s (a hung file system or a "
                                 "special file?).", 504, "timeout_error", param, "file_io_timeout") from None
