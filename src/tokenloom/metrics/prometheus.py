"""Prometheus exposition for one engine: vLLM's metric names with the `tokenloom:` prefix, or with
`metrics_prefix="vllm"` (`serve --metrics-prefix vllm`) those vLLM also has under vLLM's own
`vllm:` names (stats.VLLM_NAMES), so dashboards and alerts written for vLLM's current metrics
find their series. vLLM's deprecated `gpu_cache_usage_perc` and `time_per_output_token_seconds`
are not among them because vLLM no longer exports them: its 0.12 PrometheusStatLogger has no
`gpu_cache_usage_perc` and shows `time_per_output_token_seconds` only with
`--show-hidden-metrics-for-version=0.11` ("remove in 0.13"), and its later histogram bucket table
(vllm/v1/metrics/buckets.py) has no family for it. Their replacements are `kv_cache_usage_perc`
and `inter_token_latency_seconds`.

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

Per finished request, vLLM's request-size histograms: `request_prompt_tokens` and
`request_generation_tokens` (one observation per completion, as vLLM observes each of the n
child requests it fans a request out into), `request_params_max_tokens` (likewise per
completion), `request_params_n` and `request_max_num_generation_tokens` (once per user request,
when its last completion finished). Their token buckets are vLLM's 1-2-5 series up to
max_model_len. Latency histograms, `request_success` and the token counters stay per user
request: tokenloom times the request the caller sent (its parts add up to its e2e,
metrics/timeline.py), not each child, whose stamps are not kept apart.

With `metrics_prefix="vllm"` the metrics under vLLM's names also carry vLLM's `engine` label
(`engine="0"`), so a query written for vLLM with `{engine="0"}` matches. Not with data
parallelism: there the vLLM-named series are the totals over all replicas, which no single
engine index describes; each replica's own series are `tokenloom:replica_*{engine}`.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tokenloom.messages import SchedulerStats
from tokenloom.metrics.replica import ReplicaMetrics
from tokenloom.metrics.stats import LedgerMetrics, MetricNaming

if TYPE_CHECKING:
    from tokenloom.outputs import RequestOutput

CONTENT_TYPE = CONTENT_TYPE_LATEST

# vLLM's bucket bounds in seconds (vllm/v1/metrics/buckets.py), so a vLLM dashboard's quantiles
# mean the same here. They reach far on purpose: a long prompt prefilled on a CPU is slow to its
# first token, and a request beyond the last bound is only counted in +Inf, where no quantile
# can place it.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
                 80.0, 160.0, 640.0, 2560.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
                960.0, 1920.0, 7680.0)
_TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                          40.0, 80.0)
_PARAMS_N_BUCKETS = (1, 2, 5, 10, 20)
# The token histograms' buckets run to max_model_len, as vLLM's; an owner that does not say
# gets a generous cap (at worst, buckets no request can reach).
_DEFAULT_MAX_MODEL_LEN = 131072
_FINISH_REASONS = ("stop", "length", "abort", "error")


def build_1_2_5_buckets(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value` (100 -> up to 100)."""
    buckets: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(buckets)
            buckets.append(mantissa * scale)
        scale *= 10


class _Metrics:
    """Declares a metric in `registry`, under its name and labels as `naming` gives them, and
    returns its one labelled child."""

    def __init__(self, naming: MetricNaming, registry: CollectorRegistry) -> None:
        self.naming = naming
        self.registry = registry

    def gauge(self, name: str, doc: str) -> Gauge:
        labels = self.naming.labels(name)
        return Gauge(self.naming.full(name), doc, list(labels), registry=self.registry).labels(**labels)

    def counter(self, name: str, doc: str) -> Counter:
        labels = self.naming.labels(name)
        return Counter(self.naming.full(name), doc, list(labels), registry=self.registry).labels(**labels)

    def histogram(self, name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
        labels = self.naming.labels(name)
        return Histogram(self.naming.full(name), doc, list(labels), buckets=buckets,
                         registry=self.registry).labels(**labels)


class PrometheusMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None,
                 metrics_prefix: str = "tokenloom", data_parallel_size: int = 1,
                 max_model_len: int | None = None) -> None:
        """`max_model_len`: where the request-size histograms' buckets end (vLLM's choice); None:
        `_DEFAULT_MAX_MODEL_LEN`."""
        self.registry = registry if registry is not None else CollectorRegistry()
        self._last_totals: dict[tuple[int, str], int] = {}  # (engine, name) -> the core's running total
        naming = MetricNaming(model_name, metrics_prefix,
                              engine="0" if metrics_prefix == "vllm" and data_parallel_size == 1 else None)
        full = naming.full
        r = self.registry

        make = _Metrics(naming, r)
        self._add_scheduler_gauges(make)
        self._add_counters(make)
        self._add_freshness_gauges(make)
        self._add_histograms(make, max_model_len)
        self.ledger = LedgerMetrics(r, naming)  # the ledger's metrics, in the same registry
        self.replicas: ReplicaMetrics | None = (
            ReplicaMetrics(r, model_name, full, data_parallel_size) if data_parallel_size > 1 else None)

    def _add_scheduler_gauges(self, make: _Metrics) -> None:
        gauge = make.gauge
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

    def _add_counters(self, make: _Metrics) -> None:
        counter, naming, full, r = make.counter, make.naming, make.naming.full, make.registry
        self.num_preemptions = counter("num_preemptions", "Requests preempted by the scheduler.")
        self.prefix_cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        # Speculative decoding (vLLM's names; 0 without a speculative_config).
        self.spec_decode_num_drafts = counter("spec_decode_num_drafts", "Drafts verified (one per request and step with draft tokens).")
        self.spec_decode_num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens verified.")
        self.spec_decode_num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        per_pos_labels = naming.labels("spec_decode_num_accepted_tokens_per_pos")
        per_pos = Counter(full("spec_decode_num_accepted_tokens_per_pos"), "Draft tokens accepted, by position in the draft.",
                          [*per_pos_labels, "position"], registry=r)
        self._spec_per_pos = lambda pos: per_pos.labels(**per_pos_labels, position=str(pos))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        success_labels = naming.labels("request_success")
        success = Counter(
            full("request_success"), "Finished requests, by finish reason.", [*success_labels, "finished_reason"],
            registry=r,
        )
        self._request_success = {reason: success.labels(**success_labels, finished_reason=reason)
                                 for reason in _FINISH_REASONS}
        # Counted by the server as it renders (serving_engine.render_conversation); the log warns once per template.
        self.tool_requests_without_tools_in_prompt = counter(
            "tool_requests_without_tools_in_prompt",
            "Requests with tools whose chat template left every tool out of the rendered prompt, so the model "
            "could not call them (fix: --chat-template with a tool-aware template).",
        )
        self.request_errors = counter(
            "request_errors",
            "Requests the engine failed on their own (finish_reason=error) while it kept running: rejected "
            "by the engine core or faulted while sampling. A dead engine core is not counted here.",
        )

    def _add_freshness_gauges(self, make: _Metrics) -> None:
        gauge = make.gauge
        # How old the scrape-time gauges are (see AsyncLLM.refresh_metrics): 0 right after a
        # refresh; growing while the engine core does not answer in time.
        self.metrics_staleness = gauge(
            "metrics_staleness_seconds", "Seconds since the engine core's state was last read for these gauges."
        )
        # Set at scrape time (AsyncLLM.refresh_metrics); /health turns 503 past its heartbeat timeout.
        self.engine_heartbeat_age = gauge(
            "engine_heartbeat_age_seconds",
            "Seconds since the engine core (with data parallelism: the live replica heard from least "
            "recently) last sent anything; an idle core sends a heartbeat every 0.5 s.",
        )

    def _add_histograms(self, make: _Metrics, max_model_len: int | None) -> None:
        histogram = make.histogram
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
        token_buckets = build_1_2_5_buckets(max_model_len or _DEFAULT_MAX_MODEL_LEN)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request (once per completion).", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens of each finished completion.", token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Per finished request, the generated tokens of its longest completion.", token_buckets)
        self.request_params_n = histogram("request_params_n", "The n of each finished request.", _PARAMS_N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of each finished request (once per completion).",
            token_buckets)

    def record_scheduler_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        """One step of engine core `engine` (its data-parallel index; 0 without DP)."""
        if self.replicas is not None:
            self.replicas.record_stats(engine, stats)
            self._set_totals()
        else:
            self.num_requests_running.set(stats.num_running_reqs)
            self.num_requests_waiting.set(stats.num_waiting_reqs)
            self._set_blocks(stats.num_free_blocks, stats.num_total_blocks)
        # The core reports these as running totals; a counter takes the increase.
        for counter, name in (
            (self.num_preemptions, "num_preemptions"),
            (self.prefix_cache_queries, "prefix_cache_queries"),
            (self.prefix_cache_hits, "prefix_cache_hits"),
            (self.spec_decode_num_drafts, "spec_num_drafts"),
            (self.spec_decode_num_draft_tokens, "spec_num_draft_tokens"),
            (self.spec_decode_num_accepted_tokens, "spec_num_accepted_tokens"),
        ):
            self._add_total(counter, engine, name, getattr(stats, name))
        for pos, total in enumerate(stats.spec_accepted_per_pos):
            self._add_total(self._spec_per_pos(pos), engine, f"spec_accepted_per_pos:{pos}", total)
        self.ledger.record_scheduler_stats(stats)
        if self.replicas is not None:
            self.ledger.set_blocks(*self.replicas.blocks())

    def _add_total(self, counter: Counter, engine: int, name: str, total: int) -> None:
        last = self._last_totals.get((engine, name), 0)
        increase = total - last if total >= last else total  # a smaller total: it was reset
        if increase:
            counter.inc(increase)
        self._last_totals[(engine, name)] = total

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
        *,
        n: int | None = None,
        max_tokens: int | None = None,
        completion_tokens: Sequence[int] | None = None,
    ) -> None:
        """One finished user request. `n`, `max_tokens`: its sampling parameters (None: not
        known, and `request_params_*` are left alone); `completion_tokens`: the tokens each of
        its completions generated (None: one completion, of `num_generation_tokens`).

        The request-size histograms count as vLLM does: it fans a request with n > 1 out into n
        child requests and observes each when it finishes (prompt tokens, generated tokens,
        max_tokens: n observations), then n and the longest child's tokens once, with the last
        child (vllm/v1/engine/parallel_sampling.py, ParentRequest.observe_finished_request)."""
        completions = list(completion_tokens) if completion_tokens is not None else [num_generation_tokens]
        for tokens in completions:
            self.request_prompt_tokens.observe(num_prompt_tokens)
            self.request_generation_tokens.observe(tokens)
            if max_tokens:  # vLLM skips a max_tokens of None (and 0)
                self.request_params_max_tokens.observe(max_tokens)
        if n is not None:
            self.request_params_n.observe(n)
        self.request_max_num_generation_tokens.observe(max(completions, default=0))
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

    def record_finished_output(self, output: RequestOutput, e2e_s: float) -> None:
        """A finished request as its final output holds it (its RequestMetrics): vLLM's metrics
        and the ledger's, once per request. `e2e_s`: its end-to-end latency as the caller took it."""
        m = output.metrics
        assert m is not None
        reasons = [c.finish_reason for c in output.outputs if c.finish_reason is not None]
        self.record_finished_request(
            reasons[0] if reasons else "stop", m.num_prompt_tokens, m.num_generation_tokens, e2e_s,
            m.time_to_first_token, n=m.n, max_tokens=m.max_tokens, completion_tokens=m.completion_tokens or None,
        )
        self.record_request_output(output)

    def render(self) -> bytes:
        return generate_latest(self.registry)
