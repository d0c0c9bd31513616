"""Per-replica metrics for data parallelism (`-dp M`): one series per engine core, labelled
`engine="<index>"` as vLLM labels its DP engines, next to the unlabelled totals that
`PrometheusMetrics` keeps. The last known state of each replica is kept here so the totals are
the sum over the replicas alive, whichever replica's step arrived last."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from tokenloom.messages import SchedulerStats


@dataclass(slots=True)
class _Last:
    running: int = 0
    waiting: int = 0
    free: int = 0
    cached: int = 0
    total: int = 0


class ReplicaMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, full: Callable[[str], str], size: int) -> None:
        labels = ["model_name", "engine"]
        engines = [str(i) for i in range(size)]

        def gauges(name: str, doc: str) -> list:
            g = Gauge(full(name), doc, labels, registry=registry)
            return [g.labels(model_name, e) for e in engines]

        def counters(name: str, doc: str) -> list:
            c = Counter(full(name), doc, labels, registry=registry)
            return [c.labels(model_name, e) for e in engines]

        self.up = gauges("replica_up", "1 while the data-parallel replica (engine core) is alive, 0 once it died.")
        self.running = gauges("replica_num_requests_running", "Requests in the replica's running set.")
        self.waiting = gauges("replica_num_requests_waiting", "Requests waiting in the replica's scheduler.")
        self.kv_usage = gauges("replica_kv_cache_usage_perc", "Fraction of the replica's KV cache blocks in use (0 to 1).")
        self.sent = counters("replica_requests_sent", "Core requests the front end sent to the replica.")
        self.finished = counters("replica_requests_finished",
                                 "Core requests of the replica that finished (any reason, aborts included).")
        self.failed = counters("replica_requests_failed", "Core requests in flight on the replica when it died.")
        for g in self.up:
            g.set(1)
        self._last = [_Last() for _ in engines]
        self._alive = [True] * size
        self._counted_sent = [0] * size
        self._counted_finished = [0] * size

    def record_stats(self, engine: int, stats: SchedulerStats) -> None:
        self._record(engine, stats.num_running_reqs, stats.num_waiting_reqs, stats.num_free_blocks,
                     stats.num_cached_free_blocks, stats.num_total_blocks)

    def record_state(self, engine: int, state: dict) -> None:
        """A `get_state()` snapshot of the replica (scrape time: an idle core sends no steps)."""
        self._record(engine, state.get("num_running", 0), state.get("num_waiting", 0), state.get("num_free_blocks", 0),
                     state.get("num_cached_free_blocks", 0), state.get("num_total_blocks", 0))

    def _record(self, engine: int, running: int, waiting: int, free: int, cached: int, total: int) -> None:
        if not self._alive[engine]:
            return  # a late message of a dead replica
        self._last[engine] = _Last(running, waiting, free, cached, total)
        self.running[engine].set(running)
        self.waiting[engine].set(waiting)
        if total > 0:
            self.kv_usage[engine].set((total - free) / total)

    def record_counts(self, sent: list[int], finished: list[int]) -> None:
        """The front end's running totals per replica; the counters take the increase."""
        for engine, (s, f) in enumerate(zip(sent, finished)):
            if s > self._counted_sent[engine]:
                self.sent[engine].inc(s - self._counted_sent[engine])
                self._counted_sent[engine] = s
            if f > self._counted_finished[engine]:
                self.finished[engine].inc(f - self._counted_finished[engine])
                self._counted_finished[engine] = f

    def died(self, engine: int, num_failed: int) -> None:
        self._alive[engine] = False
        self._last[engine] = _Last()
        self.up[engine].set(0)
        self.running[engine].set(0)
        self.waiting[engine].set(0)
        self.kv_usage[engine].set(0)
        if num_failed:
            self.failed[engine].inc(num_failed)

    def requests(self) -> tuple[int, int]:
        """Running and waiting requests over the live replicas."""
        return sum(x.running for x in self._last), sum(x.waiting for x in self._last)

    def blocks(self) -> tuple[int, int, int]:
        """Free, cached-free and total KV blocks over the live replicas."""
        return (sum(x.free for x in self._last), sum(x.cached for x in self._last), sum(x.total for x in self._last))
