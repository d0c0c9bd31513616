"""`tokenloom generate --trace` and `tokenloom explain` as a user runs them, and the ledger off."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tokenloom import SamplingParams


def _cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(
        [sys.executable, "-m", "tokenloom.entrypoints.cli", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_generate_trace_then_explain(tmp_path):
    trace = tmp_path / "run.json"
    proc = _cli(
        "generate", "--max-tokens", "4", "--kv-cache-memory-bytes", str(64 * 1024**2),
        "--trace", str(trace), "The capital of France is", "Hello", "1, 2, 3,",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert trace.exists()

    plot = tmp_path / "run.png"
    proc = _cli("explain", str(trace), "--json", "--top", "2", "--plot", str(plot))
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout)
    assert report["num_requests"] == 3 and len(report["slowest"]) == 2
    assert report["verdict"] in report["group_shares"]
    assert abs(sum(report["group_shares"].values()) - 1) < 1e-9
    for r in report["slowest"]:
        assert abs(sum(r["parts"].values()) - r["e2e"]) < max(1e-3, 0.01 * r["e2e"])
    assert plot.stat().st_size > 10_000 and plot.read_bytes()[:4] == b"\x89PNG"

    proc = _cli("explain", str(trace))
    assert proc.returncode == 0 and "verdict:" in proc.stdout and "slowest" in proc.stdout

    (tmp_path / "bad.json").write_text("not json")
    proc = _cli("explain", str(tmp_path / "bad.json"))
    assert proc.returncode == 2 and "not a JSON trace" in proc.stderr


def test_ledger_off(make_llm):
    from tokenloom import LLM

    with pytest.raises(ValueError, match="trace_path needs the ledger"):
        LLM(enable_ledger=False, trace_path="x.json")
    llm = make_llm(enable_ledger=False, multiprocess=False)
    assert llm.llm_engine.engine_core.engine_core.ledger is None
    [out] = llm.generate("Hello", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    m = out.metrics
    assert m.core is None and m.returned_time is None
    # Without the core's account the decomposition still covers the request, unattributed.
    assert m.parts["core_unattributed"] > 0
    assert sum(m.parts.values()) == pytest.approx(m.e2e_latency, abs=1e-9)
    with pytest.raises(RuntimeError, match="enable_ledger=False"):
        llm.get_metrics()
    assert llm.flush_trace() is None
