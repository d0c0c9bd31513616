"""The server's chat templates, rendered in worker processes under a memory cap and a time limit.

A chat template is a program. A request's own `chat_template` (refused unless the operator passes
`--trust-request-chat-template`, as vLLM does) is a stranger's, and even the server's can be
driven hard by what a request puts in it. Jinja's sandbox stops attribute tricks, not cost:
`'a' * 10**10` is one C-level allocation (a step counter never sees it, and intercepting `*` leaves
`join`, `replace`, `format` and every filter that builds a string in one call), and two nested
`range(99999)` loops never end, in a thread that Python cannot interrupt. So every render runs in
a worker process (render_worker.py) whose address space is capped (`RLIMIT_AS`: the allocation
fails with a MemoryError in the worker, not in the server), which is killed when it runs past
the time limit or its client goes away, and replaced in the background. A render costs a pipe
round trip on top of the template itself; the workers are started with the server.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass

import msgspec

from tokenloom.engine.chat_template import ChatRender
from tokenloom.entrypoints.openai.render_worker import _HEADER, RenderJob, RenderReply

logger = logging.getLogger(__name__)

# How long a new worker may take to import its Jinja helpers (seconds on an idle machine; a loaded
# 2-core one can take many times that).
_START_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class RenderLimits:
    """What one render may use (the serve flags of the same names)."""

    timeout_s: float = 10.0  # --chat-template-timeout
    memory_bytes: int = 256 * 1024**2  # --chat-template-max-memory, above what the worker's imports take
    num_workers: int = 2  # --chat-template-workers: renders that run at once

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise ValueError(f"--chat-template-timeout must be > 0 seconds, got {self.timeout_s}.")
        if self.memory_bytes < 16 * 1024**2:
            raise ValueError(f"--chat-template-max-memory must be at least 16 MiB, got {self.memory_bytes} bytes.")
        if self.num_workers < 1:
            raise ValueError(f"--chat-template-workers must be >= 1, got {self.num_workers}.")


class RenderError(Exception):
    """A render that did not produce a prompt. `kind`: "template" (the template raised), "size"
    (its output is longer than any prompt may be), "memory", "timeout", "shutdown" (the server is
    stopping), or "server" (no worker could be started: the server's fault, not the request's)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class _Worker:
    def __init__(self, proc: asyncio.subprocess.Process, reapers: set[asyncio.Future]) -> None:
        self.proc = proc
        self._reapers = reapers  # the renderer's: aclose() waits for them

    async def read_reply(self) -> RenderReply:
        assert self.proc.stdout is not None
        head = await self.proc.stdout.readexactly(_HEADER.size)
        body = await self.proc.stdout.readexactly(_HEADER.unpack(head)[0])
        return msgspec.msgpack.decode(body, type=RenderReply)

    async def call(self, frame: bytes) -> RenderReply:
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame)
        await self.proc.stdin.drain()
        return await self.read_reply()

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        # Reaped, no zombie; kept, so that a loop that ends soon after does not destroy the wait.
        reaper = asyncio.ensure_future(self.proc.wait())
        self._reapers.add(reaper)
        reaper.add_done_callback(self._reapers.discard)


class ChatTemplateRenderer:
    """At most `limits.num_workers` renders at a time, each in a worker of its own; a render
    that fails by its memory or time limit (or whose caller gives up) costs its worker, which is
    killed and replaced. Use from one event loop."""

    def __init__(self, limits: RenderLimits | None = None) -> None:
        self.limits = limits or RenderLimits()
        # Idle workers; None once closed, passed on from one waiting render to the next.
        self._idle: asyncio.Queue[_Worker | None] = asyncio.Queue()
        self._num_workers = 0  # started or starting, idle or busy
        self._busy: dict[int, tuple[_Worker, float]] = {}  # id(worker) -> it, when its render began
        self._closed = False
        self._tasks: set[asyncio.Future] = set()  # background spawns and reaps of killed workers

    def start(self) -> None:
        """Starts the workers in the background, so that the first chat request does not wait for
        one (call from the running loop)."""
        for _ in range(self.limits.num_workers - self._num_workers):
            self._replace()

    async def render(self, job: ChatRender, max_chars: int) -> str:
        """The prompt text of `job`, or RenderError. A cancelled call kills its worker."""
        frame_body = msgspec.msgpack.encode(RenderJob(job, max_chars))
        frame = _HEADER.pack(len(frame_body)) + frame_body
        worker = await self._take()
        self._busy[id(worker)] = (worker, time.monotonic())
        healthy = False
        try:
            try:
                reply = await asyncio.wait_for(worker.call(frame), self.limits.timeout_s)
            except asyncio.TimeoutError:
                raise RenderError(f"the chat template did not finish rendering within {self.limits.timeout_s:g} s "
                                  "(--chat-template-timeout)", "timeout") from None
            except (asyncio.IncompleteReadError, ConnectionError) as e:
                if self._closed:
                    raise RenderError("the server is shutting down", "shutdown") from None
                raise RenderError(f"the render worker ended unexpectedly ({type(e).__name__})", "server") from None
            healthy = reply.kind in ("", "template", "size")
            if reply.kind == "memory":
                raise RenderError(f"the chat template used more than {self.limits.memory_bytes} bytes of memory "
                                  "(--chat-template-max-memory)", "memory")
            if reply.kind:
                raise RenderError(reply.error, reply.kind)
            return reply.text
        finally:
            del self._busy[id(worker)]
            if healthy and not self._closed:
                self._idle.put_nowait(worker)
            else:
                worker.kill()
                self._num_workers -= 1
                self._replace()

    def saturated_for(self) -> float:
        """Seconds for which every worker has been busy with the render it has now (0 while one
        is free): what /health reports, since renders that outlast the time limit are killed."""
        if len(self._busy) < self.limits.num_workers:
            return 0.0
        return time.monotonic() - max(since for _, since in self._busy.values())

    @property
    def num_busy(self) -> int:
        return len(self._busy)

    def close(self) -> None:
        """Kills every worker; renders still running or waiting for a worker end with
        RenderError("shutdown")."""
        self._closed = True
        while not self._idle.empty():
            worker = self._idle.get_nowait()
            if worker is not None:
                worker.kill()
        self._idle.put_nowait(None)
        for worker, _ in self._busy.values():
            worker.kill()

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """close(), then waits for the killed workers to be reaped and the spawns under way to end,
        so that the loop can stop with no task of ours pending."""
        self.close()
        deadline = asyncio.get_running_loop().time() + timeout_s
        while self._tasks and asyncio.get_running_loop().time() < deadline:
            await asyncio.wait(set(self._tasks), timeout=max(0.0, deadline - asyncio.get_running_loop().time()))

    # ------------------------------------------------------------------------------ internals

    async def _take(self) -> _Worker:
        if self._idle.empty() and self._num_workers < self.limits.num_workers and not self._closed:
            self._num_workers += 1
            try:
                return await self._spawn()
            except BaseException:
                self._num_workers -= 1
                raise
        worker = await self._idle.get()
        if worker is None:  # closed: the next waiter learns it too
            self._idle.put_nowait(None)
            raise RenderError("the server is shutting down", "shutdown")
        return worker

    def _replace(self) -> None:
        """Starts a worker in the background (none past the limit, none once closed)."""
        if self._closed or self._num_workers >= self.limits.num_workers:
            return
        self._num_workers += 1

        async def spawn() -> None:
            try:
                worker = await self._spawn()
            except RenderError as e:
                self._num_workers -= 1
                if not self._closed:
                    logger.error("%s", e)
                return
            if self._closed:
                worker.kill()
            else:
                self._idle.put_nowait(worker)

        task = asyncio.ensure_future(spawn())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _spawn(self) -> _Worker:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tokenloom.entrypoints.openai.render_worker", str(self.limits.memory_bytes),
            str(os.getpid()), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            # A session of its own: a terminal's Ctrl-C (sent to the server's process group) is
            # the server's to handle; the worker ends when the server kills it or dies itself.
            start_new_session=True)
        worker = _Worker(proc, self._tasks)
        try:
            hello = await asyncio.wait_for(worker.read_reply(), _START_TIMEOUT_S)
        except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.CancelledError) as e:
            worker.kill()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise RenderError(f"a chat-template render worker did not start ({type(e).__name__}); "
                              "see the server log", "server") from None
        assert hello.kind == "ready", hello
        return worker
