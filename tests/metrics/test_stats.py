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
