"""`tokenloom explain --plot`: one picture that answers "why was this slow".

- The title is the verdict, in a sentence, with its share of all requests' time and what to change.
- Left: where each request's time went, a stacked bar per request (slices: plot_parts.SLICES),
  or for many requests the mean request of each e2e percentile group plus the slowest few.
- Right, on one time axis: each step's duration (log scale, long prefill steps apart from the
  rest, so short decode steps and long prefills are both visible, with how long each waited to
  run: machine contention); the tokens each step
  computed, prefill and decode apart on a log scale with the budget; KV blocks used as a share of
  the pool, scaled to what was used (a few dozen of thousands of blocks still show); the queue.
- The slowest requests are marked on every panel: their bars are outlined and numbered, and
  their lifetimes are shaded with the same numbers on the time panels.
"""
from __future__ import annotations

import math
import os
import textwrap
from typing import Any

from tokenloom.metrics.core_ledger import is_long_prefill
from tokenloom.analysis.plot_parts import SLICES, bars
from tokenloom.metrics.trace import trace_config, trace_requests, trace_steps

NUM_SLOWEST = 3
# Beyond this many steps the time panels (but the step durations) show interval means.
MAX_POINTS = 1000
_SLOW_COLORS = ("#d62728", "#ff7f0e", "#bcbd22")


def plot_trace(trace: dict[str, Any], path: str | os.PathLike, report: dict[str, Any], dpi: int = 100) -> str:
    """Draws `trace` with the verdict of `report` (explain.analyze of the same trace) to `path`."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    steps = trace_steps(trace)
    requests = [r for r in trace_requests(trace) if r.get("e2e") is not None]
    config = trace_config(trace)
    slowest = sorted(requests, key=lambda r: r["e2e"], reverse=True)[:NUM_SLOWEST]

    fig = plt.figure(figsize=(16, 10))
    grid = fig.add_gridspec(4, 2, width_ratios=(1, 1.5), hspace=0.6, wspace=0.22, top=0.86, bottom=0.07,
                            left=0.12, right=0.97)
    _title(fig, report)
    _request_bars(fig.add_subplot(grid[:, 0]), requests)
    axes = [fig.add_subplot(grid[0, 1])]
    axes += [fig.add_subplot(grid[i, 1], sharex=axes[0]) for i in range(1, 4)]
    _step_durations(axes[0], steps)
    # Many steps are drawn as means over short intervals: a trend a reader can follow.
    series = binned(steps) if len(steps) > MAX_POINTS else steps
    _step_tokens(axes[1], series, config.get("max_num_batched_tokens"))
    _kv_blocks(axes[2], series, config.get("num_kv_blocks"))
    _queue(axes[3], series, config.get("max_num_seqs"))
    if series is not steps:
        axes[1].set_title(f"token budget spent per step (mean of the steps in each of {len(series)} intervals)",
                          fontsize=11)
    for ax in axes:
        # Every axis with its ticks and units: the shared time axis is labelled on each panel.
        ax.tick_params(axis="x", labelbottom=True)
        ax.set_xlabel("time since the first event (s)", fontsize=8 if ax is not axes[3] else None)
        _mark_slowest(ax, slowest)
    path = os.fspath(path)
    fig.savefig(path, dpi=dpi)
    plt.close(fig)
    return path


def figure_title(report: dict[str, Any]) -> str:
    """The picture's title: the verdict in a sentence, and its share of all requests' time."""
    verdict = report.get("verdict", "unknown")
    share = (report.get("group_shares") or {}).get(verdict, 0.0)
    headline = report.get("headline") or verdict
    if "_" not in headline.split(" ", 1)[0]:  # a flag's name keeps its case
        headline = headline[:1].upper() + headline[1:]
    return f"{headline}  ({verdict}: {share:.0%} of all requests' time)"


def _title(fig, report: dict[str, Any]) -> None:
    e2e = (report.get("latency") or {}).get("e2e") or {}
    stats = ""
    if e2e.get("count"):
        stats = f"{e2e['count']} requests, e2e p50 {e2e['p50']:.2f} s, p99 {e2e['p99']:.2f} s, max {e2e['max']:.2f} s"
    fig.suptitle(figure_title(report), fontsize=17, fontweight="bold", y=0.985)
    advice = report.get("advice") or ""
    lines = [stats] + textwrap.wrap(f"what to change: {advice}", 150) if advice else [stats]
    fig.text(0.5, 0.94, "\n".join(x for x in lines if x), ha="center", va="top", fontsize=10.5, color="#333333")


def _request_bars(ax, requests: list[dict[str, Any]]) -> None:
    from matplotlib.patches import Patch

    rows = bars(requests, NUM_SLOWEST)
    labels = []
    used: set[str] = set()
    for y, (label, slices, rank) in enumerate(rows):
        left = 0.0
        for name, color in SLICES:
            width = slices[name]
            if width > 0:
                ax.barh(y, width, left=left, color=color, height=0.75)
                used.add(name)
                left += width
        if rank is not None:
            i = rank
            ax.barh(y, left, height=0.75, fill=False, edgecolor=_SLOW_COLORS[i % 3], linewidth=2.5)
            ax.text(left, y, f"  #{i + 1}  {left:.2f} s", va="center", fontsize=9, fontweight="bold",
                    color=_SLOW_COLORS[i % 3])
        labels.append(label)
    ax.set_yticks(range(len(rows)), labels, fontsize=8 if len(rows) > 20 else 9)
    ax.set_ylabel("request (id), fastest at the bottom" if len(rows) == len(requests) else "requests")
    ax.set_xlabel("seconds (the slices add up to each request's e2e latency)")
    if len(rows) == len(requests):
        ax.set_title("where each request's time went", fontsize=11)
    else:
        ax.set_title("where the time went: mean request per e2e percentile group; the slowest", fontsize=11)
    ax.margins(x=0.18)
    handles = [Patch(color=color, label=name) for name, color in SLICES if name in used]
    ax.legend(handles=handles, loc="lower right", fontsize=8, framealpha=0.9)
    ax.grid(axis="x", alpha=0.3)


def binned(steps: list[dict[str, Any]], num_bins: int = MAX_POINTS // 2) -> list[dict[str, Any]]:
    """The steps as `num_bins` intervals of equal time, each the mean of its steps' counts."""
    keys = ("prefill", "decode", "used", "cached", "free", "running", "waiting")
    start, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
    width = (end - start) / num_bins or 1.0
    sums: dict[int, list[float]] = {}
    for s in steps:
        b = min(int((s["ts"] - start) / width), num_bins - 1)
        acc = sums.setdefault(b, [0.0] * (len(keys) + 1))
        for i, k in enumerate(keys):
            acc[i] += s.get(k, 0)
        acc[-1] += 1
    return [{"ts": start + b * width, "dur": width, **{k: acc[i] / acc[-1] for i, k in enumerate(keys)}}
            for b, acc in sorted(sums.items())]


def _steps_xy(steps, key) -> tuple[list[float], list[float]]:
    return [s["ts"] for s in steps], [key(s) for s in steps]


def _step_durations(ax, steps: list[dict[str, Any]]) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    kinds = (
        ("long prefill step", "#e7298a", lambda s: is_long_prefill(s.get("prefill", 0), s.get("decode", 0))),
        ("step with a prefill", "#1f77b4",
         lambda s: s.get("prefill", 0) > 0 and not is_long_prefill(s.get("prefill", 0), s.get("decode", 0))),
        ("decode-only step", "#2ca02c", lambda s: s.get("prefill", 0) == 0),
    )
    size = 14 if len(steps) < 500 else 4
    for label, color, keep in kinds:
        chosen = [s for s in steps if keep(s) and s["dur"] > 0]
        if chosen:
            x, y = _steps_xy(chosen, lambda s: s["dur"] * 1000)
            ax.scatter(x, y, s=size, color=color, label=f"{label} ({len(chosen)})", zorder=3)
    delayed = [s for s in steps if s.get("run_delay_s", 0.0) > 0 and s["dur"] > 0]
    if delayed:
        x, y = _steps_xy(delayed, lambda s: min(s["run_delay_s"], s["dur"]) * 1000)
        ax.scatter(x, y, s=size * 2, marker="x", color="#17becf", zorder=4,
                   label=f"of which waited to run: machine contention ({len(delayed)})")
    ax.set_yscale("log")
    durations = [s["dur"] * 1000 for s in steps if s["dur"] > 0]
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=_log_subs(durations)))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: ""))
    ax.set_ylabel("step duration, ms (log)")
    ax.set_title("step duration", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    if steps:
        ax.legend(loc="upper right", fontsize=8)


def _log_subs(values: list[float]) -> tuple[float, ...]:
    """The mantissas of a log axis's labelled ticks: the powers of ten alone over several
    decades, more within fewer, so that a range inside one decade still gets labelled ticks."""
    if not values or min(values) <= 0:
        return (1.0,)
    decades = math.log10(max(values) / min(values))
    if decades > 2:
        return (1.0,)
    if decades > 0.7:
        return (1.0, 2.0, 5.0)
    return tuple(float(m) for m in range(1, 10))


def _step_tokens(ax, steps: list[dict[str, Any]], budget: int | None) -> None:
    x, prefill = _steps_xy(steps, lambda s: s.get("prefill", 0))
    _, decode = _steps_xy(steps, lambda s: s.get("decode", 0))
    ax.step(x, prefill, where="post", color="#1f77b4", label="prefill tokens", linewidth=1.2)
    ax.step(x, decode, where="post", color="#2ca02c", label="decode tokens", linewidth=1.2)
    ax.set_yscale("symlog", linthresh=1)
    if budget:
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label=f"budget ({budget})")
        ax.set_ylim(0, budget * 3)
    else:
        ax.set_ylim(bottom=0)
    ax.set_ylabel("tokens (log)")
    ax.set_title("token budget spent per step", fontsize=11)
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper right", fontsize=8)


def _kv_blocks(ax, steps: list[dict[str, Any]], num_blocks: int | None) -> None:
    total = num_blocks or max((s.get("free", 0) + s.get("cached", 0) + s.get("used", 0) for s in steps), default=0)
    if not total:
        ax.set_title("KV blocks (none recorded)", fontsize=11)
        return
    x, used = _steps_xy(steps, lambda s: 100.0 * s.get("used", 0) / total)
    _, cached = _steps_xy(steps, lambda s: 100.0 * s.get("cached", 0) / total)
    ax.stackplot(x, used, cached, step="post", colors=["#d62728", "#bcbd22"],
                 labels=["used by requests", "cached (free, reusable)"], alpha=0.85)
    peak = max((u + c for u, c in zip(used, cached)), default=0.0)
    ax.set_ylim(0, min(100.0, max(peak * 1.25, 1.0)))
    if peak * 1.25 >= 100.0:
        ax.axhline(100.0, color="black", linestyle="--", linewidth=1, label="pool full")
    peak_used = max(used, default=0.0)
    ax.set_ylabel("% of the pool")
    ax.set_title(f"KV blocks: peak {peak_used:.1f}% used of {total} blocks (axis scaled to the peak)", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)


def _queue(ax, steps: list[dict[str, Any]], max_num_seqs: int | None) -> None:
    x, running = _steps_xy(steps, lambda s: s.get("running", 0))
    _, waiting = _steps_xy(steps, lambda s: s.get("waiting", 0))
    ax.step(x, running, where="post", color="#2ca02c", label="running")
    ax.step(x, waiting, where="post", color="#ff7f0e", label="waiting")
    if max_num_seqs and max_num_seqs <= 2 * max(running + waiting + [1]):
        ax.axhline(max_num_seqs, color="#9467bd", linestyle="--", linewidth=1, label=f"max_num_seqs ({max_num_seqs})")
    ax.set_ylabel("requests")
    ax.set_title("queue", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper right", fontsize=8)


def _mark_slowest(ax, slowest: list[dict[str, Any]]) -> None:
    """Shades each slow request's lifetime (arrival to returned), numbered as in the bars."""
    for i, r in enumerate(slowest):
        end = r["finish_ts"]
        start = end - r["e2e"]
        color = _SLOW_COLORS[i % 3]
        ax.axvspan(start, end, color=color, alpha=0.07, zorder=0)
        ax.axvline(end, color=color, linewidth=1, linestyle=":", zorder=1)
        ax.annotate(f"#{i + 1}", xy=(end, 0.97 - 0.12 * i), xycoords=("data", "axes fraction"), fontsize=8,
                    color=color, fontweight="bold", ha="right", va="top")
