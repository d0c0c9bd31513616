"""Physical KV blocks: reference counts, the LRU free queue and the prefix-cache map.

One pool serves every KV cache group of the model (kv_cache_spec.py): a block id is owned by one
group at a time, and the prefix cache keys a block by its hash *and* its group, since the same
tokens have one block per group.

With full attention only, every one of the `num_blocks` blocks is usable and there is no null
block (the runner pads its block table with block 0, but padded entries are never read because
`seq_lens` bounds every lookup, and no padding token is ever computed, so nothing writes through
them either). A model with sliding-window groups reserves block 0 as the *null block*: it stands
in the block lists of a sliding group for the blocks that fell out of the window (or that a
prefix hit did not need), is never handed out, never written, never freed, and stays zero-filled,
so a kernel that does touch such an entry reads finite zeros that its window mask drops.

A block is in exactly one of three states:
  * in use: ref_cnt > 0, owned by that many live requests (more than one only for a shared,
    cached prefix block);
  * free and cached: ref_cnt == 0, in the free queue, still has its block_hash and is still in
    the cache map, so a prefix hit can revive it (`touch`);
  * free and empty: ref_cnt == 0, in the free queue, no hash.
A cached block is evicted lazily: only when `get_new_blocks` hands its id out again.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tokenloom.core.kv_cache_utils import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # The KV cache group that took it last (counted per group while in use; see BlockPool).
    group_id: int = 0
    # Set while the block is full and registered in the prefix cache.
    block_hash: BlockHash | None = None
    # Links of the free queue; None while the block is in use.
    prev_free_block: "KVCacheBlock | None" = None
    next_free_block: "KVCacheBlock | None" = None

    def __repr__(self) -> str:
        cached = "cached" if self.block_hash is not None else "empty"
        return f"KVCacheBlock({self.block_id}, ref_cnt={self.ref_cnt}, {cached})"


class FreeBlockQueue:
    """Doubly-linked list of free blocks threaded through the blocks themselves, so removing a
    block from the middle (a prefix hit on a free cached block) is O(1) without a search.
    The head is the next block to hand out (least recently freed); freed blocks go to the tail."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        # Sentinels at both ends remove every "is this the first/last block" branch.
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self.num_free_blocks = 0
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail or block is None:
            raise ValueError("no free block left")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"asked for {n} free blocks, {self.num_free_blocks} left")
        return [self.popleft() for _ in range(n)]

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """Head (next to be handed out) to tail. O(n): for tests and introspection."""
        out = []
        block = self._head.next_free_block
        while block is not None and block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


def cache_key(block_hash: BlockHash, group_id: int) -> BlockHash:
    """The prefix-cache key of a block of group `group_id`. Group 0 (the only group of a model
    with full attention only) keys by the bare hash, so such a model pays nothing for groups; the
    others append the group id (a hash has a fixed length, so keys never collide)."""
    if group_id == 0:
        return block_hash
    return BlockHash(block_hash + group_id.to_bytes(2, "little"))


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True, use_null_block: bool = False,
                 num_groups: int = 1) -> None:
        if num_blocks < 1 + use_null_block:
            raise ValueError(f"num_blocks must be at least {1 + use_null_block}, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Block 0, when reserved (see the module docstring); never in the free queue.
        self.null_block: KVCacheBlock | None = self.blocks[0] if use_null_block else None
        self.num_usable_blocks = num_blocks - use_null_block
        self.free_block_queue = FreeBlockQueue(self.blocks[use_null_block:])
        # Blocks in use per KV cache group, kept only with more than one group (one group's count
        # is num_used_blocks): the step stats' per-group breakdown, O(1) to read.
        self.num_used_per_group: list[int] | None = [0] * num_groups if num_groups > 1 else None
        # One block per hash. If two requests compute the same block concurrently (both missed
        # the cache), the second one's copy simply stays private and unhashed.
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.num_cached_free_blocks = 0

    # ---- allocation ------------------------------------------------------------------------

    def get_new_blocks(self, n: int, group_id: int = 0) -> list[KVCacheBlock]:
        """Take n blocks from the head of the free queue, with ref_cnt 1, for group `group_id`. A
        cached block handed out here is evicted now: its hash leaves the map."""
        blocks = self.free_block_queue.popleft_n(n)
        for block in blocks:
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            block.group_id = group_id
        if self.num_used_per_group is not None:
            self.num_used_per_group[group_id] += n
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix hit). A free cached block leaves the
        free queue, so it cannot be evicted while used."""
        null = self.null_block
        for block in blocks:
            if block is null:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks -= 1
                if self.num_used_per_group is not None:
                    self.num_used_per_group[block.group_id] += 1
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference on each block; blocks reaching 0 join the tail of the free queue in
        the given order, i.e. the first one given is evicted first. The null block is skipped."""
        null = self.null_block
        for block in ordered_blocks:
            if block is null:
                continue
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
                if block.block_hash is not None:
                    self.num_cached_free_blocks += 1
                if self.num_used_per_group is not None:
                    self.num_used_per_group[block.group_id] -= 1

    # ---- prefix cache ----------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash, group_id: int = 0) -> KVCacheBlock | None:
        return self.cached_block_hash_to_block.get(cache_key(block_hash, group_id))

    def cache_full_blocks(
        self,
        blocks: list[KVCacheBlock],
        block_hashes: list[BlockHash],
        num_cached_blocks: int,
        num_full_blocks: int,
        group_id: int = 0,
    ) -> None:
        """Register blocks[num_cached_blocks:num_full_blocks] (full, computed, in use) under the
        matching hashes of the request's chain, in group `group_id`. A block's `block_hash` is
        its cache key (see `cache_key`)."""
        if not self.enable_caching:
            return
        null = self.null_block
        for i in range(num_cached_blocks, num_full_blocks):
            block = blocks[i]
            if block.block_hash is not None or block is null:
                continue  # already cached (it came from a prefix hit), or out of the window
            block_hash = cache_key(block_hashes[i], group_id)
            if block_hash in self.cached_block_hash_to_block:
                continue  # a concurrent duplicate: keep ours private
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.num_cached_free_blocks -= 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block. Only possible while no block is in use (a running request's
        blocks would otherwise keep stale hashes); returns whether it happened."""
        if self.num_free_blocks != self.num_usable_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.num_cached_free_blocks = 0
        return True

    # ---- accounting ------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.free_block_queue.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by live requests (cached free blocks count as free)."""
        return self.num_used_blocks / self.num_usable_blocks
