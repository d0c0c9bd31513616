"""Resident memory while loading a GGUF and generating at batch 1: tokenloom against llama.cpp
(llama-cpp-python) on the same file, each in a fresh process of its own.

Measure (issue 52): RSS summed over the engine's process tree (tokenloom's caller process and its
engine-core child; llama.cpp's one process), file-backed pages included (VmRSS = anonymous + file +
shared), sampled every `--interval` seconds from the process start (imports included) through the
model's construction (`LLM(...)` / `Llama(...)`) and one generate of `--input-len` random prompt
ids and `--output-len` greedy tokens. Printed per engine: the peak during loading, the steady
state once loaded, the peak while generating, the steady state after it, and the ratio of
tokenloom's to llama.cpp's for each; with the breakdown (anonymous / file-backed, per process)
at the load peak. llama.cpp maps the file, so only the pages it touches count (its resident
weights are file-backed and shared with the page cache).

KV cache: llama.cpp's `n_ctx` and tokenloom's `max_model_len` are both input + output (like for
like); the KV each holds for that context is printed beside the totals.

    PYTHONPATH=src .venv/bin/python benchmarks/load_memory.py \\
        --model /tmp/speed/shapes/llama-3.2-1b-Q4_K_M.gguf --llamacpp-python /tmp/speed/lcpy
    ... --engine tokenloom            # tokenloom alone (e.g. while changing the loader)
    ... --llm-kwargs '{"quantization": "none"}'
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from tokenloom.bench.common import tree_pids  # noqa: E402

_PHASE = "LOADMEM_PHASE "

# Each driver prints a phase marker (flushed) before each stage; the sampler tags its samples with
# the latest marker read. "start" is the process start (interpreter and imports).
_TOKENLOOM_DRIVER = r"""
import json, random, sys, time
spec = json.loads(sys.argv[1])
def phase(name): print("LOADMEM_PHASE " + name, flush=True)
phase("import")
from tokenloom import LLM, SamplingParams
phase("load")
llm = LLM(model=spec["model"], max_model_len=spec["n_ctx"], seed=0, **spec["kwargs"])
phase("loaded")
time.sleep(spec["settle"])
rng = random.Random(0)
ids = [rng.randrange(100, 20000) for _ in range(spec["input_len"])]
phase("generate")
out = llm.generate([{"prompt_token_ids": ids}],
                   SamplingParams(temperature=0.0, max_tokens=spec["output_len"], ignore_eos=True), use_tqdm=False)
assert len(out[0].outputs[0].token_ids) == spec["output_len"]
phase("generated")
time.sleep(spec["settle"])
phase("end")
"""

_LLAMACPP_DRIVER = r"""
import json, os, random, sys, time
spec = json.loads(sys.argv[1])
def phase(name): print("LOADMEM_PHASE " + name, flush=True)
phase("import")
import llama_cpp
phase("load")
threads = len(os.sched_getaffinity(0))
llm = llama_cpp.Llama(model_path=spec["model"], n_ctx=spec["n_ctx"], n_threads=threads,
                      n_threads_batch=threads, n_batch=512, seed=0, verbose=False)
phase("loaded")
time.sleep(spec["settle"])
rng = random.Random(0)
ids = [rng.randrange(100, 20000) for _ in range(spec["input_len"])]
phase("generate")
n = 0
for _ in llm.generate(ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0, reset=True):
    n += 1
    if n >= spec["output_len"]:
        break
phase("generated")
time.sleep(spec["settle"])
phase("end")
"""


def _status_kib(pid: int) -> dict[str, int] | None:
    """VmRSS and its parts (RssAnon, RssFile, RssShmem) of one process, in KiB."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "RssAnon:", "RssFile:", "RssShmem:")):
                    key, value = line.split(":", 1)
                    out[key] = int(value.split()[0])
    except OSError:
        return None
    return out


def _process_name(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            args = f.read().split(b"\0")
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return str(pid)
    return "engine core" if b"engine_core_proc" in b" ".join(args) else comm


def measure(cmd: list[str], interval: float, env: dict[str, str]) -> dict:
    """Runs `cmd`, sampling its process tree's memory until it exits."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    phase = ["start"]
    marks: dict[str, float] = {}
    samples: list[tuple[float, str, int, int, int, dict[int, int]]] = []
    names: dict[int, str] = {}
    t0 = time.perf_counter()

    def read_phases() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(_PHASE):
                phase[0] = line[len(_PHASE):].strip()
                marks[phase[0]] = time.perf_counter() - t0

    reader = threading.Thread(target=read_phases, daemon=True)
    reader.start()
    while proc.poll() is None:
        rss = anon = file = 0
        per: dict[int, int] = {}
        for pid in tree_pids(proc.pid):
            s = _status_kib(pid)
            if s is None:
                continue
            rss += s.get("VmRSS", 0)
            anon += s.get("RssAnon", 0)
            file += s.get("RssFile", 0) + s.get("RssShmem", 0)
            per[pid] = s.get("VmRSS", 0)
            if pid not in names:
                names[pid] = _process_name(pid)
        if rss:
            samples.append((time.perf_counter() - t0, phase[0], rss, anon, file, per))
        time.sleep(interval)
    reader.join(timeout=5)
    err = proc.stderr.read() if proc.stderr else ""
    if proc.returncode != 0 or "end" not in marks:
        raise RuntimeError(f"{cmd[0]} failed ({proc.returncode}):\n{err[-4000:]}")

    def peak(phases: set[str]) -> tuple:
        return max((s for s in samples if s[1] in phases), key=lambda s: s[2])

    def last(phase_name: str) -> tuple:
        """The last sample of a phase (a phase too short to sample: the first one after it)."""
        inside = [s for s in samples if s[1] == phase_name]
        return inside[-1] if inside else next(s for s in samples if s[0] >= marks[phase_name])

    load_peak = peak({"start", "import", "load", "loaded"})
    return {
        "load_peak": load_peak[2] / 1024,
        "load_peak_anon": load_peak[3] / 1024,
        "load_peak_file": load_peak[4] / 1024,
        "load_peak_per_process": {f"{pid} {names.get(pid, '')}": kib / 1024 for pid, kib in load_peak[5].items()},
        "load_peak_phase": load_peak[1],
        "imported": last("import")[2] / 1024,
        "loaded": last("loaded")[2] / 1024,
        "loaded_anon": last("loaded")[3] / 1024,
        "loaded_file": last("loaded")[4] / 1024,
        "generate_peak": peak({"generate"})[2] / 1024,
        "after": last("generated")[2] / 1024,
        "after_per_process": {f"{pid} {names.get(pid, '')}": kib / 1024 for pid, kib in last("generated")[5].items()},
        "load_s": marks.get("loaded", 0) - marks.get("load", 0),
        "samples": len(samples),
    }


def kv_bytes_per_token(model: str) -> int:
    """K and V of every layer for one token in float16 (llama.cpp's default cache type)."""
    from tokenloom.model.gguf_config import gguf_model_config
    from tokenloom.model.gguf_file import read_gguf

    c = gguf_model_config(read_gguf(model))
    return 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2


_ROWS = [("peak while loading", "load_peak"), ("  anonymous", "load_peak_anon"),
         ("  file-backed", "load_peak_file"), ("after imports", "imported"),
         ("loaded (steady)", "loaded"), ("  anonymous", "loaded_anon"), ("  file-backed", "loaded_file"),
         ("peak while generating", "generate_peak"), ("after generating", "after")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="/tmp/speed/shapes/llama-3.2-1b-Q4_K_M.gguf")
    p.add_argument("--llamacpp-python", default="/tmp/speed/lcpy")
    p.add_argument("--engine", choices=("both", "tokenloom", "llamacpp"), default="both")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--interval", type=float, default=0.02)
    p.add_argument("--settle", type=float, default=1.0, help="seconds idle after loading and after generating")
    p.add_argument("--llm-kwargs", default="{}", help="JSON of extra LLM(...) arguments for tokenloom")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    model = os.path.abspath(args.model)
    spec = {"model": model, "n_ctx": args.input_len + args.output_len, "input_len": args.input_len,
            "output_len": args.output_len, "settle": args.settle, "kwargs": json.loads(args.llm_kwargs)}
    src = str(Path(__file__).resolve().parents[1] / "src")
    results = {}
    if args.engine in ("both", "tokenloom"):
        env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
        results["tokenloom"] = measure([sys.executable, "-c", _TOKENLOOM_DRIVER, json.dumps(spec)], args.interval, env)
    if args.engine in ("both", "llamacpp"):
        results["llama.cpp"] = measure([args.llamacpp_python, "-c", _LLAMACPP_DRIVER, json.dumps(spec)],
                                       args.interval, dict(os.environ))
    kv = kv_bytes_per_token(model) * spec["n_ctx"] / 2**20
    print(f"model {model}; batch 1, {args.input_len} in + {args.output_len} out; context {spec['n_ctx']} "
          f"(KV for it in float16: {kv:.1f} MiB); RSS summed over each engine's processes, MiB")
    names = list(results)
    print(f"{'':<24}" + "".join(f"{n:>14}" for n in names) + ("   ratio" if len(names) == 2 else ""))
    for label, key in _ROWS:
        vals = [results[n][key] for n in names]
        ratio = f"  {vals[0] / vals[1]:6.2f}x" if len(vals) == 2 and vals[1] else ""
        print(f"{label:<24}" + "".join(f"{v:>14.0f}" for v in vals) + ratio)
    for n in names:
        r = results[n]
        print(f"{n}: load {r['load_s']:.1f} s, {r['samples']} samples; load peak in phase {r['load_peak_phase']!r}, "
              "per process: " + ", ".join(f"{k} {v:.0f}" for k, v in r["load_peak_per_process"].items())
              + "; after generating: " + ", ".join(f"{k} {v:.0f}" for k, v in r["after_per_process"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
