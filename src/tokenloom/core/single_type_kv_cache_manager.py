"""The blocks of one KV cache group for every request: full attention or a sliding window.

A request's block list in a group is indexed by token position: entry i holds tokens
[i * block_size, (i + 1) * block_size). A sliding-window group replaces the entries that fell
out of the window with the pool's null block, so the list keeps its length (the runner's block
table columns stay aligned with positions) while the blocks go back to the pool. The null
entries are always a prefix of the list: the window only moves forward.

`KVCacheManager` (kv_cache_manager.py) coordinates the groups; these classes know one attention
type's rules: which blocks a prefix hit must find, how many blocks n tokens need, what may be
given back as the request advances.
"""
from __future__ import annotations

from collections.abc import Sequence

from tokenloom.core.block_pool import BlockPool, KVCacheBlock
from tokenloom.core.kv_cache_utils import BlockHash, cdiv
from tokenloom.kv_cache_spec import KVCacheGroupSpec


class SingleTypeKVCacheManager:
    """Full attention: every block of the context stays until the request ends."""

    def __init__(self, spec: KVCacheGroupSpec, group_id: int, block_pool: BlockPool, block_size: int) -> None:
        self.spec = spec
        self.group_id = group_id
        self.block_pool = block_pool
        self.block_size = block_size
        # request id -> its blocks in this group, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are registered in the prefix cache (or
        # are null: nothing to register there).
        self.num_cached_blocks: dict[str, int] = {}

    # ---- prefix cache ----------------------------------------------------------------------

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The blocks of the longest prefix of at most `max_num_blocks` blocks this group can
        take from the cache: for full attention every block of it must be cached."""
        pool, group = self.block_pool, self.group_id
        blocks: list[KVCacheBlock] = []
        for block_hash in block_hashes[:max_num_blocks]:
            block = pool.get_cached_block(block_hash, group)
            if block is None:
                break  # the chain is a prefix: nothing after a miss can match
            blocks.append(block)
        return blocks

    def cache_blocks(self, req_id: str, block_hashes: list[BlockHash], num_computed_tokens: int) -> None:
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(block_hashes), len(blocks))
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(blocks, block_hashes, num_cached, num_full, self.group_id)
            self.num_cached_blocks[req_id] = num_full

    # ---- allocation ------------------------------------------------------------------------

    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, new_computed: list[KVCacheBlock]) -> int:
        """Blocks this group takes from the free queue to hold `num_tokens` tokens: new ones, and
        hit blocks that sit in the free queue (touching them takes them out of it)."""
        held = len(self.req_to_blocks.get(req_id, ()))
        num_new = cdiv(num_tokens, self.block_size) - held - len(new_computed)
        null = self.block_pool.null_block
        num_free_hits = sum(1 for b in new_computed if b.ref_cnt == 0 and b is not null)
        return max(num_new, 0) + num_free_hits

    def save_new_computed_blocks(self, req_id: str, new_computed: list[KVCacheBlock]) -> None:
        """Take the prefix hit of a request being admitted."""
        assert req_id not in self.req_to_blocks, "a prefix hit is only taken at admission"
        self.block_pool.touch(new_computed)
        self.req_to_blocks[req_id] = list(new_computed)
        self.num_cached_blocks[req_id] = len(new_computed)

    def allocate_new_blocks(self, req_id: str, num_tokens: int) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(req_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.block_pool.get_new_blocks(num_new, self.group_id)
        blocks.extend(new_blocks)
        return new_blocks

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Full attention never gives a block back before the request ends."""

    def free(self, req_id: str) -> None:
        """Give back the request's blocks, tail first: the free queue is LRU, so the request's last
        blocks are evicted before its first ones. Later blocks are reachable in the hash chain only
        through earlier ones, and a long prefix is shared less often than its start, so evicting
        from the tail keeps the most useful entries the longest."""
        blocks = self.req_to_blocks.pop(req_id, None)
        self.num_cached_blocks.pop(req_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    # ---- sizing ----------------------------------------------------------------------------

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once in this group when
        its steps compute at most `max_chunk` tokens each."""
        return cdiv(num_tokens, self.block_size)


FullAttentionManager = SingleTypeKVCacheManager


class SlidingWindowManager(SingleTypeKVCacheManager):
    """Sliding window W: the query at position p reads keys p - W < j <= p, so once a request has
    computed n tokens no later query reads a key before n - W + 1, and the blocks wholly before it
    go back to the pool (`remove_skipped_blocks`), leaving the null block in their entries.

    One block of slack is kept behind the window: a margin against an off-by-one between this
    arithmetic and a kernel's mask (whether the window's far edge is inclusive is the classic
    one). It costs one block per request and group; with W a multiple of block_size a request
    then holds at most W / block_size + 2 blocks here at any step (W / block_size + 1 of window
    and slack, plus the block the next token opens)."""

    SLACK_BLOCKS = 1

    def __init__(self, spec: KVCacheGroupSpec, group_id: int, block_pool: BlockPool, block_size: int) -> None:
        super().__init__(spec, group_id, block_pool, block_size)
        assert spec.sliding_window is not None and block_pool.null_block is not None
        self.sliding_window: int = spec.sliding_window
        self.null_block: KVCacheBlock = block_pool.null_block
        # Blocks a prefix hit ending at a block boundary h must find cached: those holding the
        # keys h - W + 1 .. h - 1 that the first computed query (at h) reads.
        self.num_window_blocks = cdiv(self.sliding_window - 1, block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash], max_num_blocks: int) -> list[KVCacheBlock]:
        """The longest hit of at most `max_num_blocks` blocks whose last `num_window_blocks`
        blocks (or all of them, for a shorter hit) are cached; the blocks before those are not
        needed and come back as null entries. Unlike full attention, a shorter hit is not
        implied by a longer one, so the search walks back from the longest candidate."""
        pool, group, need = self.block_pool, self.group_id, self.num_window_blocks
        if need == 0:  # a window of one token reads only the query's own key
            return [self.null_block] * max_num_blocks
        run: list[KVCacheBlock] = []  # cached blocks found, from the right, contiguous
        for i in range(max_num_blocks - 1, -1, -1):
            block = pool.get_cached_block(block_hashes[i], group)
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= need:
                end = i + len(run)
                run.reverse()
                return [self.null_block] * i + run[:end - i]
        run.reverse()
        return run  # reached block 0: a hit shorter than the window, all of it cached

    def remove_skipped_blocks(self, req_id: str, num_computed_tokens: int) -> None:
        """Give back the blocks wholly before the window of the next query (at
        `num_computed_tokens`), less the slack. They are freed tail first, as `free` does, so
        that eviction takes the later of them first, the order the full-attention groups' blocks
        go in: a prefix hit then shrinks from its end in every group alike."""
        first_needed = num_computed_tokens - self.sliding_window + 1
        num_skipped = first_needed // self.block_size - self.SLACK_BLOCKS
        if num_skipped <= 0:
            return
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        null = self.null_block
        removed = []
        # The null entries are a prefix: walk back from the last skipped block to the first null.
        for i in range(min(num_skipped, len(blocks)) - 1, -1, -1):
            if blocks[i] is null:
                break
            removed.append(blocks[i])
            blocks[i] = null
        if removed:
            self.block_pool.free_blocks(removed)

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        # The window (less one token) and its slack behind a step's chunk, the chunk itself, and
        # one block for the chunk's misalignment.
        span = self.sliding_window - 1 + max_chunk
        return min(cdiv(num_tokens, self.block_size), cdiv(span, self.block_size) + 1 + self.SLACK_BLOCKS)


def make_manager(spec: KVCacheGroupSpec, group_id: int, block_pool: BlockPool, block_size: int
                 ) -> SingleTypeKVCacheManager:
    cls = FullAttentionManager if spec.sliding_window is None else SlidingWindowManager
    return cls(spec, group_id, block_pool, block_size)
