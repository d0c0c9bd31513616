"""The ledger's Prometheus metrics fed by step stats (no engine: the stats are hand-made)."""
from prometheus_client import CollectorRegistry

from tokenloom.messages import SchedulerStats
from tokenloom.metrics.prometheus import PrometheusMetrics


def _samples(registry, name):
    for family in registry.collect():
        if family.name == name:
            return {(s.labels["kv_cache_group"], s.labels["state"]): s.value for s in family.samples}
    return {}


def test_kv_cache_group_blocks_break_the_totals_down_by_group():
    registry = CollectorRegistry()
    m = PrometheusMetrics("gemma", registry=registry)
    # A model with one group sends no breakdown, and none is exposed.
    m.record_scheduler_stats(SchedulerStats(num_free_blocks=10, num_used_blocks=6, num_total_blocks=16))
    assert _samples(registry, "tokenloom:kv_cache_group_blocks") == {}
    # Three groups; the head of the queue waits for 4 + 2 + 2 blocks.
    m.record_scheduler_stats(SchedulerStats(
        num_free_blocks=10, num_used_blocks=9, num_total_blocks=19,
        kv_cache_group_used_blocks=[5, 2, 2], kv_cache_group_wanted_blocks=[4, 2, 2]))
    got = _samples(registry, "tokenloom:kv_cache_group_blocks")
    assert got == {("0", "used"): 5, ("1", "used"): 2, ("2", "used"): 2,
                   ("0", "wanted"): 4, ("1", "wanted"): 2, ("2", "wanted"): 2}
    # Totals are still there, unchanged in meaning.
    blocks = {s.labels["state"]: s.value for f in registry.collect() if f.name == "tokenloom:kv_blocks"
              for s in f.samples}
    assert blocks["used"] == 9
    # Nobody waiting any more: wanted drops to 0; a scrape-time state keeps it and updates used.
    m.record_scheduler_stats(SchedulerStats(
        num_free_blocks=12, num_used_blocks=7, num_total_blocks=19, kv_cache_group_used_blocks=[5, 1, 1]))
    m.record_core_state({"num_free_blocks": 13, "num_total_blocks": 19, "kv_cache_group_used_blocks": [4, 1, 1]})
    got = _samples(registry, "tokenloom:kv_cache_group_blocks")
    assert got[("0", "used")] == 4 and got[("0", "wanted")] == 0


def _histograms(registry) -> dict[str, dict]:
    """{family name: {"count", "sum", "labels"}} of every histogram (one label set each here)."""
    out: dict[str, dict] = {}
    for family in registry.collect():
        if family.type != "histogram":
            continue
        for s in family.samples:
            h = out.setdefault(family.name, {})
            if s.name.endswith("_count"):
                h["count"], h["labels"] = s.value, dict(s.labels)
            elif s.name.endswith("_sum"):
                h["sum"] = s.value
    return out


def test_request_size_histograms_count_as_vllm_counts_n_children():
    # vLLM fans n=3 out into three child requests: each observes the prompt, its own generated
    # tokens and max_tokens; n and the longest child's tokens are observed once, for the parent.
    registry = CollectorRegistry()
    m = PrometheusMetrics("tiny", registry=registry, metrics_prefix="vllm", max_model_len=100)
    m.record_finished_request("length", 7, 4 + 2 + 5, 1.0, 0.1, n=3, max_tokens=5, completion_tokens=[4, 2, 5])
    m.record_finished_request("stop", 3, 1, 1.0, 0.1, n=1, max_tokens=None, completion_tokens=[1])
    h = _histograms(registry)
    assert (h["vllm:request_prompt_tokens"]["count"], h["vllm:request_prompt_tokens"]["sum"]) == (4, 3 * 7 + 3)
    assert (h["vllm:request_generation_tokens"]["count"], h["vllm:request_generation_tokens"]["sum"]) == (4, 12)
    assert (h["vllm:request_params_max_tokens"]["count"], h["vllm:request_params_max_tokens"]["sum"]) == (3, 15)
    assert (h["vllm:request_params_n"]["count"], h["vllm:request_params_n"]["sum"]) == (2, 4)
    longest = h["vllm:request_max_num_generation_tokens"]
    assert (longest["count"], longest["sum"]) == (2, 5 + 1)
    # Latency and success stay per user request (tokenloom times the request the caller sent).
    assert h["vllm:e2e_request_latency_seconds"]["count"] == 2
    # An owner that does not know n (or the completions) leaves request_params_n alone and
    # counts one completion.
    m.record_finished_request("stop", 2, 6, 1.0, 0.1)
    h = _histograms(registry)
    assert h["vllm:request_params_n"]["count"] == 2 and h["vllm:request_generation_tokens"]["sum"] == 18
    # Token buckets: vLLM's 1-2-5 series up to max_model_len.
    bounds = [s.labels["le"] for f in registry.collect() if f.name == "vllm:request_prompt_tokens"
              for s in f.samples if s.name.endswith("_bucket")]
    assert bounds == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "+Inf"]


def test_engine_label_only_where_vllm_names_describe_one_engine():
    def labels(registry, name):
        return next({k: v for k, v in s.labels.items() if k != "le"}
                    for f in registry.collect() if f.name == name for s in f.samples)

    vllm, own, dp = CollectorRegistry(), CollectorRegistry(), CollectorRegistry()
    PrometheusMetrics("tiny", registry=vllm, metrics_prefix="vllm")
    PrometheusMetrics("tiny", registry=own)
    PrometheusMetrics("tiny", registry=dp, metrics_prefix="vllm", data_parallel_size=2)
    for name in ("num_requests_running", "request_queue_time_seconds", "request_params_n"):
        assert labels(vllm, f"vllm:{name}") == {"model_name": "tiny", "engine": "0"}, name
        assert labels(own, f"tokenloom:{name}") == {"model_name": "tiny"}, name
        # With data parallelism these are the totals over the replicas: no one engine's.
        assert labels(dp, f"vllm:{name}") == {"model_name": "tiny"}, name
    assert labels(vllm, "tokenloom:request_wait_seconds") == {"model_name": "tiny", "reason": "step_boundary"}
    assert labels(dp, "tokenloom:replica_up") == {"model_name": "tiny", "engine": "0"}


def test_spec_decode_counters_take_the_cores_running_totals_under_vllms_names():
    """The core sends cumulative draft counts; the counters add the increases (a replica's
    restart from 0 included), per draft position too, under vLLM's names and labels."""
    registry = CollectorRegistry()
    m = PrometheusMetrics("tiny", registry=registry, metrics_prefix="vllm")
    m.record_scheduler_stats(SchedulerStats(spec_num_drafts=2, spec_num_draft_tokens=8, spec_num_accepted_tokens=5,
                                            spec_accepted_per_pos=[2, 2, 1, 0]))
    m.record_scheduler_stats(SchedulerStats(spec_num_drafts=3, spec_num_draft_tokens=12, spec_num_accepted_tokens=6,
                                            spec_accepted_per_pos=[3, 2, 1, 0]))
    m.record_scheduler_stats(SchedulerStats(spec_num_drafts=1, spec_num_draft_tokens=4, spec_num_accepted_tokens=1,
                                            spec_accepted_per_pos=[1, 0, 0, 0]))  # counted from 0 again
    values = {(s.name, s.labels.get("position")): s.value for f in registry.collect() for s in f.samples
              if s.name.startswith("vllm:spec_decode") and s.name.endswith("_total")}
    assert values[("vllm:spec_decode_num_drafts_total", None)] == 4
    assert values[("vllm:spec_decode_num_draft_tokens_total", None)] == 16
    assert values[("vllm:spec_decode_num_accepted_tokens_total", None)] == 7
    assert {pos: v for (name, pos), v in values.items() if name.endswith("per_pos_total")} == \
        {"0": 4, "1": 2, "2": 1, "3": 0}
