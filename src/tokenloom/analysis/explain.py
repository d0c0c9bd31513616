"""`tokenloom explain TRACE|--url URL [--api-key KEY] [--top 5] [--json] [--plot out.png]`: where a run's time went.

Reads a trace written with `LLM(trace_path=...)` / `--trace PATH`, or the live ledger of a running
server (`--url http://host:port`, its `GET /ledger`: the same records, for the recent past), and
reports:
- the latency distribution: mean, p50, p90, p99 of e2e, TTFT and TPOT;
- the slowest requests, each with its decomposition (the parts add up to its e2e), the cause
  it waited longest for, and, when it waited for the step in flight, which step that was and
  why it was long (a prefill chunk of K tokens, a full budget, its duration);
- a verdict for the run, in a sentence, with what to change.

The verdict rule: every finished request's latency is split into groups (timeline.group_seconds)
and summed over all requests; the verdict is the group with the largest total:

| verdict | the group's seconds |
|---|---|
| budget-bound | waiting for token budget (directly, or behind a head of line that was) |
| block-bound | waiting for KV blocks (directly or behind the head), and preempted time (wait + recompute) |
| seq-limit-bound | waiting because max_num_seqs requests were running (directly or behind the head) |
| prefill-bound ("long prefills starve decodes") | waiting for a long prefill step to end, and decodes computed in steps that were mostly someone else's prefill |
| grammar-bound | waiting for a structured-output grammar to compile |
| contended | the steps' time the engine's threads were runnable but not running: other processes held the cores (machine_contention) |
| compute-bound | prefill and decode steps, and waiting for any other step in flight to end |
| frontend-bound | tokenize, detokenize, IPC in and out (with the core's output queue), the caller's other work |

Summing seconds (not counting requests) weights each cause by how much latency it cost. The
shares of every group are reported with the verdict, so a close call is visible as one.
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import sys
from typing import Any

from tokenloom import envs
from tokenloom.metrics.core_ledger import is_long_prefill
from tokenloom.metrics.contention import (CONTENDED, CONTENTION_ADVICE, contention_advice, contention_headline,
                                          contention_sentence, machine_summary, verdict_of)
from tokenloom.metrics.timeline import DOMINANT_WAIT_FLOOR, VERDICT_HEADLINES
from tokenloom.metrics.trace import load_trace, trace_config, trace_requests, trace_steps


# What to change, per verdict (the CLI flags of `tokenloom serve`, as in vLLM).
VERDICT_ADVICE = {
    "budget-bound": "raise --max-num-batched-tokens (more tokens per step), or send fewer requests at once",
    "block-bound": "give the KV cache more room (--kv-cache-memory-bytes / --num-kv-blocks), or fewer concurrent "
                   "sequences (--max-num-seqs) so the running ones keep their blocks",
    "seq-limit-bound": "raise --max-num-seqs (more requests decode together)",
    "prefill-bound": "cut prefills into smaller chunks: lower --max-num-batched-tokens so decodes run between "
                     "chunks (chunked-prefill tuning; vLLM's --max-num-batched-tokens and "
                     "--long-prefill-token-threshold)",
    "grammar-bound": "reuse structured-output specs (compiled grammars are cached by spec), or send a "
                     "request's schema before the burst that needs it",
    CONTENDED: CONTENTION_ADVICE,
    "compute-bound": "the steps themselves: a faster dtype or quantization, more cores; batching more "
                     "(--max-num-seqs) buys throughput at this latency",
    "frontend-bound": "the caller's work per request: fewer n children or logprobs, smaller outputs per message",
    "unknown": "",
}


def add_explain_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("explain", help="explain where the time of a traced run (or a running server) went")
    p.add_argument("trace", metavar="TRACE", nargs="?", default=None,
                   help="a trace file written with --trace / LLM(trace_path=...)")
    p.add_argument("--url", default=None, help="a running `tokenloom serve` (http://host:port): its live ledger")
    p.add_argument("--api-key", default=envs.TOKENLOOM_API_KEY,
                   help="the key of a server started with --api-key, for --url (default: $TOKENLOOM_API_KEY)")
    p.add_argument("--top", type=int, default=5, help="how many of the slowest requests to show (default: 5)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    p.add_argument("--plot", metavar="PNG", default=None, help="also draw it: the verdict as the title, each request's parts, steps, budget, "
                   "KV blocks and the queue over time")
    p.set_defaults(func=_run_explain)


def _run_explain(args: argparse.Namespace) -> int:
    if args.top < 0:
        raise ValueError(f"--top must be >= 0, got {args.top}.")
    if (args.trace is None) == (args.url is None):
        raise ValueError("give a TRACE file or --url of a running server (one of them).")
    if args.url is not None:
        trace = fetch_live_trace(args.url, api_key=args.api_key)
    else:
        try:
            trace = load_trace(args.trace)
        except json.JSONDecodeError as e:
            raise ValueError(f"{args.trace} is not a JSON trace: {e}") from None
    report = analyze(trace, top=args.top)
    if args.plot is not None:
        from tokenloom.analysis.plot import plot_trace

        report["plot"] = plot_trace(trace, args.plot, report)
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
    else:
        print(format_report(report))
    return 0


def fetch_live_trace(url: str, timeout: float = 30.0, api_key: str | None = None) -> dict[str, Any]:
    """A running server's `GET /ledger?format=trace`: its recent steps and requests as a trace.
    `api_key`: a server started with --api-key keeps /ledger behind it."""
    import urllib.error
    import urllib.request

    full = url.rstrip("/") + "/ledger?format=trace"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(full, headers=headers), timeout=timeout) as resp:  # noqa: S310
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            given = "the key given was refused" if api_key else "no API key was given"
            raise ValueError(f"{url} answered HTTP {e.code} for its ledger: {given}; pass the server's key with "
                             "--api-key (or $TOKENLOOM_API_KEY).") from None
        raise ValueError(f"could not read the ledger of {url}: {e}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ValueError(f"could not read the ledger of {url}: {e}") from None


# ---- the report -----------------------------------------------------------------------------


def percentile(sorted_values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not sorted_values:
        return math.nan
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def distribution(values: list[float]) -> dict[str, float | int | None]:
    values = sorted(v for v in values if v is not None)
    if not values:
        return {"count": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    return {
        "count": len(values),
        "mean": sum(values) / len(values),
        "p50": percentile(values, 0.5),
        "p90": percentile(values, 0.9),
        "p99": percentile(values, 0.99),
        "max": values[-1],
    }


def analyze(trace: dict[str, Any], top: int = 5) -> dict[str, Any]:
    requests = trace_requests(trace)
    steps = trace_steps(trace)
    verdict, totals, shares = verdict_of(requests)
    parts_total: dict[str, float] = {}
    for r in requests:
        for name, seconds in (r.get("parts") or {}).items():
            parts_total[name] = parts_total.get(name, 0.0) + seconds
    slowest = sorted(requests, key=lambda r: r.get("e2e") or 0.0, reverse=True)[:top]
    budget_used = [
        (s.get("prefill", 0) + s.get("decode", 0)) / s["budget"] for s in steps if s.get("budget")
    ]
    config = trace_config(trace)
    machine = machine_summary(steps)
    headline = VERDICT_HEADLINES.get(verdict, "no finished requests")
    if verdict == CONTENDED:
        headline = contention_headline(machine)
    return {
        "config": config,
        "num_requests": len(requests),
        "num_steps": len(steps),
        "verdict": verdict,
        "headline": headline,
        "machine": machine,
        "advice": contention_advice(machine) if verdict == CONTENDED else VERDICT_ADVICE.get(verdict, ""),
        "group_seconds": totals,
        "group_shares": shares,
        "parts_seconds": parts_total,
        "latency": {
            "e2e": distribution([r.get("e2e") for r in requests]),
            "ttft": distribution([r.get("ttft") for r in requests]),
            "tpot": distribution([r.get("tpot") for r in requests]),
        },
        "steps": {
            "mean_budget_used": sum(budget_used) / len(budget_used) if budget_used else None,
            "mean_prefill_tokens": _mean([s.get("prefill", 0) for s in steps]),
            "mean_decode_tokens": _mean([s.get("decode", 0) for s in steps]),
            "min_free_blocks": min((s.get("free", 0) + s.get("cached", 0) for s in steps), default=None),
            "max_waiting": max((s.get("waiting", 0) for s in steps), default=None),
            "max_running": max((s.get("running", 0) for s in steps), default=None),
        },
        "num_preemptions": sum(r.get("num_preemptions", 0) for r in requests),
        "slowest": [
            {
                "request_id": r.get("request_id"),
                "e2e": r.get("e2e"),
                "ttft": r.get("ttft"),
                "tpot": r.get("tpot"),
                "dominant_wait": r.get("dominant_wait"),
                "wait_by_cause": r.get("wait_by_cause"),
                "num_preemptions": r.get("num_preemptions", 0),
                "parts": {k: v for k, v in (r.get("parts") or {}).items() if v > 0},
                "behind_step": step_waited_behind(r, steps, config),
            }
            for r in slowest
        ],
    }


def step_waited_behind(request: dict[str, Any], steps: list[dict[str, Any]], config: dict[str, Any]) -> dict | None:
    """The step that was in flight when the request reached the core (it waited for its end,
    `queue_step_boundary`), and what made it long; None if it did not wait for one (or the
    trace no longer holds that step)."""
    if (request.get("parts") or {}).get("queue_step_boundary", 0.0) <= 0:
        return None
    received = (request.get("stamps") or {}).get("received_by_core")
    origin = config.get("clock_origin_s")
    if received is None or origin is None or not steps:
        return None
    t = received - origin
    i = bisect.bisect_right([s["ts"] for s in steps], t) - 1
    if i < 0 or t > steps[i]["ts"] + steps[i]["dur"]:
        return None
    s = steps[i]
    prefill, decode, budget = s.get("prefill", 0), s.get("decode", 0), s.get("budget", 0)
    # The busy loop's time before the next step (outputs queued, inputs drained) is waited too.
    gap = steps[i + 1]["ts"] - (s["ts"] + s["dur"]) if i + 1 < len(steps) else 0.0
    return {
        "gap_after": max(gap, 0.0),
        "step": s.get("step"),
        "duration": s["dur"],
        "prefill_tokens": prefill,
        "decode_tokens": decode,
        "budget_full": bool(budget) and prefill + decode >= budget,
        "long_prefill": is_long_prefill(prefill, decode),
    }


def describe_step(b: dict[str, Any]) -> str:
    why = f"a prefill chunk of {b['prefill_tokens']} tokens" if b["prefill_tokens"] else f"{b['decode_tokens']} decodes"
    full = ", the budget full" if b["budget_full"] else ""
    gap = f", then {b['gap_after'] * 1000:.0f} ms before the next step" if b.get("gap_after", 0) > 0.001 else ""
    return f"behind step {b['step']} ({why}{full}, {b['duration'] * 1000:.0f} ms{gap})"


def waited_most(r: dict[str, Any]) -> str:
    """The request's dominant wait, or, when no wait reached DOMINANT_WAIT_FLOOR of its e2e, what
    did take its time (its largest part)."""
    if r.get("dominant_wait"):
        return f"waited most for: {r['dominant_wait']}"
    parts = r.get("parts") or {}
    took = max(parts, key=parts.__getitem__) if parts else None
    e2e = r.get("e2e") or sum(parts.values())
    most = f"; most of its time: {took} ({parts[took] / e2e:.0%})" if took and e2e else ""
    return f"no significant wait (none reached {DOMINANT_WAIT_FLOOR:.0%} of e2e){most}"


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def format_report(report: dict[str, Any]) -> str:
    cfg = report["config"]
    lines = [
        f"{report['num_requests']} requests, {report['num_steps']} steps"
        + (
            f"; budget {cfg.get('max_num_batched_tokens')} tokens/step, max_num_seqs {cfg.get('max_num_seqs')}, "
            f"{cfg.get('num_kv_blocks')} KV blocks of {cfg.get('block_size')}"
            if cfg
            else ""
        ),
        "",
        f"verdict: {report['verdict']}: {report['headline']}",
        "  share of all requests' time: "
        + ", ".join(f"{g} {s:.0%}" for g, s in sorted(report["group_shares"].items(), key=lambda kv: -kv[1])),
        *([f"  what to change: {report['advice']}"] if report.get("advice") else []),
        "",
        f"{'latency (ms)':<14}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}",
    ]
    for name, d in report["latency"].items():
        lines.append(f"{name:<14}" + "".join(f"{_ms(d[k]):>10}" for k in ("mean", "p50", "p90", "p99", "max")))
    st = report["steps"]
    if report["num_steps"]:
        lines += [
            "",
            f"steps: budget used {st['mean_budget_used']:.0%} on average "
            f"({st['mean_prefill_tokens']:.1f} prefill + {st['mean_decode_tokens']:.1f} decode tokens), "
            f"min free blocks {st['min_free_blocks']}, max waiting {st['max_waiting']}, "
            f"preemptions {report['num_preemptions']}",
        ]
    machine = report.get("machine")
    if machine:
        lines += ["", f"machine: {contention_sentence(machine)} "
                      f"({machine['cpu_s']:.2f} CPU s over {machine['step_s']:.2f} s of steps)"]
    if report["slowest"]:
        lines += ["", f"slowest {len(report['slowest'])} requests (parts in ms, they add up to e2e):"]
        for r in report["slowest"]:
            lines.append(
                f"  {r['request_id']}: e2e {_ms(r['e2e'])}  ttft {_ms(r['ttft'])}  tpot {_ms(r['tpot'])}  "
                + waited_most(r)
                + (f"  preempted {r['num_preemptions']}x" if r["num_preemptions"] else "")
            )
            if r.get("behind_step"):
                wait = r["parts"].get("queue_step_boundary", 0.0)
                lines.append(f"      waited {_ms(wait)} ms for the step in flight: {describe_step(r['behind_step'])}")
            lines.append("      " + "  ".join(f"{k} {_ms(v)}" for k, v in r["parts"].items()))
    if "plot" in report:
        lines += ["", f"plot: {report['plot']}"]
    return "\n".join(lines)
