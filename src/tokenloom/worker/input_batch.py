"""The model runner's persistent batch.

Each request the runner holds owns one row of preallocated numpy arrays (its token ids, how many
are computed, its block table) from the step it arrives until the step after it finishes. Rows
stay in place across steps: a decode step writes one token id and maybe one block id per request,
and the flat batch is gathered from these arrays with vector ops — nothing is rebuilt per step.

A model with several KV cache groups (sliding-window layers) has one block table per group:
`block_table[g]` is group g's page table, its columns aligned with token positions like the
single group's. Entries of blocks a sliding window gave back keep their stale ids (the scheduler
announces only new blocks); no query reads them.
"""
from __future__ import annotations

import heapq

import numpy as np

from tokenloom.sched_output import NewRequestData


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int,
                 num_kv_cache_groups: int = 1) -> None:
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)  # prompt + outputs known
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((num_kv_cache_groups, max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros((num_kv_cache_groups, max_num_reqs), dtype=np.int64)
        self.req_id_to_row: dict[str, int] = {}
        # Lowest free row first keeps the live rows packed at the top of the arrays.
        self._free_rows = list(range(max_num_reqs))

    def __len__(self) -> int:
        return len(self.req_id_to_row)

    def add_request(self, new: NewRequestData) -> int:
        row = heapq.heappop(self._free_rows)
        tokens = new.prompt_token_ids + new.output_token_ids
        n = len(tokens)
        self.token_ids[row, :n] = tokens
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = len(new.prompt_token_ids)
        self.num_computed_tokens[row] = new.num_computed_tokens
        self.num_blocks[:, row] = 0
        self.append_block_ids(row, new.block_ids)
        self.req_id_to_row[new.req_id] = row
        return row

    def remove_request(self, req_id: str) -> int | None:
        row = self.req_id_to_row.pop(req_id, None)
        if row is not None:
            heapq.heappush(self._free_rows, row)
        return row

    def append_block_ids(self, row: int, block_ids: tuple[list[int], ...]) -> None:
        """Append each group's new blocks (one list per KV cache group) to its table."""
        for g, ids in enumerate(block_ids):
            if ids:
                start = int(self.num_blocks[g, row])
                self.block_table[g, row, start : start + len(ids)] = ids
                self.num_blocks[g, row] = start + len(ids)
