"""The ledger's Prometheus metrics, and `get_metrics()`'s plain metric objects.

`LedgerMetrics` registers into a given `CollectorRegistry` only names that `PrometheusMetrics`
(metrics/prometheus.py: vLLM's basic set, running/waiting, kv_cache_usage_perc, TTFT, TPOT,
e2e, ...) does not; `PrometheusMetrics` builds one into its own registry and forwards to it, so
one `/metrics` (and one `LLM.get_metrics()`) shows both. It is fed from the same places: each
step's `SchedulerStats` (and a `get_state()` snapshot at scrape time), and each finished
`RequestOutput`.

vLLM's names where the meaning is the same (`request_queue_time_seconds`,
`request_prefill_time_seconds`, `request_decode_time_seconds`, `request_inference_time_seconds`,
`inter_token_latency_seconds`, `iteration_tokens_total`), and the ledger's own:

- `request_wait_seconds{reason}`: per finished request, seconds left waiting in the core, by
  the scheduler's reason (step_boundary: for the step in flight to end; token_budget,
  max_num_seqs, no_kv_blocks, head_of_line, preempted);
- `request_part_seconds_total{part}`: seconds of finished requests per decomposition part
  (their rates' shares are the live form of `tokenloom explain`'s verdict);
- `requests_by_dominant_wait_total{reason}`: finished requests by the cause they waited longest
  for (head-of-line resolved to what blocked the head; step_in_flight and long_prefill for the
  step in flight, long_prefill also for decodes stretched by a long prefill chunk; "none" if
  they never waited);
- `step_budget_tokens{kind=prefill|decode|unused}`: per step, the token budget spent and left;
- `kv_blocks{state=free|cached|used}`: blocks empty, free but holding a cached prefix, held;
- `kv_cache_group_blocks{kv_cache_group, state=used|wanted}` (models with sliding-window layers,
  whose KV cache groups share the pool): per group, the blocks held, and the blocks the head of
  the queue asked of it in the last step it was left waiting for KV blocks (0 otherwise): what
  `queue_no_kv_blocks` waits for, group by group. The totals stay in `kv_blocks`;
- `step_duration_seconds{phase=schedule|execute|update}` and `engine_steps_total`;
- `serialize_seconds_total`: what the core's output thread spent encoding and sending;
- `step_cpu_seconds` and `step_contention_ratio` (per step, where /proc has schedstat: the CPU
  seconds of the engine core's compute threads, and the share of the step they were runnable
  but not running, other processes holding the cores: machine contention, ops/schedstat.py), and
  `machine_other_cores` (the cores other processes used, of the `machine_cores` it may use).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tokenloom.messages import SchedulerStats
from tokenloom.metrics.buckets import WAIT_CAUSES
from tokenloom.metrics.timeline import PART_NAMES

if TYPE_CHECKING:
    from tokenloom.outputs import RequestOutput

PREFIX = "tokenloom:"
METRICS_PREFIXES = ("tokenloom", "vllm")
# The metrics vLLM also has, under the same name and meaning (vllm/v1/metrics/loggers.py,
# PrometheusStatLogger). With metrics_prefix="vllm" (`serve --metrics-prefix vllm`) these are
# named `vllm:<name>` and labelled as vLLM labels them, so dashboards and alerts written for
# vLLM find their series; the ledger's own metrics keep `tokenloom:`.
VLLM_NAMES = frozenset({
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions",
    "prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success",
    "time_to_first_token_seconds", "e2e_request_latency_seconds", "request_time_per_output_token_seconds",
    "inter_token_latency_seconds", "request_queue_time_seconds", "request_prefill_time_seconds",
    "request_decode_time_seconds", "request_inference_time_seconds", "iteration_tokens_total",
    "request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens",
    "request_params_n", "request_params_max_tokens", "spec_decode_num_drafts", "spec_decode_num_draft_tokens",
    "spec_decode_num_accepted_tokens", "spec_decode_num_accepted_tokens_per_pos",
})


def metric_name(name: str, metrics_prefix: str = "tokenloom") -> str:
    """`name`'s full Prometheus name: `vllm:` for the names vLLM shares when asked, else `tokenloom:`."""
    if metrics_prefix not in METRICS_PREFIXES:
        raise ValueError(f"metrics_prefix must be one of {METRICS_PREFIXES}, got {metrics_prefix!r}.")
    return f"vllm:{name}" if metrics_prefix == "vllm" and name in VLLM_NAMES else PREFIX + name


@dataclass(frozen=True, slots=True)
class MetricNaming:
    """How one engine's metrics are named and labelled. `engine`: the value of vLLM's `engine`
    label on the metrics named as vLLM's (None: no such label). Everything carries `model_name`."""

    model_name: str = "tokenloom"
    metrics_prefix: str = "tokenloom"
    engine: str | None = None

    def full(self, name: str) -> str:
        return metric_name(name, self.metrics_prefix)

    def labels(self, name: str) -> dict[str, str]:
        """The label values every series of `name` carries (label names in that order)."""
        if self.engine is not None and self.full(name).startswith("vllm:"):
            return {"model_name": self.model_name, "engine": self.engine}
        return {"model_name": self.model_name}
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0,
                    320.0)
_ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0)
_STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
_RATIO_BUCKETS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
_TOKEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# The scheduler's wait reasons, and the part of the decomposition each one's seconds are in.
WAIT_REASON_PARTS = {
    "step_boundary": "queue_step_boundary",
    "token_budget": "queue_token_budget",
    "max_num_seqs": "queue_max_num_seqs",
    "no_kv_blocks": "queue_no_kv_blocks",
    "head_of_line": "queue_head_of_line",
    "preempted": "preempted",
    "grammar_compile": "queue_grammar_compile",
}
_QUEUE_PARTS = ("queue_step_boundary", "queue_token_budget", "queue_max_num_seqs", "queue_no_kv_blocks",
                "queue_head_of_line", "queue_grammar_compile")


class LedgerMetrics:
    def __init__(self, registry: CollectorRegistry, naming: MetricNaming | None = None) -> None:
        self.registry = registry
        naming = naming if naming is not None else MetricNaming()
        self._naming = naming
        model_name = naming.model_name
        self._model_name = model_name

        self.queue_time = self._histogram(
            "request_queue_time_seconds", "Seconds a finished request spent waiting in the engine core.",
            _SECONDS_BUCKETS)
        self.prefill_time = self._histogram(
            "request_prefill_time_seconds", "Seconds of steps in which a request computed prompt tokens.",
            _SECONDS_BUCKETS)
        self.decode_time = self._histogram(
            "request_decode_time_seconds", "Seconds of steps in which a request computed decode tokens.",
            _SECONDS_BUCKETS)
        self.inference_time = self._histogram(
            "request_inference_time_seconds", "Prefill + decode + preempted seconds of a request.", _SECONDS_BUCKETS)
        self.inter_token_latency = self._histogram(
            "inter_token_latency_seconds", "Time between consecutive output tokens, as the caller got them.",
            _ITL_BUCKETS)
        self.wait_seconds = self._histograms(
            "request_wait_seconds",
            "Seconds a finished request was left waiting in the engine core, by the scheduler's reason.",
            _SECONDS_BUCKETS, "reason", tuple(WAIT_REASON_PARTS))
        self.part_seconds = self._counters(
            "request_part_seconds",
            "Seconds of finished requests per part of the end-to-end decomposition (the parts add up to e2e).",
            "part", PART_NAMES)
        self.dominant_wait = self._counters(
            "requests_by_dominant_wait",
            "Finished requests by the cause they waited longest for (head-of-line resolved to its cause).",
            "reason", WAIT_CAUSES + ("none",))
        self.step_budget = self._histograms(
            "step_budget_tokens",
            "Per engine step: tokens of the token budget spent on prefills, on decodes, and left unused.",
            _TOKEN_BUCKETS, "kind", ("prefill", "decode", "unused"))
        self.iteration_tokens = self._histogram("iteration_tokens_total", "Tokens computed per engine step.",
                                                _TOKEN_BUCKETS)
        self.step_duration = self._histograms(
            "step_duration_seconds", "Duration of each phase of an engine step.", _STEP_BUCKETS, "phase",
            ("schedule", "execute", "update"))
        self.engine_steps = Counter(PREFIX + "engine_steps", "Engine steps run.", ["model_name"],
                                    registry=registry).labels(model_name)
        self.serialize_seconds = Counter(
            PREFIX + "serialize_seconds", "Seconds the engine core's output thread spent encoding and sending.",
            ["model_name"], registry=registry).labels(model_name)
        self._contention_metrics()
        kv = Gauge(PREFIX + "kv_blocks",
                   "KV cache blocks by state: free (empty), cached (free, holding a cached prefix), used.",
                   ["model_name", "state"], registry=registry)
        self.kv_blocks = {state: kv.labels(model_name, state) for state in ("free", "cached", "used")}
        self.kv_cache_group_blocks = Gauge(
            PREFIX + "kv_cache_group_blocks",
            "KV cache blocks per KV cache group (models with sliding-window layers): used, and wanted "
            "by the head of the queue when it waits for KV blocks.",
            ["model_name", "kv_cache_group", "state"], registry=registry)

    def _contention_metrics(self) -> None:
        self.step_cpu = self._histogram(
            "step_cpu_seconds", "Per engine step: CPU seconds of the engine core's compute threads.", _STEP_BUCKETS)
        self.step_contention = self._histogram(
            "step_contention_ratio",
            "Per engine step: the share of it the engine's threads were runnable but not running (machine "
            "contention: other processes held the cores).", _RATIO_BUCKETS)
        labels = self._naming.labels("machine_other_cores")
        self.other_cores = Gauge(self._naming.full("machine_other_cores"),
                                 "Cores other processes used, of those the engine core may run on.",
                                 list(labels), registry=self.registry).labels(**labels)
        self.num_cores = Gauge(self._naming.full("machine_cores"), "Cores the engine core may run on.",
                               list(labels), registry=self.registry).labels(**labels)

    def _record_contention(self, stats: SchedulerStats) -> None:
        self.step_cpu.observe(stats.cpu_time)
        span = stats.step_time + stats.loop_time
        self.step_contention.observe(min(stats.run_delay / span, 1.0) if span > 0 else 0.0)
        self.other_cores.set(stats.other_cores)
        self.num_cores.set(stats.num_cores)

    def _histogram(self, name: str, doc: str, buckets: tuple) -> Any:
        labels = self._naming.labels(name)
        h = Histogram(self._naming.full(name), doc, list(labels), buckets=buckets, registry=self.registry)
        return h.labels(**labels)

    def _histograms(self, name: str, doc: str, buckets: tuple, label: str, values: tuple) -> dict[str, Any]:
        labels = self._naming.labels(name)
        h = Histogram(self._naming.full(name), doc, [*labels, label], buckets=buckets, registry=self.registry)
        return {v: h.labels(**labels, **{label: v}) for v in values}

    def _counters(self, name: str, doc: str, label: str, values: tuple) -> dict[str, Any]:
        c = Counter(PREFIX + name, doc, ["model_name", label], registry=self.registry)
        return {v: c.labels(self._model_name, v) for v in values}

    def record_scheduler_stats(self, stats: SchedulerStats) -> None:
        prefill, decode = stats.num_prefill_tokens, stats.num_decode_tokens
        self.step_budget["prefill"].observe(prefill)
        self.step_budget["decode"].observe(decode)
        self.step_budget["unused"].observe(max(stats.token_budget - prefill - decode, 0))
        self.iteration_tokens.observe(prefill + decode)
        self.engine_steps.inc()
        if stats.step_time:
            self.step_duration["schedule"].observe(stats.schedule_time)
            self.step_duration["execute"].observe(stats.prepare_time + stats.forward_time + stats.sample_time)
            self.step_duration["update"].observe(stats.update_time)
        if stats.num_cores:
            self._record_contention(stats)
        if stats.serialize_time > 0:
            self.serialize_seconds.inc(stats.serialize_time)
        self.set_blocks(stats.num_free_blocks, stats.num_cached_free_blocks, stats.num_total_blocks)
        if stats.kv_cache_group_used_blocks:
            self._set_group_blocks(stats.kv_cache_group_used_blocks, stats.kv_cache_group_wanted_blocks)

    def _set_group_blocks(self, used: list[int], wanted: list[int] | None) -> None:
        """`wanted` None: leave the last value (a scrape-time snapshot knows nothing of it)."""
        g = self.kv_cache_group_blocks
        for group, n in enumerate(used):
            g.labels(self._model_name, str(group), "used").set(n)
            if wanted is not None:
                g.labels(self._model_name, str(group), "wanted").set(wanted[group] if wanted else 0)

    def record_core_state(self, state: dict) -> None:
        """A `get_state()` snapshot of the core: an idle core sends no more steps."""
        if "num_free_blocks" in state and "num_total_blocks" in state:
            cached = state.get("num_cached_free_blocks", 0)
            self.set_blocks(state["num_free_blocks"], cached, state["num_total_blocks"])
        if state.get("kv_cache_group_used_blocks"):
            self._set_group_blocks(state["kv_cache_group_used_blocks"], None)

    def set_blocks(self, num_free: int, num_cached_free: int, num_total: int) -> None:
        if num_total > 0:
            self.kv_blocks["free"].set(num_free - num_cached_free)
            self.kv_blocks["cached"].set(num_cached_free)
            self.kv_blocks["used"].set(num_total - num_free)

    def record_finished(self, output: RequestOutput) -> None:
        m = output.metrics
        if m is None:
            return
        for itl in m.inter_token_latencies:
            self.inter_token_latency.observe(itl)
        parts = m.parts
        if not parts:
            return
        for name, seconds in parts.items():
            if seconds > 0:
                self.part_seconds[name].inc(seconds)
        if m.core is None:
            return
        for reason, part in WAIT_REASON_PARTS.items():
            self.wait_seconds[reason].observe(parts[part])
        self.queue_time.observe(sum(parts[p] for p in _QUEUE_PARTS))
        self.prefill_time.observe(parts["prefill"])
        self.decode_time.observe(parts["decode"])
        self.inference_time.observe(parts["prefill"] + parts["decode"] + parts["preempted"])
        self.dominant_wait[m.dominant_wait or "none"].inc()


# ---- get_metrics(): plain objects, as vLLM's `LLM.get_metrics()` returns ---------------------


@dataclass
class Metric:
    name: str
    labels: dict[str, str]


@dataclass
class CounterMetric(Metric):
    value: float


@dataclass
class GaugeMetric(Metric):
    value: float


@dataclass
class HistogramMetric(Metric):
    count: float
    sum: float
    buckets: dict[str, float]  # upper bound ("+Inf" last) -> cumulative count


def read_metrics(registry: CollectorRegistry) -> list[Metric]:
    """Every `tokenloom:` (and `vllm:`) sample in the registry, one object per label set."""
    result: list[Metric] = []
    for family in registry.collect():
        if not family.name.startswith((PREFIX, "vllm:")):
            continue
        if family.type == "counter":
            for s in family.samples:
                if s.name.endswith("_total"):
                    result.append(CounterMetric(family.name, dict(s.labels), s.value))
        elif family.type == "gauge":
            result.extend(GaugeMetric(family.name, dict(s.labels), s.value) for s in family.samples)
        elif family.type == "histogram":
            by_labels: dict[tuple, HistogramMetric] = {}
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k != "le"}
                key = tuple(sorted(labels.items()))
                h = by_labels.get(key)
                if h is None:
                    h = by_labels[key] = HistogramMetric(family.name, labels, 0, 0.0, {})
                if s.name.endswith("_bucket"):
                    h.buckets[s.labels["le"]] = s.value
                elif s.name.endswith("_count"):
                    h.count = s.value
                elif s.name.endswith("_sum"):
                    h.sum = s.value
            result.extend(by_labels.values())
    return result
