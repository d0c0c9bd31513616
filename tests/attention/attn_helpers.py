"""Batch builders and a dense float64 reference for testing and benchmarking attention backends.

Not used on the serving path. `make_batch` lays each request's context out in randomly chosen,
shuffled blocks of a paged KV cache (so block tables are never contiguous), fills the cache with
finite random values (including slots no request owns, which a correct kernel never reads), and
returns inputs and metadata exactly as the model runner would hand them to a backend.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.attention.metadata import AttentionMetadata


@dataclass
class AttentionBatch:
    query: torch.Tensor  # [T_rows, Hq, D]  (T_rows = T + num_padding_rows)
    key: torch.Tensor  # [T_rows, Hkv, D]
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata
    scale: float


def make_batch(
    query_lens: list[int],
    seq_lens: list[int],
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    num_padding_rows: int = 0,
    extra_blocks: int = 3,
    shuffle_blocks: bool = True,
    sliding_window: int | None = None,
) -> AttentionBatch:
    """Request i computes `query_lens[i]` new tokens and has `seq_lens[i]` tokens of context after
    this step. `num_padding_rows` extra rows are appended to query/key/value with slot -1 (beyond
    `num_actual_tokens`, as with padded batches)."""
    assert len(query_lens) == len(seq_lens)
    assert all(1 <= q <= s for q, s in zip(query_lens, seq_lens))
    g = torch.Generator().manual_seed(seed)
    B = len(query_lens)
    T = sum(query_lens)
    blocks_per_req = [(s + block_size - 1) // block_size for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1  # one spare column, filled with stale ids
    num_blocks = sum(blocks_per_req) + extra_blocks
    perm = torch.randperm(num_blocks, generator=g) if shuffle_blocks else torch.arange(num_blocks)
    # Stale entries past a request's last block point at real blocks owned by someone else.
    block_table = torch.randint(0, num_blocks, (B, max_blocks), generator=g, dtype=torch.int32)
    cursor = 0
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = perm[cursor:cursor + n].to(torch.int32)
        cursor += n

    slots = []
    for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
        for pos in range(s - q, s):
            slots.append(int(block_table[i, pos // block_size]) * block_size + pos % block_size)
    slot_mapping = torch.tensor(slots + [-1] * num_padding_rows, dtype=torch.int64)
    qsl = torch.zeros(B + 1, dtype=torch.int32)
    qsl[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    seq_lens_t = torch.tensor(seq_lens, dtype=torch.int32)

    rows = T + num_padding_rows
    dev = torch.device(device)
    # Random data is drawn on the target device (large benchmark caches would be slow on the host).
    gd = torch.Generator(device=dev).manual_seed(seed)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gd,
                           device=dev, dtype=dtype)
    query = torch.randn(rows, num_q_heads, head_dim, generator=gd, device=dev, dtype=dtype)
    key = torch.randn(rows, num_kv_heads, head_dim, generator=gd, device=dev, dtype=dtype)
    value = torch.randn(rows, num_kv_heads, head_dim, generator=gd, device=dev, dtype=dtype)
    meta = AttentionMetadata(
        num_actual_tokens=T,
        num_reqs=B,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc=qsl.to(dev),
        seq_lens=seq_lens_t.to(dev),
        block_table=block_table.to(dev),
        slot_mapping=slot_mapping.to(dev),
        block_size=block_size,
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens_t,
        sliding_window=sliding_window,
    )
    return AttentionBatch(
        query=query,
        key=key,
        value=value,
        kv_cache=kv_cache,
        meta=meta,
        scale=head_dim ** -0.5,
    )


def reference_attention(batch: AttentionBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense float64 attention, one request at a time, with an explicit per-token mask.

    Returns (output [T, Hq, D] float64, the KV cache after the write). The write skips negative
    slots; reads go through the block table of the written cache, so a token whose slot was
    skipped reads whatever the cache held.
    """
    meta = batch.meta
    T = meta.num_actual_tokens
    cache = batch.kv_cache.detach().cpu().clone()
    _, nb, bs, hkv, d = cache.shape
    slots = meta.slot_mapping.cpu()[:T]
    key = batch.key.cpu()[:T].to(cache.dtype)
    value = batch.value.cpu()[:T].to(cache.dtype)
    for t in range(T):
        s = int(slots[t])
        if s >= 0:
            cache[0, s // bs, s % bs] = key[t]
            cache[1, s // bs, s % bs] = value[t]
    q_all = batch.query.cpu()[:T].double()
    hq = q_all.shape[1]
    group = hq // hkv
    out = torch.zeros(T, hq, d, dtype=torch.float64)
    qsl = meta.query_start_loc.cpu().tolist()
    seq_lens = meta.seq_lens.cpu().tolist()
    bt = meta.block_table.cpu()
    for i in range(meta.num_reqs):
        start, end, s_len = qsl[i], qsl[i + 1], seq_lens[i]
        q_len = end - start
        # Under a window only positions some query sees are read (those behind may be NaN).
        W = meta.sliding_window
        pos = torch.arange(0 if W is None else max(0, s_len - q_len - W + 1), s_len)
        blk = bt[i, pos // bs].long()
        k = cache[0, blk, pos % bs].double()  # [S, Hkv, D]
        v = cache[1, blk, pos % bs].double()
        q = q_all[start:end]  # [q_len, Hq, D]
        for h in range(hq):
            kh = k[:, h // group]
            vh = v[:, h // group]
            scores = (q[:, h] @ kh.T) * batch.scale  # [q_len, S]
            q_pos = (s_len - q_len + torch.arange(q_len)).unsqueeze(1)
            scores = scores.masked_fill(pos.unsqueeze(0) > q_pos, float("-inf"))
            if meta.sliding_window is not None:
                scores = scores.masked_fill(pos.unsqueeze(0) <= q_pos - meta.sliding_window,
                                            float("-inf"))
            out[start:end, h] = torch.softmax(scores, dim=-1) @ vh
    return out, cache


def poison_unused_slots(batch: AttentionBatch) -> None:
    """Fill every cache slot outside the requests' contexts with NaN (in place): a kernel that
    reads past `seq_lens` or through a stale block-table entry then produces NaN."""
    meta = batch.meta
    _, nb, bs, _, _ = batch.kv_cache.shape
    used = torch.zeros(nb * bs, dtype=torch.bool)
    bt = meta.block_table.cpu().long()
    for i, s in enumerate(meta.seq_lens.cpu().tolist()):
        pos = torch.arange(s)
        used[bt[i, pos // bs] * bs + pos % bs] = True
    flat = batch.kv_cache.view(2, nb * bs, -1)
    flat[:, (~used).nonzero().squeeze(1).to(flat.device)] = float("nan")


def as_fused_qkv_views(batch: AttentionBatch) -> None:
    """Replace query/key/value (in place) by strided views of one fused [T, (Hq + 2 Hkv) * D]
    tensor, the way a model's QKV projection hands them over."""
    rows, hq, d = batch.query.shape
    hkv = batch.key.shape[1]
    qkv = torch.cat([batch.query.reshape(rows, -1), batch.key.reshape(rows, -1),
                     batch.value.reshape(rows, -1)], dim=1)
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=1)
    batch.query, batch.key, batch.value = q.view(rows, hq, d), k.view(rows, hkv, d), v.view(
        rows, hkv, d)


def poison_outside_window(batch: AttentionBatch, value: float = float("nan")) -> int:
    """Fill every block that lies wholly before the window of all of its request's queries with
    `value` (in place), as a freed block behind the window would be (the null block): a kernel
    that reads such a block gives NaN. Block 0 is left alone: the torch backend points padding
    entries of its gather at block 0, which the KV cache manager reserves as the null block (of
    zeros). Returns how many blocks were poisoned."""
    meta = batch.meta
    W = meta.sliding_window
    assert W is not None
    bs = meta.block_size
    qsl = meta.query_start_loc.cpu().tolist()
    bt = meta.block_table.cpu().long()
    count = 0
    for i, s_len in enumerate(meta.seq_lens.cpu().tolist()):
        first_query = s_len - (qsl[i + 1] - qsl[i])
        first_visible = max(0, first_query - W + 1)
        for b in range(first_visible // bs):  # blocks ending before the first visible position
            if int(bt[i, b]) != 0:
                batch.kv_cache[:, int(bt[i, b])] = value
                count += 1
    return count
