import pytest

from tokenloom.core.block_pool import BlockPool, FreeBlockQueue, KVCacheBlock
from tokenloom.core.kv_cache_utils import ROOT_BLOCK_HASH, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_order_and_o1_ops():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert len(q) == 5 and ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    q.remove(blocks[2])  # from the middle
    assert ids(q.get_all_free_blocks()) == [0, 1, 3, 4]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    assert q.popleft() is blocks[0]
    q.remove(blocks[4])  # the tail
    q.append(blocks[0])
    q.append(blocks[2])
    assert ids(q.get_all_free_blocks()) == [1, 3, 0, 2]
    assert ids(q.popleft_n(2)) == [1, 3]
    assert len(q) == 2
    with pytest.raises(ValueError):
        q.popleft_n(3)
    with pytest.raises(ValueError):
        q.remove(blocks[1])  # not in the queue
    q.popleft_n(2)
    with pytest.raises(ValueError):
        q.popleft()


def test_ref_counting_and_accounting():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.num_free_blocks == 4 and pool.num_used_blocks == 2 and pool.usage == pytest.approx(2 / 6)
    pool.touch(a)  # a second owner
    pool.free_blocks(a)
    assert pool.num_free_blocks == 4  # still owned once
    pool.free_blocks(a)
    assert pool.num_free_blocks == 6 and pool.num_used_blocks == 0
    with pytest.raises(ValueError):
        pool.free_blocks(a[:1])  # double free
    with pytest.raises(ValueError):
        pool.get_new_blocks(7)
    assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks


def test_freed_blocks_go_to_tail_in_given_order():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(4)
    pool.free_blocks(reversed(blocks[:2]))  # a request's blocks, tail first
    pool.free_blocks(blocks[2:])
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 0, 2, 3]
    assert ids(pool.get_new_blocks(1)) == [1]


def test_cached_block_is_revived_by_touch_and_evicted_lazily():
    pool = BlockPool(3)
    h0 = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2])
    h1 = hash_block_tokens(h0, [3, 4])
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [h0, h1], 0, 2)
    assert pool.get_cached_block(h0) is blocks[0] and pool.get_cached_block(h1) is blocks[1]
    pool.free_blocks(reversed(blocks))
    # Free but still cached.
    assert pool.num_free_blocks == 3 and pool.num_cached_free_blocks == 2
    assert pool.get_cached_block(h0) is blocks[0]

    # A hit revives it: out of the free queue, referenced.
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1 and pool.num_free_blocks == 2 and pool.num_cached_free_blocks == 1
    assert blocks[0] not in pool.free_block_queue.get_all_free_blocks()
    pool.free_blocks([blocks[0]])

    # Queue is now [2 (never used), 1 (h1), 0 (h0)]: handing out 2 evicts nothing, then 1 evicts h1.
    assert ids(pool.get_new_blocks(1)) == [2]
    assert pool.get_cached_block(h1) is blocks[1]
    got = pool.get_new_blocks(1)
    assert got == [blocks[1]] and blocks[1].block_hash is None and pool.get_cached_block(h1) is None
    assert pool.get_cached_block(h0) is blocks[0] and pool.num_cached_free_blocks == 1


def test_duplicate_hash_stays_private():
    pool = BlockPool(2)
    h = hash_block_tokens(ROOT_BLOCK_HASH, [5, 6])
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [h], 0, 1)
    pool.cache_full_blocks([b], [h], 0, 1)
    assert pool.get_cached_block(h) is a and b.block_hash is None
    pool.free_blocks([b, a])
    assert pool.num_cached_free_blocks == 1


def test_caching_disabled_and_reset():
    pool = BlockPool(2, enable_caching=False)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [hash_block_tokens(ROOT_BLOCK_HASH, [1])], 0, 1)
    assert blocks[0].block_hash is None

    pool = BlockPool(2)
    h = hash_block_tokens(ROOT_BLOCK_HASH, [1])
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert not pool.reset_prefix_cache()  # a block is in use
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(h) is None and pool.num_cached_free_blocks == 0


def test_hash_chain_depends_on_parent_and_tokens():
    h = hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3])
    assert h == hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 3])
    assert h != hash_block_tokens(ROOT_BLOCK_HASH, [1, 2, 4])
    assert hash_block_tokens(h, [1, 2, 3]) != h
