"""The engine-core client for asyncio callers (`AsyncLLM`).

`AsyncMPClient` is `MPClient` with awaitable I/O: start-up and the ready handshake are inherited
unchanged (blocking, once, before any event loop needs the engine), then the same two ZMQ sockets
are shadowed by `zmq.asyncio` sockets so that sending and receiving never block the loop.

Exactly one task may call `get_output_async()` (AsyncLLM's output handler). Utility calls are
answered on the output socket too, so `call_utility_async()` parks a future that the reader
resolves; it therefore needs that reader to be running.
"""
from __future__ import annotations

import asyncio
import itertools
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from tokenloom.config import EngineConfig
from tokenloom.engine.core_client import _POLL_MS, EngineDeadError, MPClient
from tokenloom.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    UtilityOutput,
    UtilityRequest,
    now,
)

_FIRST_ASYNC_CALL_ID = 1 << 40


def _ignore_send_result(future: asyncio.Future) -> None:
    # A send that failed (the socket closed under a dying core) needs no handling: the output
    # handler reports the death. Retrieving the exception keeps asyncio from logging it.
    if not future.cancelled():
        future.exception()


class AsyncMPClient(MPClient):
    def __init__(self, config: EngineConfig, **kwargs: Any) -> None:
        # Before the base class's start-up, which may already fail or die (see _mark_dead).
        self._utility_futures: dict[int, asyncio.Future] = {}
        # Created on first use: they bind to the event loop that is running then.
        self._ain: zmq.asyncio.Socket | None = None
        self._aout: zmq.asyncio.Socket | None = None
        super().__init__(config, **kwargs)
        # Apart from the sync client's ids, so a late answer to a timed-out async call is dropped.
        self._async_call_ids = itertools.count(_FIRST_ASYNC_CALL_ID)

    def rebind_loop(self) -> None:
        """A new event loop took over (the one this client last ran in has ended, as after a
        second `asyncio.run`): its asyncio sockets and pending utility futures belonged to the
        old loop; new sockets are made on first use in the new one."""
        self._ain = self._aout = None
        self._utility_futures.clear()

    def _sockets(self) -> tuple[zmq.asyncio.Socket, zmq.asyncio.Socket]:
        if self._ain is None or self._aout is None:
            self._ain = zmq.asyncio.Socket.from_socket(self.input_socket)
            self._aout = zmq.asyncio.Socket.from_socket(self.output_socket)
        return self._ain, self._aout

    # ---- sending ----------------------------------------------------------------------------

    async def _send_async(self, kind: EngineCoreRequestType, obj: Any) -> None:
        # As the base class's _send: a send to a core with no peer socket would wait forever.
        self._check_alive()
        ain, _ = self._sockets()
        sent = ain.send_multipart((kind.value, self.encoder.encode(obj)), copy=False)
        while True:
            try:
                await asyncio.wait_for(asyncio.shield(sent), _POLL_MS / 1000)
                return
            except asyncio.TimeoutError:
                try:
                    self._check_process()
                except EngineDeadError:
                    sent.cancel()
                    raise
            except asyncio.CancelledError:  # the caller went away: so does its queued send
                sent.cancel()
                raise

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        request.sent_time = now()
        await self._send_async(EngineCoreRequestType.ADD, request)

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        """The core requests of one user request (its n children): one replica gets them all."""
        for request in requests:
            await self.add_request_async(request)

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        if request_ids and self._dead_reason is None:
            await self._send_async(EngineCoreRequestType.ABORT, list(request_ids))

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        """Sends an abort without awaiting. pyzmq's asyncio sockets send at once when they can and
        otherwise queue in call order, so this abort reaches the core before any message sent
        after it returns (see `AsyncLLM.abort_nowait`)."""
        if not request_ids or self._dead_reason is not None:
            return
        ain, _ = self._sockets()
        sent = ain.send_multipart((EngineCoreRequestType.ABORT.value, self.encoder.encode(list(request_ids))), copy=False)
        sent.add_done_callback(_ignore_send_result)

    async def call_utility_async(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        call_id = next(self._async_call_ids)
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._utility_futures[call_id] = future
        try:
            await self._send_async(
                EngineCoreRequestType.UTILITY, UtilityRequest(call_id=call_id, method=method, args=list(args))
            )
            util: UtilityOutput = await asyncio.wait_for(future, timeout)
        finally:
            self._utility_futures.pop(call_id, None)
        if util.failure is not None:
            raise RuntimeError(f"engine core utility call {method!r} failed: {util.failure}")
        return msgspec.msgpack.decode(util.result)

    # ---- receiving --------------------------------------------------------------------------

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message that carries request outputs or scheduler stats. Raises
        `EngineDeadError` (and fails every pending utility call) once the core is gone."""
        while True:
            if self._pending:  # parked by a blocking utility call of the sync base class
                return self._pending.popleft()
            self._check_alive()
            _, aout = self._sockets()
            if await aout.poll(_POLL_MS, zmq.POLLIN):
                outputs = self._decode((await aout.recv(copy=False)).buffer)
                if self._has_outputs(outputs):
                    return outputs
            else:
                self._check_process()

    def _file_utility(self, util: UtilityOutput) -> None:
        future = self._utility_futures.get(util.call_id)
        if future is not None:
            if not future.done():
                future.set_result(util)
        elif util.call_id < _FIRST_ASYNC_CALL_ID:
            super()._file_utility(util)  # a blocking caller of the base class

    def _mark_dead(self, reason: str) -> None:
        error = EngineDeadError(reason)
        for future in self._utility_futures.values():
            if not future.done():
                future.set_exception(error)
        super()._mark_dead(reason)

    def shutdown(self) -> None:
        for future in self._utility_futures.values():
            if not future.done():
                future.cancel()
        # The asyncio shadows registered the sockets' fds as readers in their event loop; unhook
        # them before the base class closes the sockets, or a loop that keeps running would hold
        # stale fds. (pyzmq's own close() does this, but would also close the shared sockets
        # before the base class sends SHUTDOWN on them.)
        for sock in (self._ain, self._aout):
            clear = getattr(sock, "_clear_io_state", None)
            if clear is not None:
                clear()
        self._ain = self._aout = None
        super().shutdown()
