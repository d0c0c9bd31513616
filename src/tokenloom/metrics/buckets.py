"""The ledger's one table: for every `LedgerBucket`, the part of the end-to-end latency it adds to,
the wait cause it counts for, how it is drawn on a trace, and which scheduler `WaitReason` puts a
request in it. Every other lookup in `metrics/` is derived from this table, so a new bucket is one
new row.
"""
from __future__ import annotations

from dataclasses import dataclass

from tokenloom.messages import LedgerBucket
from tokenloom.sched_output import WaitReason


@dataclass(frozen=True, slots=True)
class Bucket:
    part: str  # the part of `RequestMetrics.parts` its seconds go to
    # The root cause it counts for in `wait_by_cause` (None: not a wait). Waiting for the step
    # in flight is a wait too: behind a long prefill chunk ("long_prefill", as is a decode
    # stretched by someone else's prefill), or behind any other step ("step_in_flight").
    cause: str | None
    phase: str  # its name on a request's trace track
    # The wait reason that puts a request in it; for head-of-line buckets, the reasons that
    # blocked the head (a head preempted in this very step is blocked by blocks).
    wait: WaitReason | None = None
    behind: tuple[WaitReason, ...] = ()


B, W = LedgerBucket, WaitReason
BUCKETS: dict[LedgerBucket, Bucket] = {
    B.STEP_BOUNDARY: Bucket("queue_step_boundary", "step_in_flight", "queued: step boundary"),
    B.BEHIND_PREFILL: Bucket("queue_step_boundary", "long_prefill", "queued: step boundary (behind a prefill)"),
    B.TOKEN_BUDGET: Bucket("queue_token_budget", "token_budget", "queued: token_budget",
                           wait=W.TOKEN_BUDGET),
    B.MAX_NUM_SEQS: Bucket("queue_max_num_seqs", "max_num_seqs", "queued: max_num_seqs",
                           wait=W.MAX_NUM_SEQS),
    B.NO_KV_BLOCKS: Bucket("queue_no_kv_blocks", "no_kv_blocks", "queued: no_kv_blocks",
                           wait=W.NO_KV_BLOCKS),
    B.HOL_TOKEN_BUDGET: Bucket("queue_head_of_line", "token_budget",
                               "queued: head_of_line (token_budget)", behind=(W.TOKEN_BUDGET,)),
    B.HOL_MAX_NUM_SEQS: Bucket("queue_head_of_line", "max_num_seqs",
                               "queued: head_of_line (max_num_seqs)", behind=(W.MAX_NUM_SEQS,)),
    B.HOL_NO_KV_BLOCKS: Bucket("queue_head_of_line", "no_kv_blocks",
                               "queued: head_of_line (no_kv_blocks)",
                               behind=(W.NO_KV_BLOCKS, W.PREEMPTED)),
    B.PREFILL: Bucket("prefill", None, "prefill"),
    B.DECODE: Bucket("decode", None, "decode"),
    B.PREFILL_BEHIND_PREFILL: Bucket("prefill", "long_prefill", "prefill (behind a long prefill)"),
    B.DECODE_BEHIND_PREFILL: Bucket("decode", "long_prefill", "decode (behind a long prefill)"),
    B.PREEMPTED: Bucket("preempted", "preempted", "preempted", wait=W.PREEMPTED),
    B.GRAMMAR_COMPILE: Bucket("queue_grammar_compile", "grammar_compile", "queued: grammar_compile",
                              wait=W.GRAMMAR_COMPILE),
    B.FIRST_STEP: Bucket("first_step", None, "first step"),
    B.MACHINE_CONTENTION: Bucket("machine_contention", None, "machine contention"),
}
del B, W
assert list(BUCKETS) == list(LedgerBucket), "one row per bucket, in the enum's order"

# Derived lookups (by bucket index, since `RequestTiming.seconds` is indexed by bucket).
BUCKET_PART = tuple(b.part for b in BUCKETS.values())
BUCKET_CAUSE = tuple(b.cause for b in BUCKETS.values())
BUCKET_PHASE = tuple(b.phase for b in BUCKETS.values())
WAIT_BUCKET = {b.wait: k for k, b in BUCKETS.items() if b.wait is not None}
HOL_BUCKET = {reason: k for k, b in BUCKETS.items() for reason in b.behind}
# The causes in table order, without repeats.
# The buckets of a request's computing steps, whose machine contention is taken out of them.
COMPUTE_BUCKETS = frozenset({LedgerBucket.PREFILL, LedgerBucket.DECODE, LedgerBucket.PREFILL_BEHIND_PREFILL,
                             LedgerBucket.DECODE_BEHIND_PREFILL})
WAIT_CAUSES = tuple(dict.fromkeys(b.cause for b in BUCKETS.values() if b.cause is not None))
