"""The threads that tokenize prompts, render chat templates and parse big bodies off the event
loop (`AsyncLLM.run_off_loop`): a `concurrent.futures.Executor` that differs from
ThreadPoolExecutor in two ways a server needs.

- Its threads are daemons and are not joined at interpreter exit: a job that never ends (a
  pathological template, a huge text) must not keep a stopped server's process alive.
- It knows what each thread is doing: `stuck_for()` says for how long every thread has been on
  the job it runs now, which is what /health reports as a saturated pool. Measured per thread
  rather than by queue length, so a burst of short jobs (a queue that moves) never counts, while
  jobs that hold every thread do.
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from typing import Any, Callable

_Job = tuple[concurrent.futures.Future, Callable, tuple, dict]  # future, fn, args, kwargs


class TokenizerPool(concurrent.futures.Executor):
    def __init__(self, num_threads: int, thread_name_prefix: str = "tokenloom-tokenize") -> None:
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}.")
        self.num_threads = num_threads
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders submit() against shutdown()
        self._shut_down = False
        # When each thread took the job it runs now (time.monotonic()); None while it waits.
        self._started: list[float | None] = [None] * num_threads
        self._queued = 0
        self._threads = [threading.Thread(target=self._work, args=(i,), name=f"{thread_name_prefix}_{i}", daemon=True)
                         for i in range(num_threads)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable, /, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        with self._lock:
            if self._shut_down:
                raise RuntimeError("cannot schedule new futures after shutdown")
            future: concurrent.futures.Future = concurrent.futures.Future()
            self._queued += 1
            self._jobs.put((future, fn, args, kwargs))
        return future

    def _work(self, i: int) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            with self._lock:
                self._queued -= 1
            self._run(i, *job)
            job = None  # no reference to a finished job's data while this thread waits

    def _run(self, i: int, future: concurrent.futures.Future, fn: Callable, args: tuple, kwargs: dict) -> None:
        if not future.set_running_or_notify_cancel():
            return
        self._started[i] = time.monotonic()
        try:
            result = fn(*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - the caller awaiting the future re-raises it
            future.set_exception(e)
        else:
            future.set_result(result)
        finally:
            self._started[i] = None

    def stuck_for(self) -> float:
        """Seconds for which every thread has been busy on the job it runs now: 0 while any thread
        is free, else the age of the youngest running job."""
        started = list(self._started)
        if any(s is None for s in started):
            return 0.0
        return max(0.0, time.monotonic() - max(s for s in started if s is not None))

    @property
    def num_queued(self) -> int:
        """Jobs submitted that no thread has taken yet."""
        return self._queued

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
        if cancel_futures:
            while True:
                try:
                    job = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if job is not None:
                    with self._lock:
                        self._queued -= 1
                    job[0].cancel()
        for _ in self._threads:
            self._jobs.put(None)
        if wait:
            for t in self._threads:
                t.join()
