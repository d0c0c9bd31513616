"""A request's end-to-end latency, decomposed into named parts that add up to it.

The parts are consecutive segments of the request's critical path, all stamped on the one clock
(`messages.now()`, CLOCK_MONOTONIC, shared by the caller and the engine-core process), so their
sum is the measured latency by construction, not by fitting:

    arrival ──tokenize──> tokenized ──frontend_other──> sent ──ipc_in──> received by core
      ──[engine core: every step's whole duration goes to one bucket, see core_ledger.py]──>
    finished in core ──core_overhead──> output sent ──ipc_out──> final output received
      ──detokenize──> detokenized ──frontend_other──> returned

The parts (caller side, then the core's buckets, then caller side again):

  tokenize             arrival → tokenized: tokenizing and validating the prompt
  frontend_other       tokenized → sent (registration), and detokenized → returned (the rest of
                       the message's outputs, processed before the caller got this one)
  ipc_in               sent → received by core: encode, socket, decode in the input thread
  queue_step_boundary  waiting for the step in flight to end (admission is between steps)
  queue_token_budget   left waiting: the step's token budget was spent
  queue_max_num_seqs   left waiting: max_num_seqs requests were running
  queue_no_kv_blocks   left waiting: no KV blocks for it
  queue_head_of_line   queued behind a waiting request that could not be admitted
  queue_grammar_compile  waiting for its structured-output grammar to compile (off the busy loop)
  prefill              steps in which it computed prompt tokens
  decode               steps in which it computed a decode token
  preempted            from a preemption until it decodes again (waiting, then recompute)
  first_step           the engine's first step after ready, beyond the warm-up step it was
                       expected to take (core/warmup.py): one-time work left over, not prefill
  machine_contention   the seconds of its prefill and decode steps in which the engine's
                       threads were runnable but not running: other processes held the cores
                       (their run_delay, ops/schedstat.py), taken out of prefill and decode
  core_overhead        finished in core (the end of its last step) → its output sent: waiting in
                       the output queue behind earlier messages (0 with the in-process client)
  ipc_out              output sent → final output received: encode, socket, decode, and any time
                       the caller was busy elsewhere
  detokenize           received → detokenized: output processing up to its final output
                       (including the outputs before it in the same message)
  core_unattributed    tokenized → received, only when the core sent no timing (the ledger off,
                       or the core died first). An aborted request (or one a stop string
                       finished in the caller) gets the core's account late, with the abort;
                       its metrics are recorded when it arrives

Until a request is returned (and when the ledger is off, which stamps no return), its e2e ends
when its final output was received, and so do its parts.

A step's duration runs from its start to the next step's start, so the busy loop's time between
steps (inputs drained, outputs queued) is part of the step, and prefill/decode are compute as
the request experienced it. Head-of-line waits are also split by what blocked the head
(`wait_by_cause`): a request behind a head that lacks token budget is waiting for budget.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenloom.metrics.buckets import BUCKET_CAUSE, BUCKET_PART, BUCKET_PHASE, WAIT_CAUSES

if TYPE_CHECKING:
    from tokenloom.outputs import RequestMetrics

# The caller's parts before the core, the core's (one per bucket part), the caller's after it.
PART_NAMES = ("tokenize", "ipc_in", *dict.fromkeys(BUCKET_PART),
              "core_overhead", "ipc_out", "detokenize", "frontend_other", "core_unattributed")

# The verdict of a run (see analysis/explain.py): which group of parts holds the most request time, and
# what it means in a sentence.
VERDICT_HEADLINES = {
    "budget-bound": "requests wait for the token budget",
    "block-bound": "KV blocks run out",
    "seq-limit-bound": "max_num_seqs is reached",
    "prefill-bound": "long prefills starve decodes",
    "grammar-bound": "requests wait for their structured-output grammars to compile",
    "contended": "other processes held the cores the engine needed",
    "compute-bound": "the model's own steps take the time",
    "frontend-bound": "the front end (tokenize, detokenize, IPC) takes the time",
}
VERDICT_GROUPS = tuple(VERDICT_HEADLINES)
COMPUTE_PARTS = ("queue_step_boundary", "prefill", "decode")
FRONTEND_PARTS = ("tokenize", "ipc_in", "core_overhead", "ipc_out", "detokenize", "frontend_other")


def critical_path(m: RequestMetrics, phases: bool = False) -> list[tuple[str, float, float]]:
    """The request's path as consecutive (name, start, end) segments, arrival to returned.
    The core's time appears as one segment per part, in bucket order (their totals), or with
    `phases` and a traced request, as the phases it went through, named for the trace
    (BUCKET_PHASE). [] until it has finished."""
    received_by_caller = m.finished_time
    if received_by_caller is None:
        return []
    arrival = m.arrival_time
    tokenized = max(m.tokenized_time if m.tokenized_time is not None else arrival, arrival)
    if m.returned_time is None:  # not returned yet (or the ledger is off): e2e ends on receipt
        detokenized = returned = received_by_caller
    else:
        returned = max(m.returned_time, received_by_caller)
        detokenized = min(max(m.detokenized_time or received_by_caller, received_by_caller), returned)
    path = [("tokenize", arrival, tokenized)]
    core = m.core
    if core is None:
        path.append(("core_unattributed", tokenized, received_by_caller))
    else:
        # An aborted request (a client gone, a stop string found by the caller) ended for its
        # caller before the core heard of it: the core's account runs on past the caller's
        # final output and is cut there, its latest parts first (see clip_core).
        end = min(core.finished_time, received_by_caller)
        received = min(max(core.received_time, tokenized), end)
        sent = min(max(core.sent_time, tokenized), received)
        path.append(("frontend_other", tokenized, sent))
        path.append(("ipc_in", sent, received))
        if phases and core.segments:
            path += [(BUCKET_PHASE[b], max(s, received), min(e, end)) for b, s, e in core.segments if min(e, end) > max(s, received)]
            last = path[-1][2]
            if last < end:  # more phases than the core kept
                path.append(("engine core (phases dropped)", last, end))
        else:
            t = received
            for bucket, seconds in enumerate(clip_core(core.seconds, end - received, core.last_bucket)):
                if seconds:
                    path.append((BUCKET_PART[bucket], t, t + seconds))
                    t += seconds
        sent_out = m.output_sent_time
        if sent_out is not None and end <= sent_out <= received_by_caller:
            path.append(("core_overhead", end, sent_out))
        else:
            sent_out = end
        path.append(("ipc_out", sent_out, received_by_caller))
    path.append(("detokenize", received_by_caller, detokenized))
    path.append(("frontend_other", detokenized, returned))
    return path


def clip_core(seconds: list[float], limit: float, last_bucket: int = -1) -> list[float]:
    """The core's seconds per bucket, cut to add up to at most `limit`. Only the account of an
    aborted request runs past its caller's end, by the time the abort took to reach the core
    (about a step); that time is taken from the bucket it was in at the end (where the time
    after its caller's end was), then, should that not hold enough, from the buckets in reverse
    order (preempted, decode, prefill, then the waits)."""
    excess = sum(seconds) - max(limit, 0.0)
    if excess <= 0:
        return seconds
    clipped = list(seconds)
    order = range(len(clipped) - 1, -1, -1)
    for bucket in ([last_bucket] if 0 <= last_bucket < len(clipped) else []) + list(order):
        cut = min(clipped[bucket], excess)
        clipped[bucket] -= cut
        excess -= cut
        if excess <= 0:
            break
    return clipped


def decompose(m: RequestMetrics) -> dict[str, float]:
    """Part name -> seconds, every part of PART_NAMES present; they add up to the request's
    e2e latency (returned - arrival). {} until the request has finished."""
    path = critical_path(m)
    if not path:
        return {}
    parts = dict.fromkeys(PART_NAMES, 0.0)
    for name, start, end in path:
        parts[name] += end - start
    return parts


def core_seconds(m: RequestMetrics) -> list[float] | None:
    """The core's seconds per bucket as the request's path holds them: cut back to the caller's
    end for an aborted request (clip_core). None without the core's account."""
    core = m.core
    if core is None:
        return None
    end = core.finished_time if m.finished_time is None else min(core.finished_time, m.finished_time)
    return clip_core(core.seconds, end - core.received_time, core.last_bucket)


def wait_by_cause(seconds: list[float] | None) -> dict[str, float]:
    causes = dict.fromkeys(WAIT_CAUSES, 0.0)
    if seconds is not None:
        for cause, s in zip(BUCKET_CAUSE, seconds):
            if cause is not None:
                causes[cause] += s
    return causes


# A wait is the one a request "waited most for" only when it holds at least this share of the
# request's e2e latency: below it the wait is not what made the request slow (a fraction of a
# millisecond behind the step in flight, in a request that decoded for seconds), and naming it
# would point at the wrong remedy. A tenth is the share where a wait is a change worth making: the
# parts it would be compared against (prefill, decode) are then at most nine times as large.
DOMINANT_WAIT_FLOOR = 0.1


def dominant_wait(causes: dict[str, float], e2e: float | None) -> str | None:
    """The cause the request waited longest for, if that wait is at least DOMINANT_WAIT_FLOOR of
    its e2e latency; None ("no significant wait") otherwise, or without an e2e."""
    cause = max(causes, key=causes.__getitem__) if causes else None
    if cause is None or not e2e or e2e <= 0.0:
        return None
    return cause if causes[cause] > 0.0 and causes[cause] >= DOMINANT_WAIT_FLOOR * e2e else None


def settle(m: RequestMetrics) -> None:
    """Fills in `m.parts`, `m.wait_by_cause` and `m.dominant_wait` from its stamps: called when
    the request's final output is built and again when it is returned (the end of its e2e)."""
    m.parts = decompose(m)
    m.wait_by_cause = wait_by_cause(core_seconds(m))
    m.dominant_wait = dominant_wait(m.wait_by_cause, sum(m.parts.values()))


def group_seconds(parts: dict[str, float], causes: dict[str, float]) -> dict[str, float]:
    """Seconds of one request per verdict group. Waits count for their root cause (head-of-line
    waits for what blocked the head); waiting for the step in flight and decoding count as
    compute, except behind or alongside a long prefill chunk, which counts as prefill-bound
    (core_ledger.is_long_prefill); the output queue (core_overhead) counts with IPC as
    frontend; waiting for a grammar to compile is its own group, and so is machine contention
    (the steps' time the engine waited to run); core_unattributed counts for no group."""
    long_prefill = causes.get("long_prefill", 0.0)
    return {
        "budget-bound": causes.get("token_budget", 0.0),
        "block-bound": causes.get("no_kv_blocks", 0.0) + causes.get("preempted", 0.0),
        "seq-limit-bound": causes.get("max_num_seqs", 0.0),
        "prefill-bound": long_prefill,
        "grammar-bound": causes.get("grammar_compile", 0.0),
        "contended": parts.get("machine_contention", 0.0),
        "compute-bound": max(sum(parts.get(p, 0.0) for p in COMPUTE_PARTS) - long_prefill, 0.0),
        "frontend-bound": sum(parts.get(p, 0.0) for p in FRONTEND_PARTS),
    }


def summarize(request_id: str, m: RequestMetrics, finish_reason: str | None = None) -> dict[str, Any]:
    """A finished request as plain JSON values: what the trace stores and explain reads."""
    parts = decompose(m)
    causes = wait_by_cause(core_seconds(m))
    core = m.core
    itl = m.inter_token_latencies
    return {
        "request_id": request_id,
        "e2e": m.e2e_latency,
        "ttft": m.time_to_first_token,
        "tpot": m.time_per_output_token,
        "itl_mean": sum(itl) / len(itl) if itl else None,
        "itl_max": max(itl) if itl else None,
        "num_prompt_tokens": m.num_prompt_tokens,
        "num_generation_tokens": m.num_generation_tokens,
        "num_preemptions": core.num_preemptions if core is not None else 0,
        "finish_reason": finish_reason,
        "parts": parts,
        "wait_by_cause": causes,
        "dominant_wait": dominant_wait(causes, sum(parts.values())),
    }
