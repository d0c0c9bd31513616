"""The engine core's half of the ledger: where each request's time went, step by step.

Every live request is in exactly one `LedgerBucket` at any moment. A step's whole duration, from
its start to the next step's start, belongs to the bucket each request was put in by that step's
`schedule()`: PREFILL or DECODE if it computed tokens, the reason it was left waiting otherwise.
Buckets only change at step starts, so a request's time is the telescoping sum of the intervals
between its bucket changes: from the moment the input thread decoded it (in STEP_BOUNDARY until
the first step considers it) to the end of the step that finished it. Nothing is sampled and
nothing is lost; the seconds add up to finished - received exactly.

Waiting for the step in flight is a wait like any other: a request received during a long
prefill step waits in BEHIND_PREFILL (else STEP_BOUNDARY), and a request that computes only a
few tokens in a step that is mostly someone else's long prefill is in DECODE_BEHIND_PREFILL or
PREFILL_BEHIND_PREFILL (`is_long_prefill`): "long prefills starve decodes", in numbers.

The engine's first step after ready may still hold one-time work its start-up warm-up did not
reach (core/warmup.py). Given the warm-up's measure of a warm step (`expect_first_step`), the
first step's time beyond it is taken out of the bucket of every request in the core during that
step and booked as FIRST_STEP: the first request's prefill is then a prefill like the next one's.

An aborted request's account is not dropped: `abort()` closes it and returns it as a final output
of its own, which the core sends to the caller (engine/accounts.py waits for it).

Machine contention (ops/schedstat.py measures it: the seconds the engine's threads were runnable
but not running) is taken out of the steps it stretched: `on_update` gets each step's, and every
request that computed in the step (PREFILL, DECODE and their behind-a-prefill kinds) owes it
to MACHINE_CONTENTION; when the request leaves that bucket, the owed seconds (never more than its
time there) go to MACHINE_CONTENTION instead, and its trace phase ends with a "machine
contention" phase as long. The seconds still add up to finished - received.

Cost: per step, one dict lookup and a comparison per scheduled or waiting request (the
scheduler already loops over both); per request a list of len(LedgerBucket) floats. The totals
cross the process boundary once, with the request's final output. Phases (bucket, start, end)
are kept only when tracing, at most `max_segments` per request.
"""
from __future__ import annotations

from collections.abc import Iterable

from tokenloom.messages import EngineCoreOutput, FinishReason, LedgerBucket, RequestTiming
from tokenloom.metrics.buckets import BUCKET_PHASE, COMPUTE_BUCKETS, HOL_BUCKET, WAIT_BUCKET
from tokenloom.sched_output import SchedulerOutput, WaitReason

NUM_BUCKETS = len(LedgerBucket)
CONTENTION = LedgerBucket.MACHINE_CONTENTION
# A step is "a long prefill" for a request it holds up (one waiting for it to end, or one that
# computes a few tokens in it) when the prefill tokens of the others number at least this many
# and are the most of the step's tokens. Below that a step's cost is mostly its fixed part
# (reading every weight once), which the request would pay anyway; above it, someone else's
# prefill is what makes the step long. Tuning the chunk size (max_num_batched_tokens) is the
# remedy: vLLM users know it as chunked-prefill tuning.
LONG_PREFILL_TOKENS = 64


def is_long_prefill(num_prefill_tokens: int, num_other_tokens: int) -> bool:
    """Whether `num_prefill_tokens` (of others' prefills) make a step long for a request, when
    `num_other_tokens` (its own and the decodes) are computed alongside."""
    return num_prefill_tokens >= LONG_PREFILL_TOKENS and num_prefill_tokens > num_other_tokens


class _Entry:
    __slots__ = (
        "sent",
        "received",
        "queued",
        "first_scheduled",
        "first_token",
        "bucket",
        "since",
        "seconds",
        "preempted",
        "num_preemptions",
        "segments",
        "num_dropped",
        "contention",
    )

    def __init__(self, sent: float, received: float, queued: float, segments: list | None,
                 boundary: LedgerBucket) -> None:
        self.sent = sent
        self.received = received
        self.queued = queued
        self.first_scheduled = 0.0
        self.first_token = 0.0
        self.bucket = boundary
        self.since = received
        self.seconds = [0.0] * NUM_BUCKETS
        # Set by a preemption, cleared by the next decode: the time between is the preemption's.
        self.preempted = False
        self.num_preemptions = 0
        self.segments = segments
        self.num_dropped = 0
        # Machine contention of the steps it computed in since it entered its bucket (owed).
        self.contention = 0.0


class CoreLedger:
    def __init__(self, record_segments: bool = False, max_segments: int = 4096) -> None:
        self.record_segments = record_segments
        self.max_segments = max_segments
        self.entries: dict[str, _Entry] = {}
        # The last step scheduled: whether it was a long prefill, and when it ended.
        self._step_long_prefill = False
        self._step_end = 0.0
        # (tokens, seconds) of a warm step the warm-up measured; then (start, expected seconds)
        # of the first step after ready, until its end books its excess.
        self._first_step_reference: tuple[int, float] | None = None
        self._first_step: tuple[float, float] | None = None
        self._step_scheduled: dict[str, int] = {}

    def expect_first_step(self, num_tokens: int, seconds: float) -> None:
        """The warm-up's warm step: `num_tokens` computed in `seconds`. The first step after ready
        is expected to take as long per token (at least as long as it), its excess is FIRST_STEP."""
        self._first_step_reference = (max(num_tokens, 1), max(seconds, 0.0))

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, request_id: str, sent_time: float, received_time: float, queued_time: float) -> None:
        """A request the scheduler accepted (or rejected: its error output still needs timing)."""
        sent = sent_time if 0.0 < sent_time <= received_time else received_time
        # Received while a long prefill step ran (the input thread stamps it during the step; the
        # busy loop adds it after): its wait for the step boundary is that prefill's doing.
        behind_prefill = self._step_long_prefill and received_time < self._step_end
        boundary = LedgerBucket.BEHIND_PREFILL if behind_prefill else LedgerBucket.STEP_BOUNDARY
        self.entries[request_id] = _Entry(sent, received_time, queued_time, [] if self.record_segments else None,
                                          boundary)

    def abort(self, request_ids: Iterable[str], t: float) -> list[EngineCoreOutput]:
        """Aborted requests (by the caller: a client gone, a stop string it found). The caller
        already gave them their final output, but their account is still owed to it: one final
        output each, carrying only the timing, to send with the next step. Ids the ledger does
        not hold (finished meanwhile: their timing went with their final output) get none."""
        finals = []
        for req_id in request_ids:
            e = self.entries.pop(req_id, None)
            if e is not None:
                finals.append(EngineCoreOutput(req_id, [], finish_reason=FinishReason.ABORT, timing=self._finish(e, t)))
        return finals

    def snapshot(self, t: float) -> list[dict]:
        """The requests the core holds now, each with where it is (its bucket's phase name:
        "queued: token_budget", "decode", ...) and for how long: the live view's rows
        (`GET /ledger`). Only on request: nothing is kept for it."""
        return [
            {"request_id": req_id, "state": BUCKET_PHASE[e.bucket], "in_state_s": t - e.since,
             "in_core_s": t - e.received, "num_preemptions": e.num_preemptions}
            for req_id, e in self.entries.items()
        ]

    def _switch(self, e: _Entry, bucket: LedgerBucket, t: float) -> None:
        owed = min(e.contention, t - e.since) if e.contention else 0.0
        e.seconds[e.bucket] += t - e.since - owed
        segments = e.segments
        if segments is not None and t > e.since:
            phases = [(int(e.bucket), e.since, t - owed), (int(CONTENTION), t - owed, t)] if owed else [
                (int(e.bucket), e.since, t)]
            phases = [p for p in phases if p[2] > p[1]]
            if len(segments) + len(phases) <= self.max_segments:
                segments += phases
            else:
                e.num_dropped += 1
        if owed:
            e.seconds[CONTENTION] += owed
            e.contention = 0.0
        e.bucket = bucket
        e.since = t

    def on_schedule(self, so: SchedulerOutput, step_start: float) -> None:
        """Puts every request the step mentions in its bucket for this step."""
        entries = self.entries
        switch = self._switch
        t = step_start
        decodes = so.decode_req_ids
        num_decodes = so.num_decode_tokens  # draft tokens are decode tokens
        num_prefill = so.num_prefill_tokens
        # Whether the step was long for someone computing only a little in it: a decode, or a
        # prefill chunk far smaller than the others' (one check per request, only then).
        long_prefill = is_long_prefill(num_prefill, num_decodes)
        self._step_long_prefill = long_prefill
        if self._first_step_reference is not None and num_prefill + num_decodes:
            ref_tokens, ref_seconds = self._first_step_reference
            self._first_step_reference = None
            self._first_step = (t, ref_seconds * max(1.0, (num_prefill + num_decodes) / ref_tokens))
        self._step_scheduled = so.num_scheduled_tokens
        decode_bucket = LedgerBucket.DECODE_BEHIND_PREFILL if long_prefill else LedgerBucket.DECODE
        for req_id, num_tokens in so.num_scheduled_tokens.items():
            e = entries.get(req_id)
            if e is None:
                continue
            if e.first_scheduled == 0.0:
                e.first_scheduled = t
            # A resumed request's recompute is a prefill with outputs: still the preemption's.
            if req_id in decodes:
                e.preempted = False
                bucket = decode_bucket
            elif e.preempted:
                bucket = LedgerBucket.PREEMPTED
            elif long_prefill and is_long_prefill(num_prefill - num_tokens, num_decodes + num_tokens):
                bucket = LedgerBucket.PREFILL_BEHIND_PREFILL
            else:
                bucket = LedgerBucket.PREFILL
            if bucket != e.bucket:
                switch(e, bucket, t)
        if not so.wait_reasons:
            return
        hol = HOL_BUCKET.get(so.blocked_reason, LedgerBucket.HOL_TOKEN_BUDGET)  # type: ignore[arg-type]
        for req_id, reason in so.wait_reasons.items():
            e = entries.get(req_id)
            if e is None:
                continue
            if reason == WaitReason.PREEMPTED:
                e.preempted = True
                e.num_preemptions += 1
                bucket = LedgerBucket.PREEMPTED
            elif e.preempted:
                bucket = LedgerBucket.PREEMPTED
            elif reason == WaitReason.HEAD_OF_LINE:
                bucket = hol
            else:
                bucket = WAIT_BUCKET[reason]
            if bucket != e.bucket:
                switch(e, bucket, t)

    def on_update(self, outputs: list[EngineCoreOutput], step_end: float, contention: float = 0.0) -> None:
        """Stamps first tokens and attaches the timing to every final output of the step.
        `contention`: the seconds of the step its threads waited to run (see the docstring)."""
        self._step_end = step_end
        if self._first_step is not None:
            self._book_first_step(step_end)
        entries = self.entries
        if contention > 0.0:
            for req_id in self._step_scheduled:
                e = entries.get(req_id)
                if e is not None and e.bucket in COMPUTE_BUCKETS:
                    e.contention += contention
        for out in outputs:
            e = entries.get(out.request_id)
            if e is None:
                continue
            if e.first_token == 0.0 and out.new_token_ids:
                e.first_token = step_end
            if out.finish_reason is not None:
                del entries[out.request_id]
                out.timing = self._finish(e, step_end)

    def _book_first_step(self, step_end: float) -> None:
        """The first step's time beyond what it was expected to take, out of the bucket of every
        request that was in the core when it began, into FIRST_STEP (at the step's start)."""
        start, expected = self._first_step  # type: ignore[misc]
        self._first_step = None
        excess = step_end - start - expected
        if excess <= 0.0:
            return
        for e in self.entries.values():
            if e.since <= start:
                bucket = e.bucket
                self._switch(e, LedgerBucket.FIRST_STEP, start)
                self._switch(e, bucket, start + excess)

    def _finish(self, e: _Entry, t: float) -> RequestTiming:
        self._switch(e, e.bucket, t)
        timing = RequestTiming(
            sent_time=e.sent,
            received_time=e.received,
            queued_time=e.queued,
            first_scheduled_time=e.first_scheduled,
            first_token_time=e.first_token,
            finished_time=t,
            seconds=e.seconds,
            num_preemptions=e.num_preemptions,
            last_bucket=int(e.bucket),
        )
        if e.segments is not None:
            timing.segments = e.segments
            timing.num_segments_dropped = e.num_dropped
        return timing
