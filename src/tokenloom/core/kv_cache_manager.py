"""Where each request's tokens live: its blocks in every KV cache group, prefix-cache lookups and
accounting.

The scheduler decides who runs and asks this manager for blocks through a narrow interface
(`get_computed_blocks`, `allocate_slots`, `cache_blocks`, `remove_skipped_blocks`, `free`); it
never touches the pool's free queue.

Groups (kv_cache_spec.py). A model with full attention only has one group, and everything here
is the single-list bookkeeping it always was (its block lists come as 1-tuples). A model with
sliding-window layers has several groups sharing one `BlockPool`; each group's
`SingleTypeKVCacheManager` keeps its own block list per request, and this class coordinates them:
  * admission and growth are all or nothing: `allocate_slots` sums what every group needs
    (a sliding group only the window and the new chunk, not the whole context) and takes nothing
    unless the pool has it all;
  * a prefix hit must serve every group: the hit length is the longest for which each group
    finds what it needs (the whole prefix for full attention, the blocks of the window before
    the hit point for a sliding window);
  * as a request advances, `remove_skipped_blocks` gives the sliding groups' out-of-window
    blocks back (a model without sliding groups does not even loop);
  * `free` (a finished or preempted request) empties every group.
"""
from __future__ import annotations

from tokenloom.core.block_pool import BlockPool, KVCacheBlock
from tokenloom.core.request import Request
from tokenloom.core.single_type_kv_cache_manager import SingleTypeKVCacheManager, SlidingWindowManager, make_manager
from tokenloom.kv_cache_spec import KVCacheGroupSpec

# One list of blocks per KV cache group, in group order (vLLM's KVCacheBlocks.blocks).
GroupBlocks = tuple[list[KVCacheBlock], ...]
GroupBlockIds = tuple[list[int], ...]


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
        kv_cache_groups: list[KVCacheGroupSpec] | None = None,
    ) -> None:
        groups = kv_cache_groups or [KVCacheGroupSpec(layer_ids=())]
        self.kv_cache_groups = groups
        self.num_groups = len(groups)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        hybrid = any(g.sliding_window is not None for g in groups)
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching,
                                    use_null_block=hybrid, num_groups=len(groups))
        # Blocks requests can hold (all but the null block, when there is one).
        self.num_usable_blocks = self.block_pool.num_usable_blocks
        self.max_model_len = max_model_len if max_model_len is not None else num_blocks * block_size
        self.managers: list[SingleTypeKVCacheManager] = [
            make_manager(spec, g, self.block_pool, block_size) for g, spec in enumerate(groups)]
        self._sliding_managers = [m for m in self.managers if isinstance(m, SlidingWindowManager)]
        # Cumulative, in tokens (vLLM's convention): tokens looked up at admission and tokens hit.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Blocks per group that the last refused `allocate_slots` asked for (the ledger's view of
        # what a request left waiting for KV blocks waits for).
        self.last_refused_need: tuple[int, ...] = ()

    def empty_blocks(self) -> GroupBlocks:
        return tuple([] for _ in range(self.num_groups))

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[GroupBlocks, int]:
        """The longest prefix of the request's tokens that every group can take from the cache
        (per group its blocks, null entries where a sliding window does not need one), and the
        number of tokens it holds. Read-only: nothing is referenced until `allocate_slots`.

        The last token is never taken from the cache: the step must run the model on at least
        one token to get the logits that sample the next one. Backing off by a single token is
        not enough, though: that token would be recomputed *into a shared cached block*, and a
        block shared by prefix must stay read-only. So the hit stops at the last full block that
        ends before the final token: at most (num_tokens - 1) // block_size blocks. A 32-token
        prompt with blocks of 16 that is fully cached hits 16 tokens and recomputes 16.

        With several groups the candidate length only shrinks: each group in turn cuts it to what
        it can serve, until a whole pass agrees (full attention's hits are prefix-closed, a
        window's are not, so a cut can make a sliding group look again further left).
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_blocks(), 0
        num_hit = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes
        if self.num_groups == 1:
            blocks = self.managers[0].find_longest_cache_hit(hashes, num_hit)
            return (blocks,), len(blocks) * self.block_size
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        while True:
            changed = False
            for g, manager in enumerate(self.managers):
                hits[g] = manager.find_longest_cache_hit(hashes, num_hit)
                if len(hits[g]) < num_hit:
                    num_hit, changed = len(hits[g]), True
            if not changed:
                break
        return tuple(blocks[:num_hit] for blocks in hits), num_hit * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full once `num_computed_tokens` are computed.
        Called at admission for the step about to compute them (the attention backends write a
        layer's new K/V for the whole batch before reading any) and after each step."""
        if not self.enable_caching:
            return
        for manager in self.managers:
            manager.cache_blocks(request.request_id, request.block_hashes, num_computed_tokens)

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: GroupBlocks | None = None,
    ) -> GroupBlockIds | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones
        (`request.num_computed_tokens` plus the tokens held by `new_computed_blocks`, the prefix
        hit of a request being admitted). Returns, per group, the ids of the blocks newly taken
        from the free queue (possibly empty), or None, with nothing changed, when there are not
        enough in the pool for all groups together."""
        req_id = request.request_id
        computed = new_computed_blocks if new_computed_blocks is not None else self.empty_blocks()
        num_hit_tokens = len(computed[0]) * self.block_size
        num_tokens_after = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        if num_tokens_after > self.max_model_len:
            raise ValueError(f"request {req_id} would hold {num_tokens_after} tokens > max_model_len")
        # Hit blocks sitting in the free queue leave it when touched, so each group counts them
        # with its new blocks.
        need = [m.num_blocks_to_allocate(req_id, num_tokens_after, computed[g])
                for g, m in enumerate(self.managers)]
        if sum(need) > self.block_pool.num_free_blocks:
            self.last_refused_need = tuple(need)
            return None

        first_allocation = req_id not in self.managers[0].req_to_blocks
        if first_allocation and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
        # Every group takes its hit before any group takes new blocks: a hit block waiting in
        # the free queue would otherwise be handed out (and evicted) as another group's new block.
        for g, manager in enumerate(self.managers):
            if computed[g]:
                manager.save_new_computed_blocks(req_id, computed[g])
        return tuple([b.block_id for b in manager.allocate_new_blocks(req_id, num_tokens_after)]
                     for manager in self.managers)

    def remove_skipped_blocks(self, request: Request) -> None:
        """Give back the sliding-window groups' blocks that no query of the request will read
        again, now that `request.num_computed_tokens` are computed (call it after the step, once
        its K/V are written and its full blocks cached, so that they stay in the prefix cache)."""
        for manager in self._sliding_managers:
            manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    def free(self, request: Request) -> None:
        """Give back the request's blocks in every group (each group tail first: see
        SingleTypeKVCacheManager.free)."""
        for manager in self.managers:
            manager.free(request.request_id)

    # ---- sizing ----------------------------------------------------------------------------

    def max_blocks_held(self, num_tokens: int, max_chunk: int) -> int:
        """The most blocks one request of `num_tokens` tokens holds at once (all groups), when its
        steps compute at most `max_chunk` tokens each."""
        return sum(m.max_blocks_held(num_tokens, max_chunk) for m in self.managers)

    def max_tokens_per_request(self, max_chunk: int) -> int:
        """The longest request the whole pool can hold on its own (at most max_model_len)."""
        if self.num_groups == 1:
            return min(self.max_model_len, self.num_usable_blocks * self.block_size)
        if self.max_blocks_held(self.max_model_len, max_chunk) <= self.num_usable_blocks:
            return self.max_model_len
        lo, hi = 0, self.max_model_len  # max_blocks_held grows with num_tokens: bisect
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.max_blocks_held(mid, max_chunk) <= self.num_usable_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo

    # ---- introspection ---------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> GroupBlocks:
        return tuple(m.req_to_blocks.get(request_id, []) for m in self.managers)

    def get_block_ids(self, request_id: str) -> GroupBlockIds:
        return tuple([b.block_id for b in m.req_to_blocks.get(request_id, ())] for m in self.managers)

    def num_held_blocks(self, request_id: str) -> list[int]:
        """Per group, the real (non-null) blocks the request holds."""
        null = self.block_pool.null_block
        return [sum(1 for b in m.req_to_blocks.get(request_id, ()) if b is not null) for m in self.managers]

    @property
    def num_used_blocks_per_group(self) -> list[int]:
        """Blocks in use per group (a block shared by prefix counts once)."""
        per_group = self.block_pool.num_used_per_group
        return list(per_group) if per_group is not None else [self.block_pool.num_used_blocks]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.block_pool.num_used_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self.block_pool.num_cached_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage
