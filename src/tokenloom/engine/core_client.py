"""Engine-core clients: one interface, two forms.

- `MPClient` (the default) starts the engine core in a child process and talks to it over two ZMQ
  sockets with msgspec-encoded messages; the caller never blocks the core, and the core's busy
  loop never waits for the caller.
- `InprocClient` runs the same `EngineCore` inside the caller, one step per `get_output()`: for
  debugging and for tests that want to look inside.
When the child dies, every blocked call raises `EngineDeadError` within a poll interval.
"""
from __future__ import annotations

import collections
import itertools
import os
import shutil
import subprocess
import sys
import weakref
from abc import ABC, abstractmethod
from typing import Any

import msgspec
import zmq

from tokenloom.config import EngineConfig
from tokenloom.engine.ipc_dir import make_ipc_dir
from tokenloom.messages import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    EngineInfo,
    READY_CALL_ID,
    UtilityOutput,
    UtilityRequest,
    now,
)

_POLL_MS = 100
STARTUP_TIMEOUT_S = float(os.environ.get("TOKENLOOM_STARTUP_TIMEOUT_S", "600"))


class EngineDeadError(RuntimeError):
    """The engine-core process died; requests in flight were finished with an error."""


class EngineCoreClient(ABC):
    info: EngineInfo

    @staticmethod
    def make_client(config: EngineConfig, multiprocess: bool = True) -> "EngineCoreClient":
        return MPClient(config) if multiprocess else InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        """The next batch of outputs (an empty one if `timeout` seconds pass without any)."""

    @abstractmethod
    def call_utility(self, method: str, *args: Any) -> Any: ...

    @abstractmethod
    def shutdown(self) -> None: ...

    @property
    def is_dead(self) -> bool:
        return False


class InprocClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        from tokenloom.core.engine_core import EngineCore  # heavy: loads the model

        self.engine_core = EngineCore(config)
        self.info = self.engine_core.info

    def add_request(self, request: EngineCoreRequest) -> None:
        request.sent_time = now()
        self.engine_core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.engine_core.abort_requests(request_ids)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        outputs = self.engine_core.step()
        outputs.received_time = now()
        return outputs

    def call_utility(self, method: str, *args: Any) -> Any:
        result = getattr(self.engine_core, method)(*args)
        # Round-trip through msgpack so both clients return the same plain types.
        return msgspec.msgpack.decode(msgspec.msgpack.encode(result))

    def shutdown(self) -> None:
        self.engine_core.shutdown()


def _cleanup(proc: subprocess.Popen, ctx: zmq.Context, tmpdir: str) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    ctx.destroy(linger=0)
    shutil.rmtree(tmpdir, ignore_errors=True)


class MPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        # A private 0700 directory (mkdtemp) recording its owner; stale ones are swept first.
        self._tmpdir = make_ipc_dir()
        in_addr = f"ipc://{self._tmpdir}/input"
        out_addr = f"ipc://{self._tmpdir}/output"
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.input_socket.bind(in_addr)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket.bind(out_addr)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tokenloom.core.engine_core_proc", in_addr, out_addr, str(os.getpid())],
            stdin=subprocess.PIPE,
        )
        assert self.proc.stdin is not None
        self.proc.stdin.write(msgspec.json.encode(config))
        self.proc.stdin.close()
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, self.ctx, self._tmpdir)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._dead_reason: str | None = None
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self._call_ids = itertools.count(1)
        self._utility_results: dict[int, Any] = {}
        try:
            ready = self._wait_for_utility(READY_CALL_ID, timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.info = msgspec.msgpack.decode(ready, type=EngineInfo)

    # ---- sending ----------------------------------------------------------------------------

    def _send(self, kind: EngineCoreRequestType, obj: Any) -> None:
        self._check_alive()
        self.input_socket.send_multipart((kind.value, self.encoder.encode(obj)), copy=False)

    def add_request(self, request: EngineCoreRequest) -> None:
        request.sent_time = now()
        self._send(EngineCoreRequestType.ADD, request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self._dead_reason is None:
            self._send(EngineCoreRequestType.ABORT, list(request_ids))

    def call_utility(self, method: str, *args: Any) -> Any:
        call_id = next(self._call_ids)
        self._send(EngineCoreRequestType.UTILITY, UtilityRequest(call_id=call_id, method=method, args=list(args)))
        return msgspec.msgpack.decode(self._wait_for_utility(call_id, timeout=None))

    # ---- receiving --------------------------------------------------------------------------

    @property
    def is_dead(self) -> bool:
        return self._dead_reason is not None

    def _check_alive(self) -> None:
        if self._dead_reason is not None:
            raise EngineDeadError(self._dead_reason)

    def _recv(self, timeout: float | None) -> EngineCoreOutputs | None:
        """One message from the core, or None after `timeout`; raises if the core is dead."""
        self._check_alive()
        deadline = None if timeout is None else now() + timeout
        while True:
            wait_ms = _POLL_MS if deadline is None else max(0, min(_POLL_MS, int((deadline - now()) * 1000)))
            if self.output_socket.poll(wait_ms):
                return self._decode(self.output_socket.recv(copy=False).buffer)
            self._check_process()
            if deadline is not None and now() >= deadline:
                return None

    # Shared with the asyncio client, which only awaits where this one blocks.

    def _decode(self, buffer: memoryview) -> EngineCoreOutputs:
        outputs = self.decoder.decode(buffer)
        outputs.received_time = now()
        if outputs.engine_error is not None:
            self._mark_dead(outputs.engine_error)
        return outputs

    def _check_process(self) -> None:
        code = self.proc.poll()
        if code is not None:
            self._mark_dead(f"engine core process {self.proc.pid} exited with code {code}")

    def _mark_dead(self, reason: str) -> None:
        self._dead_reason = reason
        raise EngineDeadError(reason)

    def _has_outputs(self, outputs: EngineCoreOutputs) -> bool:
        """Files the message's utility answer, if any; True when it also carries request outputs
        or scheduler stats (a message for `get_output`)."""
        if outputs.utility_output is not None:
            self._file_utility(outputs.utility_output)
        return bool(outputs.outputs) or outputs.scheduler_stats is not None

    def _file_utility(self, util: UtilityOutput) -> None:
        self._utility_results[util.call_id] = util

    def _wait_for_utility(self, call_id: int, timeout: float | None) -> bytes:
        deadline = None if timeout is None else now() + timeout
        while call_id not in self._utility_results:
            remaining = None if deadline is None else deadline - now()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(f"engine core did not answer within {timeout:.0f}s")
            outputs = self._recv(remaining)
            if outputs is not None and self._has_outputs(outputs):
                self._pending.append(outputs)
        util = self._utility_results.pop(call_id)
        if util.failure is not None:
            raise RuntimeError(f"engine core utility call failed: {util.failure}")
        return util.result

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        if self._pending:
            return self._pending.popleft()
        while True:
            outputs = self._recv(timeout)
            if outputs is None:
                return EngineCoreOutputs(timestamp=now())
            if self._has_outputs(outputs):
                return outputs

    def shutdown(self) -> None:
        if self.proc.poll() is None and self._dead_reason is None:
            try:
                self.input_socket.send_multipart((EngineCoreRequestType.SHUTDOWN.value, b""))
                self.proc.wait(timeout=5)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass
        self._finalizer()
