from sched_helpers import make_request

from tokenloom.core.kv_cache_manager import KVCacheManager

BS = 4


def admit(kv: KVCacheManager, request, num_new_tokens=None):
    """Admission as the scheduler does it, then mark the prompt computed and cache its blocks."""
    blocks, num_hit = kv.get_computed_blocks(request)
    if num_new_tokens is None:
        num_new_tokens = request.num_tokens - num_hit
    new_ids = kv.allocate_slots(request, num_new_tokens, blocks)
    assert new_ids is not None
    request.num_computed_tokens = num_hit + num_new_tokens
    kv.cache_blocks(request, request.num_computed_tokens)
    return num_hit, new_ids


def hashed(req):
    req.enable_block_hashing(BS)
    return req


def test_prefix_hit_on_shared_prefix_and_counters():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True, max_model_len=64)
    shared = list(range(100, 110))  # 2 full blocks + 2 tokens
    a = hashed(make_request("a", shared + [1, 1, 1]))
    b = hashed(make_request("b", shared + [9, 9, 9, 9, 9]))
    num_hit, _ = admit(kv, a)
    assert num_hit == 0
    assert kv.prefix_cache_queries == 13 and kv.prefix_cache_hits == 0
    num_hit, _ = admit(kv, b)
    assert num_hit == 8  # the two full shared blocks
    assert kv.get_block_ids("b")[0][:2] == kv.get_block_ids("a")[0][:2]
    assert kv.get_block_ids("b")[0][2] != kv.get_block_ids("a")[0][2]
    assert [blk.ref_cnt for blk in kv.get_blocks("b")[0][:2]] == [2, 2]
    assert kv.prefix_cache_queries == 13 + 15 and kv.prefix_cache_hits == 8


def test_full_hit_recomputes_last_block():
    kv = KVCacheManager(num_blocks=16, block_size=BS, enable_prefix_caching=True, max_model_len=64)
    prompt = list(range(200, 208))  # exactly 2 blocks
    a = hashed(make_request("a", prompt))
    admit(kv, a)
    kv.free(a)
    b = hashed(make_request("b", prompt))
    blocks, num_hit = kv.get_computed_blocks(b)
    # Both blocks are cached, but the last token must be computed to get logits, and it may not
    # be written into a shared block: the hit backs off a whole block.
    assert num_hit == 4 and len(blocks[0]) == 1
    # Not block aligned: 9 tokens, 2 full cached blocks, both usable (token 9 is in a 3rd block).
    c = hashed(make_request("c", prompt + [5]))
    assert kv.get_computed_blocks(c)[1] == 8


def test_allocation_failure_has_no_side_effects():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True, max_model_len=64)
    prompt = list(range(300, 308))
    a = hashed(make_request("a", prompt + [1]))
    admit(kv, a)  # 3 blocks, 2 cached
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.num_cached_free_blocks == 2
    big = hashed(make_request("big", prompt + list(range(12))))  # 20 tokens: 5 blocks
    blocks, num_hit = kv.get_computed_blocks(big)
    assert num_hit == 8
    free_before = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    stats_before = (kv.prefix_cache_queries, kv.prefix_cache_hits)
    assert kv.allocate_slots(big, 12, blocks) is None
    assert [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()] == free_before
    assert all(b.ref_cnt == 0 for b in blocks[0]) and kv.num_cached_free_blocks == 2
    assert kv.get_block_ids("big") == ([],) and "big" not in kv.managers[0].req_to_blocks
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == stats_before


def test_free_hit_blocks_are_not_counted_as_free_for_new_blocks():
    kv = KVCacheManager(num_blocks=3, block_size=BS, enable_prefix_caching=True, max_model_len=64)
    prompt = list(range(400, 409))
    a = hashed(make_request("a", prompt))
    admit(kv, a)
    kv.free(a)  # 3 free blocks, 2 of them cached
    b = hashed(make_request("b", prompt[:8] + list(range(8))))  # 16 tokens: needs 2 hit + 2 new
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8
    assert kv.allocate_slots(b, 8, blocks) is None
    c = hashed(make_request("c", prompt[:8] + [1, 2, 3]))  # needs 2 hit + 1 new
    blocks, num_hit = kv.get_computed_blocks(c)
    new_ids = kv.allocate_slots(c, 3, blocks)
    assert new_ids is not None and len(new_ids[0]) == 1
    assert kv.num_free_blocks == 0


def test_freed_then_reused_cached_blocks_and_lazy_eviction():
    kv = KVCacheManager(num_blocks=4, block_size=BS, enable_prefix_caching=True, max_model_len=64)
    a = hashed(make_request("a", list(range(500, 509))))  # 3 blocks, 2 full
    admit(kv, a)
    a_ids = kv.get_block_ids("a")[0]
    kv.free(a)
    # Freed tail first: the partial last block, then the 2nd, then the 1st.
    free_order = [b.block_id for b in kv.block_pool.free_block_queue.get_all_free_blocks()]
    assert free_order == [3, a_ids[2], a_ids[1], a_ids[0]]

    # Reuse by a request with the same prefix.
    b = hashed(make_request("b", list(range(500, 509))))
    num_hit, _ = admit(kv, b)
    assert num_hit == 8 and kv.get_block_ids("b")[0][:2] == a_ids[:2]
    kv.free(b)

    # Unrelated requests take blocks from the head; the cached prefix goes last, tail block first.
    c = hashed(make_request("c", list(range(600, 612))))  # 3 blocks
    admit(kv, c)
    assert kv.num_cached_free_blocks == 1  # a's 2nd block was evicted, its 1st survives
    assert kv.block_pool.get_cached_block(a.block_hashes[0]) is not None
    assert kv.block_pool.get_cached_block(a.block_hashes[1]) is None


def test_prefix_caching_disabled():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=False, max_model_len=64)
    a = make_request("a", list(range(8)))
    admit(kv, a)
    kv.free(a)
    b = make_request("b", list(range(8)))
    assert kv.get_computed_blocks(b) == (([],), 0)
    assert kv.num_cached_free_blocks == 0 and kv.prefix_cache_queries == 0


def test_incremental_allocation_and_hash_chain_of_outputs():
    kv = KVCacheManager(num_blocks=8, block_size=BS, enable_prefix_caching=True, max_model_len=64)
    a = hashed(make_request("a", [1, 2, 3]))
    admit(kv, a)
    assert len(kv.get_blocks("a")[0]) == 1 and a.block_hashes == []
    a.append_output_token_ids(4)  # block 0 is now full of known tokens
    assert len(a.block_hashes) == 1
    assert kv.allocate_slots(a, 1) == ([],)  # position 3 still fits block 0
    a.num_computed_tokens += 1
    kv.cache_blocks(a, a.num_computed_tokens)
    assert kv.block_pool.get_cached_block(a.block_hashes[0]) is kv.get_blocks("a")[0][0]
    a.append_output_token_ids(5)
    assert len(kv.allocate_slots(a, 1)[0]) == 1  # position 4 needs a second block
    assert kv.usage == 2 / 8
    kv.free(a)
    assert kv.num_free_blocks == 8 and kv.get_block_ids("a") == ([],)
