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
from typing import Any, Protocol

import msgspec
import zmq

from tokenloom import envs
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
STARTUP_TIMEOUT_S = envs.TOKENLOOM_STARTUP_TIMEOUT_S
# A core not heard from for this long (it sends a heartbeat every HEARTBEAT_INTERVAL_S when it has
# nothing else to say) is stalled: stopped, hung or starved of CPU. `serve --health-heartbeat-timeout`.
DEFAULT_HEARTBEAT_TIMEOUT_S = 3.0


class EngineDeadError(RuntimeError):
    """The engine-core process died; requests in flight were finished with an error."""


class EngineShutDownError(EngineDeadError):
    """The engine was shut down on purpose (a server stopping) while requests were in flight."""


ENGINE_SHUT_DOWN = "the engine was shut down"


class EngineCoreClient(ABC):
    info: EngineInfo

    @staticmethod
    def make_client(config: EngineConfig, multiprocess: bool = True) -> "EngineCoreClient":
        return MPClient(config) if multiprocess else InprocClient(config)

    @abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """The core requests of one user request (its n children): one replica gets them all."""
        for request in requests:
            self.add_request(request)

    def add_request_batch(self, groups: list[list[EngineCoreRequest]]) -> None:
        """Several user requests (each its core requests, as `add_requests` takes them), which
        the core queues together before its next step (one message where there is a socket)."""
        for group in groups:
            self.add_requests(group)

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


def _cleanup(proc: "ProcessHandle", ctx: zmq.Context, sockets: tuple[zmq.Socket, ...], tmpdir: str) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # The finalizer holds the sockets and closes them by name: when the client is freed by the
    # cycle collector, the context's weak set of its sockets may already be empty, so destroy()
    # closed none of them and term() waited forever for them (a gc.collect() that never returned).
    for sock in sockets:
        sock.close(linger=0)
    ctx.destroy(linger=0)
    shutil.rmtree(tmpdir, ignore_errors=True)


class CoreLauncher(Protocol):
    """Starts an engine core somewhere other than a local child process (engine/ray_launcher.py).
    The client binds its two sockets on tcp://`host` and hands `start` their addresses."""

    host: str

    def start(self, config: EngineConfig, in_addr: str, out_addr: str, dp_rank: int, dp_size: int) -> ProcessHandle: ...


class ProcessHandle(Protocol):
    """What the client needs of the core's process: `subprocess.Popen`'s liveness methods."""

    pid: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def terminate(self) -> None: ...

    def kill(self) -> None: ...


def _spawn_local(config: EngineConfig, in_addr: str, out_addr: str, dp_rank: int, dp_size: int) -> subprocess.Popen:
    args = [sys.executable, "-m", "tokenloom.core.engine_core_proc", in_addr, out_addr, str(os.getpid())]
    if dp_size > 1:
        args.append(f"{dp_rank}/{dp_size}")
    proc = subprocess.Popen(args, stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(msgspec.json.encode(config))
    proc.stdin.close()
    return proc


class MPClient(EngineCoreClient):
    def __init__(self, config: EngineConfig, *, dp_rank: int = 0, dp_size: int = 1,
                 launcher: CoreLauncher | None = None, wait_ready: bool = True) -> None:
        """`dp_rank`/`dp_size`: this core is data-parallel replica `dp_rank` of `dp_size` (its
        share of the cores; see engine/dp_client.py). `launcher`: start it elsewhere (Ray).
        `wait_ready=False` returns once the core is started; `wait_ready()` then waits for it
        (so that M replicas load their models at once)."""
        config.validate()
        self.dp_rank = dp_rank
        # A private 0700 directory (mkdtemp) recording its owner; stale ones are swept first.
        self._tmpdir = make_ipc_dir()
        self.ctx = zmq.Context()
        self.input_socket = self.ctx.socket(zmq.PUSH)
        self.input_socket.setsockopt(zmq.LINGER, 0)
        self.output_socket = self.ctx.socket(zmq.PULL)
        self.output_socket.setsockopt(zmq.LINGER, 0)
        if launcher is None:
            in_addr = f"ipc://{self._tmpdir}/input"
            out_addr = f"ipc://{self._tmpdir}/output"
            self.input_socket.bind(in_addr)
            self.output_socket.bind(out_addr)
        else:
            # Another machine may have to reach us: tcp on the address the launcher names.
            base = f"tcp://{launcher.host}"
            in_addr = f"{base}:{self.input_socket.bind_to_random_port(base)}"
            out_addr = f"{base}:{self.output_socket.bind_to_random_port(base)}"
        try:
            self.proc: ProcessHandle = (_spawn_local if launcher is None else launcher.start)(
                config, in_addr, out_addr, dp_rank, dp_size)
        except BaseException:
            self.ctx.destroy(linger=0)
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            raise
        self._finalizer = weakref.finalize(self, _cleanup, self.proc, self.ctx, (self.input_socket, self.output_socket),
                                           self._tmpdir)
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._dead_reason: str | None = None
        self._pending: collections.deque[EngineCoreOutputs] = collections.deque()
        self._call_ids = itertools.count(1)
        self._utility_results: dict[int, Any] = {}
        # When the core last sent anything (now() clock), as read by whoever reads the socket.
        self.last_heard = now()
        if wait_ready:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Blocks until the core has loaded its model and answered the ready handshake."""
        try:
            ready = self._wait_for_utility(READY_CALL_ID, timeout=STARTUP_TIMEOUT_S)
        except BaseException:
            self.shutdown()
            raise
        self.info = msgspec.msgpack.decode(ready, type=EngineInfo)
        self.last_heard = now()

    # ---- sending ----------------------------------------------------------------------------

    def _send(self, kind: EngineCoreRequestType, obj: Any) -> None:
        """Sends without blocking on a dead core: a PUSH socket with no peer (a core that died
        while we were idle, or one that has not connected yet) blocks a plain send forever, so
        a send that would block waits in slices and checks the process in between."""
        self._check_alive()
        frames = (kind.value, self.encoder.encode(obj))
        while True:
            try:
                self.input_socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                self.input_socket.poll(_POLL_MS, zmq.POLLOUT)
                self._check_process()

    def add_request(self, request: EngineCoreRequest) -> None:
        request.sent_time = now()
        self._send(EngineCoreRequestType.ADD, request)

    def add_request_batch(self, groups: list[list[EngineCoreRequest]]) -> None:
        requests = [r for group in groups for r in group]
        t = now()
        for request in requests:
            request.sent_time = t
        self._send(EngineCoreRequestType.ADD_BATCH, requests)

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

    def process_exited(self) -> bool:
        return self.proc.poll() is not None

    def wait_exited(self, timeout: float = 10.0) -> None:
        """Reaps the dead core's process (blocking; no zombie), killing one that lingers after
        its error message."""
        try:
            self.proc.wait(timeout)
        except Exception:  # noqa: BLE001 - subprocess.TimeoutExpired, or Ray's equivalent
            self.proc.kill()
            self.proc.wait()

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
        outputs.received_time = self.last_heard = now()
        outputs.engine_index = self.dp_rank
        if outputs.engine_error is not None:
            self._mark_dead(outputs.engine_error)
        return outputs

    def _check_process(self) -> None:
        # Another thread may have found the death first (the async client's output side) and
        # the sockets may be closed since: its reason stands.
        self._check_alive()
        code = self.proc.poll()
        if code is not None:
            self._mark_dead(self._unread_last_words() or f"engine core process {self.proc.pid} exited with code {code}")

    def _unread_last_words(self) -> str | None:
        """The dead core's own account of why it stopped, if it still waits unread: the core sends
        it and then exits, so a send that finds no peer (or a poll that just missed it) can learn
        of the exit first. Other unread outputs of a dead core are never delivered anyway: the
        death fails every unfinished request."""
        try:
            while self.output_socket.poll(0):
                outputs = self.decoder.decode(self.output_socket.recv(zmq.NOBLOCK, copy=False).buffer)
                if outputs.engine_error is not None:
                    return outputs.engine_error
        except (zmq.ZMQError, msgspec.DecodeError):  # zmq.Again, or a socket closed by a shutdown
            pass
        return None

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
        # SHUTDOWN only if the core can take it now: one that never connected (interrupted
        # while starting) or is dying has no peer socket, and the finalizer terminates it.
        if self.proc.poll() is None and self._dead_reason is None:
            try:
                self.input_socket.send_multipart((EngineCoreRequestType.SHUTDOWN.value, b""), flags=zmq.NOBLOCK)
                self.proc.wait(timeout=5)
            except (zmq.ZMQError, subprocess.TimeoutExpired):
                pass
        self._finalizer()
        if self._dead_reason is None:  # later calls raise this, not a closed socket's ZMQError
            self._dead_reason = ENGINE_SHUT_DOWN
