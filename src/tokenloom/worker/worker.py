"""Worker: one rank of the model. It owns that rank's model runner.

A worker joins the tensor-parallel group (ops/distributed), loads the model and cuts it to its
shard (model/tensor_parallel), and builds a `ModelRunner` over the shard, which allocates the KV
cache of the rank's heads only. Every rank runs every step on the same scheduler output, samples
from the same all-gathered logits with the same seed, and so keeps an identical persistent batch;
the executor returns rank 0's output. The same class runs in the engine core's process (the
uni-process executor), in a worker process (multiprocess executor) or in a Ray actor.
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tokenloom.config import EngineConfig
from tokenloom.model import packed_linear
from tokenloom.model.loader import LoadedModel, load_model
from tokenloom.model.quant_linear import weight_bytes_per_token
from tokenloom.model.tensor_parallel import check_tensor_parallel, shard_model_
from tokenloom.ops import amx, cpu_features, cpu_kernels, elementwise, kernel_plan
from tokenloom.ops.amx import AmxPackedWeight
from tokenloom.ops.cpu_threads import ThreadGovernor, fixed_num_threads, usable_cores
from tokenloom.ops.distributed import destroy_tensor_parallel, init_tensor_parallel
from tokenloom.runner_output import ModelRunnerOutput
from tokenloom.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tokenloom.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class WorkerInfo:
    """What the engine core reports about the model it serves (EngineInfo), from rank 0."""

    rank: int
    max_model_len: int
    num_kv_blocks: int
    dtype: str
    attention_backend: str
    kv_cache_dtype: str
    quantization: str
    weight_bytes_per_token: int
    num_threads: int
    pid: int
    cpu: str = ""
    cpu_kernels_isa: str = ""
    cuda_graphs: str = ""  # what the runner captured ("": every step eager)
    kernel_plan_summary: str = ""  # ops/kernel_plan.py's KernelPlan.header() (CPU only)
    kernel_plan: list[list[str]] = field(default_factory=list)  # its KernelPlan.encode()


def threads_per_rank(local_world_size: int, configured: int | None = None) -> int:
    """Each of the ranks sharing this machine gets an equal share of its usable cores (at least
    one): N ranks of spinning OpenMP threads on fewer cores than threads stall each other
    (ops/cpu_threads). num_threads (`configured`), or TOKENLOOM_NUM_THREADS, fixes the count per rank."""
    return fixed_num_threads(configured) or max(1, len(usable_cores()) // max(1, local_world_size))


def cpu_line(loaded: LoadedModel, thread_policy: str) -> tuple[str, str]:
    """(the start-up line of what runs on this CPU, the C kernels' ISA level or "off")."""
    features = cpu_features.detect()
    # ops.elementwise decides per tensor; a probe of the model's dtype says what its norms get.
    probe = torch.empty(0, dtype=loaded.dtype)
    kernels = cpu_kernels.isa() if elementwise.c_kernels_active(probe) else None
    dtype = str(loaded.dtype).removeprefix("torch.")
    fused = getattr(loaded.model, "fused_decode", None)
    if loaded.quantization not in ("", "none"):
        matmul = loaded.quantization
    elif isinstance(getattr(loaded.model, "packed_lm_head", None), AmxPackedWeight):
        matmul = f"{amx.kernel_name()} {dtype} (ops/amx)"
    elif isinstance(getattr(loaded.model, "packed_lm_head", None), cpu_kernels.F32Panels):
        matmul = f"C panels {dtype}, every row count (one copy)"
    elif getattr(loaded.model, "packed_lm_head", None) is not None:
        matmul = f"oneDNN packed {dtype}"
        if loaded.dtype == torch.float32 and packed_linear.gemv_in_use(loaded.model):
            matmul = f"C GEMV below {packed_linear.GEMV_BELOW_ROWS} rows, {matmul}"
    else:
        matmul = f"F.linear {dtype}"
    threads = f"{torch.get_num_threads()} of {features.num_cores} usable cores, {thread_policy}"
    if fused is not None:
        matmul += ", decode steps fused (one C call)"
    return (cpu_features.engine_cpu_line(features, dtype, kernels, matmul, threads),
            kernels or "off")


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str = "",
                 local_world_size: int | None = None) -> None:
        t0 = time.perf_counter()
        self.config, self.rank = config, rank
        self._profiler = None  # torch.profiler.profile while start_profile() runs (see `profile`)
        tp = config.tensor_parallel_size
        on_cpu = torch.device(config.device).type == "cpu"
        if tp > 1 and on_cpu:
            torch.set_num_threads(threads_per_rank(tp if local_world_size is None else local_world_size,
                                                   config.num_threads))
        elif on_cpu and config.num_threads is not None:  # the in-process core too
            torch.set_num_threads(config.num_threads)
        if tp > 1 and torch.device(config.device).type == "cuda":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        init_tensor_parallel(rank, tp, distributed_init_method, config.device)
        device = f"cuda:{torch.cuda.current_device()}" if tp > 1 and not on_cpu else config.device
        self.loaded = load_model(config.model, dtype=config.dtype, device=device,
                                 quantization=config.quantization, pooling=config.is_pooling,
                                 hf_overrides=config.hf_overrides, convert=config.convert,
                                 load_format=config.load_format, tokenizer=config.tokenizer,
                                 tokenizer_mode=config.tokenizer_mode, quantize_lm_head=config.quantize_lm_head)
        check_tensor_parallel(self.loaded.config, tp)
        self.full_config = self.loaded.config
        # The rank's view (its heads): the runner sizes the KV cache by it.
        self.loaded.config = shard_model_(self.loaded.model, rank, tp)
        max_model_len = config.max_model_len  # resolved in the caller (model/resolve.py)
        assert max_model_len is not None, "the engine core takes a resolved EngineConfig"
        runner_config = config if device == config.device else _with_device(config, device)
        self.model_runner = ModelRunner(self.loaded, runner_config, max_model_len)
        # With one rank the threads follow what other processes leave of the cores; N ranks on
        # one machine keep their fixed share (each would count the others as "other processes").
        self.thread_governor = ThreadGovernor(configured=config.num_threads) if on_cpu and tp == 1 else None
        runner = self.model_runner
        self.info = WorkerInfo(
            rank=rank, max_model_len=max_model_len, num_kv_blocks=runner.num_kv_blocks,
            dtype=str(self.loaded.dtype).removeprefix("torch."),
            attention_backend=runner.attn_backend.name,
            kv_cache_dtype=str(runner.kv_cache_dtype).removeprefix("torch."),
            quantization=self.loaded.quantization,
            weight_bytes_per_token=weight_bytes_per_token(self.loaded.model),
            num_threads=torch.get_num_threads(), pid=os.getpid(),
            cuda_graphs=runner.graphs.describe() if runner.graphs is not None else "")
        if on_cpu:
            policy = (self.thread_governor.describe() if self.thread_governor is not None
                      else f"fixed, rank {rank} of {tp}")
            self.info.cpu, self.info.cpu_kernels_isa = cpu_line(self.loaded, policy)
            plan = kernel_plan.current()
            self.info.kernel_plan_summary, self.info.kernel_plan = plan.header(), plan.encode()
        logger.info("worker rank %d of %d ready in %.1fs", rank, tp, time.perf_counter() - t0)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        if self.thread_governor is not None:
            self.thread_governor.step()
        return self.model_runner.execute_model(scheduler_output)

    def remove_requests(self, req_ids: set[str]) -> None:
        self.model_runner.remove_requests(req_ids)

    def num_runner_requests(self) -> int:
        return len(self.model_runner.input_batch)

    def get_info(self) -> WorkerInfo:
        return self.info

    def profile(self, is_start: bool, directory: str) -> list[str]:
        """vLLM's start_profile / stop_profile on this rank: the torch profiler (CPU, and CUDA on
        a GPU) over every step between the two; stopping writes its Chrome trace (Perfetto,
        chrome://tracing, TensorBoard) into `directory` and returns its path."""
        import torch.profiler as tp

        if is_start:
            if self._profiler is not None:
                raise RuntimeError("the profiler is already running: stop_profile() first.")
            activities = [tp.ProfilerActivity.CPU]
            if torch.device(self.config.device).type == "cuda":
                activities.append(tp.ProfilerActivity.CUDA)
            self._profiler = tp.profile(activities=activities, record_shapes=True)
            self._profiler.start()
            return []
        if self._profiler is None:
            raise RuntimeError("the profiler is not running: start_profile() first.")
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, f"tokenloom-rank{self.rank}-pid{os.getpid()}-{time.time_ns()}.pt.trace.json.gz")
        profiler.export_chrome_trace(path)
        logger.info("torch profiler trace of rank %d written to %s", self.rank, path)
        return [path]

    def shutdown(self) -> None:
        destroy_tensor_parallel()


def _with_device(config: EngineConfig, device: str) -> EngineConfig:
    import msgspec

    return msgspec.structs.replace(config, device=device)
