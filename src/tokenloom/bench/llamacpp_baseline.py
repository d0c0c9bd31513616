"""`bench latency|throughput --baseline llamacpp`: llama.cpp (through llama-cpp-python) on the same
GGUF file, in another Python.

llama-cpp-python compiles llama.cpp for about ten minutes on two cores and is no dependency of
tokenloom, so it lives in its own environment, e.g.::

    python3 -m venv /tmp/llamacpp-venv
    /tmp/llamacpp-venv/bin/pip install llama-cpp-python

and runs as a long-lived subprocess of that python (`--llamacpp-python`) on `_llamacpp_script.py`,
which answers one command per line: the latency bench alternates its iterations with ours, as it
does with transformers. llama.cpp gets every core this process may use (`n_threads`).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from typing import Any

_PREFIX = "TOKENLOOM_LLAMACPP "


def gguf_weight_bytes_per_token(path: str) -> int:
    """Bytes of matrix weights llama.cpp reads per decode step: every 2-D tensor as stored, the
    token embedding only when it is also the LM head (a tied model; the lookup reads rows)."""
    from tokenloom.model.gguf_file import read_gguf

    g = read_gguf(path)
    tied = "output.weight" not in g.tensors
    return sum(t.nbytes for name, t in g.tensors.items()
               if len(t.shape) == 2 and (name != "token_embd.weight" or tied))


class LlamaCppBaseline:
    """One llama.cpp model in a subprocess; `run` generates greedily, one prompt at a time,
    `run_batched` all prompts together."""

    def __init__(self, args: argparse.Namespace, n_ctx: int) -> None:
        from tokenloom.model.loader import default_model_path

        python = args.llamacpp_python
        if not python:
            raise ValueError("--baseline llamacpp needs --llamacpp-python: the python of an environment with "
                             "llama-cpp-python installed.")
        path = default_model_path() if args.model is None else os.path.abspath(os.path.expanduser(args.model))
        if not os.path.isfile(path):
            raise ValueError(f"--baseline llamacpp runs a GGUF file; {path} is not one")
        self.model_path = path
        self.threads = len(os.sched_getaffinity(0))
        spec = {"model": path, "n_ctx": n_ctx, "n_threads": self.threads, "seed": args.seed}
        self._spec = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(spec, self._spec)
        self._spec.close()
        script = os.path.join(os.path.dirname(__file__), "_llamacpp_script.py")
        self.proc = subprocess.Popen([python, script, self._spec.name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self.version = self._answer()["version"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_PREFIX):
                return json.loads(line[len(_PREFIX):])
        err = self.proc.stderr.read() if self.proc.stderr else ""
        raise RuntimeError(f"the llama.cpp baseline failed ({self.proc.wait()}):\n{err[-3000:]}")

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def run(self, prompts: list[list[int]], output_len: int) -> list[dict[str, float]]:
        runs = self._ask({"prompts": prompts, "output_len": output_len})["runs"]
        for r in runs:
            if r["num_output_tokens"] != output_len:
                raise RuntimeError(f"llama.cpp generated {r['num_output_tokens']} tokens, expected {output_len}")
        return runs

    def run_batched(self, prompts: list[list[int]], output_len: int) -> dict[str, float]:
        """All prompts decoded together through llama.cpp's batch API: one record for the batch."""
        run = self._ask({"prompts": prompts, "output_len": output_len, "batched": True})["runs"][0]
        if run["num_output_tokens"] != output_len * len(prompts):
            raise RuntimeError(f"llama.cpp generated {run['num_output_tokens']} tokens, "
                               f"expected {output_len * len(prompts)}")
        return run

    def memory(self) -> dict[str, float]:
        m = self._ask({"memory": True})
        return {"rss_mib": m["rss_bytes"] / 2**20, "peak_rss_mib": m["peak_rss_bytes"] / 2**20}

    def describe(self) -> dict[str, Any]:
        return {"backend": f"llama.cpp {self.version}", "dtype": "GGUF as stored",
                "threads": self.threads, "weight_bytes_per_token": gguf_weight_bytes_per_token(self.model_path)}

    def close(self) -> None:
        from tokenloom.bench.common import end_command_process

        end_command_process(self.proc, timeout=30)
        os.unlink(self._spec.name)
