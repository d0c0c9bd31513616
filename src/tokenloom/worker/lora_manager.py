"""The model runner's LoRA adapters (enable_lora): which adapter each row of the persistent batch
runs with, the adapters' weights (loaded on a request's first use, kept for the next ones), and,
each step, the token groups `model/lora.LoRAState` adds them to.

Loaded adapters are kept up to `max_cpu_loras` (default: max_loras); past that, the least recently
used one that no running request holds is dropped (one in use never is, so a step may hold more).
"""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch
from torch import nn

from tokenloom.config import EngineConfig
from tokenloom.lora_request import LoRARequest
from tokenloom.model.lora import LoRAAdapter, LoRAState, load_adapter, wrap_projections

logger = logging.getLogger(__name__)


class LoRAManager:
    def __init__(self, model: nn.Module, config: EngineConfig, dtype: torch.dtype, max_rows: int) -> None:
        self.model = model
        self.dtype = dtype
        self.max_rank = config.max_lora_rank
        self.capacity = config.max_cpu_loras or config.max_loras
        self.state = LoRAState()
        wrap_projections(model, self.state)
        # The fused C decode step adds the step's adapters itself (float32 steps; it reads them
        # from the state and runs the eager layers where it cannot).
        fused = getattr(model, "fused_decode", None)
        if fused is not None:
            fused.lora_state = self.state
        self.adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self.row_adapter = np.zeros(max_rows, dtype=np.int64)  # lora_int_id per row, 0: none

    def add_request(self, row: int, lora_request: LoRARequest | None) -> None:
        """Row `row` runs with `lora_request`'s adapter, loaded now if it is not (raises what
        loading raised; the row then runs without one)."""
        self.row_adapter[row] = 0
        if lora_request is None:
            return
        lora_id = lora_request.lora_int_id
        if lora_id in self.adapters:
            self.adapters.move_to_end(lora_id)
        else:
            self.adapters[lora_id] = load_adapter(lora_id, lora_request.lora_path, self.model, self.max_rank, self.dtype)
            logger.info("loaded LoRA adapter %s (id %d, rank %d, %.1f MiB) from %s", lora_request.lora_name, lora_id,
                        self.adapters[lora_id].rank, self.adapters[lora_id].nbytes / 2**20, lora_request.lora_path)
        self.row_adapter[row] = lora_id  # in use from here on: never the one dropped
        self._evict()

    def remove_row(self, row: int) -> None:
        self.row_adapter[row] = 0

    def _evict(self) -> None:
        in_use = set(self.row_adapter.tolist())
        for lora_id in list(self.adapters):
            if len(self.adapters) <= self.capacity:
                break
            if lora_id not in in_use:
                del self.adapters[lora_id]

    def prepare(self, rows: np.ndarray, query_start_loc: np.ndarray, device: torch.device) -> None:
        """The step's token groups: the tokens of the requests in `rows` (request i's are
        query_start_loc[i]:query_start_loc[i+1]) by adapter."""
        ids = self.row_adapter[rows]
        self.state.groups, self.state.adapters, self.state.token_adapter = [], [], None
        if not ids.any():
            return
        step_ids = np.unique(ids[ids > 0])
        self.state.adapters = [self.adapters[i] for i in step_ids.tolist()]
        index = np.where(ids > 0, np.searchsorted(step_ids, ids), -1).astype(np.int32)
        self.state.token_adapter = torch.from_numpy(np.repeat(index, np.diff(query_start_loc[:len(rows) + 1])))
        for lora_id in step_ids.tolist():
            members = np.flatnonzero(ids == lora_id)
            starts, ends = query_start_loc[members], query_start_loc[members + 1]
            if len(members) == len(rows) or (np.all(starts[1:] == ends[:-1])):
                tokens: torch.Tensor | slice = slice(int(starts[0]), int(ends[-1]))  # one run of tokens
            else:
                tokens = torch.from_numpy(np.concatenate([np.arange(s, e) for s, e in zip(starts, ends)])).to(device)
            self.state.groups.append((tokens, self.adapters[lora_id]))

    def clear(self) -> None:
        self.state.groups, self.state.adapters, self.state.token_adapter = [], [], None
