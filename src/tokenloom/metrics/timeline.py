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
  core_overhead        finished in core (the end of its last step) → its output sent: waiting in
                       the output queue behind earlier messages (0 with the in-process client)
  ipc_out              output sent → final output received: encode, socket, decode, and any time
                       the caller was busy elsewhere
  detokenize           received → detokenized: output processing up to its final output
                       (including the outputs before it in the same message)
  core_unattributed    tokenized → received, only when the core sent no timing (ledger off,
                       aborted, or finished by a stop string in the caller)

Until a request is returned (and when the ledger is off, which stamps no return), its e2e ends
when its final output was received, and so do its parts.

A step's duration runs from its start to the next step's start, so the busy loop's time between
steps (inputs drained, outputs queued) is part of the step, and prefill/decode are compute as
the request experienced it. Head-of-line waits are also split by what blocked the head
(`wait_by_cause`): a request behind a head that lacks token budget is waiting for budget.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tokenloom.messages import RequestTiming
from tokenloom.metrics.buckets import BUCKET_CAUSE, BUCKET_PART, BUCKET_PHASE, WAIT_CAUSES

if TYPE_CHECKING:
    from tokenloom.outputs import RequestMetrics

# The caller's parts before the core, the core's (one per bucket part), the caller's after it.
PART_NAMES = ("tokenize", "ipc_in", *dict.fromkeys(BUCKET_PART),
              "core_overhead", "ipc_out", "detokenize", "frontend_other", "core_unattributed")

# The verdict of a run (see explain.py): which group of parts holds the most request time.
VERDICT_GROUPS = ("budget-bound", "block-bound", "seq-limit-bound", "compute-bound", "frontend-bound")
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
        sent = min(max(core.sent_time, tokenized), core.received_time)
        path.append(("frontend_other", tokenized, sent))
        path.append(("ipc_in", sent, core.received_time))
        if phases and core.segments:
            path += [(BUCKET_PHASE[b], start, end) for b, start, end in core.segments]
            if core.segments[-1][2] < core.finished_time:  # more phases than the core kept
                path.append(("engine core (phases dropped)", core.segments[-1][2], core.finished_time))
        else:
            t = core.received_time
            for bucket, seconds in enumerate(core.seconds):
                if seconds:
                    path.append((BUCKET_PART[bucket], t, t + seconds))
                    t += seconds
        sent_out = m.output_sent_time
        if sent_out is not None and core.finished_time <= sent_out <= received_by_caller:
            path.append(("core_overhead", core.finished_time, sent_out))
        else:
            sent_out = core.finished_time
        path.append(("ipc_out", sent_out, received_by_caller))
    path.append(("detokenize", received_by_caller, detokenized))
    path.append(("frontend_other", detokenized, returned))
    return path


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


def wait_by_cause(core: RequestTiming | None) -> dict[str, float]:
    causes = dict.fromkeys(WAIT_CAUSES, 0.0)
    if core is not None:
        for cause, seconds in zip(BUCKET_CAUSE, core.seconds):
            if cause is not None:
                causes[cause] += seconds
    return causes


def dominant_wait(causes: dict[str, float]) -> str | None:
    cause = max(causes, key=causes.__getitem__) if causes else None
    return cause if cause is not None and causes[cause] > 0.0 else None


def settle(m: RequestMetrics) -> None:
    """Fills in `m.parts`, `m.wait_by_cause` and `m.dominant_wait` from its stamps: called when
    the request's final output is built and again when it is returned (the end of its e2e)."""
    m.parts = decompose(m)
    m.wait_by_cause = wait_by_cause(m.core)
    m.dominant_wait = dominant_wait(m.wait_by_cause)


def group_seconds(parts: dict[str, float], causes: dict[str, float]) -> dict[str, float]:
    """Seconds of one request per verdict group. Waits count for their root cause (head-of-line
    waits for what blocked the head); waiting for the step in flight counts as compute (it is
    the length of that step); the output queue (core_overhead) counts with IPC as frontend;
    core_unattributed counts for no group."""
    return {
        "budget-bound": causes.get("token_budget", 0.0),
        "block-bound": causes.get("no_kv_blocks", 0.0) + causes.get("preempted", 0.0),
        "seq-limit-bound": causes.get("max_num_seqs", 0.0),
        "compute-bound": sum(parts.get(p, 0.0) for p in COMPUTE_PARTS),
        "frontend-bound": sum(parts.get(p, 0.0) for p in FRONTEND_PARTS),
    }


def summarize(request_id: str, m: RequestMetrics, finish_reason: str | None = None) -> dict[str, Any]:
    """A finished request as plain JSON values: what the trace stores and explain reads."""
    parts = decompose(m)
    causes = wait_by_cause(m.core)
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
        "dominant_wait": dominant_wait(causes),
    }
