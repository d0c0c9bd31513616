"""Which executor runs the ranks (EngineConfig.distributed_executor_backend)."""
from __future__ import annotations

from tokenloom.config import EngineConfig
from tokenloom.executor.abstract import Executor


def executor_class(config: EngineConfig) -> type[Executor]:
    """uni, mp or ray; imported on demand (Ray only when asked for)."""
    backend = config.executor_backend
    if backend == "uni":
        from tokenloom.executor.uniproc_executor import UniProcExecutor

        return UniProcExecutor
    if backend == "mp":
        from tokenloom.executor.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor
    from tokenloom.executor.ray_executor import RayExecutor

    return RayExecutor
