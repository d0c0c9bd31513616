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


def _families(server) -> dict:
    """/metrics parsed by prometheus_client: {family name: Metric}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    return {f.name: f for f in text_string_to_metric_families(httpx.get(server.url("/metrics"), timeout=30).text)}


def _histogram(families: dict, name: str) -> dict:
    """One labelled histogram's samples: {"count", "sum", "labels", "buckets": {le: cumulative}}."""
    family = families[name]
    assert family.type == "histogram", (name, family.type)
    out: dict = {"buckets": {}}
    for s in family.samples:
        if s.name.endswith("_bucket"):
            out["buckets"][s.labels["le"]] = s.value
        elif s.name.endswith("_count"):
            out["count"], out["labels"] = s.value, {k: v for k, v in s.labels.items()}
        elif s.name.endswith("_sum"):
            out["sum"] = s.value
    return out


def test_vllm_request_size_histograms_and_engine_label(server):
    """vLLM's request_prompt_tokens / request_generation_tokens (the heatmaps of vLLM's Grafana
    dashboard) count each finished request with the numbers its response's usage gives; every
    series under a vLLM name carries vLLM's engine label, and TTFT's buckets are vLLM's."""
    before = {n: _histogram(_families(server), f"vllm:{n}")
              for n in ("request_prompt_tokens", "request_generation_tokens", "request_max_num_generation_tokens")}
    response = server.client().completions.create(model="tiny", prompt="The capital of France is", max_tokens=4,
                                                  extra_body={"ignore_eos": True})
    usage = response.usage
    assert usage.completion_tokens == 4
    families = _families(server)
    prompt = _histogram(families, "vllm:request_prompt_tokens")
    generated = _histogram(families, "vllm:request_generation_tokens")
    longest = _histogram(families, "vllm:request_max_num_generation_tokens")
    assert prompt["count"] - before["request_prompt_tokens"]["count"] == 1
    assert prompt["sum"] - before["request_prompt_tokens"]["sum"] == usage.prompt_tokens
    assert generated["count"] - before["request_generation_tokens"]["count"] == 1
    assert generated["sum"] - before["request_generation_tokens"]["sum"] == usage.completion_tokens
    assert longest["sum"] - before["request_max_num_generation_tokens"]["sum"] == usage.completion_tokens
    # vLLM's 1-2-5 token buckets, up to max_model_len (256 here).
    assert list(prompt["buckets"]) == ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "100.0", "200.0", "+Inf"]
    # vLLM's TTFT bounds (vllm/v1/metrics/buckets.py): a slow CPU prefill still lands in a bucket.
    ttft = _histogram(families, "vllm:time_to_first_token_seconds")
    assert [float(le) for le in ttft["buckets"] if le != "+Inf"] == [
        0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
        160.0, 640.0, 2560.0]
    for name in ("vllm:request_prompt_tokens", "vllm:request_params_n", "vllm:request_params_max_tokens",
                 "vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds"):
        assert _histogram(families, name)["labels"] == {"model_name": "tiny", "engine": "0"}, name
    for name in ("vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens",
                 "vllm:request_success", "vllm:request_queue_time_seconds", "vllm:inter_token_latency_seconds"):
        assert all(s.labels.get("engine") == "0" and s.labels["model_name"] == "tiny"
                   for s in families[name].samples), name
    # tokenloom's own metrics keep their own labels.
    assert all("engine" not in s.labels for s in families["tokenloom:request_part_seconds"].samples)


def test_n_counts_as_vllm_counts_its_children(server):
    """A request with n=2 counts as vLLM counts the two child requests it fans it out into: prompt
    tokens, generated tokens and max_tokens once per completion, n and the longest completion
    once per request. Streamed (each output holds only what is new) and not."""
    names = ("request_prompt_tokens", "request_generation_tokens", "request_params_max_tokens", "request_params_n",
             "request_max_num_generation_tokens")
    before = {n: _histogram(_families(server), f"vllm:{n}") for n in names}
    client = server.client()
    plain = client.completions.create(model="tiny", prompt="One, two,", max_tokens=3, extra_body={"ignore_eos": True})
    fanned = client.completions.create(model="tiny", prompt="The capital of France is", max_tokens=4, n=2,
                                       extra_body={"ignore_eos": True})
    stream = client.completions.create(model="tiny", prompt="Hello", max_tokens=5, n=2, stream=True,
                                       stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    streamed = [chunk.usage for chunk in stream if chunk.usage is not None][-1]
    families = _families(server)
    got = {n: _histogram(families, f"vllm:{n}") for n in names}
    delta = {n: (got[n]["count"] - before[n]["count"], got[n]["sum"] - before[n]["sum"]) for n in names}
    prompts = plain.usage.prompt_tokens + 2 * fanned.usage.prompt_tokens + 2 * streamed.prompt_tokens
    assert delta["request_prompt_tokens"] == (5, prompts)
    assert fanned.usage.completion_tokens == 8 and streamed.completion_tokens == 10
    assert delta["request_generation_tokens"] == (5, 3 + 8 + 10)
    assert delta["request_params_max_tokens"] == (5, 3 + 2 * 4 + 2 * 5)
    assert delta["request_params_n"] == (3, 1 + 2 + 2)
    assert got["request_params_n"]["buckets"]["1.0"] - before["request_params_n"]["buckets"]["1.0"] == 1
    assert delta["request_max_num_generation_tokens"] == (3, 3 + 4 + 5)
