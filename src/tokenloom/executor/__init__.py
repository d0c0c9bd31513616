"""Executors: how the engine core's one scheduler drives the model's rank(s) (vLLM V1's shape).

`UniProcExecutor` runs the one rank in the engine core's own process (the default);
`MultiprocExecutor` runs one worker process per tensor-parallel rank; `RayExecutor` runs the
same workers as Ray actors, on one machine or a Ray cluster.
"""
from tokenloom.executor.abstract import Executor, WorkerDiedError
from tokenloom.executor.selector import executor_class

__all__ = ["Executor", "WorkerDiedError", "executor_class"]
