"""`tokenloom serve --metrics-prefix vllm`: the metrics vLLM also has are named as vLLM names them,
so a dashboard or alert written for vLLM works unchanged; the ledger's own keep `tokenloom:`."""
from __future__ import annotations

SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 * 1024**2), "--served-model-name", "tiny",
               "--metrics-prefix", "vllm"]


def test_vllm_names_and_dashboard(server, dashboard_metrics):
    server.client().completions.create(model="tiny", prompt="Hello", max_tokens=3)
    m = server.metrics()
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count",
                 "vllm:inter_token_latency_seconds_count", "vllm:request_queue_time_seconds_count",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:request_success_total",
                 "vllm:prefix_cache_queries_total", "vllm:num_preemptions_total", "vllm:iteration_tokens_total_count",
                 "tokenloom:request_part_seconds_total", "tokenloom:step_budget_tokens_count"):
        assert name in m, name
    assert m["vllm:e2e_request_latency_seconds_count"] == 1
    assert "tokenloom:e2e_request_latency_seconds_count" not in m  # renamed, not duplicated
    missing = sorted(n for n in dashboard_metrics("vllm") if n not in m)
    assert not missing, missing
