"""The tensor-parallel group of this process and the collectives the model's parallel layers call.

Tensor parallelism runs one process per rank (executor/, worker/), joined by torch.distributed:
gloo on the CPU, NCCL on CUDA. The group is process-wide state, set once by the worker before the
model is sharded (as vLLM's parallel_state): the model's layers read it at call time instead of
having a group threaded through every forward. With no group (one rank, the default) every
collective is the identity and costs a global read.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TensorParallelGroup:
    rank: int
    world_size: int
    backend: str  # "gloo" | "nccl"


_GROUP: TensorParallelGroup | None = None


def init_tensor_parallel(rank: int, world_size: int, init_method: str, device: str = "cpu",
                         timeout_s: float = 600.0) -> TensorParallelGroup:
    """Joins the rendezvous at `init_method` (e.g. "tcp://127.0.0.1:29501", chosen by the
    executor) as `rank` of `world_size`; the backend follows the device."""
    global _GROUP
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
    _GROUP = TensorParallelGroup(rank, world_size, backend)
    logger.info("tensor-parallel rank %d of %d (%s, %s)", rank, world_size, backend, init_method)
    return _GROUP


def destroy_tensor_parallel() -> None:
    global _GROUP
    _GROUP = None
    if dist.is_initialized():
        dist.destroy_process_group()


def tp_rank() -> int:
    return 0 if _GROUP is None else _GROUP.rank


def tp_world_size() -> int:
    return 1 if _GROUP is None else _GROUP.world_size


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum of `x` over the ranks, in place (the row-parallel layers' partial products)."""
    if _GROUP is None or _GROUP.world_size == 1:
        return x
    dist.all_reduce(x)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The ranks' `x` concatenated along `dim` in rank order (the vocab-parallel LM head's
    logits: every rank samples from the full vocabulary, so every rank samples the same token and
    each keeps its own persistent batch in step without a broadcast)."""
    if _GROUP is None or _GROUP.world_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_GROUP.world_size)]
    dist.all_gather(parts, x)
    return torch.cat(parts, dim=dim)
