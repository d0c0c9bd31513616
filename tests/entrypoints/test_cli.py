"""The command line as a user runs it: real processes, the embedded model."""
from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import pytest


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Callable[[], tuple[int, str, str]]]:
    """The two commands that load the model, started together: each spends most of its run
    (imports, loading) on one core, so side by side they take little longer than one. Output
    goes to files, so that the one read second never blocks on a full pipe. name -> a function
    waiting for that command: (exit status, stdout, stderr)."""
    commands = {
        # What `make run` executes.
        "demo": ["-m", "tokenloom.entrypoints.demo"],
        "generate": ["-m", "tokenloom.entrypoints.cli", "generate", "--json", "--max-tokens", "8", "--chat",
                     "--kv-cache-memory-bytes", str(64 * 1024**2), "What is the capital of France?", "Hello!"],
    }
    out_dir = tmp_path_factory.mktemp("cli")
    procs = {}
    for name, args in commands.items():
        with open(out_dir / f"{name}.out", "w") as out, open(out_dir / f"{name}.err", "w") as err:
            procs[name] = subprocess.Popen([sys.executable, *args], stdout=out, stderr=err, text=True)

    def waiter(name: str) -> Callable[[], tuple[int, str, str]]:
        def wait() -> tuple[int, str, str]:
            rc = procs[name].wait(timeout=300)
            return rc, (out_dir / f"{name}.out").read_text(), (out_dir / f"{name}.err").read_text()
        return wait

    yield {name: waiter(name) for name in procs}
    for proc in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_make_run_demo_answers_sensibly(runs):
    rc, stdout, stderr = runs["demo"]()
    assert rc == 0, stderr[-2000:]
    assert "Q: What is the capital of France?" in stdout
    answer = stdout.split("Q: What is the capital of France?")[1].split("Q:")[0]
    assert "Paris" in answer


def test_generate_json_and_chat(runs):
    rc, stdout, stderr = runs["generate"]()
    assert rc == 0, stderr[-2000:]
    lines = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
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
    assert main(["generate", "--seed", "-5", "hi"]) == 2
    assert "seed must be an integer in [0, 2**64)" in capsys.readouterr().err


def test_vllm_spellings_parse_as_tokenloom_options():
    """vLLM's launch lines: underscores in option names, its dtype names and size suffixes."""
    from tokenloom.entrypoints.cli import build_parser, normalize_flags
    from tokenloom.entrypoints.engine_args import engine_config_from_args

    argv = ["serve", "--max_model_len=8K", "--max_num_seqs", "4", "--dtype", "half", "--served-model-name", "my_model",
            "--enable-prefix-caching", "--gpu-memory-utilization", "0.9"]
    args = build_parser().parse_args(normalize_flags(argv))
    config = engine_config_from_args(args)
    assert (config.max_model_len, config.max_num_seqs, config.dtype) == (8192, 4, "float16")
    assert config.enable_prefix_caching and args.served_model_name == ["my_model"]  # values keep their underscores
    assert build_parser().parse_args(["serve", "--max-model-len", "8k"]).max_model_len == 8000
    assert build_parser().parse_args(["serve", "--dtype", "float"]).dtype == "float"
    assert engine_config_from_args(build_parser().parse_args(["serve", "--dtype", "float"])).dtype == "float32"
    assert not build_parser().parse_args(["serve", "--no-enable-prefix-caching"]).enable_prefix_caching
    assert normalize_flags(["generate", "--", "--a_b"]) == ["generate", "--", "--a_b"]  # positional after --


def test_an_engine_that_cannot_start_is_one_line(capsys):
    """A setting the model refuses (found when the config is resolved, before any process starts)
    ends the command with the reason on one line, naming the field and the model's limit, and the
    exit status of a bad argument."""
    from tokenloom.entrypoints.cli import main

    assert main(["generate", "--max-model-len", "100000", "--max-tokens", "1", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("tokenloom: error: max_model_len=100000 is larger than the model's context length (8192, "
                       "the GGUF's context_length): pass max_model_len <= 8192, or leave it unset for 8192.")


def test_env_prints_versions_and_the_kernel_plan(capsys):
    """`tokenloom env` (vLLM's collect-env): versions, the CPU, the set variables and the plan."""
    from tokenloom.entrypoints.cli import main
    from tokenloom.ops import kernel_plan

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "torch:" in out and "isa flags:" in out
    assert kernel_plan.format_table(kernel_plan.current()) in out
