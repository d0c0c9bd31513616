"""`tokenloom bench throughput | latency | serve` on a tiny workload: they run, take `vllm bench`'s
spellings, and their JSON carries the fields the README's tables are built from. No timing is
asserted (the machine is shared). `bench serve` (and `explain --url`) run against a real server
started with an API key."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from typing import Any

import pytest

from tokenloom.bench.common import format_spec_decode, random_prompt_ids, spec_decode_summary, step_profile
from tokenloom.messages import SchedulerStats
from tokenloom.metrics.timeline import VERDICT_HEADLINES

SMALL_ENGINE = ["--kv-cache-memory-bytes", str(32 * 1024**2), "--max-model-len", "64"]
# The module's `server` (tests/entrypoints/conftest.py), for bench serve and explain --url.
SERVER_ARGS = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 * 1024**2), "--served-model-name", "tiny"]
SERVER_API_KEY = "bench-key"


def _start_bench(*args: str) -> tuple[subprocess.Popen, Any, Any]:
    # Output to files, not pipes: a command nobody reads yet must not block on a full pipe.
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    cmd = [sys.executable, "-m", "tokenloom.entrypoints.cli", "bench", *args, "--json", *SMALL_ENGINE]
    return subprocess.Popen(cmd, stdout=out, stderr=err, text=True), out, err


def _result(run: tuple[subprocess.Popen, Any, Any], timeout: float = 600, output_json: Any = None) -> dict:
    """The command's JSON report; with `output_json`, also checks that its --output-json file
    holds the same report."""
    proc, out, err = run
    proc.wait(timeout=timeout)
    out.seek(0), err.seek(0)
    stdout, stderr = out.read(), err.read()
    assert proc.returncode == 0, stderr[-3000:]
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    assert len(lines) == 1, stdout[-2000:]
    # Progress goes to stderr, phase by phase, so the JSON on stdout stays one object.
    assert "[bench" in stderr and "timed" in stderr, stderr[-2000:]
    result = json.loads(lines[0])
    if output_json is not None:
        assert json.loads(output_json.read_text()) == result
    return result | {"_stderr": stderr}


@pytest.fixture(scope="module")
def hf_baseline_runs(tmp_path_factory):
    """Both commands with a transformers baseline, started together: each spends most of its
    start-up (imports, transformers' GGUF parse) on one core, so side by side they take little
    longer than one. No timing is asserted, so sharing the machine changes no check. Each also
    writes its report to `--output-json` (vLLM's flag); latency's warm-up is given by vLLM's name."""
    folder = tmp_path_factory.mktemp("bench")
    procs = {
        "throughput": _start_bench("throughput", "--num-prompts", "4", "--input-len", "8", "--output-len", "4",
                                   "--baseline", "hf", "--hf-batch-size", "2", "--profile", "--num-iters", "2",
                                   "--output-json", str(folder / "throughput.json")),
        "latency": _start_bench("latency", "--batch-size", "2", "--input-len", "8", "--output-len", "4",
                                "--num-iters", "2", "--num-iters-warmup", "0", "--baseline", "hf", "--profile",
                                "--output-json", str(folder / "latency.json")),
    }
    procs["folder"] = folder
    yield procs
    del procs["folder"]
    for proc, out, err in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        out.close(), err.close()


def _check_rates(run: dict, num_prompts: int, output_len: int) -> None:
    assert run["num_output_tokens"] == num_prompts * output_len
    for key in ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s"):
        assert run[key] > 0, key


@pytest.mark.slow
def test_throughput_with_hf_baseline_and_profile(hf_baseline_runs):
    r = _result(hf_baseline_runs["throughput"], output_json=hf_baseline_runs["folder"] / "throughput.json")
    assert (r["num_prompts"], r["input_len"], r["output_len"]) == (4, 8, 4)
    assert len(r["tokenloom"]["elapsed_runs_s"]) == len(r["baseline"]["elapsed_runs_s"]) == 2
    ours, base = r["tokenloom"], r["baseline"]
    _check_rates(ours, 4, 4)
    _check_rates(base, 4, 4)
    assert ours["num_input_tokens"] == base["num_input_tokens"] == 32
    from tokenloom.model.loader import resolve_dtype

    # tokenloom runs its default dtype ("auto": bfloat16 on CPUs with native bf16, but float32
    # activations when the GGUF is computed quantized, as the embedded one is by default), the
    # transformers baseline float32 unless --baseline-dtype says otherwise.
    quantized = ours["quantization"] != "none"
    assert ours["dtype"] == ("float32" if quantized else str(resolve_dtype("auto", "cpu")).removeprefix("torch."))
    assert base["dtype"] == "float32" and [b["dtype"] for b in r["baselines"]] == ["float32"]
    machine = r["machine"]
    assert machine["cpu_model_name"] and machine["usable_cores"] >= 1
    assert machine["kernel_isa"] in ("avx512", "avx2", "scalar")
    assert ours["memory"]["rss_mib"] > 0 and ours["cpu_choice"]
    assert base["backend"] == "transformers" and base["batch_size"] == 2
    assert r["ratio_output_tokens_per_s"] > 0
    # Both engines stay loaded and their timed runs alternate, round by round on the same prompts;
    # the per-round ratios are the baseline's time over ours in each round.
    tl = f"tokenloom ({ours['dtype']})"
    phases = [m for line in r["_stderr"].splitlines()
              if (m := line.split("] ", 1)[-1]).startswith("timed round")]  # not the "... (15s)" beats
    assert phases == [f"timed round 1/2: {tl}", "timed round 1/2: transformers (float32)",
                      f"timed round 2/2: {tl}", "timed round 2/2: transformers (float32)"]
    assert [row[tl] for row in r["rounds_s"]] == ours["elapsed_runs_s"]
    assert [row["transformers (float32)"] for row in r["rounds_s"]] == base["elapsed_runs_s"]
    assert r["ratio_rounds"] == pytest.approx([b / o for b, o in zip(base["elapsed_runs_s"], ours["elapsed_runs_s"])])
    # The median of two rounds' ratios is their mean, not the larger one.
    assert r["ratio_median_of_rounds"] == pytest.approx(sum(r["ratio_rounds"]) / 2)
    # the waiting engine's process (ours, while transformers ran in the bench's own) is measured
    assert r["idle_cpu_util"][tl] >= 0
    assert ours["cpu"]["caller_cpu_s"] >= 0 and "core_cpu_s" in ours["cpu"]
    profile = ours["profile"]["all_steps"]
    assert profile["num_steps"] >= 4  # at least one prefill and three decode steps
    assert set(profile["share"]) == {"schedule", "prepare", "forward", "sample", "update", "loop"}
    assert sum(profile["share"].values()) == pytest.approx(1.0, abs=0.05)
    assert 0 <= profile["engine_overhead_pct"] <= 100
    assert profile["seconds"]["forward"] > 0 and profile["seconds"]["sample"] > 0
    assert ours["profile"]["decode_steps"]["num_steps"] >= 1
    # The decode steps against the measured read bandwidth: weights once a step plus each
    # running sequence's KV, per token; what their time implies, as a share of the ceiling.
    roof, ceiling = ours["roofline"], r["read_bandwidth"]["bytes_per_s"]
    assert roof["ceiling_bytes_per_s"] == ceiling > 0
    assert ours["weight_bytes_per_token"] / 4 <= roof["bytes_per_token"] < ours["weight_bytes_per_token"]
    assert roof["decode_tokens_per_s"] > 0
    assert roof["fraction_of_ceiling"] == pytest.approx(roof["implied_bytes_per_s"] / ceiling)
    assert "roofline" not in base  # transformers reports no weight bytes


@pytest.mark.slow
def test_latency_with_hf_baseline(hf_baseline_runs):
    r = _result(hf_baseline_runs["latency"], output_json=hf_baseline_runs["folder"] / "latency.json")
    assert (r["batch_size"], r["num_iters"], r["warmup"]) == (2, 2, 0)  # --num-iters-warmup 0
    for run in (r["tokenloom"], r["baseline"]):
        for part in ("prefill", "decode_per_token", "e2e"):
            assert run[part]["median_ms"] > 0 and run[part]["p90_ms"] >= run[part]["median_ms"] * 0.999
    assert r["speedup_decode_per_token"] > 0 and r["speedup_prefill"] > 0
    assert r["tokenloom"]["profile"]["all_steps"]["num_steps"] >= 2 * 4
    # Which path ran, what a decode step reads and what the engine core holds: the embedded GGUF
    # is computed as shipped (Q4_1 linears, Q8_0 tied head: ~96 MB, not ~540 MB of float32).
    ours = r["tokenloom"]
    assert ours["quantization"].startswith("gguf Q4_1x210+Q8_0x1")
    assert 90e6 < ours["weight_bytes_per_token"] < 100e6
    assert 0 < ours["memory"]["rss_mib"] <= ours["memory"]["peak_rss_mib"]
    # Its decode figure against the measured roofline: a 2-sequence step reads the weights once
    # and each sequence's K and V at the mean decode context (8 + 4 // 2 tokens; SmolLM2: 30
    # layers x 3 KV heads x 64 x 2 (K, V) x 2 bytes of bfloat16 = 23,040 bytes a token).
    bw = r["read_bandwidth"]
    assert bw["bytes_per_s"] > 0 and bw["buffer_bytes"] >= 256 << 20 and bw["threads"] >= 1
    roof = ours["roofline"]
    kv_bytes = {"bfloat16": 2, "float32": 4}[ours["kv_cache_dtype"]]
    assert roof["kv_bytes_per_step"] == 2 * 10 * 30 * 3 * 64 * 2 * kv_bytes
    assert roof["bytes_per_step"] == ours["weight_bytes_per_token"] + roof["kv_bytes_per_step"]
    assert roof["bytes_per_token"] == pytest.approx(roof["bytes_per_step"] / 2)
    step_s = ours["decode_per_token"]["median_ms"] / 1000
    assert roof["implied_bytes_per_s"] == pytest.approx(roof["bytes_per_step"] / step_s)
    assert roof["fraction_of_ceiling"] == pytest.approx(roof["implied_bytes_per_s"] / bw["bytes_per_s"])
    assert "roofline" not in r["baseline"]


def test_bad_arguments_are_clear_errors(capsys):
    # One through the real command line (exit status 2, the message on stderr) ...
    proc = subprocess.run(
        [sys.executable, "-m", "tokenloom.entrypoints.cli", "bench", "throughput", "--num-prompts", "0"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2 and "--num-prompts" in proc.stderr
    # ... the rest through the same entry point in this process (each is refused before any model
    # loads; a fresh interpreter per case cost ~8 s of imports each).
    from tokenloom.entrypoints.cli import main

    for argv, needed in ((["throughput", "--baseline", "vllm"], "--vllm-python"),
                         (["throughput", "--baseline", "llamacpp"], "--llamacpp-python"),
                         (["latency", "--baseline", "llamacpp"], "--llamacpp-python")):
        try:
            rc = main(["bench", *argv])
        except SystemExit as e:  # argparse's own refusals
            rc = e.code
        assert rc == 2 and needed in capsys.readouterr().err, argv


def test_random_prompts_avoid_special_tokens_and_are_seeded():
    from tokenloom.model.loader import load_tokenizer

    tok = load_tokenizer(None)
    a = random_prompt_ids(tok, 49152, 8, 16, seed=3)
    assert a == random_prompt_ids(tok, 49152, 8, 16, seed=3)
    assert a != random_prompt_ids(tok, 49152, 8, 16, seed=4)
    assert all(len(p) == 16 for p in a)
    special = set(tok.all_special_ids)
    assert not special & {t for p in a for t in p}


def test_step_profile_shares_add_up():
    steps = [
        SchedulerStats(num_prefill_tokens=8, schedule_time=0.001, prepare_time=0.002, forward_time=0.05,
                       sample_time=0.002, update_time=0.001, step_time=0.056, loop_time=0.001),
        SchedulerStats(num_decode_tokens=2, schedule_time=0.001, prepare_time=0.001, forward_time=0.02,
                       sample_time=0.001, update_time=0.001, step_time=0.024, loop_time=0.001),
    ]
    p = step_profile(steps)
    assert p["all_steps"]["num_steps"] == 2 and p["decode_steps"]["num_steps"] == 1
    assert sum(p["all_steps"]["share"].values()) == pytest.approx(1.0)
    d = p["decode_steps"]
    assert d["total_s"] == pytest.approx(0.025)
    assert d["engine_overhead_pct"] == pytest.approx(100 * (1 - 0.021 / 0.025))


def _cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`tokenloom ARGS` as a user runs it, without the caller's API-key variables (unless `env` sets them)."""
    import os

    clean = {k: v for k, v in os.environ.items() if k not in ("TOKENLOOM_API_KEY", "OPENAI_API_KEY")}
    return subprocess.run([sys.executable, "-m", "tokenloom.entrypoints.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=clean | (env or {}))


def _one_clear_line(proc: subprocess.CompletedProcess, *needles: str) -> None:
    """A refused run: exit status 1, one line on stderr saying why, no traceback."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout[-1000:], proc.stderr[-2000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tokenloom: error: "), proc.stderr[-2000:]
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])


def test_spec_decode_summary_counts_the_recorded_steps():
    """`bench` reports the drafts of its timed steps (the core's counters are cumulative)."""
    steps = [SchedulerStats(step=1, spec_num_drafts=10, spec_num_draft_tokens=40, spec_num_accepted_tokens=20),
             SchedulerStats(step=2, spec_num_drafts=12, spec_num_draft_tokens=48, spec_num_accepted_tokens=23),
             SchedulerStats(step=3, spec_num_drafts=14, spec_num_draft_tokens=56, spec_num_accepted_tokens=30)]
    summary = spec_decode_summary(steps)
    assert summary == {"drafts": 4, "draft_tokens": 16, "accepted_tokens": 10, "acceptance_rate": 10 / 16,
                       "accepted_per_draft": 2.5}
    assert format_spec_decode(summary) == [
        "tokenloom speculative decoding: drafts in 4 request-steps, 10 of 16 draft tokens accepted (62%), 2.50 per draft"]
    assert spec_decode_summary([SchedulerStats(step=1), SchedulerStats(step=2)]) is None


def test_bench_serve_takes_vllm_flags_for_chat(server, tmp_path):
    # vllm bench serve's spellings: --host/--port instead of a URL, the chat endpoint and backend,
    # the random dataset's lengths, --ignore-eos, and the report written to --output-json.
    report = tmp_path / "serve.json"
    ttft = "tokenloom:time_to_first_token_seconds_sum"
    before = server.metrics()[ttft]
    proc = _cli("bench", "serve", "--host", "127.0.0.1", "--port", str(server.port), "--backend", "openai-chat",
                "--endpoint", "/v1/chat/completions", "--dataset-name", "random", "--random-input-len", "8",
                "--random-output-len", "4", "--ignore-eos", "--num-prompts", "2", "--api-key", SERVER_API_KEY,
                "--json", "--output-json", str(report))
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(report.read_text()) == r
    assert (r["model"], r["endpoint"], r["completed"], r["failed"]) == ("tiny", "/v1/chat/completions", 2, 0)
    assert r["total_output_tokens"] == 2 * 4 and r["input_len"] == 8 and r["output_len"] == 4
    # Chat requests went through the chat template: more prompt tokens than the 8 words.
    assert r["total_input_tokens"] > 2 * (8 + 8)
    # The client's TTFT holds the server's (from arrival to the first token) inside it. A chat
    # stream opens with a role-only chunk, sent before any token: taken for the first token, it
    # would make the client's TTFT shorter than the server's.
    server_mean_ttft_ms = (server.metrics()[ttft] - before) / 2 * 1000
    assert r["mean_ttft_ms"] >= server_mean_ttft_ms > 0 and r["mean_itl_ms"] > 0


def test_bench_serve_completions_through_base_url(server):
    # --base-url wins over --host/--port (vLLM's rule); a trailing /v1 is fine; --backend vllm
    # sends completions, of exactly --input-len prompt tokens (token ids).
    proc = _cli("bench", "serve", "--base-url", server.url("/v1"), "--port", "1", "--backend", "vllm",
                "--input-len", "8", "--output-len", "3", "--num-prompts", "2", "--json",
                env={"TOKENLOOM_API_KEY": SERVER_API_KEY})
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (r["endpoint"], r["completed"], r["total_input_tokens"], r["total_output_tokens"]) == (
        "/v1/completions", 2, 16, 6)


@pytest.mark.slow
def test_bench_serve_errors_are_one_line(server):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        nobody = s.getsockname()[1]
    _one_clear_line(_cli("bench", "serve", "--port", str(nobody), "--num-prompts", "2"), "cannot connect")
    _one_clear_line(_cli("bench", "serve", "--base-url", f"127.0.0.1:{server.port}", "--num-prompts", "2"),
                    "not a server URL", "http://")
    _one_clear_line(_cli("bench", "serve", "--port", str(server.port), "--num-prompts", "2"),
                    "HTTP 401", "no API key was given", "--api-key")
    _one_clear_line(_cli("bench", "serve", "--port", str(server.port), "--num-prompts", "2", "--api-key", "wrong",
                         "--model", "tiny"), "HTTP 401", "refused")
    # Flags that cannot work are usage errors (status 2), named.
    for argv, needed in ((["--dataset-name", "sharegpt"], "--dataset-name sharegpt"),
                         (["--endpoint", "/v1/embeddings"], "--endpoint"),
                         (["--backend", "openai-chat", "--endpoint", "/v1/completions"], "--backend openai")):
        proc = _cli("bench", "serve", "--port", str(server.port), *argv)
        assert proc.returncode == 2 and needed in proc.stderr and "Traceback" not in proc.stderr, (argv, proc.stderr)


def test_explain_url_takes_the_api_key(server):
    server.client().completions.create(model="tiny", prompt="Hello", max_tokens=2)
    url = server.base_url
    refused = _cli("explain", "--url", url, "--json")
    assert refused.returncode == 2 and "HTTP 401" in refused.stderr and "--api-key" in refused.stderr
    assert "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    by_flag = _cli("explain", "--url", url, "--api-key", SERVER_API_KEY, "--json")
    assert by_flag.returncode == 0, by_flag.stderr[-2000:]
    assert json.loads(by_flag.stdout)["num_requests"] >= 1
    by_env = _cli("explain", "--url", url, "--json", env={"TOKENLOOM_API_KEY": SERVER_API_KEY})
    assert by_env.returncode == 0, by_env.stderr[-2000:]
    assert "$TOKENLOOM_API_KEY" in _cli("explain", "--help").stdout


def test_kv_bytes_of_a_sliding_window_layer_stop_at_its_window():
    from types import SimpleNamespace

    from tokenloom.bench.roofline import kv_bytes_per_sequence

    config = SimpleNamespace(num_hidden_layers=3, num_key_value_heads=2, head_dim=4, sliding_window=8,
                             layer_types=("sliding_attention", "full_attention", "sliding_attention"))
    per_token_layer = 2 * 2 * 4 * 2  # K and V, bfloat16
    assert kv_bytes_per_sequence(config, "bfloat16", 100) == per_token_layer * (8 + 100 + 8)
    assert kv_bytes_per_sequence(config, "float32", 4) == 2 * per_token_layer * 3 * 4


def test_a_figure_a_baseline_does_not_report_is_a_dash():
    from tokenloom.bench.common import megabytes_cell

    assert megabytes_cell(None) == megabytes_cell(0) == "-"  # transformers reports no weight bytes
    assert megabytes_cell(96_412_345) == "96.4"


def test_the_transformers_baseline_runs_in_the_dtype_tokenloom_runs_on_its_device():
    """float32 on the CPU (transformers' best there), bfloat16 on CUDA (like for like with
    tokenloom's dtype="auto"); an explicit --baseline-dtype wins; vLLM compares both."""
    from tokenloom.bench.throughput import baseline_dtypes

    def args(**kw):
        return argparse.Namespace(**{"baseline": "hf", "baseline_dtype": None, "vllm_dtype": None, "device": "cpu", **kw})

    assert baseline_dtypes(args()) == ["float32"]
    assert baseline_dtypes(args(device="cuda")) == baseline_dtypes(args(device="cuda:1")) == ["bfloat16"]
    assert baseline_dtypes(args(device="cuda", baseline_dtype="float32")) == ["float32"]
    assert baseline_dtypes(args(baseline="vllm")) == ["float32", "bfloat16"]


def test_bench_serve_prints_the_machine_progress_and_verdict(server):
    # As the other bench commands: the machine line, a progress bar while it runs (tqdm, on
    # stderr), and the ledger's verdict for the run (the server's /ledger, as explain --url).
    proc = _cli("bench", "serve", "--port", str(server.port), "--input-len", "8", "--output-len", "3",
                "--num-prompts", "3", "--api-key", SERVER_API_KEY)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "machine: " in proc.stdout and "load average" in proc.stdout
    assert "machine: " in proc.stderr  # before the run, while it is silent otherwise
    assert "requests: 100%" in proc.stderr and "3/3" in proc.stderr
    verdict = next(line for line in proc.stdout.splitlines() if line.startswith("ledger verdict"))
    assert any(f": {v}: " in verdict for v in VERDICT_HEADLINES), verdict
    assert "share of their time:" in proc.stdout
    proc = _cli("bench", "serve", "--port", str(server.port), "--input-len", "8", "--output-len", "3",
                "--num-prompts", "2", "--api-key", SERVER_API_KEY, "--json", "--disable-tqdm")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["machine"]["usable_cores"] >= 1 and r["ledger"]["verdict"] in VERDICT_HEADLINES
    assert r["ledger"]["num_requests"] >= 2 and "requests:" not in proc.stderr
