"""What `explain --plot` draws per request: its e2e latency as a few named slices that add up to it,
and how requests are grouped when there are too many to draw one bar each.

The slices follow the verdict groups (timeline.group_seconds), so the picture's colours and its
title tell the same story: each wait by its root cause, then the request's own compute, then the
front end's share. They are derived from a request's summary in the trace (its `parts` and
`wait_by_cause`), which already add up to its e2e.
"""
from __future__ import annotations

from typing import Any

# (slice, colour), in the order they are stacked: waits first (in the order they usually happen),
# then compute, then the front end.
SLICES = (
    ("wait: step in flight", "#9ecae1"),
    ("wait: long prefill", "#e7298a"),
    ("wait: token budget", "#ff7f0e"),
    ("wait: max_num_seqs", "#9467bd"),
    ("wait: KV blocks", "#d62728"),
    ("wait: grammar compile", "#bcbd22"),
    ("preempted", "#8c564b"),
    ("prefill", "#1f77b4"),
    ("decode", "#2ca02c"),
    ("first step", "#fdae6b"),
    ("machine contention", "#17becf"),
    ("front end", "#7f7f7f"),
    ("unattributed", "#000000"),
)
SLICE_COLORS = dict(SLICES)
FRONTEND_PARTS = ("tokenize", "ipc_in", "core_overhead", "ipc_out", "detokenize", "frontend_other")
# Up to this many requests get a bar each; more are drawn as percentile groups.
MAX_BARS = 30
# The percentile groups of e2e (lower, upper) for many requests; the slowest few also get a bar each.
GROUPS = ((0.0, 0.5), (0.5, 0.9), (0.9, 0.99), (0.99, 1.0))


def request_slices(r: dict[str, Any]) -> dict[str, float]:
    """Seconds per slice of one request summary; they add up to its e2e."""
    parts = r.get("parts") or {}
    causes = r.get("wait_by_cause") or {}
    step = causes.get("step_in_flight", 0.0)
    long_prefill = causes.get("long_prefill", 0.0)
    # The long-prefill cause holds the wait for a prefill step to end (the rest of the step-
    # boundary part) and the steps in which its own few tokens were computed alongside someone
    # else's long prefill (taken from the decode part first, then from the prefill part).
    boundary_behind_prefill = max(parts.get("queue_step_boundary", 0.0) - step, 0.0)
    stretched = max(long_prefill - boundary_behind_prefill, 0.0)
    decode = parts.get("decode", 0.0)
    prefill = max(parts.get("prefill", 0.0) - max(stretched - decode, 0.0), 0.0)
    return {
        "wait: step in flight": step,
        "wait: long prefill": long_prefill,
        "wait: token budget": causes.get("token_budget", 0.0),
        "wait: max_num_seqs": causes.get("max_num_seqs", 0.0),
        "wait: KV blocks": causes.get("no_kv_blocks", 0.0),
        "wait: grammar compile": causes.get("grammar_compile", 0.0),
        "preempted": causes.get("preempted", 0.0),
        "prefill": prefill,
        "decode": max(decode - stretched, 0.0),
        "first step": parts.get("first_step", 0.0),
        "machine contention": parts.get("machine_contention", 0.0),
        "front end": sum(parts.get(p, 0.0) for p in FRONTEND_PARTS),
        "unattributed": parts.get("core_unattributed", 0.0),
    }


def bars(requests: list[dict[str, Any]], num_slowest: int = 3) -> list[tuple[str, dict[str, float], int | None]]:
    """(label, seconds per slice, rank among the slowest: 0 for the slowest, None if not one)
    per bar, fastest first. One bar per request up to MAX_BARS; beyond, the mean request of each
    percentile group of e2e, then the slowest `num_slowest` requests one by one (what the reader
    is looking for)."""
    done = sorted((r for r in requests if r.get("e2e") is not None), key=lambda r: r["e2e"])
    rank = {id(r): i for i, r in enumerate(reversed(done[-num_slowest:])) if num_slowest}
    if len(done) <= MAX_BARS:
        return [(_label(r), request_slices(r), rank.get(id(r))) for r in done]
    result = []
    n = len(done)
    for lo, hi in GROUPS:
        group = done[int(lo * n):max(int(hi * n), int(lo * n) + 1)]
        mean = {name: 0.0 for name, _ in SLICES}
        for r in group:
            for name, seconds in request_slices(r).items():
                mean[name] += seconds / len(group)
        result.append((f"p{lo * 100:g}-{hi * 100:g} (n={len(group)})", mean, None))
    result += [(_label(r), request_slices(r), rank[id(r)]) for r in done[-num_slowest:]] if num_slowest else []
    return result


def _label(r: dict[str, Any]) -> str:
    rid = str(r.get("request_id"))
    return rid if len(rid) <= 14 else rid[:6] + "…" + rid[-6:]
