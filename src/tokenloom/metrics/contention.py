"""The run's verdict over its requests, and the machine's side of it: how much of its step time the
engine waited to run (machine contention) and how many cores other processes used meanwhile.

Shared by `tokenloom explain` (analysis/explain.py, over a trace) and the live view (`GET /ledger`,
metrics/live.py, over the recent past), so both name a contended run the same way:

    contended: the engine waited to run for X% of its step time; other processes used N of the M cores

X is the steps' run_delay (ops/schedstat.py) over their duration; N is the mean of the steps'
`other_cores` (/proc/stat's non-idle time of the engine's cores minus its own CPU time).
In a container with a CPU quota, when the quota's throttling is a good share of that wait
(`THROTTLED_SHARE`: the throttled time is part of run_delay, ops/schedstat.py), the cause is the
quota, not other processes, and the sentence and the advice say so:

    contended: throttled by the container's CPU quota (cpu.max Q/P, C cores) for X% of its step time
    (it waited to run for Y% in all)
"""
from __future__ import annotations

from typing import Any

from tokenloom.metrics.timeline import VERDICT_GROUPS, VERDICT_HEADLINES, group_seconds

CONTENDED = "contended"
CONTENTION_ADVICE = (
    "give the engine cores of its own: pin it (taskset/cpuset) away from the other work or move that work "
    "off its cores; run fewer threads (TOKENLOOM_NUM_THREADS) so each keeps a core; or run it on another "
    "machine")
THROTTLED_ADVICE = (
    "raise the container's CPU quota (cpu.max; docker --cpus, a Kubernetes CPU limit) to the cores the "
    "engine uses, or run fewer threads (TOKENLOOM_NUM_THREADS) so that its quota lasts the period")
# The throttled share of the wait from which the quota is named as the cause. Less than half: the
# throttled time is a floor (once its cgroup is unthrottled a thread still waits for the threads
# that ran meanwhile to leave its core, and run_delay counts that too), and a container's owner
# can change its quota where the other processes on the host are out of reach.
THROTTLED_SHARE = 0.3


def verdict_of(requests: list[dict[str, Any]]) -> tuple[str, dict[str, float], dict[str, float]]:
    """(verdict, seconds per group, share per group) over the given request summaries: the group
    holding the most request time (timeline.group_seconds); "unknown" when they hold none."""
    totals = dict.fromkeys(VERDICT_GROUPS, 0.0)
    for r in requests:
        for group, seconds in group_seconds(r.get("parts") or {}, r.get("wait_by_cause") or {}).items():
            totals[group] += seconds
    whole = sum(totals.values())
    if whole <= 0:
        return "unknown", totals, dict.fromkeys(VERDICT_GROUPS, 0.0)
    shares = {g: s / whole for g, s in totals.items()}
    return max(totals, key=totals.__getitem__), totals, shares


def _step_seconds(s: dict[str, Any]) -> float:
    if "dur" in s:  # a trace's step (trace.trace_steps)
        return s["dur"]
    return s.get("schedule", 0.0) + s.get("execute", 0.0) + s.get("update", 0.0) + s.get("loop", 0.0)


def machine_summary(steps: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Over the steps that measured it (a trace's steps or the live view's rows): the share of
    their time the engine waited to run, its CPU seconds, and the cores other processes used (of
    how many). None when no step measured it."""
    measured = [s for s in steps if s.get("cores")]
    if not measured:
        return None
    seconds = sum(_step_seconds(s) for s in measured)
    delay = sum(s.get("run_delay_s", s.get("run_delay", 0.0)) for s in measured)
    throttled = sum(s.get("throttled_s", s.get("throttled", 0.0)) for s in measured)
    quotas = [s["quota"] for s in measured if s.get("quota")]
    return {
        "contention_ratio": min(delay / seconds, 1.0) if seconds > 0 else 0.0,
        "run_delay_s": delay,
        "step_s": seconds,
        "cpu_s": sum(s.get("cpu_s", s.get("cpu", 0.0)) for s in measured),
        "other_cores": sum(s.get("other_cores", 0.0) for s in measured) / len(measured),
        "cores": max(s["cores"] for s in measured),
        "num_steps": len(measured),
        "throttled_s": min(throttled, delay),
        "quota": quotas[-1] if quotas else "",
    }


def throttled(machine: dict[str, Any] | None) -> bool:
    """Whether the container's CPU quota caused most of the engine's wait to run."""
    return bool(machine and machine.get("quota") and machine["run_delay_s"] > 0
                and machine["throttled_s"] >= THROTTLED_SHARE * machine["run_delay_s"])


def _quota_words(quota: str) -> str:
    """"cpu.max 20000/100000" -> "cpu.max 20000/100000, 0.2 cores"."""
    try:
        q, p = quota.split()[-1].split("/")
        return f"{quota}, {int(q) / int(p):.2g} cores"
    except (ValueError, IndexError, ZeroDivisionError):
        return quota


# The headline of a contended run whose wait was mostly the quota's (VERDICT_HEADLINES' otherwise).
THROTTLED_HEADLINE = "the container held the engine to its CPU quota"


def contention_headline(machine: dict[str, Any] | None) -> str:
    """A contended run's headline with its numbers, naming the cause that held the engine."""
    head = THROTTLED_HEADLINE if throttled(machine) else VERDICT_HEADLINES[CONTENDED]
    return f"{head}: {contention_sentence(machine)}"


def contention_advice(machine: dict[str, Any] | None) -> str:
    return THROTTLED_ADVICE if throttled(machine) else CONTENTION_ADVICE


def contention_sentence(machine: dict[str, Any] | None) -> str:
    """What the verdict says of a contended run, with its numbers."""
    if not machine:
        return "the engine waited to run (other processes held its cores)"
    if throttled(machine):
        ratio = machine["throttled_s"] / machine["step_s"] if machine["step_s"] > 0 else 0.0
        return (f"throttled by the container's CPU quota ({_quota_words(machine['quota'])}) for {min(ratio, 1.0):.0%} "
                f"of its step time (it waited to run for {machine['contention_ratio']:.0%} in all)")
    return (f"the engine waited to run for {machine['contention_ratio']:.0%} of its step time; other processes "
            f"used {machine['other_cores']:.1f} of the {machine['cores']} cores")


def machine_verdict(requests: list[dict[str, Any]], steps: list[dict[str, Any]]) -> dict[str, Any]:
    """The live view's verdict: the group holding the most of the requests' time, and for a
    contended run the sentence and what to change."""
    verdict, _, shares = verdict_of(requests)
    machine = machine_summary(steps)
    out: dict[str, Any] = {"verdict": verdict, "share": shares.get(verdict, 0.0), "machine": machine}
    if verdict == CONTENDED:
        out["headline"] = f"{CONTENDED}: {contention_sentence(machine)}"
        out["advice"] = contention_advice(machine)
    return out
