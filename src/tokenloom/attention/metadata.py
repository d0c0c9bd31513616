"""The page table at the kernel boundary.

One `AttentionMetadata` describes a whole flat batch of B requests and T tokens (no padding tokens
are computed). Request i owns query tokens `query_start_loc[i]:query_start_loc[i+1]`; after this
step its context holds `seq_lens[i]` tokens, so its queries sit at positions
`seq_lens[i] - query_len_i ... seq_lens[i] - 1` and attend causally to every earlier position,
or, with `sliding_window` W, a query at position p attends to the keys j with p - W < j <= p
(exactly W keys including itself, as transformers' Gemma 3). Block-table entries of blocks that
lie wholly before every query's window may point at a null block whose content is undefined:
a backend must not let them reach the output (kernels skip them, the torch path masks them).
Context token j of request i lives in block `block_table[i, j // block_size]` at offset
`j % block_size`. The new tokens' K/V are written to `slot_mapping[t] = block_id * block_size +
offset` before attention reads them (a negative slot is skipped: padding).

KV cache layout, per layer: one tensor `[2, num_blocks, block_size, num_kv_heads, head_dim]`,
index 0 = K, 1 = V.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_actual_tokens: int  # T
    num_reqs: int  # B
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # int32 [B+1], on the model's device
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, max_blocks_per_req]
    slot_mapping: torch.Tensor  # int64 [T]
    block_size: int
    # CPU copies: backends that plan on the host (the torch backend) read these without a sync.
    query_start_loc_cpu: torch.Tensor | None = None
    seq_lens_cpu: torch.Tensor | None = None
    sliding_window: int | None = None  # None: full causal attention (see the module docstring)

    def host_lens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`query_start_loc[:B + 1]` and `seq_lens[:B]` on the host, for planning a step: the CPU
        copies when the runner gave them, else one device-to-host copy each."""
        B = self.num_reqs
        qsl = self.query_start_loc_cpu if self.query_start_loc_cpu is not None \
            else self.query_start_loc.cpu()
        seq_lens = self.seq_lens_cpu if self.seq_lens_cpu is not None else self.seq_lens.cpu()
        return qsl[: B + 1], seq_lens[:B]
