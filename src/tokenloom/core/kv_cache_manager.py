"""Where each request's tokens live: its list of blocks, prefix-cache lookups and accounting.

The scheduler decides who runs and asks this manager for blocks through a narrow interface
(`get_computed_blocks`, `allocate_slots`, `cache_blocks`, `free`); it never touches the pool's
free queue.
"""
from __future__ import annotations

from tokenloom.core.block_pool import BlockPool, KVCacheBlock
from tokenloom.core.kv_cache_utils import cdiv
from tokenloom.core.request import Request


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        max_model_len: int | None = None,
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_prefix_caching
        self.max_model_len = max_model_len if max_model_len is not None else num_blocks * block_size
        self.block_pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        # request id -> its blocks, in token order.
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> how many of its leading blocks are registered in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Cumulative, in tokens (vLLM's convention): tokens looked up at admission and tokens hit.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- prefix cache ----------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks at the start of the request's tokens, and the
        number of tokens they hold. Read-only: nothing is referenced until `allocate_slots`.

        The last token is never taken from the cache: the step must run the model on at least
        one token to get the logits that sample the next one. Backing off by a single token is
        not enough, though: that token would be recomputed *into a shared cached block*, and a
        block shared by prefix must stay read-only. So the hit stops at the last full block that
        ends before the final token: at most (num_tokens - 1) // block_size blocks. A 32-token
        prompt with blocks of 16 that is fully cached hits 16 tokens and recomputes 16.
        """
        # Prompt logprobs need the logits of every prompt position, so such a request computes its
        # whole prompt (it still publishes its blocks for others).
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break  # the chain is a prefix: nothing after a miss can match
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register the request's blocks that are full once `num_computed_tokens` are computed.
        Called at admission for the step about to compute them (the attention backends write a
        layer's new K/V for the whole batch before reading any) and after each step."""
        if not self.enable_caching:
            return
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id)
        if blocks is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        num_cached = self.num_cached_blocks.get(req_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(blocks, request.block_hashes, num_cached, num_full)
            self.num_cached_blocks[req_id] = num_full

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    # ---- allocation ------------------------------------------------------------------------

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed ones
        (`request.num_computed_tokens` plus the tokens held by `new_computed_blocks`, the prefix
        hit of a request being admitted). Returns the ids of the blocks newly taken from the free
        queue (possibly empty), or None, with nothing changed, when there are not enough."""
        req_id = request.request_id
        computed = new_computed_blocks or []
        req_blocks = self.req_to_blocks.get(req_id, [])
        num_tokens_after = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        if num_tokens_after > self.max_model_len:
            raise ValueError(f"request {req_id} would hold {num_tokens_after} tokens > max_model_len")
        num_new_blocks = cdiv(num_tokens_after, self.block_size) - len(req_blocks) - len(computed)

        # Hit blocks sitting in the free queue leave it when touched, so they are not available
        # for the new blocks.
        num_free_hits = sum(1 for block in computed if block.ref_cnt == 0)
        if num_new_blocks > self.block_pool.num_free_blocks - num_free_hits:
            return None

        first_allocation = req_id not in self.req_to_blocks
        if first_allocation and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += len(computed) * self.block_size
        if computed:
            assert not req_blocks, "a prefix hit is only taken at admission"
            self.block_pool.touch(computed)
            self.num_cached_blocks[req_id] = len(req_blocks) + len(computed)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        self.req_to_blocks[req_id] = req_blocks + computed + new_blocks
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        """Give back the request's blocks. They are freed tail first: the free queue is LRU, so
        the request's last blocks are evicted before its first ones. Later blocks are reachable
        in the hash chain only through earlier ones, and a long prefix is shared less often than
        its start, so evicting from the tail keeps the most useful entries the longest."""
        blocks = self.req_to_blocks.pop(request.request_id, None)
        self.num_cached_blocks.pop(request.request_id, None)
        if blocks:
            self.block_pool.free_blocks(reversed(blocks))

    # ---- introspection ---------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]

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
