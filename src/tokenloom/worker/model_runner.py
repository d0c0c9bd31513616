"""The model runner: scheduler output in, sampled tokens out.

It owns the model, the paged KV cache tensors, the persistent batch and the sampler. Each step it
applies the scheduler's diff to the persistent batch, gathers the flat batch with numpy vector ops,
runs the model once over all scheduled tokens, and samples one token for every request whose
computed tokens reach the end of what it has (a prefill chunk that stops short is not sampled).
"""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from tokenloom.attention import get_attn_backend
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.config import DEFAULT_KV_CACHE_MEMORY_BYTES, EngineConfig
from tokenloom.messages import LogprobsLists
from tokenloom.model.loader import LoadedModel
from tokenloom.sample.sampler import Sampler
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput

if TYPE_CHECKING:
    from tokenloom.core.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)


def kv_cache_bytes_per_block(loaded: LoadedModel, block_size: int) -> int:
    cfg = loaded.config
    elem = torch.tensor([], dtype=loaded.dtype).element_size()
    return 2 * cfg.num_hidden_layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.dtype = loaded.dtype
        self.device = torch.device(config.device)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_reqs = config.max_num_seqs
        self.attn_backend = get_attn_backend(config.attention_backend, self.device)

        self.num_kv_blocks = self._num_kv_blocks(loaded, config)
        cfg = self.model_config
        shape = (2, self.num_kv_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(cfg.num_hidden_layers)
        ]
        max_blocks_per_req = -(-max_model_len // self.block_size)
        # +1 column: the token sampled at max_model_len is written before the scheduler stops it.
        self.input_batch = InputBatch(self.max_num_reqs, max_model_len + 1, max_blocks_per_req)
        self.sampler = Sampler(self.max_num_reqs, cfg.vocab_size, device=self.device)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        # Requests that asked for prompt logprobs and have not finished their prefill: k, and the
        # parts computed so far (one per chunk), joined and sent when the prefill ends.
        self._prompt_logprobs_k: dict[str, int] = {}
        self._pending_prompt_logprobs: dict[str, list[LogprobsLists]] = {}

    def _num_kv_blocks(self, loaded: LoadedModel, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        budget = config.kv_cache_memory_bytes or DEFAULT_KV_CACHE_MEMORY_BYTES
        per_block = kv_cache_bytes_per_block(loaded, config.block_size)
        num = budget // per_block
        if num < 1:
            raise ValueError(
                f"kv_cache_memory_bytes={budget} is smaller than one KV block ({per_block} bytes "
                f"for block_size={config.block_size}); raise kv_cache_memory_bytes."
            )
        return int(num)

    # ---- persistent batch -------------------------------------------------------------------

    def remove_requests(self, req_ids: set[str]) -> None:
        """Drops finished, aborted or preempted requests from the persistent batch."""
        for req_id in req_ids:
            row = self.input_batch.remove_request(req_id)
            if row is not None:
                self.sampler.remove_request(row)
            self._prompt_logprobs_k.pop(req_id, None)
            self._pending_prompt_logprobs.pop(req_id, None)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        self.remove_requests(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            row = batch.add_request(new)
            self.sampler.add_request(row, new.sampling_params, new.prompt_token_ids, new.output_token_ids)
            # A request resumed after preemption (it has outputs) already sent its prompt logprobs.
            if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids:
                self._prompt_logprobs_k[new.req_id] = new.sampling_params.prompt_logprobs
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = batch.req_id_to_row[req_id]
            batch.num_computed_tokens[row] = num_computed
            batch.append_block_ids(row, new_blocks)

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            return EMPTY_MODEL_RUNNER_OUTPUT
        batch = self.input_batch
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
        num_reqs = len(req_ids)
        rows = np.fromiter((batch.req_id_to_row[r] for r in req_ids), dtype=np.int64, count=num_reqs)
        num_sched = np.fromiter((so.num_scheduled_tokens[r] for r in req_ids), dtype=np.int64, count=num_reqs)

        # Scheduled tokens [2, 5, 3] give query_start_loc [0, 2, 7, 10] and per-token request
        # indices [0,0,1,1,1,1,1,2,2,2]; a token's position is its request's computed count plus
        # its offset inside the request's query.
        query_start_loc = np.zeros(num_reqs + 1, dtype=np.int64)
        np.cumsum(num_sched, out=query_start_loc[1:])
        num_tokens = int(query_start_loc[-1])
        req_indices = np.repeat(np.arange(num_reqs), num_sched)
        offsets = np.arange(num_tokens) - query_start_loc[:-1][req_indices]
        computed = batch.num_computed_tokens[rows]
        positions = computed[req_indices] + offsets
        token_rows = rows[req_indices]
        input_ids = batch.token_ids[token_rows, positions]
        seq_lens = computed + num_sched
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // self.block_size)
        block_table = batch.block_table[rows, :max_blocks]
        block_size = self.block_size
        slot_mapping = block_table[req_indices, positions // block_size].astype(np.int64) * block_size + (
            positions % block_size
        )

        # Requests that reach the end of their known tokens are sampled; prefill chunks that stop
        # short of it are not.
        do_sample = seq_lens >= batch.num_tokens[rows]
        logits_indices = query_start_loc[1:][do_sample] - 1

        dev = self.device
        qsl_cpu = torch.from_numpy(query_start_loc.astype(np.int32))
        seq_lens_cpu = torch.from_numpy(seq_lens.astype(np.int32))
        meta = AttentionMetadata(
            num_actual_tokens=num_tokens,
            num_reqs=num_reqs,
            max_query_len=int(num_sched.max()),
            max_seq_len=max_seq_len,
            query_start_loc=qsl_cpu.to(dev, non_blocking=True),
            seq_lens=seq_lens_cpu.to(dev, non_blocking=True),
            block_table=torch.from_numpy(np.ascontiguousarray(block_table)).to(dev, non_blocking=True),
            slot_mapping=torch.from_numpy(slot_mapping).to(dev, non_blocking=True),
            block_size=block_size,
            query_start_loc_cpu=qsl_cpu,
            seq_lens_cpu=seq_lens_cpu,
        )
        plan = self.attn_backend.prepare(meta)
        input_ids_t = torch.from_numpy(input_ids).to(dev, non_blocking=True)
        positions_t = torch.from_numpy(positions).to(dev, non_blocking=True)
        t1 = time.perf_counter()

        hidden = self.model(input_ids_t, positions_t, self.kv_caches, self.attn_backend, plan)
        prompt_logprobs = (
            self._prompt_logprobs(req_ids, rows, num_sched, computed, query_start_loc, hidden)
            if self._prompt_logprobs_k
            else {}
        )
        sample_rows = rows[do_sample]
        logits = self.model.compute_logits(hidden[torch.from_numpy(logits_indices).to(dev)])
        t2 = time.perf_counter()

        sampler_out = self.sampler.sample(logits, sample_rows.tolist())
        sampled = sampler_out.sampled_token_ids.tolist()
        t3 = time.perf_counter()

        # Append the sampled tokens to the persistent batch; the next decode step reads them.
        if len(sample_rows):
            batch.token_ids[sample_rows, batch.num_tokens[sample_rows]] = sampled
            batch.num_tokens[sample_rows] += 1
        batch.num_computed_tokens[rows] = seq_lens

        sampled_token_ids: list[list[int]] = [[] for _ in range(num_reqs)]
        logprobs: dict[str, LogprobsLists] = {}
        sample_pos = np.flatnonzero(do_sample).tolist()
        for i, (pos, tok) in enumerate(zip(sample_pos, sampled)):
            sampled_token_ids[pos] = [tok]
            lp = sampler_out.logprobs[i] if sampler_out.logprobs is not None else None
            if lp is not None:
                logprobs[req_ids[pos]] = lp
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=sampled_token_ids,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            prepare_time=t1 - t0,
            forward_time=t2 - t1,
            sample_time=t3 - t2,
        )

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        rows: np.ndarray,
        num_sched: np.ndarray,
        computed: np.ndarray,
        query_start_loc: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, LogprobsLists]:
        """Logprobs of prompt tokens for the requests that asked for them (rare, so a Python loop
        over just those requests). Chunks accumulate until the prefill ends, then go out together;
        the first prompt token has none (nothing predicts it)."""
        done: dict[str, LogprobsLists] = {}
        batch = self.input_batch
        for i, req_id in enumerate(req_ids):
            k = self._prompt_logprobs_k.get(req_id)
            if k is None:
                continue
            row = int(rows[i])
            n_prompt = int(batch.num_prompt_tokens[row])
            start = int(computed[i])
            # The query token at position p predicts prompt token p + 1.
            end = min(start + int(num_sched[i]), n_prompt - 1)
            if end > start:
                flat = torch.arange(end - start, device=hidden.device) + int(query_start_loc[i])
                logits = self.model.compute_logits(hidden[flat])
                targets = torch.from_numpy(batch.token_ids[row, start + 1 : end + 1].copy())
                self._pending_prompt_logprobs.setdefault(req_id, []).append(
                    self.sampler.compute_prompt_logprobs(logits, targets, k)
                )
            if start + int(num_sched[i]) >= n_prompt:
                del self._prompt_logprobs_k[req_id]
                parts = self._pending_prompt_logprobs.pop(req_id, [])
                done[req_id] = LogprobsLists(
                    token_ids=[t for p in parts for t in p.token_ids],
                    logprobs=[x for p in parts for x in p.logprobs],
                    ranks=[r for p in parts for r in p.ranks],
                )
        return done
