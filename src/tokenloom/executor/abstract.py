"""The executor interface the engine core steps through."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from tokenloom.config import EngineConfig
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.source import load_model_config, load_tokenizer
from tokenloom.model.tensor_parallel import check_tensor_parallel
from tokenloom.runner_output import ModelRunnerOutput
from tokenloom.worker.worker import WorkerInfo

if TYPE_CHECKING:
    from tokenloom.sched_output import SchedulerOutput


class WorkerDiedError(RuntimeError):
    """A tensor-parallel rank raised or exited; the engine core cannot go on without it."""


class Executor(ABC):
    """Runs each step's `SchedulerOutput` on every rank and returns rank 0's `ModelRunnerOutput`.
    The scheduler, the KV cache manager and the ledger stay single, in the engine core; an
    executor only carries steps to the ranks and their results back."""

    #: Rank 0's description of the model it runs (set by the constructor).
    info: WorkerInfo

    def __init__(self, config: EngineConfig) -> None:
        self.config = config

    @staticmethod
    def check_model(config: EngineConfig) -> ModelArchConfig:
        """The model's config, read from metadata, after checking that the tensor-parallel size
        splits it: a bad size fails here, before any worker starts."""
        model_config = load_model_config(config.model, config.hf_overrides, config.convert)
        check_tensor_parallel(model_config, config.tensor_parallel_size)
        return model_config

    def model_config(self) -> ModelArchConfig:
        """The full model's config (vocabulary, EOS ids) for the engine core."""
        return load_model_config(self.config.model, self.config.hf_overrides, self.config.convert)

    def tokenizer(self) -> Any:
        return load_tokenizer(self.config.tokenizer or self.config.model, self.config.tokenizer_mode)

    def determine_num_kv_blocks(self) -> int:
        """The KV blocks every rank holds: each rank sizes its cache for its own heads from the
        same budget, so the counts agree (vLLM takes the smallest; so do we)."""
        return min(self.collective_rpc("get_info"), key=lambda i: i.num_kv_blocks).num_kv_blocks

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    @abstractmethod
    def collective_rpc(self, method: str, *args: Any) -> list[Any]:
        """Calls `Worker.<method>(*args)` on every rank; their results in rank order."""

    def remove_requests(self, req_ids: set[str]) -> None:
        self.collective_rpc("remove_requests", req_ids)

    def num_runner_requests(self) -> int:
        return self.collective_rpc("num_runner_requests")[0]

    def check_health(self) -> None:
        """Raises if a rank is gone."""

    @abstractmethod
    def shutdown(self) -> None: ...


def step_meter(config: EngineConfig) -> Any:
    """This rank's meter of its compute threads (ops/schedstat.py), with the ledger on; the
    engine core reads the machine's load and the cgroup itself."""
    if not config.enable_ledger:
        return None
    from tokenloom.ops.schedstat import StepCpuMeter

    meter = StepCpuMeter(machine=False)
    return meter if meter.available else None
