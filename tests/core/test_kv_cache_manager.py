from sched_helpers import make_request

from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.messages import FinishReason

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


# ---- hybrid models: a full-attention group and sliding-window groups sharing one pool -----------

from sched_helpers import check_block_invariants, hybrid_groups, make_scheduler, run_step  # noqa: E402

from tokenloom.core.kv_cache_utils import cdiv  # noqa: E402
from tokenloom.core.request import RequestStatus  # noqa: E402
from tokenloom.kv_cache_spec import KVCacheGroupSpec, kv_cache_groups  # noqa: E402
from tokenloom.sched_output import WaitReason  # noqa: E402


def real_blocks(kv, req_id):
    """Per group, the blocks the request really holds (null entries left out)."""
    return kv.num_held_blocks(req_id)


def test_gemma3_grouping_and_full_only_models_keep_one_group():
    class Cfg:
        num_hidden_layers = 18
        sliding_window = 512
        layer_types = tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))

    groups = kv_cache_groups(Cfg)
    # Three full layers (5, 11, 17) and fifteen sliding ones: six groups of three layers.
    assert [g.sliding_window for g in groups] == [None] + [512] * 5
    assert groups[0].layer_ids == (5, 11, 17)
    assert all(len(g.layer_ids) == 3 for g in groups)
    assert sorted(i for g in groups for i in g.layer_ids) == list(range(18))

    class Llama:
        num_hidden_layers = 30
        sliding_window = None
        layer_types = None

    assert kv_cache_groups(Llama) == [KVCacheGroupSpec(tuple(range(30)), None)]
    s = make_scheduler(num_blocks=64)
    # One group: no null block, every block usable, no per-group stats.
    assert s.kv_cache_manager.block_pool.null_block is None and s.kv_cache_manager.num_usable_blocks == 64
    s.add_request(make_request("a", 10))
    _, outs = run_step(s)
    assert outs.scheduler_stats.kv_cache_group_used_blocks == []


def test_long_generation_holds_a_window_of_blocks_in_each_sliding_group():
    """3,000 tokens at batch 1 (a 40-token prompt, then decodes): at every step each sliding group
    holds at most window / block_size + 2 blocks; the full group grows with the context."""
    window, bs = 32, 4
    s = make_scheduler(num_blocks=1024, block_size=bs, max_model_len=4096, max_num_batched_tokens=16,
                       kv_cache_groups=hybrid_groups(window, 2))
    kv = s.kv_cache_manager
    s.add_request(make_request("a", 40, max_tokens=2960, eos_token_id=None))
    bound = window // bs + 2
    peak = [0, 0, 0]
    for _ in range(4000):
        if not s.has_unfinished_requests():
            break
        so = s.schedule()
        for when in ("scheduled", "updated"):
            if "a" in s.requests:
                held = real_blocks(kv, "a")
                n = s.requests["a"].num_computed_tokens
                assert held[0] == cdiv(n, bs), (when, n, held)  # full attention: the whole context
                assert max(held[1:]) <= bound, (when, n, held)
                peak = [max(p, h) for p, h in zip(peak, held)]
            if when == "scheduled":
                from sched_helpers import fake_runner_output
                s.update_from_output(so, fake_runner_output(s, so))
        check_block_invariants(s)
    assert not s.requests and peak[0] == 3000 // bs and peak[1] == bound
    # No leak: every block is back, in every group.
    assert kv.num_free_blocks == kv.num_usable_blocks and kv.num_used_blocks_per_group == [0, 0, 0]


def test_chunked_prefill_of_a_long_prompt_needs_only_the_window_in_sliding_groups():
    """A 2,000-token prompt in chunks of 64 fits a pool that could not hold it in every group:
    the sliding groups need the window and one chunk, not the prompt."""
    window, bs = 32, 4
    groups = hybrid_groups(window, 2)
    full_need = cdiv(2001, bs)
    s = make_scheduler(num_blocks=full_need + 2 * 30, block_size=bs, max_model_len=4096,
                       max_num_batched_tokens=64, kv_cache_groups=groups)
    assert full_need * 3 > s.kv_cache_manager.num_usable_blocks
    s.add_request(make_request("long", 2000, max_tokens=1))
    for _ in range(40):
        so, outs = run_step(s)
        check_block_invariants(s)
        if outs.outputs:
            break
    assert outs.outputs[0].finished and outs.outputs[0].finish_reason is not None
    assert outs.outputs[0].error is None


def test_hybrid_prefix_hit_needs_the_window_before_the_hit_point():
    window, bs = 8, 4
    kv = KVCacheManager(num_blocks=64, block_size=bs, enable_prefix_caching=True, max_model_len=256,
                        kv_cache_groups=hybrid_groups(window, 2))
    prompt = list(range(1000, 1030))  # 30 tokens: 7 full blocks
    a = hashed(make_request("a", prompt))
    admit(kv, a)
    kv.remove_skipped_blocks(a)  # the windows move past the early blocks, which stay cached
    assert real_blocks(kv, "a")[1] < cdiv(30, bs)
    kv.free(a)
    b = hashed(make_request("b", prompt + [7, 7]))
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 28  # every group found what it needs: 7 blocks
    null = kv.block_pool.null_block
    need = cdiv(window - 1, bs)  # blocks the first query's window reads in a sliding group
    for sliding in blocks[1:]:
        assert sliding[: 7 - need] == [null] * (7 - need) and null not in sliding[7 - need:]
    assert null not in blocks[0]
    admit(kv, b)
    assert kv.prefix_cache_hits == 28

    # A sliding group missing a block inside the window cuts the hit back to where its window is
    # whole again (here: block 5 of group 2 evicted -> the hit may end at 5 blocks at most).
    kv.free(b)
    victim = kv.block_pool.get_cached_block(b.block_hashes[5], 2)
    kv.block_pool.free_block_queue.remove(victim)
    kv.block_pool._evict(victim)
    kv.block_pool.free_block_queue.append(victim)
    c = hashed(make_request("c", prompt + [7, 7]))
    blocks, num_hit = kv.get_computed_blocks(c)
    assert num_hit == 5 * bs and all(len(g) == 5 for g in blocks)


def test_hybrid_prefix_hits_occur_on_shared_prompts_in_the_scheduler():
    window, bs = 16, 4
    s = make_scheduler(num_blocks=200, block_size=bs, max_num_batched_tokens=256,
                       kv_cache_groups=hybrid_groups(window, 2))
    shared = list(range(5000, 5100))  # 100 shared tokens, longer than the window
    s.add_request(make_request("a", shared + [1, 2, 3], max_tokens=4))
    while s.has_unfinished_requests():
        run_step(s)
    s.add_request(make_request("b", shared + [4, 5, 6], max_tokens=4))
    so, _ = run_step(s)
    assert so.scheduled_new_reqs[0].num_computed_tokens == 100
    assert s.kv_cache_manager.prefix_cache_hits == 100
    check_block_invariants(s)


def test_hybrid_preemption_frees_every_group_and_outputs_match():
    """Two long decodes in a pool too small for both: the later one is preempted (it then holds
    nothing in any group), resumes, and its greedy tokens equal those of an unpreempted run."""
    import zlib
    from array import array

    def greedy(req_id):
        r = s.requests[req_id]
        return 3 + zlib.crc32(array("q", r.all_token_ids).tobytes()) % 50

    results = {}
    for num_blocks in (400, 40):
        s = make_scheduler(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16,
                           kv_cache_groups=hybrid_groups(8, 2))
        assert s.max_request_len >= 80  # each request fits alone, so nothing is cut short
        s.add_request(make_request("a", list(range(100, 120)), max_tokens=60, eos_token_id=None))
        s.add_request(make_request("b", list(range(200, 220)), max_tokens=60, eos_token_id=None))
        tokens: dict[str, list[int]] = {"a": [], "b": []}
        preempted = 0
        while s.has_unfinished_requests():
            so, outs = run_step(s, greedy)
            for req_id, reason in so.wait_reasons.items():
                if reason == WaitReason.PREEMPTED:
                    preempted += 1
                    assert s.requests[req_id].status == RequestStatus.PREEMPTED
                    assert s.kv_cache_manager.num_held_blocks(req_id) == [0, 0, 0]
            check_block_invariants(s)
            for o in outs.outputs:
                tokens[o.request_id] += o.new_token_ids
        assert (preempted > 0) == (num_blocks == 40)
        results[num_blocks] = tokens
        assert s.kv_cache_manager.num_free_blocks == s.kv_cache_manager.num_usable_blocks
    assert results[40] == results[400]


def test_hybrid_admission_counts_every_group_and_stats_break_down_by_group():
    window, bs = 8, 4
    s = make_scheduler(num_blocks=21, block_size=bs, max_num_batched_tokens=64, max_model_len=1024,
                       kv_cache_groups=hybrid_groups(window, 2))
    kv = s.kv_cache_manager
    assert kv.num_usable_blocks == 20  # block 0 is the null block
    # A 40-token prompt in one chunk needs 10 blocks in each of three groups: never fits.
    s.add_request(make_request("big", 40))
    _, outs = run_step(s)
    assert outs.outputs[0].finish_reason == FinishReason.ERROR and "needs 30 KV cache blocks" in outs.outputs[0].error
    # Two 20-token prompts need 5 blocks per group each: the second waits for blocks.
    s.add_request(make_request("a", 20, max_tokens=3, eos_token_id=None))
    s.add_request(make_request("b", 24, max_tokens=3, eos_token_id=None))
    so, outs = run_step(s)
    stats = outs.scheduler_stats
    assert so.wait_reasons == {"b": WaitReason.NO_KV_BLOCKS}
    assert stats.kv_cache_group_wanted_blocks == [6, 6, 6]
    assert sum(stats.kv_cache_group_used_blocks) == stats.num_used_blocks
    assert stats.kv_cache_group_used_blocks[0] == 5 and stats.num_total_blocks == 20
    assert stats.num_free_blocks + stats.num_used_blocks == stats.num_total_blocks


def test_window_blocks_are_freed_tail_first_and_stay_cached():
    """A 40-token prefill with window 8 and blocks of 4: the sliding groups keep the window (two
    blocks), one block of slack and the open block, and give back blocks 0-6 tail first, still
    cached: eviction takes block 6 first, block 0 last, as a full group's freed blocks go."""
    kv = KVCacheManager(num_blocks=64, block_size=BS, enable_prefix_caching=True, max_model_len=256,
                        kv_cache_groups=hybrid_groups(8, 1))
    a = hashed(make_request("a", list(range(700, 741))))
    admit(kv, a, num_new_tokens=40)
    blocks = list(kv.get_blocks("a")[1])
    kv.remove_skipped_blocks(a)
    null = kv.block_pool.null_block
    # The next query (position 40) reads keys 33..40: blocks 8-10 (block 8 from 32), slack block 7.
    assert kv.get_blocks("a")[1][:7] == [null] * 7 and null not in kv.get_blocks("a")[1][7:]
    freed = kv.block_pool.free_block_queue.get_all_free_blocks()[-7:]
    assert freed == blocks[6::-1] and all(b.block_hash is not None for b in freed)
    # A short hit (shorter than the window) needs every block from the start, and finds them.
    b = hashed(make_request("b", list(range(700, 706))))
    got, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 4 and got[1] == blocks[:1]
