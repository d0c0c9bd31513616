"""Decode steps replayed from CUDA graphs.

On a GPU, a small model's decode step is bound by the host: every layer launches a dozen kernels,
and Python and the launches take longer than the GPU takes to run them. As vLLM does by default,
the runner captures the model forward of a decode batch once per batch size (1, 2, 4, then every
multiple of 8 up to max_num_seqs) when it starts, and replays it: the whole forward for the price
of one launch. The LM head, the sampler and every other kind of step (prefill chunks, mixed
batches, draft tokens) stay eager.

A graph reads its inputs from fixed addresses: the runner's staged device buffers (input ids,
positions, query_start_loc, seq_lens, each group's block_table and slot_mapping). A step of n
requests replays the smallest captured size >= n; rows n.. of the buffers are padding that reads
one key and writes nothing (slot -1), and its hidden rows are dropped. Every launch's grid is
fixed at capture, so the attention plan is made for the longest context (max_model_len) and the
kernels bound their loops by each row's `seq_lens` on the device
(AttentionBackend.prepare_for_cuda_graph).

Off with enforce_eager (vLLM's switch), on the CPU, under torch.compile, with tensor parallelism,
LoRA adapters or a pooling runner, and with a backend that plans on the host (the torch backend).
"""
from __future__ import annotations

import bisect
import logging
import time
from typing import Any

import numpy as np
import torch

from tokenloom.attention.backend import AttentionBackend
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.config import EngineConfig
from tokenloom.kv_cache_spec import KVCacheGroupSpec

logger = logging.getLogger(__name__)

MAX_CAPTURE_SIZE = 512  # vLLM's default largest graph


def capture_sizes(max_batch: int) -> list[int]:
    """vLLM's default sizes: 1, 2, 4, then every multiple of 8, up to `max_batch` (capped), and
    `max_batch` itself so that every decode batch has a graph."""
    top = min(max_batch, MAX_CAPTURE_SIZE)
    return sorted({s for s in (1, 2, 4) if s <= top} | set(range(8, top + 1, 8)) | {top}) if top > 0 else []


def why_eager(config: EngineConfig, device: torch.device, backend: AttentionBackend) -> str | None:
    """Why this engine runs its decode steps eagerly, or None when it captures graphs."""
    if device.type != "cuda":
        return "not on CUDA"
    for reason, applies in (("enforce_eager", config.enforce_eager), ("compile", config.compile),
                            ("tensor parallelism", config.tensor_parallel_size > 1),
                            ("LoRA", config.enable_lora), ("a pooling runner", config.is_pooling)):
        if applies:
            return reason
    if type(backend).prepare_for_cuda_graph is AttentionBackend.prepare_for_cuda_graph:
        return f"the {backend.name} attention backend plans on the host"
    return None


class DecodeGraphs:
    """The captured decode forwards, by batch size, over the runner's staged input buffers
    (worker/model_runner._StagedInput: `.np` the host side, `.dev` the device side)."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], backend: AttentionBackend,
                 groups: list[KVCacheGroupSpec], block_size: int, max_model_len: int, sizes: list[int],
                 input_ids: Any, positions: Any, query_start_loc: Any, seq_lens: Any,
                 block_tables: list[Any], slot_mappings: list[Any]) -> None:
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.groups, self.block_size, self.max_model_len = groups, block_size, max_model_len
        self.sizes = sizes
        self.input_ids, self.positions = input_ids, positions
        self.query_start_loc, self.seq_lens = query_start_loc, seq_lens
        self.block_tables, self.slot_mappings = block_tables, slot_mappings
        # size -> (graph, its output hidden states [size, hidden], the plans it reads)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list[Any]]] = {}
        self.num_replays = 0

    def describe(self) -> str:
        return f"decode batches of {self.sizes[0]}-{self.sizes[-1]} requests ({len(self.sizes)} sizes)"

    def size_for(self, num_reqs: int) -> int | None:
        """The captured size a decode batch of `num_reqs` replays (None: larger than any)."""
        i = bisect.bisect_left(self.sizes, num_reqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def pad(self, n: int, size: int) -> None:
        """Rows n..size of the host buffers as padding (rows ..n hold the step's decodes): token
        0 at position 0, one query token, a context of one key (block 0's first slot, read and
        never written: slot -1), so that the kernels read valid memory and compute finite rows."""
        self.input_ids.np[n:size] = 0
        self.positions.np[n:size] = 0
        self.query_start_loc.np[n:size + 1] = np.arange(n, size + 1)
        self.seq_lens.np[n:size] = 1
        for block_table, slot_mapping in zip(self.block_tables, self.slot_mappings, strict=True):
            block_table.np[n:size, 0] = 0
            slot_mapping.np[n:size] = -1

    def stage(self, n: int, size: int) -> None:
        """Rows n..size padded (`pad`), then the first `size` rows of every host buffer copied to
        the device buffers the graphs read."""
        self.pad(n, size)
        for staged in (self.input_ids, self.positions, self.seq_lens, *self.block_tables, *self.slot_mappings):
            staged.to_device(size)
        self.query_start_loc.to_device(size + 1)

    def capture(self) -> None:
        """Captures every size, largest first: the smaller graphs reuse the memory pool's blocks.
        The largest and the smallest are checked against eager forwards (`_check`)."""
        pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):
            args = self._warm_up(size)
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self.model(*args)
            self.graphs[size] = (graph, out, args[-1])
            if size in (self.sizes[0], self.sizes[-1]):
                self._check(size, args)
        torch.cuda.synchronize()

    def _warm_up(self, size: int) -> tuple:
        """Stages a batch of `size` padding rows, makes its plans, and runs one eager forward:
        it compiles the kernels and builds what the plans keep (program tables, split-KV
        buffers) before the capture, which must not copy from the host. Returns the forward's
        arguments, which the graph reads."""
        self.stage(0, size)
        plans = [self.backend.prepare_for_cuda_graph(AttentionMetadata(
            num_actual_tokens=size, num_reqs=size, max_query_len=1, max_seq_len=self.max_model_len,
            query_start_loc=self.query_start_loc.dev[:size + 1], seq_lens=self.seq_lens.dev[:size],
            block_table=self.block_tables[g].dev[:size], slot_mapping=self.slot_mappings[g].dev[:size],
            block_size=self.block_size, sliding_window=spec.sliding_window,
        )) for g, spec in enumerate(self.groups)]
        args = (self.input_ids.dev[:size], self.positions.dev[:size], self.kv_caches, self.backend, plans)
        self.model(*args)
        return args

    def _check(self, size: int, args: tuple) -> None:
        """A replay must compute what the eager forward computes from the same buffers after
        they changed (other tokens in every row): raises where it does not, so that the engine
        runs eagerly rather than replay a graph that reads stale inputs."""
        self.input_ids.np[:size] = np.arange(1, size + 1) % self.model.config.vocab_size
        self.input_ids.to_device(size)
        expected = self.model(*args).float()
        got = self.replay(size).float()
        self.num_replays = 0
        self.stage(0, size)
        if not torch.allclose(got, expected, rtol=1e-2, atol=1e-2):
            raise RuntimeError(f"the CUDA graph of {size} requests replays other hidden states than the eager "
                               f"forward (max difference {float((got - expected).abs().max()):.3g})")

    def replay(self, size: int) -> torch.Tensor:
        """The hidden states [size, hidden] of the decode batch staged in the device buffers
        (the step's rows, then padding). Overwritten by the next replay of a graph."""
        graph, out, _ = self.graphs[size]
        graph.replay()
        self.num_replays += 1
        return out


def build_decode_graphs(runner: Any, config: EngineConfig) -> DecodeGraphs | None:
    """The runner's decode graphs, captured; None (eager decode steps) where `why_eager` says
    so, or where the capture failed (logged: the engine still runs, eagerly)."""
    reason = why_eager(config, runner.device, runner.attn_backend)
    # A decode batch is at most max_num_seqs requests and at most the token budget.
    sizes = capture_sizes(min(runner.max_num_reqs, config.max_num_batched_tokens))
    if reason is not None or not sizes:
        if reason not in (None, "not on CUDA"):
            logger.info("decode steps run eagerly (no CUDA graphs): %s", reason)
        return None
    graphs = DecodeGraphs(runner.model, runner.kv_caches, runner.attn_backend, runner.kv_cache_groups,
                          runner.block_size, runner.max_model_len, sizes, runner._input_ids, runner._positions,
                          runner._query_start_loc, runner._seq_lens, runner._block_table, runner._slot_mapping)
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():
            graphs.capture()
    except Exception:  # noqa: BLE001 - a backend or model that cannot be captured still runs eagerly
        logger.exception("capturing CUDA graphs failed; decode steps run eagerly")
        return None
    logger.info("captured CUDA graphs of decode batches of %s requests in %.1fs",
                ", ".join(map(str, sizes)), time.perf_counter() - t0)
    return graphs
