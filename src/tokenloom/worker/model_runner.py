"""The model runner: scheduler output in, sampled tokens out.

It owns the model, the paged KV cache tensors, the persistent batch and the sampler. Each step it
applies the scheduler's diff to the persistent batch, gathers the flat batch with numpy vector ops,
runs the model once over all scheduled tokens, and samples one token for every request whose
computed tokens reach the end of what it has (a prefill chunk that stops short is not sampled).

Speculative decoding (n-gram): a request's draft tokens are computed in the same forward pass
as its decode token, and the sampler draws at each of those positions as it would have drawn
that token; the drafts are kept up to the first one the draw disagrees with, and the draw there
(or after the last draft) is the request's next token. With drafts that are a certainty (no
draft model, no draft probabilities) this is exactly rejection sampling's rule, so the tokens
follow the target distribution: greedy requests get the tokens they would get without drafts.
After the step the proposer (spec_decode/) searches each eligible request's tokens for its next
drafts, which the scheduler schedules.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenloom.attention import get_attn_backend
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.config import EngineConfig, default_kv_cache_bytes
from tokenloom.kv_cache_spec import KVCacheGroupSpec, group_size, kv_cache_groups, kv_tensor_of_layer
from tokenloom.messages import LogprobsLists
from tokenloom.model.loader import LoadedModel
from tokenloom.model.fused_decode import FusedDecode
from tokenloom.worker.lora_manager import LoRAManager
from tokenloom.model.packed_linear import prepare_cpu_weights
from tokenloom.ops import cpu_features, cpu_kernels, cpu_memory
from tokenloom.runner_output import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from tokenloom.sample.grammar import GrammarMask
from tokenloom.sample.sampler import Sampler, SamplerOutput
from tokenloom.spec_decode.ngram_proposer import NgramProposer
from tokenloom.worker.cuda_graph import build_decode_graphs
from tokenloom.worker.input_batch import InputBatch
from tokenloom.worker.pooler import Pooler
from tokenloom.worker.prompt_logprobs import PromptLogprobs

if TYPE_CHECKING:
    from tokenloom.sched_output import SchedulerOutput

logger = logging.getLogger(__name__)


def resolve_kv_cache_dtype(name: str, model_dtype: torch.dtype, device: torch.device,
                           quantized: bool = False) -> torch.dtype:
    """The KV cache's dtype for `EngineConfig.kv_cache_dtype`. "auto" is the model's, except on
    the quantized CPU path (a GGUF's blocks, or int8), whose float32 model keeps K and V in
    bfloat16 as llama.cpp keeps them in float16 by default: half the bytes a batch's decode
    attention reads, which bounds it (faster end to end, the answers as good: benchmarks/CHANGELOG.md,
    "The quantized path keeps K and V in bfloat16"); float32 stays one `kv_cache_dtype="float32"` away. That needs the C
    decode kernel, which reads bfloat16 K/V under float32 queries directly (without it the torch
    path would cast every gathered context). Another dtype than the model's is for the CPU: the
    torch backend casts on write (and on read without the kernel); the Triton kernels do not."""
    if name == "auto":
        if (quantized and device.type == "cpu" and model_dtype == torch.float32
                and cpu_kernels.load() is not None):
            return torch.bfloat16
        return model_dtype
    kv_dtype = getattr(torch, name)
    if kv_dtype != model_dtype and device.type != "cpu":
        raise ValueError(f"kv_cache_dtype={name} differs from the model dtype "
                         f"({str(model_dtype).removeprefix('torch.')}), which is supported on the "
                         f"CPU only; use kv_cache_dtype='auto' on {device.type}.")
    return kv_dtype


def kv_cache_bytes_per_block(loaded: LoadedModel, block_size: int,
                             kv_dtype: torch.dtype | None = None) -> int:
    """Bytes of one block id: K and V of `block_size` tokens in each layer of one KV cache group
    (every layer, for a model with full attention only; see kv_cache_spec.py)."""
    cfg = loaded.config
    elem = torch.tensor([], dtype=kv_dtype or loaded.dtype).element_size()
    layers = group_size(kv_cache_groups(cfg))
    return 2 * layers * block_size * cfg.num_key_value_heads * cfg.head_dim * elem


class _StagedInput:
    """One per-step input (input_ids, positions, ...) in a buffer allocated once for the largest
    step: numpy fills the host side in place, and the model reads a view of its first n entries.
    On CUDA the host side is pinned and copied into a device buffer, also allocated once; on the
    CPU the host tensor is what the model reads, so nothing is copied or allocated per step."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> None:
        on_cpu = device.type == "cpu"
        self.cpu = torch.zeros(shape, dtype=dtype, pin_memory=not on_cpu and torch.cuda.is_available())
        self.np = self.cpu.numpy()
        self.dev = self.cpu if on_cpu else torch.zeros(shape, dtype=dtype, device=device)

    def to_device(self, n: int) -> torch.Tensor:
        if self.dev is self.cpu:
            return self.cpu[:n]
        return self.dev[:n].copy_(self.cpu[:n], non_blocking=True)


@dataclass(slots=True)
class _StepInputs:
    """One step's flat batch as `_prepare_inputs` laid it out (host-side arrays per request)."""

    req_ids: list[str]
    rows: np.ndarray  # persistent-batch row of each scheduled request
    num_sched: np.ndarray
    computed: np.ndarray  # num_computed_tokens before the step
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    do_sample: np.ndarray  # bool: the request's last scheduled token is sampled
    input_ids: torch.Tensor | None  # None: the step replays a CUDA graph, which reads its own
    positions: torch.Tensor | None
    plans: list[Any]  # one attention plan per KV cache group
    graph_size: int | None = None  # the captured decode batch size it replays (worker/cuda_graph)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig, max_model_len: int) -> None:
        self.model = loaded.model
        self.model_config = loaded.config
        self.dtype = loaded.dtype
        self.device = torch.device(config.device)
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype, self.device,
                                                     quantized=loaded.quantized_matmuls)
        if config.is_pooling:  # pooled, never sampled: no LM head to hold or pack
            self.model.drop_lm_head()
        if self.device.type == "cpu" and not config.compile and not getattr(self.model, "plain_weights", False):
            prepare_cpu_weights(self.model)
            # A Llama-family model's decode steps as one C call (the eager layers for every
            # other step); None where the layers are not what that call computes.
            self.model.fused_decode = FusedDecode.build(self.model)
        if config.compile:
            # The step's token count varies, so one graph with a symbolic length; compute_logits
            # stays eager (it runs on the few sampled rows).
            self.model.forward = torch.compile(self.model.forward, dynamic=True)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.max_num_reqs = config.max_num_seqs
        self._set_up_attention(config)
        # KV cache groups (kv_cache_spec.py): one block table, slot mapping and attention plan
        # per group each step. A model with full attention only has one group of every layer.
        self.kv_cache_groups: list[KVCacheGroupSpec] = kv_cache_groups(loaded.config)
        num_groups = len(self.kv_cache_groups)

        self.num_kv_blocks = self._num_kv_blocks(loaded, config)
        cfg = self.model_config
        shape = (2, self.num_kv_blocks, self.block_size, cfg.num_key_value_heads, cfg.head_dim)
        # One tensor per layer of a group; layer k of every group shares tensor k, each block id
        # belonging to one group at a time (with one group: one tensor per layer, as ever). On
        # the CPU, pages are committed as blocks are first written (ops/cpu_memory); the null
        # block (id 0 with sliding groups) is never written and stays zero.
        tensors = [cpu_memory.zeros(shape, self.kv_cache_dtype, self.device)
                   for _ in range(group_size(self.kv_cache_groups))]
        self.kv_caches = [tensors[k] for k in kv_tensor_of_layer(self.kv_cache_groups, cfg.num_hidden_layers)]
        max_blocks_per_req = -(-max_model_len // self.block_size)
        # +1 column: the token sampled at max_model_len is written before the scheduler stops it.
        self.input_batch = InputBatch(self.max_num_reqs, max_model_len + 1, max_blocks_per_req, num_groups)
        self.sampler = Sampler(self.max_num_reqs, cfg.vocab_size, device=self.device, seed=config.seed)
        self._allocate_step_buffers(config, max_blocks_per_req, num_groups)
        spec = config.speculative_config
        if config.seed is not None:
            torch.manual_seed(config.seed)
        # Requests that asked for prompt logprobs and have not finished their prefill: k, and the
        # parts computed so far (one per chunk), joined and sent when the prefill ends.
        self.prompt_logprobs = PromptLogprobs()
        # Requests failed in this step (see _fail_request), reported in its ModelRunnerOutput.
        self._failed: dict[str, str] = {}
        # Speculative decoding: the proposer, and the rows whose request asked for structured
        # outputs (their next token depends on the grammar's state: no drafts).
        self.proposer = (NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,  # type: ignore[arg-type]
                                       spec.prompt_lookup_max) if spec is not None else None)  # type: ignore[arg-type]
        self._spec_max_batch = spec.disable_by_batch_size if spec is not None else None
        self._structured = np.zeros(self.max_num_reqs, dtype=bool)
        # LoRA adapters (enable_lora): every projection wrapped, the adapters per row.
        self.lora = LoRAManager(self.model, config, self.dtype, self.max_num_reqs) if config.enable_lora else None
        # Pooling (runner="pooling"): prompts are pooled, never sampled (worker/pooler.py).
        self.pooler = (Pooler(config.pooler_config, getattr(self.model, "score", None), self.dtype)  # type: ignore[arg-type]
                       if config.is_pooling else None)
        # On CUDA: decode steps replayed from graphs captured now (None: every step eager).
        self.graphs = build_decode_graphs(self, config)

    def _set_up_attention(self, config: EngineConfig) -> None:
        """The attention backend, told how the model's and the cache's dtypes want prefills run."""
        self.attn_backend = get_attn_backend(config.attention_backend, self.device,
                                             softcap=self.model_config.attn_logit_softcapping is not None,
                                             sinks=self.model_config.attention_sinks)
        if (self.device.type == "cpu" and self.kv_cache_dtype == torch.bfloat16
                and self.dtype == torch.float32 and hasattr(self.attn_backend, "prefill_in_cache_dtype")
                and cpu_features.detect().native_bf16):
            # A bfloat16 cache under float32 activations: prefill attends in bfloat16 too where
            # the CPU multiplies it natively (see TorchAttentionBackend.prefill_in_cache_dtype).
            setattr(self.attn_backend, "prefill_in_cache_dtype", True)
        if (self.device.type == "cpu" and self.dtype in (torch.bfloat16, torch.float16)
                and hasattr(self.attn_backend, "prefill_16bit_model")):
            # A 16-bit model: each prompt's prefill attention as it would be alone (transformers'
            # bf16 greedy replies depended on the neighbours a padded batch gave a prompt).
            setattr(self.attn_backend, "prefill_16bit_model", True)

    def _allocate_step_buffers(self, config: EngineConfig, max_blocks_per_req: int, num_groups: int) -> None:
        """The staged inputs of a step (tokens, positions, slots, query starts, lengths, block tables)."""
        # The flat batch's buffers, sized for the largest step (the token budget, max_num_seqs).
        max_tokens, dev = config.max_num_batched_tokens, self.device
        self._input_ids = _StagedInput((max_tokens,), torch.int64, dev)
        self._positions = _StagedInput((max_tokens,), torch.int64, dev)
        self._slot_mapping = [_StagedInput((max_tokens,), torch.int64, dev) for _ in range(num_groups)]
        # With draft tokens a step's attention may see each token as a query of its own (see
        # _prepare_inputs): up to 1 + num_speculative_tokens rows per request.
        spec = config.speculative_config
        attn_rows = self.max_num_reqs if spec is None else min(
            max(max_tokens, self.max_num_reqs), self.max_num_reqs * (1 + spec.num_speculative_tokens))
        self._query_start_loc = _StagedInput((attn_rows + 1,), torch.int32, dev)
        self._seq_lens = _StagedInput((attn_rows,), torch.int32, dev)
        self._block_table = [_StagedInput((attn_rows, max_blocks_per_req), torch.int32, dev)
                             for _ in range(num_groups)]
        self._arange = np.arange(max(max_tokens, self.max_num_reqs) + 1, dtype=np.int64)

    def _num_kv_blocks(self, loaded: LoadedModel, config: EngineConfig) -> int:
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        per_block = kv_cache_bytes_per_block(loaded, config.block_size, self.kv_cache_dtype)
        # The default budget sizes for full-length sequences in every layer (with sliding groups:
        # every group's block per block_size tokens, an upper bound on what a token needs).
        per_token = -(-per_block * len(self.kv_cache_groups) // config.block_size)
        budget = config.kv_cache_memory_bytes or default_kv_cache_bytes(
            per_token, config.max_num_seqs, self.max_model_len)
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
                if self.lora is not None:
                    self.lora.remove_row(row)
            if self.pooler is not None:
                self.pooler.remove_request(req_id)
            self.prompt_logprobs.remove_request(req_id)

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        self.remove_requests(so.finished_req_ids)
        for new in so.scheduled_new_reqs:
            row = batch.add_request(new)
            self._structured[row] = new.sampling_params.structured_outputs is not None
            try:
                self.sampler.add_request(row, new.sampling_params, new.prompt_token_ids, new.output_token_ids)
            except Exception as e:  # noqa: BLE001 - one request's parameters: fail it alone
                self._fail_request(new.req_id, row, "admitting it to the sampler", e)
                continue
            if self.pooler is not None:
                try:
                    self.pooler.add_request(new.req_id, new.pooling_params)
                except Exception as e:  # noqa: BLE001 - a generation request sent to a pooling engine
                    self._fail_request(new.req_id, row, "admitting it to the pooler", e)
                    continue
            if self.lora is not None:
                try:
                    self.lora.add_request(row, new.lora_request)
                except Exception as e:  # noqa: BLE001 - an adapter that does not load fails its request alone
                    self._fail_request(new.req_id, row, "loading its LoRA adapter", e)
                    continue
            # A request resumed after preemption (it has outputs) already sent its prompt logprobs.
            if new.sampling_params.prompt_logprobs is not None and not new.output_token_ids:
                self.prompt_logprobs.add_request(new.req_id, new.sampling_params.prompt_logprobs)
        cached = so.scheduled_cached_reqs
        for req_id, new_blocks, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens
        ):
            row = batch.req_id_to_row[req_id]
            batch.num_computed_tokens[row] = num_computed
            batch.append_block_ids(row, new_blocks)
        # Draft tokens sit after the request's known tokens, where the gather reads them; the
        # tokens kept overwrite them after sampling.
        for req_id, drafts in so.scheduled_spec_decode_tokens.items():
            row = batch.req_id_to_row[req_id]
            start = int(batch.num_tokens[row])
            batch.token_ids[row, start : start + len(drafts)] = drafts

    def _fail_request(self, req_id: str, row: int, stage: str, error: BaseException) -> None:
        """Fails one request whose sampler state raised, leaving everyone else running. Its row
        stays in the persistent batch until the scheduler's finished ids remove it (its forward
        only writes its own KV blocks); the sampler forgets it now, and it is never sampled.
        Faults that can corrupt shared state (the model forward, the KV cache) are not caught."""
        logger.exception("request %s failed while %s; the engine keeps running", req_id, stage)
        self.sampler.remove_request(row)
        if self.pooler is not None:
            self.pooler.remove_request(req_id)
        self.prompt_logprobs.remove_request(req_id)
        self._failed[req_id] = f"request {req_id} failed while {stage}: {error!r}"

    def _sample(self, logits: torch.Tensor, sample_rows: np.ndarray, sample_req_ids: list[str],
                grammar: GrammarMask | None = None, offsets: np.ndarray | None = None) -> SamplerOutput:
        """One batched draw; if it raises, each row again on its own, so that only the rows that
        raise on their own fail (their token is -1). A row's draw does not depend on the others
        (sample/ops), and a failed sample() changes no row's history, so the retry is exact."""
        try:
            return self.sampler.sample(logits, sample_rows, grammar, offsets)
        except Exception:  # noqa: BLE001 - find the culprits below
            logger.warning("batched sampling failed; sampling its %d rows one by one", len(sample_rows))
        tokens = torch.full((len(sample_rows),), -1, dtype=torch.int64)
        logprobs: list[LogprobsLists | None] = [None] * len(sample_rows)
        for i, row in enumerate(sample_rows.tolist()):
            try:
                out = self.sampler.sample(logits[i : i + 1], [row], None if grammar is None else grammar.select(i),
                                          None if offsets is None else offsets[i : i + 1])
            except Exception as e:  # noqa: BLE001 - this row's own fault
                self._fail_request(sample_req_ids[i], row, "sampling its next token", e)
                continue
            tokens[i] = out.sampled_token_ids[0]
            if out.logprobs is not None:
                logprobs[i] = out.logprobs[0]
        has_logprobs = any(lp is not None for lp in logprobs)
        return SamplerOutput(sampled_token_ids=tokens, logprobs=logprobs if has_logprobs else None)

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, so: SchedulerOutput) -> ModelRunnerOutput:
        t0 = time.perf_counter()
        self._failed = {}
        self._update_states(so)
        if so.total_num_scheduled_tokens == 0:
            if self._failed:
                return ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[], failed_req_ids=self._failed)
            return EMPTY_MODEL_RUNNER_OUTPUT
        step = self._prepare_inputs(so)
        t1 = time.perf_counter()
        if self.lora is not None:
            self.lora.prepare(step.rows, step.query_start_loc, self.device)
        if step.graph_size is not None:
            hidden = self.graphs.replay(step.graph_size)[: len(step.req_ids)]  # type: ignore[union-attr]
        elif self.pooler is not None and getattr(self.model, "takes_token_types", False):
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, self.attn_backend, step.plans,
                                token_type_ids=self.pooler.token_types(step.req_ids, step.num_sched, step.computed).to(self.device))
        else:
            hidden = self.model(step.input_ids, step.positions, self.kv_caches, self.attn_backend, step.plans)
        if self.pooler is not None:
            return self._pool(step, hidden, t0, t1)
        prompt_logprobs = self.prompt_logprobs.compute(
            step.req_ids, step.rows, step.num_sched, step.computed, step.query_start_loc,
            self.input_batch.num_prompt_tokens, self.input_batch.token_ids, hidden, self.model.compute_logits,
            self.sampler.compute_prompt_logprobs,
            lambda req_id, row, e: self._fail_request(req_id, row, "computing its prompt logprobs", e),
        ) if self.prompt_logprobs else {}
        if self._failed:  # failed in this step: computed with the rest, never sampled
            step.do_sample &= np.fromiter((r not in self._failed for r in step.req_ids), dtype=bool,
                                          count=len(step.req_ids))
        sample_pos = np.flatnonzero(step.do_sample)
        # Logits rows: the last token of each sampled request, and with draft tokens its last
        # 1 + drafts tokens (`num_logits` rows each, `offsets` 0, 1, ... within a request).
        num_logits = offsets = None
        ends = step.query_start_loc[1:][sample_pos]
        if so.scheduled_spec_decode_tokens:
            spec = so.scheduled_spec_decode_tokens
            num_logits = 1 + np.fromiter((len(spec.get(step.req_ids[p], ())) for p in sample_pos.tolist()),
                                         dtype=np.int64, count=len(sample_pos))
            first = np.cumsum(num_logits) - num_logits
            offsets = self._arange[: int(num_logits.sum())] - np.repeat(first, num_logits)
            logits_indices = np.repeat(ends - num_logits, num_logits) + offsets
        else:
            logits_indices = ends - 1
        logits = self.model.compute_logits(hidden[torch.from_numpy(logits_indices).to(self.device)])
        t2 = time.perf_counter()
        sample_req_ids = [step.req_ids[p] for p in sample_pos.tolist()]
        sample_rows = step.rows[sample_pos]
        if num_logits is not None:
            sample_req_ids = [r for r, c in zip(sample_req_ids, num_logits.tolist()) for _ in range(c)]
            sample_rows = np.repeat(sample_rows, num_logits)
        grammar = None if so.grammar_bitmask is None else _grammar_mask(so, sample_req_ids)
        sampler_out = self._sample(logits, sample_rows, sample_req_ids, grammar, offsets)
        t3 = time.perf_counter()
        if num_logits is None:
            out = self._build_output(step, sample_pos.tolist(), sampler_out)
        else:
            out = self._build_spec_output(step, sample_pos, num_logits, sampler_out, so.scheduled_spec_decode_tokens)
        if self.proposer is not None:
            out.spec_token_ids = self._propose(step, out)
        out.prompt_logprobs = prompt_logprobs
        out.prepare_time, out.forward_time, out.sample_time = t1 - t0, t2 - t1, t3 - t2
        return out

    # long because: the step's hot path, numpy ops over a dozen shared arrays that helpers would pass around
    def _prepare_inputs(self, so: SchedulerOutput) -> _StepInputs:
        """The flat batch of this step, gathered from the persistent batch with numpy vector ops
        into the staged buffers (no per-step tensor allocation), and the attention plan."""
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
        computed = batch.num_computed_tokens[rows]
        positions = self._positions.np[:num_tokens]
        if num_tokens == num_reqs:  # decode only: one token per request, no repeat needed
            req_indices = self._arange[:num_reqs]
            positions[:] = computed
        else:
            req_indices = np.repeat(self._arange[:num_reqs], num_sched)
            np.add(computed[req_indices], self._arange[:num_tokens], out=positions)
            positions -= query_start_loc[:-1][req_indices]
        self._input_ids.np[:num_tokens] = batch.token_ids[rows[req_indices], positions]
        seq_lens = computed + num_sched
        max_seq_len = int(seq_lens.max())
        max_blocks = -(-max_seq_len // self.block_size)
        block_in_req, offset = positions // self.block_size, positions % self.block_size

        # Attention's view of the batch. A step of decodes with draft tokens shows attention
        # every token as a decode query of its own (a draft at position p attends to positions
        # 0..p of its request, through the request's blocks): every backend writes the step's
        # new K/V before any query reads them, so this is the same causal attention, and the
        # step stays a plain decode step (one C call for the whole model where it runs, rather
        # than the eager layers and a prefill attention for a few queries).
        attn_rows, attn_req = rows, None
        if so.num_spec_tokens and so.num_prefill_tokens == 0:
            attn_rows, attn_req = rows[req_indices], req_indices
            num_attn = num_tokens
            self._query_start_loc.np[: num_tokens + 1] = self._arange[: num_tokens + 1]
            self._seq_lens.np[:num_tokens] = positions + 1
            max_query_len = 1
        else:
            num_attn = num_reqs
            self._query_start_loc.np[: num_reqs + 1] = query_start_loc
            self._seq_lens.np[:num_reqs] = seq_lens
            max_query_len = int(num_sched.max())
        # One token per request and no drafts: a decode batch, which a captured graph replays.
        graph_size = (self.graphs.size_for(num_reqs) if self.graphs is not None and num_tokens == num_reqs
                      and attn_req is None else None)
        if graph_size is None:
            query_start_loc_dev = self._query_start_loc.to_device(num_attn + 1)
            seq_lens_dev = self._seq_lens.to_device(num_attn)

        # One metadata per KV cache group: the lengths are shared, the page table and the slots
        # are the group's, and so is the window. The backend plans each group once per step.
        plans = []
        for g, spec in enumerate(self.kv_cache_groups):
            block_table = self._block_table[g].np[:num_attn, :max_blocks]
            np.take(batch.block_table[g, :, :max_blocks], attn_rows, axis=0, out=block_table)
            slot_mapping = self._slot_mapping[g].np[:num_tokens]
            slot_mapping[:] = block_table[req_indices if attn_req is None else self._arange[:num_tokens], block_in_req]
            slot_mapping *= self.block_size
            slot_mapping += offset
            if graph_size is not None:
                continue
            plans.append(self.attn_backend.prepare(AttentionMetadata(
                num_actual_tokens=num_tokens,
                num_reqs=num_attn,
                max_query_len=max_query_len,
                max_seq_len=max_seq_len,
                query_start_loc=query_start_loc_dev,
                seq_lens=seq_lens_dev,
                block_table=self._block_table[g].to_device(num_attn)[:, :max_blocks],
                slot_mapping=self._slot_mapping[g].to_device(num_tokens),
                block_size=self.block_size,
                query_start_loc_cpu=self._query_start_loc.cpu[: num_attn + 1],
                seq_lens_cpu=self._seq_lens.cpu[:num_attn],
                sliding_window=spec.sliding_window,
            )))
        # Requests that reach the end of their known tokens are sampled; prefill chunks that stop
        # short of it are not.
        do_sample = seq_lens >= batch.num_tokens[rows]
        if graph_size is not None:  # the graph's buffers: the step's rows, then padding
            self.graphs.stage(num_reqs, graph_size)  # type: ignore[union-attr]
        return _StepInputs(
            req_ids=req_ids, rows=rows, num_sched=num_sched, computed=computed,
            query_start_loc=query_start_loc, seq_lens=seq_lens, do_sample=do_sample,
            input_ids=self._input_ids.to_device(num_tokens) if graph_size is None else None,
            positions=self._positions.to_device(num_tokens) if graph_size is None else None,
            plans=plans, graph_size=graph_size,
        )

    def _build_output(self, step: _StepInputs, sample_pos: list[int], sampler_out: SamplerOutput
                      ) -> ModelRunnerOutput:
        """Appends the sampled tokens to the persistent batch (the next decode step reads them)
        and reports them, one list per scheduled request ([] for a prefill chunk, or a request
        that failed in this step)."""
        batch = self.input_batch
        sampled = sampler_out.sampled_token_ids.tolist()
        sample_rows = step.rows[step.do_sample]
        if len(sample_rows):
            ok = sampler_out.sampled_token_ids.numpy() >= 0  # -1: the row failed (see _sample)
            kept = sample_rows[ok]
            batch.token_ids[kept, batch.num_tokens[kept]] = np.asarray(sampled, dtype=np.int64)[ok]
            batch.num_tokens[kept] += 1
        batch.num_computed_tokens[step.rows] = step.seq_lens

        req_ids = step.req_ids
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        for i, (pos, tok) in enumerate(zip(sample_pos, sampled)):
            if tok < 0:
                continue
            sampled_token_ids[pos] = [tok]
            if sampler_out.logprobs is not None and sampler_out.logprobs[i] is not None:
                logprobs[req_ids[pos]] = sampler_out.logprobs[i]
        return self._runner_output(req_ids, sampled_token_ids, logprobs)

    def _build_spec_output(self, step: _StepInputs, sample_pos: np.ndarray, num_logits: np.ndarray,
                           sampler_out: SamplerOutput, spec: dict[str, list[int]]) -> ModelRunnerOutput:
        """`_build_output` for a step with draft tokens: each sampled request keeps its draws up
        to and including the first that differs from its draft (all of them when none does).
        A Python loop over the sampled requests, a handful of numpy ops each."""
        batch = self.input_batch
        req_ids = step.req_ids
        drawn = sampler_out.sampled_token_ids.numpy()
        lp = sampler_out.logprobs
        sampled_token_ids: list[list[int]] = [[] for _ in req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        num_computed = step.seq_lens.copy()
        kept_rows, kept_extra = [], []
        start = 0
        for pos, count in zip(sample_pos.tolist(), num_logits.tolist()):
            draws = drawn[start : start + count]
            req_id = req_ids[pos]
            first_row = start
            start += count
            if draws[0] < 0 or req_id in self._failed:
                continue
            drafts = spec.get(req_id)
            if drafts:
                agree = draws[:-1] == np.asarray(drafts)
                num = count if agree.all() else int(np.argmin(agree)) + 1
            else:
                num = 1
            tokens = draws[:num]
            row = int(step.rows[pos])
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n : n + num] = tokens
            batch.num_tokens[row] = n + num
            num_computed[pos] = step.computed[pos] + num if drafts else step.seq_lens[pos]
            sampled_token_ids[pos] = tokens.tolist()
            if num > 1:
                kept_rows.append(row)
                kept_extra.append(num - 1)
            if lp is not None and lp[first_row] is not None:
                parts = lp[first_row : first_row + num]
                logprobs[req_id] = LogprobsLists(
                    token_ids=[p.token_ids[0] for p in parts], logprobs=[p.logprobs[0] for p in parts],
                    ranks=[p.ranks[0] for p in parts])
        if kept_rows:
            self.sampler.accept(np.asarray(kept_rows, dtype=np.int64), np.asarray(kept_extra, dtype=np.int64))
        batch.num_computed_tokens[step.rows] = num_computed
        return self._runner_output(req_ids, sampled_token_ids, logprobs)

    def _pool(self, step: _StepInputs, hidden: torch.Tensor, t0: float, t1: float) -> ModelRunnerOutput:
        """A pooling engine's step: no logits, no sampling; requests whose prompt ends here get
        their pooled result (and finish)."""
        assert self.pooler is not None
        batch = self.input_batch
        pooled = self.pooler(hidden, step.req_ids, step.query_start_loc, step.computed, step.seq_lens,
                             batch.num_prompt_tokens[step.rows], set(self._failed))
        batch.num_computed_tokens[step.rows] = step.seq_lens
        out = self._runner_output(step.req_ids, [[] for _ in step.req_ids], {})
        out.pooler_output = pooled
        out.prepare_time, out.forward_time = t1 - t0, time.perf_counter() - t1
        return out

    def _runner_output(self, req_ids: list[str], sampled_token_ids: list[list[int]],
                       logprobs: dict[str, LogprobsLists]) -> ModelRunnerOutput:
        return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                 sampled_token_ids=sampled_token_ids, logprobs=logprobs, failed_req_ids=self._failed)

    def _propose(self, step: _StepInputs, out: ModelRunnerOutput) -> dict[str, list[int]]:
        """The next drafts of the requests that sampled in this step and may speculate."""
        assert self.proposer is not None
        pos = np.fromiter((i for i, t in enumerate(out.sampled_token_ids) if t), dtype=np.int64)
        if not pos.size or (self._spec_max_batch is not None and len(self.input_batch) >= self._spec_max_batch):
            return {}  # nothing sampled, or a batch the scheduler gives no drafts
        rows = step.rows[pos]
        ok = self.sampler.speculation_ok(rows) & ~self._structured[rows]
        batch = self.input_batch
        drafts: dict[str, list[int]] = {}
        for p, row in zip(pos[ok].tolist(), rows[ok].tolist()):
            proposal = self.proposer.propose(batch.token_ids[row, : batch.num_tokens[row]])
            if proposal.size:
                drafts[step.req_ids[p]] = proposal.tolist()
        return drafts


def _grammar_mask(so: SchedulerOutput, sample_req_ids: list[str]) -> GrammarMask | None:
    """The scheduler's bitmask rows placed on this step's logits rows. A request the scheduler
    filled a row for is always sampled, unless it failed in this step (then its row is dropped)."""
    position = {req_id: i for i, req_id in enumerate(sample_req_ids)}
    keep = [(j, position[r]) for j, r in enumerate(so.structured_output_req_ids) if r in position]
    if not keep:
        return None
    bitmask = so.grammar_bitmask
    if len(keep) < len(so.structured_output_req_ids):
        bitmask = bitmask[torch.tensor([j for j, _ in keep], dtype=torch.int64)]
    return GrammarMask(bitmask, np.fromiter((p for _, p in keep), dtype=np.int64, count=len(keep)))
