"""The engine core as a Ray actor (`--distributed-executor-backend ray` with data parallelism).

The actor runs the same `EngineCoreProc` as the child process does: the same three threads and
busy loop, connected to the front end's two ZMQ sockets over tcp on the front end's node address
(engine/ray_launcher.py places the actor and watches it). Ray is imported by the launcher only:
this class is plain, and `ray.remote` wraps it there.
"""
from __future__ import annotations

import logging
import os
import traceback

import msgspec

from tokenloom import envs
from tokenloom.config import EngineConfig


class EngineCoreActor:
    def __init__(self, config_json: bytes, in_addr: str, out_addr: str, num_threads: int) -> None:
        logging.basicConfig(level=envs.TOKENLOOM_LOG_LEVEL)
        # The placement group's bundle is this replica's share of its node: that many threads,
        # fixed (the ThreadGovernor would count the node's other replicas as intruders).
        os.environ["TOKENLOOM_NUM_THREADS"] = str(num_threads)
        from tokenloom.core.engine_core_proc import EngineCoreProc, _set_compute_threads

        config = msgspec.json.decode(config_json, type=EngineConfig)
        _set_compute_threads(configured=config.num_threads)  # --threads, where given, still wins
        # "ray" placed this replica; its own tensor-parallel ranks (if any) run as local processes
        # inside the replica's bundle, not as Ray actors nested in it.
        config = msgspec.structs.replace(
            config, distributed_executor_backend="uni" if config.tensor_parallel_size == 1 else "mp")
        # On failure it has told the front end (engine_error) before raising.
        self.proc = EngineCoreProc(config, in_addr, out_addr)

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> None:
        """The busy loop, until the front end sends SHUTDOWN; the actor is then done."""
        try:
            self.proc.run_busy_loop()
        except BaseException as e:  # noqa: BLE001 - every in-flight request must hear about it
            self.proc._send_fatal(f"engine core died: {e!r}\n{traceback.format_exc()}")
            raise
