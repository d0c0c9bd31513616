"""The ledger's live view of a running server (`GET /ledger`): the last steps, the requests in
flight with where each one is right now, and the last finished requests.

The caller side keeps a small `TraceRecorder` of the recent past (every server does, with the
ledger on: a tuple per step, a summary per finished request, both bounded), and the engine core
answers for the requests it holds (CoreLedger.snapshot). `?format=trace` returns the recent past
as a trace, which `tokenloom explain --url` reads and draws like a trace file.
"""
from __future__ import annotations

from typing import Any

from tokenloom.metrics.contention import machine_verdict
from tokenloom.metrics.trace import STEP_FIELDS, TraceRecorder

# The recent past a server keeps for the live view: enough for a picture, small enough to keep
# on (about 0.6 MB of steps, 3 MB of requests).
LIVE_MAX_STEPS = 4096
LIVE_MAX_REQUESTS = 2048


def live_view(recorder: TraceRecorder, in_core: list[dict[str, Any]], caller_ids: list[str], now: float,
              num_steps: int = 100, num_requests: int = 20) -> dict[str, Any]:
    """The JSON of `GET /ledger`: `steps` (the last `num_steps`, oldest first, with `age_s`),
    `in_flight` (every request the caller holds, with its state in the core: "queued:
    <reason>", "prefill", "decode", ... or "in the caller" when the core does not hold it:
    tokenized and not yet received, or finished and not yet returned), `finished` (the last
    `num_requests` finished requests' summaries), `verdict` (over every step and request the
    recorder holds: the group holding the most request time, the engine's machine contention
    and other processes' use of its cores, and for a contended run the sentence that says so:
    metrics/contention.py)."""
    steps = list(recorder.steps)[-num_steps:] if num_steps > 0 else []
    step_rows = []
    for values in steps:
        row = dict(zip(STEP_FIELDS, values))
        row["age_s"] = now - row["start"]
        step_rows.append(row)
    # A child of an n > 1 request is "<index>_<id>" in the core (engine/parallel_sampling.py).
    by_caller_id: dict[str, list[dict[str, Any]]] = {}
    wanted = set(caller_ids)
    for r in in_core:
        cid = r["request_id"]
        index, _, parent = cid.partition("_")
        key = parent if cid not in wanted and index.isdigit() and parent in wanted else cid
        by_caller_id.setdefault(key, []).append(r)
    in_flight = []
    for rid in caller_ids:
        rows = by_caller_id.get(rid, [])
        if not rows:
            in_flight.append({"request_id": rid, "state": "in the caller"})
        for r in rows:
            in_flight.append({**r, "request_id": rid, "core_request_id": r["request_id"]})
    finished = [{k: v for k, v in r.items() if not k.startswith("_")}
                for r in list(recorder.requests)[-num_requests:]] if num_requests > 0 else []
    return {
        "config": recorder.config,
        "num_steps_recorded": len(recorder.steps),
        "steps": step_rows,
        "in_flight": in_flight,
        "finished": finished,
        "verdict": machine_verdict(list(recorder.requests),
                                   [dict(zip(STEP_FIELDS, values)) for values in recorder.steps]),
    }
