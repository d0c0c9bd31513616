"""The waiting queue, in the order of the scheduling policy.

FCFS: a deque in arrival order; a preempted request goes back to the front, so it resumes before
anything that arrived after it. Priority: a heap keyed by (priority, arrival_time) — a lower value
runs first, as in vLLM; a preempted request keeps its key, which already puts it ahead of every
later arrival of the same priority.
"""
from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Iterator
from typing import Protocol

from tokenloom.core.request import Request


class RequestQueue(Protocol):
    def add(self, request: Request) -> None: ...
    def prepend(self, request: Request) -> None: ...
    def peek(self) -> Request: ...
    def pop(self) -> Request: ...
    def remove(self, request: Request) -> None: ...
    def __len__(self) -> int: ...
    def __bool__(self) -> bool: ...
    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def peek(self) -> Request:
        return self._queue[0]

    def pop(self) -> Request:
        return self._queue.popleft()

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def __len__(self) -> int:
        return len(self._queue)

    def __bool__(self) -> bool:
        return bool(self._queue)

    def __iter__(self) -> Iterator[Request]:
        """In the order requests will be admitted."""
        return iter(self._queue)


class PriorityQueue:
    def __init__(self) -> None:
        self._heap: list[tuple[int, float, int, Request]] = []
        self._seq = itertools.count()  # equal keys keep insertion order; Requests never compare

    def add(self, request: Request) -> None:
        heapq.heappush(self._heap, (request.priority, request.arrival_time, next(self._seq), request))

    def prepend(self, request: Request) -> None:
        self.add(request)

    def peek(self) -> Request:
        return self._heap[0][3]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[3]

    def remove(self, request: Request) -> None:
        self._heap = [entry for entry in self._heap if entry[3] is not request]
        heapq.heapify(self._heap)

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        """Heap order, not admission order (only the head is guaranteed first)."""
        return (entry[3] for entry in self._heap)


def create_request_queue(policy: str) -> FCFSQueue | PriorityQueue:
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "priority":
        return PriorityQueue()
    raise ValueError(f"unknown scheduling policy {policy!r}")
