"""The command line as a user runs it: real processes, the embedded model."""
from __future__ import annotations

import json
import subprocess
import sys


def _run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout)


def test_make_run_demo_answers_sensibly():
    # What `make run` executes.
    proc = _run("-m", "tokenloom.entrypoints.demo")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Q: What is the capital of France?" in proc.stdout
    answer = proc.stdout.split("Q: What is the capital of France?")[1].split("Q:")[0]
    assert "Paris" in answer


def test_generate_json_and_chat():
    proc = _run(
        "-m", "tokenloom.entrypoints.cli", "generate", "--json", "--max-tokens", "8", "--chat",
        "--kv-cache-memory-bytes", str(64 * 1024**2), "What is the capital of France?", "Hello!",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [l["prompt"] for l in lines] == ["What is the capital of France?", "Hello!"]
    assert "Paris" in lines[0]["text"]
    assert all(1 <= len(l["token_ids"]) <= 8 and l["finish_reason"] in ("stop", "length") for l in lines)


def test_bad_engine_option_is_a_clear_error(capsys):
    # The entry point `python -m tokenloom.entrypoints.cli` exits with, called in this process: the
    # refusal comes before any model loads, and a fresh interpreter only added its imports (the
    # real command line's exit status 2 is covered by test_bench.py's bad-argument test).
    from tokenloom.entrypoints.cli import main

    assert main(["generate", "--max-num-seqs", "0", "hi"]) == 2
    err = capsys.readouterr().err
    assert "max_num_seqs" in err and "positive" in err
