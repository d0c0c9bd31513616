"""Pure-PyTorch attention over the paged KV cache: the CPU path and the reference for the kernels.

A step's batch is split once, in `prepare`, into decodes (query length 1) and prefill chunks
(query length > 1, possibly with earlier context already in the cache). Everything derived from
the metadata -- the partition, gather indices, masks -- is built there from the CPU copies of
`query_start_loc` / `seq_lens`, so the ~30 `forward` calls of a step only gather, multiply and
softmax.

Decodes are attended together: each request's blocks are gathered whole (one `index_select` of
`block_size * num_kv_heads * head_dim` contiguous rows per block, K and V in the same call) into a
padded `[B, num_blocks * block_size, Hkv, D]` buffer, and an additive `-inf` bias hides the
positions past `seq_lens`. Query heads are grouped per KV head (`[B, Hkv, group, D]`) and that
group is handed to SDPA as the query-length axis, so grouped-query attention never repeats K/V
and the fused CPU kernel reads the strided K/V views in place, which is faster than gather +
matmul + softmax (the matmuls copy the strided views; benchmarks/torch_backend.py).

Because the padded positions are multiplied by a probability of exactly 0 rather than skipped,
the cache must hold finite values everywhere a block table can point: allocate it with
`torch.zeros`, not `torch.empty` (0 * NaN would be NaN). The Triton kernels do not need this.

Prefill chunks are attended with `scaled_dot_product_attention`, either batched in one padded call
or one call per request; `prepare` picks the cheaper by the padding it would waste (see
`_PADDED_PREFILL_MAX_WASTE`).

With a sliding window W (`AttentionMetadata.sliding_window`) a decode reads only the blocks its
window touches: each request's block-table row is shifted to start at the window's first block
(its length shifted by as many whole blocks), so the gather, the bias and the C kernel all see a
context of at most W + block_size positions, and the bias (the kernel: its own skip) hides the
positions of that first block before the window. A request prefill reads keys from its first
query's window on; a padded prefill reads the whole context and masks. Blocks before every
query's window may be a null block: they are never read, or read and masked.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.attention.backend import AttentionBackend
from tokenloom.attention.metadata import AttentionMetadata
from tokenloom.ops import cpu_kernels

# Padded prefill runs one SDPA over [P, Lq_max, Lk_max]; per-request prefill runs P calls over the
# exact sizes. Padding wins while the padded work stays under about twice the exact work
# (benchmarks/torch_backend.py).
_PADDED_PREFILL_MAX_WASTE = 2.0


@dataclass(slots=True)
class _DecodePlan:
    num_decodes: int
    # Token rows of the decode queries: a slice when they are contiguous (the model runner puts
    # decodes first), an index tensor otherwise.
    token_slice: slice | None
    token_index: torch.Tensor | None  # int64 [Bd]
    block_ids: torch.Tensor  # int64 [Bd * num_blocks], padded with block 0
    num_blocks: int  # per request, enough for the longest decode context
    bias: torch.Tensor  # float32 [Bd, 1, 1, num_blocks * block_size]: 0 or -inf
    # For the C kernel (float32 on the CPU): int32 [Bd, num_blocks] block table and [Bd] lengths
    # (both shifted to the window's first block under a sliding window, see the module docstring).
    block_table_i32: torch.Tensor | None = None
    seq_lens_i32: torch.Tensor | None = None
    sliding_window: int | None = None
    # Built by the first layer and reused: K and V block ids in the [2 * num_blocks] view, and
    # the bias in the query dtype.
    kv_block_ids: torch.Tensor | None = None
    bias_cast: torch.Tensor | None = None


@dataclass(slots=True)
class _PaddedPrefillPlan:
    num_prefills: int
    max_query_len: int
    max_seq_len: int
    query_index: torch.Tensor  # int64 [P * Lq]: token row of each padded query (0 for padding)
    context_slots: torch.Tensor  # int64 [P * Lk]: cache slot of each padded key (0 for padding)
    mask: torch.Tensor | None  # bool [P, 1, Lq, Lk]; None when plain top-left causal suffices
    valid_rows: torch.Tensor | None  # int64: rows of the padded output that are real tokens
    token_slice: slice | None  # where the real rows go (contiguous case)
    token_index: torch.Tensor | None
    # No request has earlier context: K/V are read from this step's inputs, not the cache.
    no_context: bool
    # Equal query lengths in contiguous rows: the padded query is a plain view of the input.
    dense_rows: slice | None


@dataclass(slots=True)
class _RequestPrefill:
    start: int  # first token row
    end: int
    context_len: int  # tokens already in the cache before this chunk
    # Only when context_len > 0: cache slots of positions [0, seq_len) and the offset-causal mask.
    context_slots: torch.Tensor | None
    mask: torch.Tensor | None  # bool [q_len, seq_len]


@dataclass(slots=True)
class TorchAttentionPlan:
    num_actual_tokens: int
    block_size: int
    write_slots: torch.Tensor  # int64 [T]: the cache slot each token's K/V is written to
    decode: _DecodePlan | None
    padded_prefill: _PaddedPrefillPlan | None
    request_prefills: list[_RequestPrefill]
    # Reused by every layer of the step: the decode gather target, allocated by the first layer.
    decode_buffer: torch.Tensor | None = None


def _index_or_slice(rows: torch.Tensor) -> tuple[slice | None, torch.Tensor | None]:
    """A slice when `rows` (sorted, int64, CPU) is one contiguous run, else the index itself."""
    n = rows.numel()
    if n and int(rows[-1]) - int(rows[0]) == n - 1:
        return slice(int(rows[0]), int(rows[0]) + n), None
    return None, rows


def _slots_for_positions(block_table_cpu: torch.Tensor, positions: torch.Tensor, block_size: int,
                         valid: torch.Tensor) -> torch.Tensor:
    """Cache slot of context position `positions[i, j]` of request row i (0 where not `valid`)."""
    pos = torch.where(valid, positions, torch.zeros_like(positions))
    blocks = torch.gather(block_table_cpu, 1, pos // block_size)
    return torch.where(valid, blocks * block_size + pos % block_size, torch.zeros_like(pos))


def _put_rows(out: torch.Tensor, rows: slice | None, index: torch.Tensor | None,
              values: torch.Tensor) -> None:
    """out[rows] = values, by the slice when the rows are one run, else by the index."""
    if rows is not None:
        out[rows] = values
    else:
        out[index] = values


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
          scale: float, softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [..., H, L, D] (GQA when k has fewer heads): causal from position 0 without a
    mask, else the boolean `mask`; with `sinks` (one per query head, [H]) `_sink_attention`, with
    `softcap` `_eager_attention`."""
    if softcap is not None or (sinks is not None and q.device.type != "cpu"):
        return _eager_attention(q, k, v, mask, scale, softcap,
                                None if sinks is None else sinks.view(-1, 1, 1))
    if sinks is not None:
        return _sink_attention(q, k, v, mask, scale, sinks.view(-1, 1))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=q.shape[-3] != k.shape[-3])


def _sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                    scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """Attention with gpt-oss's sinks on the CPU, in SDPA's fused kernel (no [Lq, Lk] scores in
    memory): a sink s joins each row's softmax denominator, so the row's output is SDPA's times
    sum(e^scores) / (sum(e^scores) + e^s) = sigmoid(logsumexp(scores) - s). `mask` as `_sdpa`'s, or
    an additive float one; `sinks` broadcasts to the logsumexp's [..., H, Lq]."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    if mask is not None and mask.dtype == torch.bool:
        mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, mask is None, attn_mask=None if mask is None else mask.to(q.dtype), scale=scale)
    return out * torch.sigmoid(lse - sinks.float()).unsqueeze(-1).to(out.dtype)


def _eager_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                     scale: float, softcap: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention that SDPA has no option for, in transformers' eager order, softmaxed in float32:
    Gemma 2's score capping (score = cap * tanh(score / cap)), then the mask (boolean: keep where
    True; float: added; None: causal from position 0), then gpt-oss's sinks: a learned logit per
    query head that joins each row's softmax denominator and attends to nothing (`sinks`
    broadcasts to the scores' [..., :1])."""
    group = q.shape[-3] // k.shape[-3]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=-3), v.repeat_interleave(group, dim=-3)
    scores = (q @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is None:
        Lq, Lk = scores.shape[-2:]
        mask = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device).tril()
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask
    if sinks is None:
        return torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype) @ v
    scores = torch.cat([scores.float(), sinks.float().expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., :-1].to(q.dtype) @ v


def _kernel_fits(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """The C decode kernel takes float32 queries over a float32 or bfloat16 cache, or bfloat16
    queries over a bfloat16 cache, on the CPU, with each token's heads contiguous."""
    return (((query.dtype == torch.float32 and kv_cache.dtype in (torch.float32, torch.bfloat16))
             or (query.dtype == kv_cache.dtype == torch.bfloat16))
            and query.device.type == "cpu" and kv_cache.is_contiguous()
            and query.stride(2) == 1 and query.stride(1) == query.shape[2])


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, prefill_mode: str = "auto", use_cpu_kernel: bool = True) -> None:
        """`prefill_mode`: "auto" (padded when it wastes little, see above), "padded" (always
        when there are two or more prefills) or "per_request". `use_cpu_kernel=False` keeps
        float32 CPU decodes on the PyTorch path. Both for tests and benchmarks."""
        if prefill_mode not in ("auto", "padded", "per_request"):
            raise ValueError(f"unknown prefill_mode {prefill_mode!r}")
        self.prefill_mode = prefill_mode
        # The C decode kernel (cpu_kernels), None where it cannot be built or is switched off.
        self._cpu_kernel = cpu_kernels.load() if use_cpu_kernel else None
        # Whether float32 queries over a 16-bit cache are attended in the cache's dtype during
        # prefill (the model runner sets it where the CPU multiplies that dtype natively): the
        # keys are rounded to it in the cache anyway, and SDPA's bfloat16 kernel beats its float32
        # one at a prompt's shapes (benchmarks/torch_backend.py). Decodes always read
        # the cache with float32 queries (the C kernel widens K/V as it loads them).
        self.prefill_in_cache_dtype = False
        # Whether the model computes in a 16-bit dtype (set by the model runner): its prefill
        # attention runs SDPA's 16-bit kernel, as that of prefill_in_cache_dtype does, so a
        # request's prefill is batched only with prompts it pads nothing for (see prepare).
        self.prefill_16bit_model = False

    # ------------------------------------------------------------------ plan (once per step)
    def prepare(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        device = meta.slot_mapping.device
        qsl, seq_lens = meta.host_lens()
        B = meta.num_reqs
        T = meta.num_actual_tokens
        bs = meta.block_size
        qsl, seq_lens = qsl.to(torch.int64), seq_lens.to(torch.int64)
        query_lens = qsl[1:] - qsl[:-1]
        # A window no shorter than every context changes nothing: plan as full attention.
        W = meta.sliding_window
        if W is not None and meta.max_seq_len <= W:
            W = None

        # Every scheduled token is written: the runner computes no padding tokens.
        write_slots = meta.slot_mapping[:T].to(torch.int64)

        block_table_cpu = None

        def bt_cpu() -> torch.Tensor:
            nonlocal block_table_cpu
            if block_table_cpu is None:
                block_table_cpu = meta.block_table[:B].to("cpu", torch.int64)
            return block_table_cpu

        is_decode = query_lens == 1
        decode_reqs = is_decode.nonzero().squeeze(1)
        prefill_reqs = (query_lens > 1).nonzero().squeeze(1)

        decode = self._plan_decode(decode_reqs, qsl, seq_lens, W, bs, device, bt_cpu)
        padded_prefill, request_prefills = self._plan_prefills(prefill_reqs, qsl, query_lens, seq_lens, W, bs,
                                                               device, bt_cpu)

        return TorchAttentionPlan(
            num_actual_tokens=T,
            block_size=bs,
            write_slots=write_slots,
            decode=decode,
            padded_prefill=padded_prefill,
            request_prefills=request_prefills,
        )

    def _plan_decode(self, decode_reqs: torch.Tensor, qsl: torch.Tensor, seq_lens: torch.Tensor, W: int | None,
                     bs: int, device: torch.device, bt_cpu: Callable[[], torch.Tensor]) -> _DecodePlan | None:
        """The step's decodes (one query token each) as one batched plan over their blocks."""
        decode = None
        if decode_reqs.numel():
            Bd = decode_reqs.numel()
            d_seq = seq_lens[decode_reqs]
            if W is None:
                nblk = int((int(d_seq.max()) + bs - 1) // bs)
                blocks = bt_cpu()[decode_reqs, :nblk]
            else:  # each row starts at its window's first block (see the module docstring)
                first_blk = (d_seq - W).clamp(min=0) // bs
                d_seq = d_seq - first_blk * bs
                nblk = int((int(d_seq.max()) + bs - 1) // bs)
                table = bt_cpu()[decode_reqs]
                cols = (first_blk.unsqueeze(1) + torch.arange(nblk)).clamp(max=table.shape[1] - 1)
                blocks = torch.gather(table, 1, cols)
            # Blocks past a request's context may hold stale ids (or -1): point them at block 0,
            # the bias hides whatever they contain.
            used = torch.arange(nblk).unsqueeze(0) * bs < d_seq.unsqueeze(1)
            blocks = torch.where(used, blocks, torch.zeros_like(blocks))
            L = nblk * bs
            bias = torch.zeros(Bd, L, dtype=torch.float32)
            bias.masked_fill_(torch.arange(L).unsqueeze(0) >= d_seq.unsqueeze(1), float("-inf"))
            if W is not None:
                bias.masked_fill_(torch.arange(L).unsqueeze(0) < (d_seq - W).unsqueeze(1), float("-inf"))
            tok_slice, tok_index = _index_or_slice(qsl[decode_reqs])
            kernel = device.type == "cpu" and self._cpu_kernel is not None
            decode = _DecodePlan(
                num_decodes=Bd,
                token_slice=tok_slice,
                token_index=None if tok_index is None else tok_index.to(device),
                block_ids=blocks.reshape(-1).to(device),
                num_blocks=nblk,
                bias=bias.view(Bd, 1, 1, L).to(device),
                block_table_i32=blocks.to(torch.int32) if kernel else None,
                seq_lens_i32=d_seq.to(torch.int32) if kernel else None,
                sliding_window=W,
            )
        return decode

    def _plan_prefills(self, prefill_reqs: torch.Tensor, qsl: torch.Tensor, query_lens: torch.Tensor,
                       seq_lens: torch.Tensor, W: int | None, bs: int, device: torch.device,
                       bt_cpu: Callable[[], torch.Tensor]) -> tuple[_PaddedPrefillPlan | None, list[_RequestPrefill]]:
        """The step's prefills: batched into one padded call where that pays (prefill_mode), else
        one by one."""
        padded_prefill = None
        request_prefills: list[_RequestPrefill] = []
        if prefill_reqs.numel():
            p_qlen = query_lens[prefill_reqs]
            p_seq = seq_lens[prefill_reqs]
            P = prefill_reqs.numel()
            Lq, Lk = int(p_qlen.max()), int(p_seq.max())
            exact = int((p_qlen * p_seq).sum())
            if self.prefill_mode == "padded":
                padded = P > 1
            elif self.prefill_mode == "per_request":
                padded = False
            elif self.prefill_in_cache_dtype or self.prefill_16bit_model:
                # SDPA's bfloat16 kernel sums a padded batch's rows in chunks that depend on the
                # padding, so one request's result would depend on its neighbours (a greedy
                # reply flipped between DP=1 and DP=2): one batched call only for prompts it
                # pads nothing for (one length, no context; bit-identical to per request).
                padded = P > 1 and exact == P * Lq * Lk and Lq == Lk
                if not padded and P > 2 and W is None:
                    # The largest such group of this step's prompts, the rest one by one: a
                    # step that admits 15 whole prompts beside a chunked one and the running
                    # decodes (the usual step of a long batch) made 16 calls per layer.
                    alone = p_seq == p_qlen
                    if int(alone.sum()) > 1:
                        lens, counts = p_qlen[alone].unique(return_counts=True)
                        if int(counts.max()) > 1:
                            group = alone & (p_qlen == lens[counts.argmax()])
                            L = int(lens[counts.argmax()])
                            padded_prefill = self._plan_padded_prefill(
                                qsl, prefill_reqs[group], p_qlen[group], p_seq[group], L, L,
                                bt_cpu(), bs, device, W)
                            prefill_reqs = prefill_reqs[~group]
            else:
                padded = P > 1 and P * Lq * Lk <= _PADDED_PREFILL_MAX_WASTE * exact
            if padded:
                padded_prefill = self._plan_padded_prefill(
                    qsl, prefill_reqs, p_qlen, p_seq, Lq, Lk, bt_cpu(), bs, device, W)
            else:
                for r in prefill_reqs.tolist():
                    start, end = int(qsl[r]), int(qsl[r + 1])
                    q_len, s_len = end - start, int(seq_lens[r])
                    ctx = s_len - q_len
                    slots = mask = None
                    # Keys from the first query's window on (all of them without a window).
                    k0 = 0 if W is None else max(0, ctx + 1 - W)
                    if ctx > 0:
                        pos = torch.arange(k0, s_len).unsqueeze(0)
                        slots = _slots_for_positions(bt_cpu()[r:r + 1], pos, bs,
                                                     torch.ones_like(pos, dtype=torch.bool))
                        slots = slots.squeeze(0).to(device)
                    if ctx > 0 or (W is not None and q_len > W):
                        kp = torch.arange(k0, s_len).unsqueeze(0)
                        qp = ctx + torch.arange(q_len).unsqueeze(1)
                        m = kp <= qp
                        if W is not None:
                            m &= kp > qp - W
                        mask = m.to(device)
                    request_prefills.append(_RequestPrefill(start, end, ctx, slots, mask))
        return padded_prefill, request_prefills

    @staticmethod
    def _plan_padded_prefill(qsl, reqs, q_lens, seq_lens, Lq, Lk, block_table_cpu, bs, device,
                             window: int | None):
        P = reqs.numel()
        starts = qsl[reqs]
        ctx = seq_lens - q_lens
        qi = torch.arange(Lq).unsqueeze(0)  # [1, Lq]
        q_valid = qi < q_lens.unsqueeze(1)  # [P, Lq]
        query_index = torch.where(q_valid, starts.unsqueeze(1) + qi, torch.zeros_like(qi))
        kj = torch.arange(Lk).unsqueeze(0)
        k_valid = kj < seq_lens.unsqueeze(1)
        context_slots = _slots_for_positions(block_table_cpu[reqs], kj.expand(P, Lk), bs, k_valid)

        uniform = bool((q_lens == Lq).all()) and bool((ctx == 0).all()) and (window is None or Lk <= window)
        mask = None
        if not uniform:
            # query i of request p sits at position ctx[p] + i and sees keys j <= that position
            # (and j > that position - W under a window). Padded query rows get key 0 only so
            # that their softmax stays finite.
            qpos = ctx.view(P, 1, 1) + qi.unsqueeze(2)
            m = kj.unsqueeze(0) <= qpos
            if window is not None:
                m &= kj.unsqueeze(0) > qpos - window
            m &= k_valid.unsqueeze(1)
            m &= q_valid.unsqueeze(2)
            m[:, :, 0] |= ~q_valid
            mask = m.unsqueeze(1).to(device)
        rows = q_valid.reshape(-1).nonzero().squeeze(1)
        valid_rows = None if rows.numel() == P * Lq else rows.to(device)
        tokens = (starts.unsqueeze(1) + qi)[q_valid]
        tok_slice, tok_index = _index_or_slice(tokens)
        no_context = bool((ctx == 0).all())
        dense_rows = tok_slice if valid_rows is None else None
        return _PaddedPrefillPlan(
            num_prefills=P,
            max_query_len=Lq,
            max_seq_len=Lk,
            query_index=query_index.reshape(-1).to(device),
            context_slots=context_slots.reshape(-1).to(device),
            mask=mask,
            valid_rows=valid_rows,
            token_slice=tok_slice,
            token_index=None if tok_index is None else tok_index.to(device),
            no_context=no_context,
            dense_rows=dense_rows,
        )

    # ------------------------------------------------------------------ per layer
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: TorchAttentionPlan,
        scale: float,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T = plan.num_actual_tokens
        _, num_blocks, bs, Hkv, D = kv_cache.shape
        k_flat = kv_cache[0].view(num_blocks * bs, Hkv, D)
        v_flat = kv_cache[1].view(num_blocks * bs, Hkv, D)
        key, value = key[:T], value[:T]
        key_c, value_c = key.to(kv_cache.dtype), value.to(kv_cache.dtype)
        k_flat.index_copy_(0, plan.write_slots, key_c)
        v_flat.index_copy_(0, plan.write_slots, value_c)

        # Rows past num_actual_tokens (a padded batch) come back as zeros.
        out = torch.empty_like(query)
        if out.shape[0] > T:
            out[T:].zero_()
        query = query[:T]
        if plan.decode is not None:
            # The C kernel neither caps scores nor adds sinks: such decodes take the PyTorch path.
            if (plan.decode.block_table_i32 is not None and softcap is None and sinks is None
                    and _kernel_fits(query, kv_cache)):
                self._decode_kernel(query, kv_cache, plan.decode, scale, out)
            else:
                self._decode(query, kv_cache, plan, scale, out, softcap, sinks)
        # The dtype prefill attention computes in (see prefill_in_cache_dtype).
        cdt = (kv_cache.dtype if self.prefill_in_cache_dtype and query.dtype == torch.float32
               and kv_cache.element_size() == 2 else query.dtype)
        if cdt != query.dtype and (plan.padded_prefill is not None or plan.request_prefills):
            # Converted once for the step (the keys and values as the cache write has them), not
            # per request: a prefill step of 16 prompts made ~200 small conversions per layer.
            query, key, value = query.to(cdt), key_c, value_c
        if plan.padded_prefill is not None:
            self._padded_prefill(query, key, value, k_flat, v_flat, plan.padded_prefill, scale,
                                out, cdt, softcap, sinks)
        for rp in plan.request_prefills:
            self._request_prefill(query, key, value, k_flat, v_flat, rp, scale, out, cdt, softcap, sinks)
        return out

    def _decode_kernel(self, query, kv_cache, dp: _DecodePlan, scale: float,
                       out: torch.Tensor) -> None:
        if dp.token_slice is not None:
            cpu_kernels.paged_decode(self._cpu_kernel, query[dp.token_slice], kv_cache,
                                     dp.block_table_i32, dp.seq_lens_i32, out[dp.token_slice], scale,
                                     dp.sliding_window)
            return
        o = torch.empty(dp.num_decodes, *query.shape[1:], dtype=query.dtype)
        cpu_kernels.paged_decode(self._cpu_kernel, query[dp.token_index], kv_cache,
                                 dp.block_table_i32, dp.seq_lens_i32, o, scale, dp.sliding_window)
        out[dp.token_index] = o

    @staticmethod
    def _decode(query, kv_cache, plan: TorchAttentionPlan, scale: float, out: torch.Tensor,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> None:
        dp = plan.decode
        _, num_blocks, bs, Hkv, D = kv_cache.shape
        Bd, nblk = dp.num_decodes, dp.num_blocks
        L = nblk * bs
        Hq = query.shape[1]

        # One gather of whole blocks, K and V together (the block ids of V are offset by
        # num_blocks in the flattened [2 * num_blocks] view), into a buffer every layer reuses.
        buf = plan.decode_buffer
        if buf is None or buf.dtype != kv_cache.dtype or buf.device != kv_cache.device:
            buf = torch.empty(2 * Bd * nblk, bs * Hkv * D, dtype=kv_cache.dtype,
                              device=kv_cache.device)
            plan.decode_buffer = buf
        if dp.kv_block_ids is None or dp.kv_block_ids.device != kv_cache.device:
            dp.kv_block_ids = torch.cat([dp.block_ids, dp.block_ids + num_blocks])
        torch.index_select(kv_cache.view(2 * num_blocks, bs * Hkv * D), 0, dp.kv_block_ids, out=buf)
        k = buf[: Bd * nblk].view(Bd, L, Hkv, D).transpose(1, 2)  # [Bd, Hkv, L, D], strided
        v = buf[Bd * nblk:].view(Bd, L, Hkv, D).transpose(1, 2)

        q = query[dp.token_slice] if dp.token_slice is not None else query[dp.token_index]
        # Grouped-query attention without repeating K/V: the `group` query heads that share a KV
        # head become `group` query rows of one attention problem over that head's keys.
        q = q.view(Bd, Hkv, Hq // Hkv, D)
        if k.dtype != q.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        bias = dp.bias
        if bias.dtype != q.dtype:
            if dp.bias_cast is None or dp.bias_cast.dtype != q.dtype:
                dp.bias_cast = bias.to(q.dtype)
            bias = dp.bias_cast
        # On CPU this is the fused (flash) SDPA kernel: it reads the strided K/V views directly
        # and accumulates the softmax in float32 also for bf16/fp16 inputs.
        if softcap is None and sinks is None:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale)
        elif softcap is None and q.device.type == "cpu":  # query head h is row h % group of KV head h // group
            o = _sink_attention(q, k, v, bias, scale, sinks.view(Hkv, Hq // Hkv))
        else:
            o = _eager_attention(q, k, v, bias, scale, softcap,
                                 None if sinks is None else sinks.view(Hkv, Hq // Hkv, 1))
        _put_rows(out, dp.token_slice, dp.token_index, o.reshape(Bd, Hq, D))

    @staticmethod
    def _padded_prefill(query, key, value, k_flat, v_flat, pp: _PaddedPrefillPlan, scale,
                        out, cdt: torch.dtype, softcap: float | None = None,
                        sinks: torch.Tensor | None = None) -> None:
        P, Lq, Lk = pp.num_prefills, pp.max_query_len, pp.max_seq_len
        Hq, D = query.shape[1], query.shape[2]
        Hkv = k_flat.shape[1]

        def padded(x: torch.Tensor, L: int) -> torch.Tensor:  # [rows, H, D] -> [P, H, L, D]
            if pp.dense_rows is not None:
                x = x[pp.dense_rows]
            else:
                x = x.index_select(0, pp.query_index)
            return x.view(P, L, x.shape[1], D).transpose(1, 2)

        q = padded(query, Lq)
        if pp.no_context:  # Lk == Lq and the keys are exactly this step's tokens
            k, v = padded(key, Lq), padded(value, Lq)
        else:
            k = k_flat.index_select(0, pp.context_slots).view(P, Lk, Hkv, D).transpose(1, 2)
            v = v_flat.index_select(0, pp.context_slots).view(P, Lk, Hkv, D).transpose(1, 2)
        o = _sdpa(q.to(cdt), k.to(cdt), v.to(cdt), pp.mask, scale, softcap, sinks).to(out.dtype)
        o = o.transpose(1, 2)  # [P, Lq, Hq, D]
        if pp.valid_rows is None and pp.token_slice is not None:
            out[pp.token_slice].view(P, Lq, Hq, D).copy_(o)
            return
        o = o.reshape(P * Lq, Hq, D)
        if pp.valid_rows is not None:
            o = o.index_select(0, pp.valid_rows)
        _put_rows(out, pp.token_slice, pp.token_index, o)

    @staticmethod
    def _request_prefill(query, key, value, k_flat, v_flat, rp: _RequestPrefill, scale,
                         out, cdt: torch.dtype, softcap: float | None = None,
                         sinks: torch.Tensor | None = None) -> None:
        # [1, H, len, D]: SDPA runs its fused (flash) CPU kernel only on 4-D inputs; 3-D ones go
        # to the math path, which in bfloat16 rounds where transformers (4-D, flash) does not.
        q = query[rp.start:rp.end].transpose(0, 1).unsqueeze(0)
        if rp.context_len == 0:
            # The whole context is this chunk: read it from the inputs, no gather needed.
            k, v = key[rp.start:rp.end], value[rp.start:rp.end]
        else:
            k, v = k_flat.index_select(0, rp.context_slots), v_flat.index_select(0, rp.context_slots)
        o = _sdpa(q.to(cdt), k.transpose(0, 1).unsqueeze(0).to(cdt),
                  v.transpose(0, 1).unsqueeze(0).to(cdt), rp.mask, scale, softcap, sinks)
        out[rp.start:rp.end] = o[0].transpose(0, 1)
