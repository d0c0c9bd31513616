"""`tokenloom explain --plot`: a traced run over time, in four panels sharing the time axis:
token budget spent per step (prefill, decode) against the budget; KV blocks (used, cached, free);
queue depth (running, waiting); each request's e2e latency at the time it finished, coloured by
the cause it waited longest for."""
from __future__ import annotations

import os
from typing import Any

from tokenloom.metrics.buckets import WAIT_CAUSES
from tokenloom.metrics.trace import trace_config, trace_requests, trace_steps

_CAUSE_COLORS = {
    "token_budget": "tab:orange",
    "max_num_seqs": "tab:purple",
    "no_kv_blocks": "tab:red",
    "preempted": "tab:brown",
}


def plot_trace(trace: dict[str, Any], path: str | os.PathLike) -> str:
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    steps = trace_steps(trace)
    requests = trace_requests(trace)
    budget = trace_config(trace).get("max_num_batched_tokens")
    if steps:  # hold the last step's values until it ends
        steps = steps + [{**steps[-1], "ts": steps[-1]["ts"] + steps[-1]["dur"]}]
    t = [s["ts"] for s in steps]

    fig, axes = plt.subplots(4, 1, figsize=(11, 11), sharex=True)
    ax = axes[0]
    ax.stackplot(t, [s.get("prefill", 0) for s in steps], [s.get("decode", 0) for s in steps],
                 labels=["prefill", "decode"], step="post", colors=["tab:blue", "tab:green"])
    if budget:
        ax.axhline(budget, color="black", linestyle="--", linewidth=1, label="budget")
    ax.set_ylabel("tokens / step")
    ax.set_title("token budget spent")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[1]
    ax.stackplot(t, [s.get("used", 0) for s in steps], [s.get("cached", 0) for s in steps],
                 [s.get("free", 0) for s in steps], labels=["used", "cached (free)", "free"], step="post",
                 colors=["tab:red", "tab:olive", "tab:gray"])
    ax.set_ylabel("blocks")
    ax.set_title("KV blocks")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[2]
    ax.step(t, [s.get("running", 0) for s in steps], where="post", label="running")
    ax.step(t, [s.get("waiting", 0) for s in steps], where="post", label="waiting")
    ax.set_ylabel("requests")
    ax.set_title("queue depth")
    ax.legend(loc="upper right", fontsize=8)

    ax = axes[3]
    for cause in WAIT_CAUSES + (None,):
        xs = [r["finish_ts"] for r in requests if r.get("dominant_wait") == cause and r.get("e2e") is not None]
        ys = [r["e2e"] for r in requests if r.get("dominant_wait") == cause and r.get("e2e") is not None]
        if xs:
            color = _CAUSE_COLORS.get(cause, "tab:blue")  # type: ignore[arg-type]
            ax.scatter(xs, ys, s=12, color=color, label=f"waited most for {cause or 'nothing'}")
    ax.set_ylabel("e2e latency (s)")
    ax.set_xlabel("time since the first event (s)")
    ax.set_title("requests, at the time they finished")
    if requests:
        ax.legend(loc="upper left", fontsize=8)

    fig.tight_layout()
    path = os.fspath(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
