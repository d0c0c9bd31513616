"""How many 2,048-token requests Gemma 3 holds at once at equal KV memory: the hybrid KV cache
manager (a full-attention group and five sliding-window groups sharing one pool; sliding groups
give back the blocks that leave the 512-token window) against treating every layer as full
attention (one group of all 18 layers).

No model runs: the real scheduler and KV cache manager take Gemma 3 270M's KV geometry (18
layers, one full-attention layer in six, window 512, 1 KV head, head_dim 256) and a fake token
source, as the scheduler tests do. The number of KV blocks of each layout comes from the same
byte budget and block bytes as the engine computes them (`kv_cache_bytes_per_block`: layers per
group x 2 x block_size x heads x head_dim x element size).

    python benchmarks/hybrid_kv_admission.py [--kv-gib 0.5] [--context 2048] [--budget 512]

Prints, for each layout: the KV blocks the budget buys; the capacity probe (requests of
`--context` prompt tokens arrive one at a time: how many hold their whole context when the cache
first runs out) against the theoretical count; a workload (`--num-requests` requests of
context - output-len prompt tokens generating output-len tokens: the most decoding at once, the
mean number running, preemptions, engine steps to finish); then a prefix-cache check on shared
prompts.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

from tokenloom.config import EngineConfig
from tokenloom.core.kv_cache_utils import cdiv
from tokenloom.core.request import Request
from tokenloom.core.scheduler import Scheduler
from tokenloom.kv_cache_spec import group_size, kv_cache_groups
from tokenloom.runner_output import ModelRunnerOutput
from tokenloom.sampling_params import SamplingParams


@dataclass
class Gemma3Geometry:
    num_hidden_layers: int = 18
    sliding_window: int | None = 512
    layer_types: tuple[str, ...] | None = tuple(
        "full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18))
    num_key_value_heads: int = 1
    head_dim: int = 256
    elem: int = 2  # bfloat16


def block_bytes(cfg: Gemma3Geometry, groups, block_size: int) -> int:
    return 2 * group_size(groups) * block_size * cfg.num_key_value_heads * cfg.head_dim * cfg.elem


def theoretical_blocks(groups, context: int, block_size: int) -> int:
    """Blocks one request holds at `context` tokens in steady decode (window blocks + slack +
    the block the next token opens, per sliding group)."""
    total = 0
    for g in groups:
        if g.sliding_window is None:
            total += cdiv(context, block_size)
        else:
            total += min(cdiv(context, block_size), g.sliding_window // block_size + 2)
    return total


def run(groups, num_blocks: int, args) -> dict:
    config = EngineConfig(block_size=args.block_size, max_num_batched_tokens=args.budget,
                          max_num_seqs=args.num_requests, enable_prefix_caching=True)
    s = Scheduler(config, num_kv_blocks=num_blocks, max_model_len=args.context + 16, kv_cache_groups=groups)
    prompt_len = args.context - args.output_len
    for i in range(args.num_requests):
        base = 100_000 * (i + 1)
        s.add_request(Request(f"r{i}", list(range(base, base + prompt_len)), SamplingParams(
            max_tokens=args.output_len, ignore_eos=True), None, arrival_time=float(i)))
    peak_full, running_sum, steps = 0, 0, 0
    while s.has_unfinished_requests():
        so = s.schedule()
        # Requests that hold their whole prompt and decode: their context is at its largest.
        decoding = sum(1 for r in s.running if r.num_computed_tokens > prompt_len)
        peak_full = max(peak_full, decoding)
        running_sum += len(s.running)
        steps += 1
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in req_ids]
        s.update_from_output(so, ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                                                   sampled_token_ids=sampled))
    kv = s.kv_cache_manager
    assert kv.num_free_blocks == kv.num_usable_blocks, "leaked blocks"
    return {"peak_decoding": peak_full, "mean_running": running_sum / steps, "steps": steps,
            "preemptions": s.num_preemptions}


def probe(groups, num_blocks: int, args) -> int:
    """Capacity: requests of `context` prompt tokens (that then decode on and on) arrive one at a
    time, the next as soon as the previous one is admitted; counts the requests holding at least
    `context` tokens when the cache first runs out (a request left waiting for KV blocks, or a
    preemption)."""
    config = EngineConfig(block_size=args.block_size, max_num_batched_tokens=args.budget,
                          max_num_seqs=1024, enable_prefix_caching=True)
    s = Scheduler(config, num_kv_blocks=num_blocks, max_model_len=args.context * 2, kv_cache_groups=groups)
    i = 0
    while True:
        if not s.waiting:
            base = 100_000 * (i + 1)
            s.add_request(Request(f"r{i}", list(range(base, base + args.context)), SamplingParams(
                max_tokens=args.context, ignore_eos=True), None, arrival_time=float(i)))
            i += 1
        so = s.schedule()
        if s.num_preemptions or so.blocked_reason is not None and so.blocked_reason.name == "NO_KV_BLOCKS":
            return sum(1 for r in s.running if r.num_computed_tokens >= args.context)
        req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
        sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in req_ids]
        s.update_from_output(so, ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: j for j, r in enumerate(req_ids)},
                                                   sampled_token_ids=sampled))


def prefix_check(groups, num_blocks: int, args) -> tuple[int, int]:
    """Two requests sharing a 1,536-token prefix, one after the other: prefix-cache hit tokens."""
    config = EngineConfig(block_size=args.block_size, max_num_batched_tokens=args.budget, enable_prefix_caching=True)
    s = Scheduler(config, num_kv_blocks=num_blocks, max_model_len=args.context + 16, kv_cache_groups=groups)
    shared = list(range(10_000, 10_000 + 1536))
    for i, tail in enumerate(([1] * 400, [2] * 400)):
        s.add_request(Request(f"p{i}", shared + tail, SamplingParams(max_tokens=8, ignore_eos=True), None, float(i)))
        while s.has_unfinished_requests():
            so = s.schedule()
            req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
            sampled = [[7] if s.requests[r].num_computed_tokens >= s.requests[r].num_tokens else [] for r in req_ids]
            s.update_from_output(so, ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: j for j, r in enumerate(req_ids)},
                                                       sampled_token_ids=sampled))
    return s.kv_cache_manager.prefix_cache_hits, s.kv_cache_manager.prefix_cache_queries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-gib", type=float, default=0.5)
    p.add_argument("--context", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=512, help="max_num_batched_tokens (the prefill chunk)")
    p.add_argument("--num-requests", type=int, default=96)
    args = p.parse_args(argv)
    cfg = Gemma3Geometry()
    hybrid = kv_cache_groups(cfg)
    full = kv_cache_groups(Gemma3Geometry(sliding_window=None, layer_types=None))
    budget = int(args.kv_gib * 1024**3)
    print(f"Gemma 3 270M KV geometry, {args.kv_gib} GiB of bfloat16 KV cache, block_size {args.block_size}, "
          f"contexts of {args.context} tokens ({args.context - args.output_len} prompt + {args.output_len} "
          f"generated), max_num_batched_tokens {args.budget}, {args.num_requests} requests")
    results = {}
    for name, groups in (("all layers full attention", full), ("hybrid (1 full + 5 sliding groups)", hybrid)):
        num_blocks = budget // block_bytes(cfg, groups, args.block_size)
        r = run(groups, num_blocks, args)
        r["held"] = probe(groups, num_blocks, args)
        per_req = theoretical_blocks(groups, args.context, args.block_size)
        theory = (num_blocks - (len(groups) > 1)) / per_req
        results[name] = (r, theory)
        print(f"{name:36s} blocks {num_blocks:6d} ({block_bytes(cfg, groups, args.block_size) // 1024} KiB each) | "
              f"{args.context}-token contexts held at once {r['held']:3d} (theory {theory:5.1f}, {per_req} "
              f"blocks/request) | workload: most decoding at once {r['peak_decoding']:3d}, mean running "
              f"{r['mean_running']:5.1f}, preemptions {r['preemptions']:4d}, steps {r['steps']:5d}")
    (rf, tf), (rh, th) = results.values()
    print(f"ratio hybrid / full: contexts held at once {rh['held'] / rf['held']:.2f}x (theoretical {th / tf:.2f}x); "
          f"workload: {rh['peak_decoding'] / rf['peak_decoding']:.2f}x most decoding at once, "
          f"{rh['mean_running'] / rf['mean_running']:.2f}x mean running, {rf['steps'] / rh['steps']:.2f}x fewer steps")
    ratios = []
    for n in (1024, 2048, 4096, 8192, 32768):
        ratios.append(f"{n}: {theoretical_blocks(full, n, args.block_size) * len(hybrid) / theoretical_blocks(hybrid, n, args.block_size):.2f}x")
    print("theoretical ratio by context length (steady decode, equal memory): " + ", ".join(ratios)
          + f"; the limit is {len(hybrid)}x")
    hits, queries = prefix_check(hybrid, budget // block_bytes(cfg, hybrid, args.block_size), args)
    print(f"prefix cache, hybrid, two prompts sharing 1,536 tokens: {hits} of {queries} prompt tokens hit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
