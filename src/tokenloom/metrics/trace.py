"""The ledger as a Chrome trace (JSON object format), which Perfetto and chrome://tracing open.

Layout:
- process 1 "requests": one track (tid) per request. A slice `request <id>` spans arrival to
  returned, with the whole summary in its args (parts, wait_by_cause, dominant_wait, TTFT, TPOT,
  e2e, and its stamps in seconds on the monotonic clock: what `tokenloom explain` reads back);
  under it, its critical path as consecutive slices (timeline.critical_path): tokenize,
  frontend_other, ipc_in, the core's phases (queued: <reason>, prefill, decode, preempted),
  ipc_out, detokenize, frontend_other; an instant at the first token.
- process 2 "engine core": track 1 has a slice per step (`step N`) with schedule / execute /
  update slices under it; counters `token budget` (prefill, decode, unused), `kv blocks` (free,
  cached, used), `queue` (running, waiting), `preemptions` (cumulative), sampled at each step.
- an instant `tokenloom run` at time 0 carries the engine's configuration.
Times are integer microseconds from the first thing recorded, so nested slices nest exactly.

Memory is bounded: the recorder keeps the last `max_steps` steps (about 150 bytes each) and the
last `max_requests` finished requests (about 1.5 KB each, plus about 60 bytes per phase, and the
core keeps at most 4096 phases per request), dropping the oldest and counting them. The defaults
(100,000 steps, 20,000 requests) bound it to roughly 50 MB. The file is written by `write()`:
at shutdown, or whenever the caller flushes.
"""
from __future__ import annotations

import json
import os
from collections import deque
from typing import TYPE_CHECKING, Any

from tokenloom.messages import EngineCoreOutputs
from tokenloom.metrics.timeline import critical_path, summarize

if TYPE_CHECKING:
    from tokenloom.outputs import RequestOutput

REQUESTS_PID = 1
ENGINE_PID = 2
STEPS_TID = 1
DEFAULT_MAX_STEPS = 100_000
DEFAULT_MAX_REQUESTS = 20_000

# Fields of one step record, in order.
STEP_FIELDS = (
    "step",
    "start",
    "schedule",
    "execute",
    "update",
    "prefill",
    "decode",
    "budget",
    "running",
    "waiting",
    "free",
    "cached",
    "used",
    "preemptions",
    "loop",
    "serialize",
    # Machine contention (SchedulerStats): CPU seconds of the compute threads, their run_delay,
    # the cores other processes used, the cores the engine may use.
    "cpu",
    "run_delay",
    "other_cores",
    "cores",
    # Of run_delay, the time the container's CPU quota throttled the engine, and that quota.
    "throttled",
    "quota",
)


class TraceRecorder:
    def __init__(
        self,
        path: str | os.PathLike | None = None,
        config: dict[str, Any] | None = None,
        max_steps: int = DEFAULT_MAX_STEPS,
        max_requests: int = DEFAULT_MAX_REQUESTS,
    ) -> None:
        self.path = None if path is None else os.fspath(path)
        self.config = dict(config or {})
        self.steps: deque[tuple] = deque(maxlen=max_steps)
        self.requests: deque[dict[str, Any]] = deque(maxlen=max_requests)
        self.num_steps_dropped = 0
        self.num_requests_dropped = 0

    # ---- recording ------------------------------------------------------------------------

    def record_step(self, outputs: EngineCoreOutputs) -> None:
        stats = outputs.scheduler_stats
        if stats is None:
            return
        if len(self.steps) == self.steps.maxlen:
            self.num_steps_dropped += 1
        execute = stats.prepare_time + stats.forward_time + stats.sample_time
        # The step ended just before the message was stamped; its profile says how long it ran.
        start = outputs.timestamp - (stats.step_time or 0.0)
        cached = stats.num_cached_free_blocks
        self.steps.append(
            (
                stats.step,
                start,
                stats.schedule_time,
                execute,
                stats.update_time,
                stats.num_prefill_tokens,
                stats.num_decode_tokens,
                stats.token_budget,
                stats.num_running_reqs,
                stats.num_waiting_reqs,
                stats.num_free_blocks - cached,
                cached,
                stats.num_total_blocks - stats.num_free_blocks,
                stats.num_preemptions,
                stats.loop_time,
                stats.serialize_time,
                stats.cpu_time,
                stats.run_delay,
                stats.other_cores,
                stats.num_cores,
                stats.throttled,
                stats.cpu_quota,
            )
        )

    def record_request(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is None or m.finished_time is None:
            return
        if len(self.requests) == self.requests.maxlen:
            self.num_requests_dropped += 1
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason is not None]
        record = summarize(output.request_id, m, reasons[0] if reasons else None)
        stamps = {
            "arrival": m.arrival_time,
            "tokenized": m.tokenized_time,
            "received_by_caller": m.finished_time,
            "detokenized": m.detokenized_time,
            "returned": m.returned_time,
            "first_token_caller": m.first_token_time,
        }
        core = m.core
        if core is not None:
            stamps.update(
                sent=core.sent_time,
                received_by_core=core.received_time,
                queued=core.queued_time,
                first_scheduled=core.first_scheduled_time or None,
                first_token_core=core.first_token_time or None,
                finished_in_core=core.finished_time,
                output_sent=m.output_sent_time,
            )
            record["num_phases_dropped"] = core.num_segments_dropped
        record["stamps"] = {k: v for k, v in stamps.items() if v is not None}
        record["_path"] = critical_path(m, phases=True)
        self.requests.append(record)

    # ---- output ---------------------------------------------------------------------------

    def _origin(self) -> float:
        times = [self.steps[0][1]] if self.steps else []
        times += [r["_path"][0][1] for r in self.requests]
        return min(times) if times else 0.0

    def to_json(self) -> dict[str, Any]:
        origin = self._origin()

        def us(t: float) -> int:
            return max(0, round((t - origin) * 1e6))

        events: list[dict[str, Any]] = [
            _meta("process_name", REQUESTS_PID, 0, "requests"),
            _meta("process_name", ENGINE_PID, 0, "engine core"),
            _meta("thread_name", ENGINE_PID, STEPS_TID, "steps"),
            {
                "name": "tokenloom run",
                "cat": "config",
                "ph": "i",
                "s": "g",
                "ts": 0,
                "pid": ENGINE_PID,
                "tid": STEPS_TID,
                "args": {
                    **self.config,
                    "clock_origin_s": origin,
                    "num_steps_dropped": self.num_steps_dropped,
                    "num_requests_dropped": self.num_requests_dropped,
                },
            },
        ]
        last_end = 0
        for step in self.steps:
            step_events = _step_events(dict(zip(STEP_FIELDS, step)), us, last_end)
            last_end = step_events[0]["ts"] + step_events[0]["dur"]
            events.extend(step_events)
        for tid, record in enumerate(self.requests, start=1):
            events.extend(_request_events(record, tid, us))
        return {"traceEvents": events, "displayTimeUnit": "ms"}

    def write(self, path: str | os.PathLike | None = None) -> str:
        path = os.fspath(path) if path is not None else self.path
        if path is None:
            raise ValueError("no trace path given")
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(self.to_json(), f, separators=(",", ":"))
        os.replace(tmp, path)  # a reader never sees half a file
        return path


def _meta(name: str, pid: int, tid: int, value: str) -> dict[str, Any]:
    return {"name": name, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": value}}


def _slice(name: str, cat: str, start: int, end: int, pid: int, tid: int, args: dict | None = None) -> dict[str, Any]:
    event = {"name": name, "cat": cat, "ph": "X", "ts": start, "dur": max(0, end - start), "pid": pid, "tid": tid}
    if args:
        event["args"] = args
    return event


def _counter(name: str, ts: int, args: dict[str, float]) -> dict[str, Any]:
    return {"name": name, "cat": "counter", "ph": "C", "ts": ts, "pid": ENGINE_PID, "tid": STEPS_TID, "args": args}


def _step_events(s: dict[str, Any], us, not_before: int) -> list[dict[str, Any]]:
    # Rounded once each and never before the previous step's end: slices on a track must nest.
    t0 = max(us(s["start"]), not_before)
    t1 = max(t0, us(s["start"] + s["schedule"]))
    t2 = max(t1, us(s["start"] + s["schedule"] + s["execute"]))
    t3 = max(t2, us(s["start"] + s["schedule"] + s["execute"] + s["update"]))
    unused = max(s["budget"] - s["prefill"] - s["decode"], 0)
    args = {k: s[k] for k in ("prefill", "decode", "budget", "running", "waiting", "free", "cached", "used")}
    # The busy loop's time before this step, and the output thread's encode+send since the last.
    args.update(loop_s=s["loop"], serialize_s=s["serialize"])
    if s.get("cores"):  # measured (ops/schedstat.py)
        args.update(cpu_s=s["cpu"], run_delay_s=s["run_delay"], other_cores=s["other_cores"], cores=s["cores"])
        if s.get("quota"):  # a container's CPU quota (ops/cgroup_cpu.py)
            args.update(throttled_s=s["throttled"], quota=s["quota"])
    pid, tid = ENGINE_PID, STEPS_TID
    return [
        _slice(f"step {s['step']}", "step", t0, t3, pid, tid, {"step": s["step"], **args}),
        _slice("schedule", "step_phase", t0, t1, pid, tid),
        _slice("execute", "step_phase", t1, t2, pid, tid),
        _slice("update", "step_phase", t2, t3, pid, tid),
        _counter("token budget", t0, {"prefill": s["prefill"], "decode": s["decode"], "unused": unused}),
        _counter("kv blocks", t0, {"free": s["free"], "cached": s["cached"], "used": s["used"]}),
        _counter("queue", t0, {"running": s["running"], "waiting": s["waiting"]}),
        _counter("preemptions", t0, {"total": s["preemptions"]}),
    ]


def _request_events(record: dict[str, Any], tid: int, us) -> list[dict[str, Any]]:
    path = record["_path"]
    args = {k: v for k, v in record.items() if not k.startswith("_")}
    pid = REQUESTS_PID
    start, end = us(path[0][1]), us(path[-1][2])
    events = [
        _meta("thread_name", pid, tid, f"req {record['request_id']}"),
        _slice(f"request {record['request_id']}", "request", start, end, pid, tid, args),
    ]
    # The path's segments are consecutive: each boundary is rounded once, so they tile.
    last = start
    for name, _, seg_end in path:
        b = min(max(last, us(seg_end)), end)
        if b > last:
            events.append(_slice(name, "phase", last, b, pid, tid))
        last = b
    first_token = record["stamps"].get("first_token_caller")
    if first_token is not None:
        ts = us(first_token)
        events.append({"name": "first token", "cat": "phase", "ph": "i", "s": "t", "ts": ts, "pid": pid, "tid": tid})
    return events


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, list):  # the JSON array format: events only
        data = {"traceEvents": data}
    return data


def trace_requests(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """The summary of every request in the trace (the args of its `request` slice), with
    `finish_ts` (seconds from the trace's origin) added."""
    requests = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "request" and e.get("ph") == "X":
            args = dict(e.get("args") or {})
            args["finish_ts"] = (e["ts"] + e.get("dur", 0)) / 1e6
            requests.append(args)
    return requests


def trace_steps(trace: dict[str, Any]) -> list[dict[str, Any]]:
    """Every engine step (the args of its `step` slice), with `ts` and `dur` in seconds."""
    steps = []
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "step" and e.get("ph") == "X":
            args = dict(e.get("args") or {})
            args["ts"], args["dur"] = e["ts"] / 1e6, e.get("dur", 0) / 1e6
            steps.append(args)
    return steps


def trace_config(trace: dict[str, Any]) -> dict[str, Any]:
    for e in trace.get("traceEvents", []):
        if e.get("cat") == "config":
            return dict(e.get("args") or {})
    return {}
