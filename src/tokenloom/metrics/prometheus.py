"""Prometheus exposition for one engine: vLLM's metric names with the `tokenloom:` prefix, or with
`metrics_prefix="vllm"` (`serve --metrics-prefix vllm`) those vLLM also has under vLLM's own
`vllm:` names (stats.VLLM_NAMES), so its dashboards and alerts work unchanged.

Every engine owns its `CollectorRegistry`, so several servers (or engines in one test process)
never collide on metric names. Fed from two places only:
- `record_scheduler_stats()`: the `SchedulerStats` of each engine step (and, at scrape time, a
  fresh `get_state()` of the core, because an idle core sends no more steps after the last one);
- `record_finished_request()`: one call per finished request, with the latencies the caller
  measured (and `record_request_output()` with the output itself, for the ledger's metrics:
  wait seconds by reason, latency parts, budget per step, blocks by state; see metrics/stats.py).

With data parallelism (`-dp M`) the metrics above stay the engine's totals (gauges summed over
the replicas, counters over their steps), and `tokenloom:replica_*` metrics with an `engine`
label (vLLM's label for a DP replica: `engine="0"`) show each replica: whether it is up, its
running and waiting requests, KV cache usage, and the core requests sent to it, finished by it
and failed by its death. They exist only when M > 1.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenloom.messages import SchedulerStats
from tokenloom.metrics.replica import ReplicaMetrics
from tokenloom.metrics.stats import LedgerMetrics, metric_name

if TYPE_CHECKING:
    from tokenloom.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

# Bucket bounds in seconds, a little wider than vLLM's at the slow end: a CPU engine is slow.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_FINISH_REASONS = ("stop", "length", "abort", "error")


class PrometheusMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 metrics_prefix: str = "tokenloom", data_parallel_size: int = 1) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self._last_totals: dict[tuple[int, str], int] = {}  # (engine, name) -> the core's running total
        labels = ["model_name"]
        r = self.registry

        def full(name: str) -> str:
            return metric_name(name, metrics_prefix)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(full(name), doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(full(name), doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(full(name), doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.num_requests_running = gauge("num_requests_running", "Requests in the running set of the scheduler.")
        self.num_requests_waiting = gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0 to 1).")
        self.num_kv_blocks_used = gauge("num_kv_blocks_used", "KV cache blocks held by requests.")
        self.num_kv_blocks_free = gauge("num_kv_blocks_free", "KV cache blocks free (including cached free blocks).")
        self.num_kv_blocks_total = gauge("num_kv_blocks_total", "KV cache blocks in the pool.")
        # Leak detectors, refreshed at scrape time only (from get_state()): both are 0 when idle.
        self.num_requests_in_core = gauge(
            "num_requests_in_engine_core", "Requests the engine core's scheduler holds (waiting, running or preempted)."
        )
        self.num_requests_in_runner = gauge(
            "num_requests_in_model_runner", "Requests holding a row of the model runner's persistent batch."
        )

        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        success = Counter(
            full("request_success"), "Finished requests, by finish reason.", labels + ["finished_reason"], registry=r
        )
        self._request_success = {reason: success.labels(model_name, reason) for reason in _FINISH_REASONS}
        self.request_errors = counter(
            "request_errors",
            "Requests the engine failed on their own (finish_reason=error) while it kept running: rejected "
            "by the engine core or faulted while sampling. A dead engine core is not counted here.",
        )
        # How old the scrape-time gauges are (see AsyncLLM.refresh_metrics): 0 right after a
        # refresh; growing while the engine core does not answer in time.
        self.metrics_staleness = gauge(
            "metrics_staleness_seconds", "Seconds since the engine core's state was last read for these gauges."
        )

        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Time from arrival to the first generated token.", _TTFT_BUCKETS
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Time from arrival to the final output.", _E2E_BUCKETS
        )
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request.",
            _TOKEN_LATENCY_BUCKETS,
        )
        self.ledger = LedgerMetrics(r, model_name, metrics_prefix)  # the ledger's metrics, in the same registry
        self.replicas: ReplicaMetrics | None = (
            ReplicaMetrics(r, model_name, full, data_parallel_size) if data_parallel_size > 1 else None)

    def record_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        """One step of engine core `engine` (its data-parallel index; 0 without DP)."""
        if self.replicas is not None:
            self.replicas.record_stats(engine, stats)
            self._set_totals()
        else:
            self.num_requests_running.set(stats.num_running_reqs)
            self.num_requests_waiting.set(stats.num_waiting_reqs)
            self._set_blocks(stats.num_free_blocks, stats.num_total_blocks)
        # The core reports these three as running totals; a counter takes the increase.
        for counter, name in (
            (self.num_preemptions, "num_preemptions"),
            (self.prefix_cache_queries, "prefix_cache_queries"),
            (self.prefix_cache_hits, "prefix_cache_hits"),
        ):
            total = getattr(stats, name)
            last = self._last_totals.get((engine, name), 0)
            increase = total - last if total >= last else total  # a smaller total: it was reset
            if increase:
                counter.inc(increase)
            self._last_totals[(engine, name)] = total
        self.ledger.record_scheduler_stats(stats)
        if self.replicas is not None:
            self.ledger.set_blocks(*self.replicas.blocks())

    def _set_totals(self) -> None:
        assert self.replicas is not None
        running, waiting = self.replicas.requests()
        self.num_requests_running.set(running)
        self.num_requests_waiting.set(waiting)
        free, _, total = self.replicas.blocks()
        self._set_blocks(free, total)

    def record_replica_states(self, states: dict[int, dict], sent: list[int], finished: list[int]) -> None:
        """Scrape time with data parallelism: each live replica's `get_state()` (by index), and
        the core requests the front end sent to each and saw finish."""
        assert self.replicas is not None
        for engine, state in states.items():
            self.replicas.record_state(engine, state)
        self.replicas.record_counts(sent, finished)
        self._set_totals()
        self.ledger.set_blocks(*self.replicas.blocks())
        totals: dict[str, int] = {}
        for state in states.values():
            for k in ("num_requests", "num_runner_requests"):
                totals[k] = totals.get(k, 0) + state.get(k, 0)
        self.num_requests_in_core.set(totals.get("num_requests", 0))
        self.num_requests_in_runner.set(totals.get("num_runner_requests", 0))

    def replica_died(self, engine: int, num_failed: int) -> None:
        """Replica `engine` is gone, failing `num_failed` core requests: it is down, and counts
        no more in the totals."""
        if self.replicas is not None:
            self.replicas.died(engine, num_failed)
            self._set_totals()

    def record_core_state(self, state: dict) -> None:
        """A `get_state()` snapshot of the core (see EngineCore.get_state)."""
        self.num_requests_running.set(state.get("num_running", 0))
        self.num_requests_waiting.set(state.get("num_waiting", 0))
        self.num_requests_in_core.set(state.get("num_requests", 0))
        self.num_requests_in_runner.set(state.get("num_runner_requests", 0))
        if "num_free_blocks" in state and "num_total_blocks" in state:
            self._set_blocks(state["num_free_blocks"], state["num_total_blocks"])
        self.ledger.record_core_state(state)

    def _set_blocks(self, num_free: int, num_total: int) -> None:
        if num_total <= 0:
            return
        self.num_kv_blocks_total.set(num_total)
        self.num_kv_blocks_free.set(num_free)
        self.num_kv_blocks_used.set(num_total - num_free)
        self.kv_cache_usage_perc.set((num_total - num_free) / num_total)

    def record_finished_request(
        self,
        finish_reason: str,
        num_prompt_tokens: int,
        num_generation_tokens: int,
        e2e_s: float,
        ttft_s: float | None,
    ) -> None:
        counter = self._request_success.get(finish_reason)
        if counter is not None:
            counter.inc()
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generation_tokens)
        self.e2e_request_latency.observe(e2e_s)
        if ttft_s is not None:
            self.time_to_first_token.observe(ttft_s)
            if num_generation_tokens > 1:
                self.time_per_output_token.observe((e2e_s - ttft_s) / (num_generation_tokens - 1))

    def record_request_output(self, output: RequestOutput) -> None:
        """A finished output, for the ledger's metrics."""
        self.ledger.record_finished(output)

    def render(self) -> bytes:
        return generate_latest(self.registry)
