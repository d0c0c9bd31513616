"""The tensor-parallel ranks as Ray actors: the same `Worker` as the multiprocess executor, placed
by Ray on this machine or across the machines of a Ray cluster.

`ray.init()` joins the cluster this machine belongs to (`ray start --head` on one machine,
`ray start --address=<head>:6379` on the others; or RAY_ADDRESS), and starts a local one when
there is none. The actors are spread over the cluster's nodes; rank 0's node address and a free
port there are the torch.distributed rendezvous, and each rank's thread count is its node's
cores over the ranks placed on that node. Ray is imported only here, only when this backend is
chosen: it is not a dependency of tokenloom (pip install ray).
"""
from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import TYPE_CHECKING, Any

from tokenloom import envs
from tokenloom.config import EngineConfig
from tokenloom.executor.abstract import Executor, WorkerDiedError, step_meter
from tokenloom.runner_output import ModelRunnerOutput

if TYPE_CHECKING:
    from tokenloom.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError("distributed_executor_backend='ray' needs the ray package: pip install ray") from None
    return ray


class RayWorkerWrapper:
    """A Ray actor holding one rank's `Worker`, built once the rendezvous is known."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.meter: Any = None  # this rank's compute threads, with the ledger on

    def node_address(self) -> tuple[str, int]:
        """(this node's IP, a free port on it): the rendezvous, when this actor is rank 0."""
        import ray

        return ray.util.get_node_ip_address(), free_local_port_any()

    def init_worker(self, config: EngineConfig, rank: int, init_method: str, local_world_size: int) -> Any:
        logging.basicConfig(level=envs.TOKENLOOM_LOG_LEVEL)
        from tokenloom.worker.worker import Worker

        self.worker = Worker(config, rank, init_method, local_world_size=local_world_size)
        self.meter = step_meter(config)
        return self.worker.get_info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> tuple[ModelRunnerOutput, float, Any]:
        """(the step's output, its wall time, (CPU seconds, run_delay seconds) of this rank's
        compute threads, or None without the ledger)."""
        t0 = time.perf_counter()
        if self.meter is not None:
            self.meter.begin(t0)
        out = self.worker.execute_model(scheduler_output)
        t1 = time.perf_counter()
        figures = None
        if self.meter is not None:
            cpu, delay = self.meter.measure(t1)
            figures = (cpu, min(delay, t1 - t0))
        return out, t1 - t0, figures

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.worker, method)(*args)


def free_local_port_any() -> int:
    """A free port on every interface of this node (other nodes connect to it)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.check_model(config)
        ray = self.ray = _import_ray()
        if not ray.is_initialized():
            # Joins a running cluster (RAY_ADDRESS, or the one `ray start` left on this machine),
            # else starts a local one; workers get the engine's log level.
            ray.init(log_to_driver=True, include_dashboard=False,
                     runtime_env={"env_vars": {k: v for k, v in os.environ.items()
                                               if k.startswith("TOKENLOOM_") or k == "PYTHONPATH"}})
        n = config.tensor_parallel_size
        gpu = 1 if config.device.startswith("cuda") else 0
        actor_cls = ray.remote(num_cpus=0, num_gpus=gpu, scheduling_strategy="SPREAD")(RayWorkerWrapper)
        self.actors = [actor_cls.remote() for _ in range(n)]
        addresses = ray.get([a.node_address.remote() for a in self.actors])
        ip, port = addresses[0]
        per_node = Counter(a[0] for a in addresses)
        init_method = f"tcp://{ip}:{port}"
        try:
            infos = ray.get([a.init_worker.remote(config, rank, init_method, per_node[addresses[rank][0]])
                             for rank, a in enumerate(self.actors)])
        except Exception as e:
            self.shutdown()
            raise WorkerDiedError(f"a tensor-parallel Ray worker failed to start: {e}") from e
        self.info = infos[0]
        logger.info("%d tensor-parallel Ray actors ready on %s (%s)", n, dict(per_node), init_method)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ray = self.ray
        t0 = time.perf_counter()
        step = ray.put(scheduler_output)  # serialized once, read by every rank
        refs = [a.execute_model.remote(step) for a in self.actors]
        try:
            # Every rank's result is awaited (the others' are empty of news but carry their
            # errors); they end together, at the LM head's all-gather.
            results = ray.get(refs)
        except Exception as e:  # RayActorError, RayTaskError: a rank died or raised
            raise WorkerDiedError(f"a tensor-parallel Ray worker failed: {e}") from e
        out, rank0_wall, _ = results[0]
        ranks = [figures for _, _, figures in results if figures is not None]
        if ranks:  # with the ledger on: as the multiproc executor books its ranks
            out.cpu_time = sum(cpu for cpu, _ in ranks)
            out.run_delay = max(delay for _, delay in ranks)
        out.prepare_time += max(0.0, time.perf_counter() - t0 - rank0_wall)  # see multiproc_executor
        return out

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        try:
            return self.ray.get([a.call.remote(method, *args) for a in self.actors])
        except Exception as e:
            raise WorkerDiedError(f"a tensor-parallel Ray worker failed: {e}") from e

    def check_health(self) -> None:
        self.collective_rpc("get_info")

    def shutdown(self) -> None:
        for actor in getattr(self, "actors", []):
            try:
                self.ray.kill(actor)
            except Exception:  # noqa: BLE001 - already gone
                pass
        self.actors = []
