"""The one rank in the engine core's own process: today's path, with no copy or hop per step."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenloom.config import EngineConfig
from tokenloom.executor.abstract import Executor
from tokenloom.model.config import ModelArchConfig
from tokenloom.runner_output import ModelRunnerOutput
from tokenloom.worker.worker import Worker

if TYPE_CHECKING:
    from tokenloom.sched_output import SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.driver_worker = Worker(config)
        self.info = self.driver_worker.info
        # The step's one call, bound once (the default path must cost what calling the runner did).
        self.execute_model = self.driver_worker.execute_model  # type: ignore[method-assign]

    def model_config(self) -> ModelArchConfig:
        return self.driver_worker.full_config

    def tokenizer(self) -> Any:
        return self.driver_worker.loaded.tokenizer

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.driver_worker.execute_model(scheduler_output)

    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        return [getattr(self.driver_worker, method)(*args)]

    def shutdown(self) -> None:
        self.driver_worker.shutdown()
