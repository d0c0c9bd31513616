"""Data-parallel engine cores as Ray actors, placed with one placement group.

`RayCoreLauncher` connects to the Ray cluster (`ray.init()`: the one `ray start --head` started
on this node or RAY_ADDRESS names, else a local one), reserves one bundle per replica with its
share of the cluster's CPUs (SPREAD: on a cluster of several nodes the replicas land on different
machines), and starts each replica's `EngineCoreActor` in its bundle. The front end binds its
sockets on this node's address (`host`), which the actors connect to over tcp: the engine's ZMQ
protocol is unchanged, so everything else (balancing, abort, streaming, the ledger, death) is
the same as with local processes. `RayCoreHandle` gives the client `subprocess.Popen`'s liveness
methods on top of the actor's `run()` call, which ends when the actor does (killed, crashed, or
shut down).

Ray is imported here only, when the backend is asked for: it is not a runtime dependency.
"""
from __future__ import annotations

import subprocess
from typing import Any

import msgspec

from tokenloom.config import EngineConfig
from tokenloom.core.ray_engine_core import EngineCoreActor


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError("distributed_executor_backend='ray' needs the ray package: pip install ray") from e
    return ray


class RayCoreHandle:
    def __init__(self, actor: Any, run_ref: Any, pid_ref: Any) -> None:
        self.actor = actor
        self._run = run_ref
        self._pid_ref = pid_ref
        self._pid: int | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int | None:
        """The actor's worker process id (once the actor is up)."""
        if self._pid is None:
            ray = _ray()
            ready, _ = ray.wait([self._pid_ref], timeout=0)
            if ready:
                try:
                    self._pid = ray.get(self._pid_ref)
                except Exception:  # noqa: BLE001 - the actor died before answering
                    return None
        return self._pid

    def poll(self) -> int | None:
        if self.returncode is None:
            ray = _ray()
            ready, _ = ray.wait([self._run], timeout=0)
            if not ready:
                return None
            try:
                ray.get(self._run)
                self.returncode = 0
            except Exception:  # noqa: BLE001 - killed (RayActorError) or crashed
                self.returncode = 1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        ready, _ = _ray().wait([self._run], timeout=timeout)
        if not ready:
            raise subprocess.TimeoutExpired("ray engine-core actor", timeout or 0)
        code = self.poll()
        assert code is not None
        return code

    def terminate(self) -> None:
        _ray().kill(self.actor, no_restart=True)

    kill = terminate


class RayCoreLauncher:
    def __init__(self, size: int) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group

        if not ray.is_initialized():
            ray.init(ignore_reinit_error=True, logging_level="warning", log_to_driver=False)
        self.host = ray.util.get_node_ip_address()
        # Each replica's share of the cluster: its bundle's CPUs, and as many compute threads.
        self.cpus = max(1, int(ray.cluster_resources().get("CPU", 1)) // size)
        self.pg = placement_group([{"CPU": self.cpus}] * size, strategy="SPREAD")
        ray.get(self.pg.ready())
        self._actor_cls = ray.remote(EngineCoreActor)

    def start(self, config: EngineConfig, in_addr: str, out_addr: str, dp_rank: int, dp_size: int) -> RayCoreHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = self._actor_cls.options(
            num_cpus=self.cpus,
            # run() holds one thread for the actor's life; pid() is answered on the other.
            max_concurrency=2,
            scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=dp_rank),
        ).remote(msgspec.json.encode(config), in_addr, out_addr, self.cpus)
        return RayCoreHandle(actor, actor.run.remote(), actor.pid.remote())

    def close(self) -> None:
        """Releases the placement group (after the actors are gone)."""
        from ray.util.placement_group import remove_placement_group

        try:
            remove_placement_group(self.pg)
        except Exception:  # noqa: BLE001 - Ray already shut down
            pass
