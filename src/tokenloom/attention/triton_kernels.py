"""Triton kernels for paged attention (GPU; on CPU only under `TRITON_INTERPRET=1`, for tests).

Four kernels, each with a thin launcher that takes torch tensors:

* `kv_cache_write`    scatter this step's K/V into the paged cache through `slot_mapping`.
* `unified_attention` one launch for a mixed batch (prefill chunks with context + decodes):
                      a program owns BLOCK_Q query tokens x all query heads of one KV head, so
                      grouped-query attention reads each K/V tile once for the whole group.
* `split_kv_decode`   decode-only batches with long contexts and few sequences: the context is
                      cut into partitions handled by separate programs; a second small kernel
                      merges their partial softmax results by log-sum-exp.
* `varlen_flash_attention` prefill without earlier context: FlashAttention-2 style tiling over
                      the packed (cu_seqlens) query/key/value, causal, one program per
                      (query tile, query head).

All softmax arithmetic is float32 in the log2 domain (`exp2`, scores pre-multiplied by
`scale * log2(e)`); the running maximum starts at a large finite negative number instead of
`-inf` so that rows with nothing to attend to (padding rows of a tile) never produce NaN.

A sliding window W (`WINDOW`, a compile-time constant: 0 = full attention, so a batch without a
window runs exactly the kernels it ran before) restricts a query at position p to keys
p - W < j <= p. Every kernel starts its key loop at the first position some query of the program
can see, so blocks wholly before the window (possibly the null block) are never read, and masks
the rest per query.

The env var TRITON_INTERPRET is read when `@triton.jit` runs, i.e. when this module is first
imported; set it before importing (the tests do).
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
_NEG_BIG = tl.constexpr(-1.0e30)


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _dot_precision(dtype: torch.dtype) -> str | None:
    # float32 inputs: exact products (the default would use TF32 on Ampere+ and lose ~3 digits).
    # Half types: Triton's default.
    return "ieee" if dtype == torch.float32 else None


def _interpreting() -> bool:
    return bool(triton.knobs.runtime.interpret)


def _dot_upcast(dtype: torch.dtype) -> bool:
    # Triton 3.9's interpreter computes tl.dot of bfloat16 operands on their raw bits (garbage);
    # there, and only there, the operands are widened to float32 first. Same rounding of the
    # inputs, so the tests still check the bf16 data path.
    return dtype == torch.bfloat16 and _interpreting()


@triton.jit
def _mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PRECISION)


# --------------------------------------------------------------------------- KV cache write
@triton.jit
def _kv_cache_write_kernel(
    key_ptr, value_ptr, cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    v_offset, stride_slot, stride_kvh,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    H_PAD: tl.constexpr, D_PAD: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    # A negative slot (padding) writes nothing: no head passes the mask. (Written as a bound
    # rather than `& (slot >= 0)`: the interpreter mistypes a broadcast scalar bool.)
    num_heads = tl.where(slot >= 0, NUM_KV_HEADS, 0)
    mask = (h[:, None] < num_heads) & (d[None, :] < HEAD_DIM)
    k = tl.load(key_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    v = tl.load(value_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    dst = slot * stride_slot + h[:, None] * stride_kvh + d[None, :]
    tl.store(cache_ptr + dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(cache_ptr + v_offset + dst, v.to(cache_ptr.dtype.element_ty), mask=mask)


def kv_cache_write(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                   slot_mapping: torch.Tensor, num_tokens: int) -> None:
    """key/value [>=num_tokens, Hkv, D]; kv_cache [2, num_blocks, block_size, Hkv, D]."""
    if num_tokens == 0:
        return
    _, _, block_size, hkv, d = kv_cache.shape
    assert kv_cache.stride(4) == 1 and key.stride(2) == 1 and value.stride(2) == 1
    # One slot = one (block, offset) pair; the cache is contiguous over (block, offset).
    assert kv_cache.stride(1) == block_size * kv_cache.stride(2)
    _kv_cache_write_kernel[(num_tokens,)](
        key, value, kv_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        kv_cache.stride(0), kv_cache.stride(2), kv_cache.stride(3),
        NUM_KV_HEADS=hkv, HEAD_DIM=d, H_PAD=_pow2(hkv), D_PAD=_pow2(d),
    )


# --------------------------------------------------------------------------- shared KV tile step
@triton.jit
def _attend_tile(
    q, m_i, l_i, acc, cache_ptr, v_offset, block_table_row_ptr,
    kv_head_off, pos, pos_valid, q_pos, d, d_valid,
    stride_blk, stride_tok, scale_log2e,
    BLOCK_SIZE: tl.constexpr, CAUSAL: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, WINDOW: tl.constexpr,
):
    """One online-softmax step over the KV positions `pos` (a tile of TILE_N), read through the
    block table. q: [M, D_PAD]; q_pos: [M] absolute position of each query row."""
    blk = tl.load(block_table_row_ptr + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
    base = blk * stride_blk + (pos % BLOCK_SIZE) * stride_tok + kv_head_off
    kv_mask = pos_valid[:, None] & d_valid[None, :]
    k = tl.load(cache_ptr + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(cache_ptr + v_offset + base[:, None] + d[None, :], mask=kv_mask, other=0.0)
    s = _mma(q, tl.trans(k), PRECISION, UPCAST) * scale_log2e
    if CAUSAL:
        keep = (pos[None, :] <= q_pos[:, None]) & pos_valid[None, :]
    else:
        keep = pos_valid[None, :] & (q_pos[:, None] >= 0)
    if WINDOW > 0:
        keep = keep & (pos[None, :] > q_pos[:, None] - WINDOW)
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


# --------------------------------------------------------------------------- unified attention
@triton.jit
def _unified_attention_kernel(
    out_ptr, q_ptr, cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    prog_req_ptr, prog_qoff_ptr,
    scale_log2e, v_offset,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    stride_blk, stride_tok, stride_kvh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, WINDOW: tl.constexpr,
):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    req = tl.load(prog_req_ptr + pid)
    qoff = tl.load(prog_qoff_ptr + pid)  # first query row of this tile within the request
    q_start = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    ctx = seq_len - q_len

    # Tile rows are (query token, head within the group) pairs: row r = tok * G_PAD + g.
    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    r = tl.arange(0, BLOCK_M)
    tok = qoff + r // G_PAD
    g = r % G_PAD
    row_valid = (tok < q_len) & (g < GROUP)
    head = kvh * GROUP + g
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    q_rows = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    # Padding rows get position -1: they see nothing (and stay finite, see module docstring).
    q_pos = tl.where(row_valid, ctx + tok, -1)

    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    # The last query of this tile sits at ctx + qoff + BLOCK_Q - 1: no key past it is needed.
    kv_end = tl.minimum(seq_len, ctx + qoff + BLOCK_Q)
    # The first query of this tile sits at ctx + qoff: under a window no key before its window
    # is needed by any row.
    kv_start = 0
    if WINDOW > 0:
        kv_start = tl.maximum(ctx + qoff - WINDOW + 1, 0)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(kv_start, kv_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, cache_ptr, v_offset, bt_row, kvh * stride_kvh,
            pos, pos < kv_end, q_pos, d, d_valid, stride_blk, stride_tok, scale_log2e,
            BLOCK_SIZE, True, PRECISION, UPCAST, WINDOW)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=row_valid[:, None] & d_valid[None, :])


def unified_block_q(num_q_heads: int, num_kv_heads: int, max_query_len: int) -> int:
    """Query tokens per program: enough rows for a 16-row dot (64 when prefills are long)."""
    g_pad = _pow2(num_q_heads // num_kv_heads)
    rows = 64 if max_query_len >= 64 else 16
    return max(1, rows // g_pad)


def unified_program_table(query_start_loc_cpu: torch.Tensor, block_q: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(request, first query row) of every program: request i gets ceil(q_len_i / block_q)."""
    q_lens = (query_start_loc_cpu[1:] - query_start_loc_cpu[:-1]).to(torch.int64)
    tiles = (q_lens + block_q - 1) // block_q
    reqs = torch.repeat_interleave(torch.arange(q_lens.numel()), tiles)
    first = torch.cumsum(tiles, 0) - tiles
    qoff = (torch.arange(reqs.numel()) - first[reqs]) * block_q
    return reqs.to(torch.int32), qoff.to(torch.int32)


def unified_attention(out, query, kv_cache, block_table, query_start_loc, seq_lens,
                      prog_req, prog_qoff, block_q: int, scale: float, tile_n: int = 32,
                      sliding_window: int | None = None) -> None:
    """Mixed batch in one launch. prog_req/prog_qoff from `unified_program_table(.., block_q)`."""
    _, _, block_size, hkv, d = kv_cache.shape
    hq = query.shape[1]
    group = hq // hkv
    grid = (prog_req.numel(), hkv)
    if grid[0] == 0:
        return
    _unified_attention_kernel[grid](
        out, query, kv_cache, block_table, query_start_loc, seq_lens, prog_req, prog_qoff,
        scale * LOG2E, kv_cache.stride(0),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        HEAD_DIM=d, D_PAD=max(16, _pow2(d)), GROUP=group, G_PAD=_pow2(group),
        BLOCK_Q=block_q, BLOCK_SIZE=block_size, TILE_N=tile_n,
        PRECISION=_dot_precision(query.dtype), UPCAST=_dot_upcast(query.dtype),
        WINDOW=sliding_window or 0,
    )


# --------------------------------------------------------------------------- split-KV decode
@triton.jit
def _split_kv_decode_kernel(
    part_out_ptr, part_lse_ptr, q_ptr, cache_ptr, block_table_ptr, query_start_loc_ptr,
    seq_lens_ptr,
    scale_log2e, v_offset, partition_len,
    stride_qt, stride_qh, stride_bt, stride_blk, stride_tok, stride_kvh,
    stride_pr, stride_ph, stride_ps,  # part_out [B, Hq, S, D_PAD]
    stride_lr, stride_lh,  # part_lse [B, Hq, S], last stride 1
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr, M_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, WINDOW: tl.constexpr,
):
    req = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    t = tl.load(query_start_loc_ptr + req).to(tl.int64)  # the request's one query token
    seq_len = tl.load(seq_lens_ptr + req)
    # The partitions cover the query's window: [seq_len - W, seq_len), or the whole context.
    first = 0
    if WINDOW > 0:
        first = tl.maximum(seq_len - WINDOW, 0)
    part_start = first + split * partition_len
    part_end = tl.minimum(seq_len, part_start + partition_len)

    g = tl.arange(0, M_PAD)
    row_valid = g < GROUP
    head = kvh * GROUP + g
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    q = tl.load(q_ptr + t * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_valid[:, None] & d_valid[None, :], other=0.0)
    q_pos = tl.where(row_valid, seq_len - 1, -1)

    m_i = tl.full([M_PAD], _NEG_BIG, tl.float32)
    l_i = tl.zeros([M_PAD], tl.float32)
    acc = tl.zeros([M_PAD, D_PAD], tl.float32)
    bt_row = block_table_ptr + req.to(tl.int64) * stride_bt
    for start in range(part_start, part_end, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        m_i, l_i, acc = _attend_tile(
            q, m_i, l_i, acc, cache_ptr, v_offset, bt_row, kvh * stride_kvh,
            pos, pos < part_end, q_pos, d, d_valid, stride_blk, stride_tok, scale_log2e,
            BLOCK_SIZE, False, PRECISION, UPCAST, 0)
    # Normalised partial output and its log2-sum-exp; an empty partition has lse = -inf.
    lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    base = req.to(tl.int64) * stride_pr + head.to(tl.int64) * stride_ph + split * stride_ps
    tl.store(part_out_ptr + base[:, None] + d[None, :], acc, mask=row_valid[:, None])
    tl.store(part_lse_ptr + req.to(tl.int64) * stride_lr + head * stride_lh + split, lse,
             mask=row_valid)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, query_start_loc_ptr, num_splits,
    stride_ot, stride_oh, stride_pr, stride_ph, stride_ps, stride_lr, stride_lh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, S_PAD: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    t = tl.load(query_start_loc_ptr + req).to(tl.int64)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    s_valid = s < num_splits
    lse_base = req.to(tl.int64) * stride_lr + head * stride_lh
    lse = tl.load(part_lse_ptr + lse_base + s, mask=s_valid, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))  # the first partition is never empty: max is finite
    base = req.to(tl.int64) * stride_pr + head * stride_ph
    parts = tl.load(part_out_ptr + base + s[:, None] * stride_ps + d[None, :],
                    mask=s_valid[:, None] & (w[:, None] > 0), other=0.0)
    o = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + t * stride_ot + head * stride_oh + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


def split_kv_num_splits(max_seq_len: int, num_seqs: int, num_kv_heads: int,
                        num_sms: int, partition_len: int) -> int:
    """Enough partitions to give every SM about two programs, never shorter than one tile."""
    by_len = math.ceil(max_seq_len / partition_len)
    by_sms = math.ceil(2 * num_sms / max(1, num_seqs * num_kv_heads))
    return max(1, min(by_len, by_sms))


def split_kv_decode(out, query, kv_cache, block_table, query_start_loc, seq_lens,
                    num_seqs: int, max_seq_len: int, num_splits: int, scale: float,
                    tile_n: int = 32, workspace: tuple[torch.Tensor, torch.Tensor] | None = None,
                    sliding_window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-only batch (every query length 1). Returns the (reusable) partial-result buffers."""
    _, _, block_size, hkv, d = kv_cache.shape
    if sliding_window:  # the partitions split the window, not the whole context
        max_seq_len = min(max_seq_len, sliding_window)
    hq = query.shape[1]
    group = hq // hkv
    d_pad = max(16, _pow2(d))
    # Partition length: a whole number of tiles covering max_seq_len in num_splits parts.
    partition_len = math.ceil(math.ceil(max_seq_len / num_splits) / tile_n) * tile_n
    shape = (num_seqs, hq, num_splits, d_pad)
    if workspace is None or workspace[0].shape != shape or workspace[0].device != query.device:
        workspace = (torch.empty(shape, dtype=torch.float32, device=query.device),
                     torch.empty(shape[:3], dtype=torch.float32, device=query.device))
    part_out, part_lse = workspace
    if num_seqs == 0:
        return workspace
    prec = _dot_precision(query.dtype)
    _split_kv_decode_kernel[(num_seqs, hkv, num_splits)](
        part_out, part_lse, query, kv_cache, block_table, query_start_loc, seq_lens,
        scale * LOG2E, kv_cache.stride(0), partition_len,
        query.stride(0), query.stride(1), block_table.stride(0),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=d, D_PAD=d_pad, GROUP=group, M_PAD=max(16, _pow2(group)),
        BLOCK_SIZE=block_size, TILE_N=tile_n, PRECISION=prec,
        UPCAST=_dot_upcast(query.dtype), WINDOW=sliding_window or 0,
    )
    _split_kv_reduce_kernel[(num_seqs, hq)](
        out, part_out, part_lse, query_start_loc, num_splits,
        out.stride(0), out.stride(1), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        part_lse.stride(0), part_lse.stride(1),
        HEAD_DIM=d, D_PAD=d_pad, S_PAD=_pow2(num_splits),
    )
    return workspace


# --------------------------------------------------------------------------- varlen flash
@triton.jit
def _flash_step(q, m_i, l_i, acc, k_ptr, v_ptr, q_start, n, n_valid, q_idx, d, d_valid,
                stride_kt, stride_vt, kv_head_off_k, kv_head_off_v, scale_log2e,
                MASKED: tl.constexpr, PRECISION: tl.constexpr,
                UPCAST: tl.constexpr, WINDOW: tl.constexpr):
    rows = (q_start + n).to(tl.int64)
    kv_mask = n_valid[:, None] & d_valid[None, :]
    k = tl.load(k_ptr + rows[:, None] * stride_kt + kv_head_off_k + d[None, :], mask=kv_mask,
                other=0.0)
    v = tl.load(v_ptr + rows[:, None] * stride_vt + kv_head_off_v + d[None, :], mask=kv_mask,
                other=0.0)
    s = _mma(q, tl.trans(k), PRECISION, UPCAST) * scale_log2e
    if MASKED:
        keep = (n[None, :] <= q_idx[:, None]) & n_valid[None, :]
        if WINDOW > 0:
            keep = keep & (n[None, :] > q_idx[:, None] - WINDOW)
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _varlen_flash_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr, cu_seqlens_ptr, prog_req_ptr, prog_qoff_ptr, scale_log2e,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr, WINDOW: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1)
    kvh = head // GROUP
    req = tl.load(prog_req_ptr + pid)
    start_m = tl.load(prog_qoff_ptr + pid)
    q_start = tl.load(cu_seqlens_ptr + req)
    q_len = tl.load(cu_seqlens_ptr + req + 1) - q_start

    q_idx = start_m + tl.arange(0, BLOCK_M)
    q_valid = q_idx < q_len
    d = tl.arange(0, D_PAD)
    d_valid = d < HEAD_DIM
    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=q_valid[:, None] & d_valid[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    diag_end = tl.minimum(start_m + BLOCK_M, q_len)
    if WINDOW > 0:
        # From the first row's window on, every tile masked (rows see different key ranges).
        for start_n in range(tl.maximum(start_m - WINDOW + 1, 0), diag_end, BLOCK_N):
            n = start_n + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _flash_step(q, m_i, l_i, acc, k_ptr, v_ptr, q_start, n, n < q_len,
                                        q_idx, d, d_valid, stride_kt, stride_vt, kvh * stride_kh,
                                        kvh * stride_vh, scale_log2e, True, PRECISION, UPCAST,
                                        WINDOW)
    else:
        # Keys before start_m are visible to every row of the tile: no mask (BLOCK_N | BLOCK_M,
        # so these tiles are whole). Only the tiles on the diagonal need the causal mask.
        for start_n in range(0, start_m, BLOCK_N):
            n = start_n + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _flash_step(q, m_i, l_i, acc, k_ptr, v_ptr, q_start, n, n < q_len,
                                        q_idx, d, d_valid, stride_kt, stride_vt, kvh * stride_kh,
                                        kvh * stride_vh, scale_log2e, False, PRECISION, UPCAST, 0)
        for start_n in range(start_m, diag_end, BLOCK_N):
            n = start_n + tl.arange(0, BLOCK_N)
            m_i, l_i, acc = _flash_step(q, m_i, l_i, acc, k_ptr, v_ptr, q_start, n, n < q_len,
                                        q_idx, d, d_valid, stride_kt, stride_vt, kvh * stride_kh,
                                        kvh * stride_vh, scale_log2e, True, PRECISION, UPCAST, 0)
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + d[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=q_valid[:, None] & d_valid[None, :])


def varlen_flash_attention(out, query, key, value, cu_seqlens, prog_req, prog_qoff,
                           block_m: int, scale: float, block_n: int | None = None,
                           sliding_window: int | None = None) -> None:
    """Causal attention of packed sequences (no earlier context): query [T, Hq, D], key/value
    [T, Hkv, D], cu_seqlens int32 [B+1]. prog_req/prog_qoff from
    `unified_program_table(cu_seqlens_cpu, block_m)`."""
    hq, d = query.shape[1], query.shape[2]
    hkv = key.shape[1]
    block_n = block_n or min(block_m, 64)
    assert block_m % block_n == 0
    if prog_req.numel() == 0:
        return
    _varlen_flash_kernel[(prog_req.numel(), hq)](
        out, query, key, value, cu_seqlens, prog_req, prog_qoff, scale * LOG2E,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1),
        value.stride(0), value.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=d, D_PAD=max(16, _pow2(d)), GROUP=hq // hkv,
        BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_dot_precision(query.dtype),
        UPCAST=_dot_upcast(query.dtype), WINDOW=sliding_window or 0,
    )
