"""The engine-core child process: `python -m tokenloom.core.engine_core_proc IN_ADDR OUT_ADDR
PARENT_PID [DP_RANK/DP_SIZE]`.

Three threads, so that (de)serialization and socket I/O overlap the model's compute:
- the input thread receives and decodes messages and puts them on `input_queue`;
- the main thread runs the busy loop: drain inputs, step, put outputs on `output_queue`;
- the output thread encodes and sends.
The caller binds both ZMQ sockets (ipc:// paths in its private 0700 temp dir) and writes the
EngineConfig as JSON on our stdin. The first message we send is either the ready handshake (an
`EngineInfo` as a utility result with call_id -1) or an `engine_error` if start-up failed.
This process must never outlive its parent: the kernel kills it when the parent dies (prctl
PDEATHSIG), and a watchdog thread checks the parent pid in case the parent died before prctl.
Once ready, the output thread sends a heartbeat (an empty message) whenever it has sent nothing for
HEARTBEAT_INTERVAL_S: it runs beside the busy loop, so a long step never silences it, while a
stopped or hung process does (what the server's /health reports).
"""
from __future__ import annotations

import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any

import msgspec
import zmq

from tokenloom import envs
from tokenloom.config import EngineConfig
from tokenloom.messages import (
    ENGINE_STOPPED_BY_SIGINT,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreRequestType,
    HEARTBEAT_INTERVAL_S,
    READY_CALL_ID,
    UtilityOutput,
    UtilityRequest,
    now,
)

logger = logging.getLogger("tokenloom.engine_core")

_SHUTDOWN = object()
# An idle core wakes this often: Python runs signal handlers only in the main thread, and a
# SIGINT that the kernel hands to another of the core's threads leaves the main thread asleep
# in its queue wait until something wakes it (the keep-alive server, polled by /health, sends
# nothing). A wake-up a second costs nothing measurable.
_IDLE_WAKE_S = 1.0
_REJECT = "reject"  # input-queue kind: an ADD message that failed to decode, (request_id, error)


def _request_id_of(payload: Any) -> str | None:
    """The request id of an ADD message that failed validation: the first field of the
    array-like EngineCoreRequest, read without validating anything else."""
    try:
        fields = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return None
    if isinstance(fields, list) and fields and isinstance(fields[0], str):
        return fields[0]
    return None


def _decode_add(decoder: msgspec.msgpack.Decoder, payload: Any) -> tuple[Any, Any]:
    """The input-queue item of one ADD: the request, or a rejection of it alone when it fails to
    decode (a dead input thread would leave the core deaf)."""
    try:
        request = decoder.decode(payload)
    except (msgspec.DecodeError, ValueError) as e:  # ValidationError is a ValueError
        return _REJECT, (_request_id_of(payload), f"{e!r}")
    request.received_time = now()  # the ledger's "received by core"
    return EngineCoreRequestType.ADD, request


def _die_with_parent(parent_pid: int) -> None:
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the watchdog below still works
        pass

    def watchdog() -> None:
        while True:
            if os.getppid() != parent_pid:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watchdog, name="parent-watchdog", daemon=True).start()


class EngineCoreProc:
    def __init__(self, config: EngineConfig, in_addr: str, out_addr: str) -> None:
        self.ctx = zmq.Context()
        self.in_sock = self.ctx.socket(zmq.PULL)
        self.in_sock.connect(in_addr)
        self.out_sock = self.ctx.socket(zmq.PUSH)
        self.out_sock.setsockopt(zmq.LINGER, 2000)
        self.out_sock.connect(out_addr)
        self.input_queue: queue.Queue[tuple[EngineCoreRequestType, Any]] = queue.Queue()
        self.output_queue: queue.Queue[Any] = queue.Queue()
        self.encoder = msgspec.msgpack.Encoder()
        self.serialize_time_total = 0.0
        self._heartbeats = False  # on once the ready handshake is queued: it must go out first
        threading.Thread(target=self._output_thread, name="output", daemon=True).start()
        try:
            from tokenloom.core.engine_core import EngineCore

            self.engine = EngineCore(config)
        except ValueError as e:  # a setting the model cannot take: the message says it all
            self._send_fatal(f"engine core failed to start: {e}")
            raise SystemExit(1) from e
        except BaseException as e:  # noqa: BLE001 - reported to the caller, then we exit
            self._send_fatal(f"engine core failed to start: {e!r}\n{traceback.format_exc()}")
            raise SystemExit(1) from e
        self.output_queue.put(
            EngineCoreOutputs(
                utility_output=UtilityOutput(call_id=READY_CALL_ID, result=self.encoder.encode(self.engine.info))
            )
        )
        self._heartbeats = True
        threading.Thread(target=self._input_thread, name="input", daemon=True).start()

    # ---- threads ----------------------------------------------------------------------------

    def _input_thread(self) -> None:
        add_decoder = msgspec.msgpack.Decoder(EngineCoreRequest)
        abort_decoder = msgspec.msgpack.Decoder(list[str])
        util_decoder = msgspec.msgpack.Decoder(UtilityRequest)
        batch_decoder = msgspec.msgpack.Decoder(list[msgspec.Raw])
        while True:
            frames = self.in_sock.recv_multipart(copy=False)
            try:
                kind_frame, payload = frames
                kind = EngineCoreRequestType(bytes(kind_frame.buffer))
            except ValueError:
                logger.error("dropped a malformed message of %d frame(s) on the input socket", len(frames))
                continue
            if kind is EngineCoreRequestType.ADD:
                self.input_queue.put(_decode_add(add_decoder, payload.buffer))
            elif kind is EngineCoreRequestType.ADD_BATCH:
                # One queue item for the whole batch: the busy loop applies it before its next
                # step, whatever the timing of this thread.
                try:
                    parts = batch_decoder.decode(payload.buffer)
                except (msgspec.DecodeError, ValueError) as e:
                    logger.error("dropped a malformed ADD_BATCH message: %r", e)
                    continue
                self.input_queue.put((kind, [_decode_add(add_decoder, part) for part in parts]))
            elif kind is EngineCoreRequestType.ABORT or kind is EngineCoreRequestType.UTILITY:
                decoder = abort_decoder if kind is EngineCoreRequestType.ABORT else util_decoder
                try:
                    self.input_queue.put((kind, decoder.decode(payload.buffer)))
                except (msgspec.DecodeError, ValueError) as e:
                    logger.error("dropped a malformed %s message: %r", kind.name, e)
            else:
                self.input_queue.put((kind, None))
                return

    def _output_thread(self) -> None:
        # Encoded once; not stamped, not counted in serialize_time: the ledger never sees it.
        heartbeat = msgspec.msgpack.Encoder().encode(EngineCoreOutputs())
        while True:
            try:
                item = self.output_queue.get(timeout=HEARTBEAT_INTERVAL_S)
            except queue.Empty:
                if self._heartbeats:
                    try:  # never blocks: a caller that reads nothing (idle, no reader) just misses it
                        self.out_sock.send(heartbeat, flags=zmq.NOBLOCK)
                    except zmq.Again:
                        pass
                continue
            if item is _SHUTDOWN:
                return
            item.sent_time = now()  # the ledger's "output sent"
            t0 = time.perf_counter()
            self.out_sock.send(self.encoder.encode(item), copy=False)
            # Only this thread writes the total; the busy loop reads deltas of it (no lock).
            self.serialize_time_total += time.perf_counter() - t0

    def _send_fatal(self, message: str, level: int = logging.ERROR) -> None:
        logger.log(level, message)
        self.output_queue.put(EngineCoreOutputs(engine_error=message))
        self.output_queue.put(_SHUTDOWN)
        time.sleep(0.2)  # let the output thread flush before the process exits

    # ---- busy loop --------------------------------------------------------------------------

    def _handle(self, kind: EngineCoreRequestType, obj: Any) -> bool:
        """Applies one input message; False means shut down."""
        if kind is EngineCoreRequestType.ADD:
            self.engine.add_request(obj)
        elif kind is EngineCoreRequestType.ADD_BATCH:
            for item in obj:
                self._handle(*item)
        elif kind is _REJECT:
            request_id, error = obj
            logger.error("request %s could not be decoded: %s", request_id, error)
            if request_id is not None:
                self.engine.reject_request(request_id, f"request {request_id} could not be decoded: {error}")
        elif kind is EngineCoreRequestType.ABORT:
            self.engine.abort_requests(obj)
            aborted = self.engine.pop_aborted_outputs()
            if aborted:  # their accounts, owed to the caller (see metrics/core_ledger.py)
                self.output_queue.put(EngineCoreOutputs(outputs=aborted, timestamp=now()))
        elif kind is EngineCoreRequestType.UTILITY:
            self.output_queue.put(EngineCoreOutputs(utility_output=self._call_utility(obj)))
        else:
            return False
        return True

    def _call_utility(self, req: UtilityRequest) -> UtilityOutput:
        try:
            method = getattr(self.engine, req.method)
            if req.method.startswith("_") or not callable(method):
                raise AttributeError(req.method)
            return UtilityOutput(call_id=req.call_id, result=self.encoder.encode(method(*req.args)))
        except Exception as e:  # noqa: BLE001 - the caller re-raises it
            return UtilityOutput(call_id=req.call_id, failure=f"{type(e).__name__}: {e}")

    def run_busy_loop(self) -> None:
        engine = self.engine
        perf_counter = time.perf_counter
        step_end = None  # None after an idle wait: the wait is not loop time
        serialized = 0.0
        while True:
            # Block only when there is nothing to step: an idle core costs no CPU.
            if not engine.has_unfinished_requests():
                step_end = None
                try:
                    item = self.input_queue.get(timeout=_IDLE_WAKE_S)
                except queue.Empty:
                    continue
                if not self._handle(*item):
                    break
            while not self.input_queue.empty():
                if not self._handle(*self.input_queue.get_nowait()):
                    return self._shutdown()
            if engine.has_unfinished_requests():
                step_start = perf_counter()
                outputs = engine.step()
                stats = outputs.scheduler_stats
                if stats is not None:
                    total = self.serialize_time_total
                    stats.serialize_time, serialized = total - serialized, total
                    stats.loop_time = 0.0 if step_end is None else step_start - step_end
                if outputs.outputs or stats is not None:
                    self.output_queue.put(outputs)
                step_end = perf_counter()
        self._shutdown()

    def _shutdown(self) -> None:
        self.engine.shutdown()
        self.output_queue.put(_SHUTDOWN)


def _set_compute_threads(dp_rank: int = 0, dp_size: int = 1, configured: int | None = None) -> int:
    """The model's threads get every core this process may run on (TOKENLOOM_NUM_THREADS
    overrides), fewer while other processes use them (ops/cpu_threads, the engine core's
    ThreadGovernor). The caller process does not compete for them during a run: it blocks on the
    output socket between steps, and its per-step work (decode, detokenize) is small next to a
    step's (`tokenloom bench throughput` reports it as caller CPU). A data-parallel
    replica first confines itself to its share of the cores (cores // M). `configured`: the
    engine's num_threads (--threads), which fixes the count."""
    from tokenloom.ops.cpu_threads import pin_to_replica_share, set_compute_threads

    pin_to_replica_share(dp_rank, dp_size)
    return set_compute_threads(configured)


def main() -> None:
    in_addr, out_addr, parent_pid = sys.argv[1], sys.argv[2], int(sys.argv[3])
    # A data-parallel replica: RANK/SIZE (see engine/dp_client.py).
    dp_rank, dp_size = (int(x) for x in sys.argv[4].split("/")) if len(sys.argv) > 4 else (0, 1)
    _die_with_parent(parent_pid)
    logging.basicConfig(level=envs.TOKENLOOM_LOG_LEVEL)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=EngineConfig)
    _set_compute_threads(dp_rank, dp_size, config.num_threads)
    proc = EngineCoreProc(config, in_addr, out_addr)
    # SIGINT raises KeyboardInterrupt in the busy loop, so the core reports its own death (below)
    # whatever a library imported while loading the model did with the handler.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc.run_busy_loop()
    except KeyboardInterrupt:
        # A stop, not a crash (no traceback); requests in flight still hear of it.
        proc._send_fatal(ENGINE_STOPPED_BY_SIGINT, level=logging.INFO)
        os._exit(1)
    except BaseException as e:  # noqa: BLE001 - every in-flight request must hear about it
        proc._send_fatal(f"engine core died: {e!r}\n{traceback.format_exc()}")
        os._exit(1)
    time.sleep(0.1)
    os._exit(0)


if __name__ == "__main__":
    main()
