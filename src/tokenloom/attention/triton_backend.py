"""Attention backend on the Triton kernels of `triton_kernels` (CUDA; CPU only for tests under
`TRITON_INTERPRET=1`).

Per step, `prepare` classifies the batch from the host copies of the metadata:

* `varlen`   every request is a prefill without earlier context (seq_len == query_len): the
             FlashAttention-2 style kernel reads K/V straight from this step's inputs.
* `split_kv` every request is a decode, contexts are long and there are too few
             (request, KV head) programs to fill the GPU: the context is split into partitions.
* `unified`  everything else (and the fallback): one launch over the mixed batch.

Program tables (which request and which query rows each program owns) depend on the number of
query heads per KV head, which only `forward` sees; they are built by the first layer of the
step and reused by the rest.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tokenloom.attention import triton_kernels as tk
from tokenloom.attention.backend import AttentionBackend
from tokenloom.attention.metadata import AttentionMetadata

MODES = ("auto", "unified", "split_kv", "varlen")


@dataclass(slots=True)
class TritonAttentionPlan:
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor
    query_start_loc_cpu: torch.Tensor
    seq_lens: torch.Tensor
    block_table: torch.Tensor
    slot_mapping: torch.Tensor
    decode_only: bool
    prefill_only_no_context: bool
    sliding_window: int | None  # None also when no context is longer than the window
    # Filled by the first layer: the chosen path per (Hq, Hkv), program tables per tile height,
    # and the split-KV partial-result buffers.
    paths: dict = field(default_factory=dict)
    tables: dict = field(default_factory=dict)
    workspace: tuple | None = None


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, mode: str = "auto", split_min_seq_len: int = 1024,
                 split_partition_len: int = 512, tile_n: int = 32, flash_block_m: int = 64,
                 num_sms: int | None = None) -> None:
        """`mode` forces one kernel family (tests, benchmarks); "auto" chooses per step.
        `split_min_seq_len`: shortest longest-context for which split-KV decode is considered.
        `split_partition_len`: shortest context partition of split-KV decode.
        `tile_n`: KV positions per inner-loop step of the paged kernels (power of 2, >= 16).
        `flash_block_m`: query rows per program of the varlen prefill kernel."""
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
        self.mode = mode
        self.split_min_seq_len = split_min_seq_len
        self.split_partition_len = split_partition_len
        self.tile_n = tile_n
        self.flash_block_m = flash_block_m
        self._num_sms = num_sms

    def _sms(self, device: torch.device) -> int:
        if self._num_sms is None:
            if device.type == "cuda":
                self._num_sms = torch.cuda.get_device_properties(device).multi_processor_count
            else:
                self._num_sms = 132  # interpreter: pretend to be an H100
        return self._num_sms

    def prepare(self, meta: AttentionMetadata) -> TritonAttentionPlan:
        qsl, seq_lens = meta.host_lens()
        B = meta.num_reqs
        q_lens = qsl[1:] - qsl[:-1]
        return TritonAttentionPlan(
            num_actual_tokens=meta.num_actual_tokens,
            num_reqs=B,
            max_query_len=int(q_lens.max()) if B else 0,
            max_seq_len=int(seq_lens.max()) if B else 0,
            query_start_loc=meta.query_start_loc,
            query_start_loc_cpu=qsl,
            seq_lens=meta.seq_lens,
            block_table=meta.block_table,
            slot_mapping=meta.slot_mapping,
            decode_only=bool((q_lens == 1).all()),
            prefill_only_no_context=bool((seq_lens == q_lens).all()),
            # A window no context exceeds changes nothing: the plain kernels run.
            sliding_window=meta.sliding_window if B and meta.sliding_window is not None
            and int(seq_lens.max()) > meta.sliding_window else None,
        )

    def prepare_for_cuda_graph(self, meta: AttentionMetadata) -> TritonAttentionPlan:
        """A decode-only plan whose launches hold for any context up to `meta.max_seq_len`: the
        kernel choice and split-KV partitions are made for that length (shorter contexts leave
        the later partitions empty), and every kernel bounds its loops by `seq_lens` on the
        device. The program tables and split-KV buffers are built by the first forward (the
        warm-up before capture) and kept in the plan, which the graph then owns."""
        B, w = meta.num_reqs, meta.sliding_window
        return TritonAttentionPlan(
            num_actual_tokens=B, num_reqs=B, max_query_len=1, max_seq_len=meta.max_seq_len,
            query_start_loc=meta.query_start_loc, query_start_loc_cpu=torch.arange(B + 1, dtype=torch.int32),
            seq_lens=meta.seq_lens, block_table=meta.block_table, slot_mapping=meta.slot_mapping,
            decode_only=True, prefill_only_no_context=False,
            sliding_window=w if w is not None and meta.max_seq_len > w else None,
        )

    def _path(self, plan: TritonAttentionPlan, hq: int, hkv: int, device: torch.device):
        key = (hq, hkv)
        if key in plan.paths:
            return plan.paths[key]
        mode = self.mode
        splits = 1
        if mode == "auto":
            mode = "unified"
            if plan.prefill_only_no_context:
                mode = "varlen"
            elif plan.decode_only and self._decode_len(plan) >= self.split_min_seq_len:
                splits = tk.split_kv_num_splits(self._decode_len(plan), plan.num_reqs, hkv,
                                                self._sms(device), self.split_partition_len)
                if splits > 1:
                    mode = "split_kv"
        elif mode == "split_kv":
            if not plan.decode_only:
                raise ValueError("split_kv mode needs a decode-only batch")
            splits = tk.split_kv_num_splits(self._decode_len(plan), plan.num_reqs, hkv,
                                            self._sms(device), self.split_partition_len)
        elif mode == "varlen" and not plan.prefill_only_no_context:
            raise ValueError("varlen mode needs a prefill-only batch without context")

        if mode == "unified":
            block_q = tk.unified_block_q(hq, hkv, plan.max_query_len)
            table = self._table(plan, block_q, device)
            path = ("unified", block_q, table)
        elif mode == "varlen":
            table = self._table(plan, self.flash_block_m, device)
            path = ("varlen", self.flash_block_m, table)
        else:
            path = ("split_kv", splits, None)
        plan.paths[key] = path
        return path

    @staticmethod
    def _decode_len(plan: TritonAttentionPlan) -> int:
        """The most keys one decode reads: its context, or its window."""
        w = plan.sliding_window
        return plan.max_seq_len if w is None else min(plan.max_seq_len, w)

    @staticmethod
    def _table(plan: TritonAttentionPlan, rows: int, device: torch.device):
        if rows not in plan.tables:
            req, qoff = tk.unified_program_table(plan.query_start_loc_cpu, rows)
            plan.tables[rows] = (req.to(device), qoff.to(device))
        return plan.tables[rows]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: TritonAttentionPlan,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if softcap is not None or sinks is not None:  # the selector picks the torch backend for such models
            raise ValueError("the triton attention backend neither caps attention scores "
                             "(attn_logit_softcapping) nor adds attention sinks; use --attention-backend torch")
        T = plan.num_actual_tokens
        assert query.stride(-1) == 1 and key.stride(-1) == 1 and value.stride(-1) == 1
        tk.kv_cache_write(key, value, kv_cache, plan.slot_mapping, T)
        out = torch.empty_like(query)
        if out.shape[0] > T:
            out[T:].zero_()
        if T == 0:
            return out
        hq, hkv = query.shape[1], kv_cache.shape[3]
        kind, param, table = self._path(plan, hq, hkv, query.device)
        if kind == "varlen":
            tk.varlen_flash_attention(out, query, key, value, plan.query_start_loc,
                                      table[0], table[1], param, scale,
                                      sliding_window=plan.sliding_window)
        elif kind == "split_kv":
            plan.workspace = tk.split_kv_decode(
                out, query, kv_cache, plan.block_table, plan.query_start_loc, plan.seq_lens,
                plan.num_reqs, plan.max_seq_len, param, scale, tile_n=self.tile_n,
                workspace=plan.workspace, sliding_window=plan.sliding_window)
        else:
            tk.unified_attention(out, query, kv_cache, plan.block_table, plan.query_start_loc,
                                 plan.seq_lens, table[0], table[1], param, scale,
                                 tile_n=self.tile_n, sliding_window=plan.sliding_window)
        return out
