"""One worker process per tensor-parallel rank on this machine.

Each step's `SchedulerOutput` is pickled once and written to every rank's pipe; the ranks run the
step together (their all-reduces and all-gather go through torch.distributed, gloo on the CPU,
NCCL on CUDA, rendezvous on a free port of 127.0.0.1), and rank 0 alone writes its
`ModelRunnerOutput` back; the other ranks write only when they fail. The executor waits on rank
0's pipe, every other rank's pipe and every process's sentinel at once, so a rank that raises or
dies ends the step with an error at once instead of leaving the engine core waiting: the engine
core then dies with the usual engine-death contract (every in-flight request fails), and the
workers die with it.

With the ledger on, every rank measures its step (its compute threads' CPU time and run_delay,
ops/schedstat.py) and every rank replies to every step: rank 0 with its output, the others with
their figures alone. The executor waits for all of them (a step is over when its slowest rank is)
and hands the core the sum of their CPU time and the largest run_delay on the step's output.
"""
from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING, Any

from tokenloom import envs
from tokenloom.config import EngineConfig
from tokenloom.executor.abstract import Executor, WorkerDiedError, step_meter
from tokenloom.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from tokenloom.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)

_SHUTDOWN_WAIT_S = 5.0


def free_local_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.check_model(config)
        n = config.tensor_parallel_size
        init_method = f"tcp://127.0.0.1:{free_local_port()}"
        ctx = multiprocessing.get_context("spawn")
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(n):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, name=f"tokenloom-tp{rank}", daemon=True,
                               args=(config, rank, init_method, child, os.getpid()))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._by_fd = {c.fileno(): r for r, c in enumerate(self.conns)}
        self.measured = config.enable_ledger  # every rank replies to every step (module docstring)
        self._sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        try:
            infos = [self._reply(rank) for rank in range(n)]
        except BaseException:
            self.shutdown()
            raise
        self.info = infos[0]
        logger.info("%d tensor-parallel worker processes ready (pids %s, %s)", n,
                    [i.pid for i in infos], init_method)

    # ---- the wire ------------------------------------------------------------------------------
    def _reply(self, rank: int, others_only_fail: bool = False) -> Any:
        """Rank `rank`'s next reply; raises WorkerDiedError as soon as any rank dies, or, when
        the other ranks write only to fail (`others_only_fail`: a step), as soon as one writes."""
        want = self.conns[rank]
        watch = [*(self.conns if others_only_fail else [want]), *self._sentinels]
        while True:
            ready = wait(watch)
            self._raise_if_exited(ready)
            for obj in ready:
                if obj is not want:
                    self._raise_from(self._by_fd[obj.fileno()])
            status, *payload = pickle.loads(want.recv_bytes())
            if status != "ok":
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} failed: {payload[0]}")
            return payload[0] if len(payload) == 1 else payload

    def _raise_if_exited(self, ready: list[Any]) -> None:
        for obj in ready:
            if obj in self._sentinels:
                r = self._sentinels[obj]
                self.procs[r].join(1.0)  # reap it, for its exit code
                raise WorkerDiedError(f"tensor-parallel worker rank {r} (pid {self.procs[r].pid}) "
                                      f"exited with code {self.procs[r].exitcode}")

    def _gather(self) -> list[Any]:
        """Every rank's reply to a step, in the order they come; raises WorkerDiedError as soon
        as a rank dies or fails."""
        replies: list[Any] = [None] * len(self.conns)
        waiting = {conn: rank for rank, conn in enumerate(self.conns)}
        while waiting:
            ready = wait([*waiting, *self._sentinels])
            self._raise_if_exited(ready)
            for obj in ready:
                rank = waiting.pop(obj)  # type: ignore[call-overload]
                status, *payload = pickle.loads(obj.recv_bytes())  # type: ignore[union-attr]
                if status != "ok":
                    raise WorkerDiedError(f"tensor-parallel worker rank {rank} failed: {payload[0]}")
                replies[rank] = payload[0] if len(payload) == 1 else payload
        return replies

    def _raise_from(self, rank: int) -> None:
        try:
            status, *payload = pickle.loads(self.conns[rank].recv_bytes())
        except (EOFError, OSError):
            raise WorkerDiedError(f"tensor-parallel worker rank {rank} closed its pipe") from None
        raise WorkerDiedError(f"tensor-parallel worker rank {rank} failed: {payload[0]}")

    def _send_all(self, message: bytes) -> None:
        try:
            for conn in self.conns:
                conn.send_bytes(message)
        except (BrokenPipeError, OSError) as e:
            self.check_health()
            raise WorkerDiedError(f"a tensor-parallel worker's pipe broke: {e!r}") from None

    # ---- the executor --------------------------------------------------------------------------
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._send_all(pickle.dumps(("execute_model", (scheduler_output,)), pickle.HIGHEST_PROTOCOL))
        if self.measured:
            replies = self._gather()
            out, rank0_wall, figures = replies[0]
            ranks = [figures, *replies[1:]]  # (CPU seconds, run_delay seconds) per rank
            out.cpu_time = sum(cpu for cpu, _ in ranks)
            out.run_delay = max(delay for _, delay in ranks)
        else:
            out, rank0_wall, _ = self._reply(0, others_only_fail=True)
        # Shipping the step to the ranks and the result back is part of preparing the step: the
        # ledger's step profile then adds up to the executor's wall time (the collectives are
        # inside rank 0's forward time already).
        out.prepare_time += max(0.0, time.perf_counter() - t0 - rank0_wall)
        return out

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        self._send_all(pickle.dumps((method, args), pickle.HIGHEST_PROTOCOL))
        return [self._reply(rank) for rank in range(len(self.conns))]

    def check_health(self) -> None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                raise WorkerDiedError(f"tensor-parallel worker rank {rank} (pid {proc.pid}) "
                                      f"exited with code {proc.exitcode}")

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(("shutdown", ())))
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + _SHUTDOWN_WAIT_S
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


# ---- the worker process ----------------------------------------------------------------------
def _die_with_parent(parent_pid: int) -> None:
    """A rank outlives no engine core: the kernel kills it when its parent goes (Linux), and a
    watchdog thread checks elsewhere."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watchdog() -> None:
        while os.getppid() == parent_pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watchdog, daemon=True, name="tokenloom-parent-watch").start()


def _worker_main(config: EngineConfig, rank: int, init_method: str, conn: Connection,
                 parent_pid: int) -> None:
    _die_with_parent(parent_pid)
    logging.basicConfig(level=envs.TOKENLOOM_LOG_LEVEL)
    from tokenloom.worker.worker import Worker

    try:
        worker = Worker(config, rank, init_method)
    except BaseException:  # noqa: BLE001 - the executor re-raises it
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        sys.exit(1)
    conn.send_bytes(pickle.dumps(("ok", worker.get_info())))
    perf_counter = time.perf_counter
    meter = step_meter(config)
    while True:
        try:
            method, args = pickle.loads(conn.recv_bytes())
        except EOFError:  # the executor is gone
            break
        if method == "shutdown":
            break
        try:
            if method == "execute_model":
                t0 = perf_counter()
                if meter is not None:
                    meter.begin(t0)
                out = worker.execute_model(*args)
                t1 = perf_counter()
                figures = None
                if config.enable_ledger:
                    cpu, delay = meter.measure(t1) if meter is not None else (0.0, 0.0)
                    figures = (cpu, min(delay, t1 - t0))
                if rank == 0:
                    reply = ("ok", out, t1 - t0, figures)
                    conn.send_bytes(pickle.dumps(reply, pickle.HIGHEST_PROTOCOL))
                elif figures is not None:
                    conn.send_bytes(pickle.dumps(("ok", figures), pickle.HIGHEST_PROTOCOL))
            else:
                conn.send_bytes(pickle.dumps(("ok", getattr(worker, method)(*args)), pickle.HIGHEST_PROTOCOL))
        except BaseException:  # noqa: BLE001 - a failed rank stops the engine (see module docstring)
            conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
            sys.exit(1)
    if meter is not None:
        meter.close()
    worker.shutdown()
