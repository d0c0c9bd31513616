"""What `bench throughput` and `bench latency` share: random prompts, the transformers baseline,
the engine's step profile and the process CPU accounting.

Imported only inside the commands' `func` (it imports torch and numpy).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import numpy as np
import torch

from tokenloom.messages import SchedulerStats

# The phases of one engine step, in the order they run; "loop" is the busy loop between two steps
# (draining inputs, queueing outputs for the output thread).
PHASES = ("schedule", "prepare", "forward", "sample", "update", "loop")


# ---- prompts -------------------------------------------------------------------------------------


def random_prompt_ids(tokenizer: Any, vocab_size: int, num: int, length: int, seed: int) -> list[list[int]]:
    """`num` prompts of exactly `length` token ids drawn uniformly from the ordinary vocabulary:
    special and added tokens (BOS, EOS, chat markers) are left out, so no prompt ends early or
    switches the model into a chat turn."""
    limit = min(vocab_size, len(tokenizer))
    special = set(getattr(tokenizer, "all_special_ids", ()))
    special |= {i for i in getattr(tokenizer, "added_tokens_decoder", {}) if i < limit}
    allowed = np.setdiff1d(np.arange(limit), np.fromiter(special, dtype=np.int64, count=len(special)))
    rng = np.random.default_rng(seed)
    return rng.choice(allowed, size=(num, length)).tolist()


# ---- engine side -----------------------------------------------------------------------------------


def default_hf_dtype(device: str) -> str:
    """The transformers baseline's dtype when none is given: float32 on the CPU (its best
    there), bfloat16 on CUDA, like for like with tokenloom's dtype="auto" there."""
    return "bfloat16" if str(device).startswith("cuda") else "float32"


def make_llm(args: argparse.Namespace, **overrides: Any) -> Any:
    """An `LLM` from the command's engine options (`add_engine_args`)."""
    import dataclasses

    from tokenloom.entrypoints.engine_args import EngineArgs
    from tokenloom.entrypoints.llm import LLM

    return LLM.from_engine_args(dataclasses.replace(EngineArgs.from_cli_args(args), **overrides))


class StepRecorder:
    """Sits between `LLMEngine` and its engine-core client and keeps the `SchedulerStats` of
    every step that passes (they carry the core's step profile); everything else is forwarded."""

    def __init__(self, llm: Any) -> None:
        self._engine = llm.llm_engine
        self._client = self._engine.engine_core
        self._engine.engine_core = self
        self.stats: list[SchedulerStats] = []
        self.recording = False

    def get_output(self, timeout: float | None = None) -> Any:
        outputs = self._client.get_output(timeout)
        if self.recording and outputs.scheduler_stats is not None:
            self.stats.append(outputs.scheduler_stats)
        return outputs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)

    def detach(self) -> None:
        self._engine.engine_core = self._client


def process_cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc), 0 where unavailable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


def end_command_process(proc: subprocess.Popen, timeout: float) -> None:
    """Ends a baseline that reads one command per stdin line (vLLM's, llama.cpp's script): stdin
    closed, so its loop ends; killed if it has not exited within `timeout` seconds."""
    if proc.poll() is None:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def tree_pids(pid: int) -> list[int]:
    """A process and all its descendants (vLLM's engine core is a child of the process the bench
    starts), from /proc; [] for one gone."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        out.append(p)
        for task in tasks:
            try:
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
            except OSError:
                pass
    return out


def tree_cpu_seconds(pid: int) -> float:
    """process_cpu_seconds summed over tree_pids(pid)."""
    return sum(process_cpu_seconds(p) for p in tree_pids(pid))


def process_memory_mib(pid: int) -> dict[str, float]:
    """Resident memory of a process now and at its peak (Linux /proc VmRSS, VmHWM), in MiB."""
    out = {"rss_mib": 0.0, "peak_rss_mib": 0.0}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    key = "rss_mib" if line.startswith("VmRSS") else "peak_rss_mib"
                    out[key] = int(line.split()[1]) / 1024
    except OSError:
        pass
    return out


@dataclass
class CpuMeter:
    """CPU seconds used by the caller and by the engine-core process over a timed region: shows
    whether the caller took CPU the core's threads could have used."""

    core_pid: int
    _start: tuple[float, float, float] = (0.0, 0.0, 0.0)
    result: dict[str, float] = field(default_factory=dict)

    def __enter__(self) -> "CpuMeter":
        self._start = (time.perf_counter(), time.process_time(), self._core())
        return self

    def _core(self) -> float:
        return 0.0 if self.core_pid == os.getpid() else process_cpu_seconds(self.core_pid)

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._start[0]
        caller = time.process_time() - self._start[1]
        self.result = {"caller_cpu_s": caller, "wall_s": wall}
        if self.core_pid != os.getpid():
            core = self._core() - self._start[2]
            self.result["core_cpu_s"] = core
            self.result["core_cpu_util"] = core / wall if wall > 0 else 0.0
        self.result["caller_cpu_util"] = caller / wall if wall > 0 else 0.0


def megabytes_cell(num_bytes: int | None) -> str:
    """A report cell in MB; a baseline that does not report the figure shows "-", not a 0.0 that
    reads as a measurement."""
    return "-" if not num_bytes else f"{num_bytes / 1e6:.1f}"


def memory_cell(run: dict[str, Any], key: str, width: int) -> str:
    """A report cell: a run's memory figure (`process_memory_mib`'s keys) in MiB, or "-" for a
    baseline that reports none (vLLM's engine process is not ours to read)."""
    value = run.get("memory", {}).get(key)
    return f"{value:>{width}.0f}" if value is not None else f"{'-':>{width}}"


def spec_decode_summary(stats: Sequence[SchedulerStats]) -> dict[str, Any] | None:
    """Speculative decoding over the recorded steps (the core's counters are cumulative: the
    last recorded step's less the first's); None without drafts."""
    if len(stats) < 2 or not stats[-1].spec_num_drafts:
        return None
    first, last = stats[0], stats[-1]
    drafts = last.spec_num_drafts - first.spec_num_drafts
    drafted = last.spec_num_draft_tokens - first.spec_num_draft_tokens
    accepted = last.spec_num_accepted_tokens - first.spec_num_accepted_tokens
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "accepted_per_draft": accepted / drafts if drafts else 0.0}


def format_spec_decode(summary: dict[str, Any] | None) -> list[str]:
    if summary is None:
        return []
    return [f"tokenloom speculative decoding: drafts in {summary['drafts']} request-steps, "
            f"{summary['accepted_tokens']} of {summary['draft_tokens']} draft tokens accepted "
            f"({summary['acceptance_rate']:.0%}), {summary['accepted_per_draft']:.2f} per draft"]


def step_profile(stats: Sequence[SchedulerStats]) -> dict[str, Any]:
    """Aggregates the core's per-step timings: seconds and share of step time per phase, for all
    steps and for the decode-only steps (the steady state). Engine overhead is everything but
    forward and sampling, as a share of step time."""

    def aggregate(steps: Sequence[SchedulerStats]) -> dict[str, Any]:
        totals = {p: 0.0 for p in PHASES}
        unaccounted = serialize = 0.0
        for s in steps:
            totals["schedule"] += s.schedule_time
            totals["prepare"] += s.prepare_time
            totals["forward"] += s.forward_time
            totals["sample"] += s.sample_time
            totals["update"] += s.update_time
            totals["loop"] += s.loop_time
            unaccounted += s.step_time - (
                s.schedule_time + s.prepare_time + s.forward_time + s.sample_time + s.update_time
            )
            serialize += s.serialize_time
        total = sum(totals.values()) + unaccounted
        share = {p: (v / total if total > 0 else 0.0) for p, v in totals.items()}
        return {
            "num_steps": len(steps),
            "total_s": total,
            "mean_step_ms": 1000.0 * total / len(steps) if steps else 0.0,
            "seconds": totals,
            "share": share,
            "engine_overhead_pct": 100.0 * (1.0 - share["forward"] - share["sample"]) if total > 0 else 0.0,
            # Encoding and sending outputs runs on the core's output thread, overlapping the next
            # step; it shows here, not in the step time.
            "serialize_overlapped_s": serialize,
        }

    decode = [s for s in stats if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0]
    return {"all_steps": aggregate(stats), "decode_steps": aggregate(decode)}


def format_profile(profile: dict[str, Any], title: str) -> list[str]:
    lines = [f"{' ' + title + ' ':-^72}"]
    header = f"{'phase':<12}" + "".join(f"{k:>30}" for k in ("all steps", "decode-only steps"))
    lines.append(header)
    a, d = profile["all_steps"], profile["decode_steps"]
    for p in PHASES:
        cells = [f"{x['seconds'][p]:9.3f} s {100 * x['share'][p]:6.1f} %" for x in (a, d)]
        lines.append(f"{p:<12}" + "".join(f"{c:>30}" for c in cells))
    lines.append(f"{'steps':<12}" + "".join(f"{x['num_steps']:>30}" for x in (a, d)))
    lines.append(f"{'mean step':<12}" + "".join(f"{x['mean_step_ms']:>27.2f} ms" for x in (a, d)))
    lines.append(f"{'overhead':<12}" + "".join(f"{x['engine_overhead_pct']:>28.1f} %" for x in (a, d)))
    lines.append(f"{'serialize*':<12}" + "".join(f"{x['serialize_overlapped_s']:>28.3f} s" for x in (a, d)))
    lines.append("overhead: step time outside forward+sample. *serialize: output thread, overlapped")
    return lines


# ---- transformers baseline ---------------------------------------------------------------------


@contextlib.contextmanager
def gguf_read_once() -> Iterator[None]:
    """While transformers loads from a GGUF file: gguf-py parses each file once, and builds its
    tensor-name table once per (architecture, layer count).

    transformers' GGUF loading parses the whole file twice (for the config, then for the tensors:
    for Gemma 3 that is 262k vocabulary strings each time) and rebuilds gguf-py's name table for
    every submodule of the model (hundreds of times). Both are pure functions of their arguments,
    so remembering them for the duration of one load gives the same tensors, config and tokenizer;
    it cuts SmolLM2's load to a fraction on a busy machine. The reader also reads
    through a plain ndarray view of its memmap (see `_plain_gguf_reader`)."""
    import gguf

    with mock.patch.object(gguf, "GGUFReader", functools.cache(_plain_gguf_reader())), \
            mock.patch.object(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map)):
        yield


@functools.cache
def _plain_gguf_reader() -> type:
    """gguf-py's GGUFReader slicing a plain ndarray view of its memmap rather than the memmap
    itself: it reads a file as millions of tiny slices (one per vocabulary string and its
    length), and each slice of a `np.memmap` runs numpy's Python-level subclass hooks. Same
    bytes, same fields and tensors (the view shares the mapping), parsed without those hooks."""
    import gguf

    class PlainGGUFReader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset : offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainGGUFReader


def load_hf_model(model: str | None, dtype: str, device: str) -> tuple[Any, torch.dtype]:
    """transformers' own model for the same checkpoint: from a GGUF file it dequantizes the same
    tensors our loader does (`from_pretrained(dir, gguf_file=...)`)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from tokenloom.model.loader import default_model_path, resolve_dtype

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    torch_dtype = resolve_dtype(dtype, device)
    path = default_model_path() if model is None else os.path.abspath(os.path.expanduser(model))
    if os.path.isfile(path):
        # transformers' GGUF conversion draws its own tqdm bar, deaf to disable_progress_bar().
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        with mock.patch.object(gguf_utils, "tqdm", lambda it, **kwargs: it), gguf_read_once():
            hf = AutoModelForCausalLM.from_pretrained(
                os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch_dtype
            )
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype)
    return hf.to(device).eval(), torch_dtype


class _StepClock:
    """A logits processor that changes nothing and notes when each new token's logits are ready:
    the first is the end of the prefill, the gaps after it are the decode steps."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.times.append(time.perf_counter())
        return scores


def hf_generate(
    hf: Any, prompts: list[list[int]], output_len: int, batch_size: int, pad_token_id: int, device: str
) -> dict[str, Any]:
    """Greedy `generate()` over static batches of `batch_size` prompts, left-padded to the
    batch's longest prompt; exactly `output_len` new tokens per prompt (`min_new_tokens` keeps
    EOS from ending one early, like `ignore_eos`). Returns the elapsed time, the output token
    count and, per batch, the prefill time and the decode step times."""
    from transformers import LogitsProcessorList

    num_out = 0
    batches = []
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        chunk = prompts[b : b + batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad_token_id, dtype=torch.int64)
        mask = torch.zeros((len(chunk), width), dtype=torch.int64)
        for i, p in enumerate(chunk):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        clock = _StepClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=False,
                pad_token_id=pad_token_id,
                logits_processor=LogitsProcessorList([clock]),
            )
        if device != "cpu":
            torch.cuda.synchronize()
        new = out.shape[1] - width
        if new != output_len:
            raise RuntimeError(f"transformers generated {new} tokens per prompt, expected {output_len}")
        num_out += new * len(chunk)
        steps = [b - a for a, b in zip(clock.times, clock.times[1:])]
        batches.append({"prefill_s": clock.times[0] - t0 if clock.times else 0.0, "decode_step_s": steps})
    return {"elapsed_s": time.perf_counter() - start, "num_output_tokens": num_out, "batches": batches}


# ---- statistics ------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q)) if len(values) else 0.0


def summary_ms(values_s: Sequence[float]) -> dict[str, float]:
    return {
        "median_ms": 1000.0 * percentile(values_s, 50),
        "p90_ms": 1000.0 * percentile(values_s, 90),
        "mean_ms": 1000.0 * float(np.mean(values_s)) if len(values_s) else 0.0,
    }


def positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}.")


def check_output_json(path: str | None) -> None:
    """Refuses an `--output-json` FILE that cannot be written before the benchmark runs, not
    after it (a long run would be lost)."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"--output-json {path}: the folder {folder} does not exist.")
    if os.path.isdir(path):
        raise ValueError(f"--output-json {path} is a folder, not a file.")


def emit(result: dict[str, Any], as_json: bool, report: Callable[[dict[str, Any]], None],
         output_json: str | None = None) -> int:
    """Print a bench result as one JSON object or as its human report, and with `output_json`
    also write the JSON to that file (as vLLM's `bench --output-json`); the command's exit code."""
    if output_json is not None:
        with open(output_json, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if as_json:
        print(json.dumps(result))
    else:
        report(result)
    return 0


def result_runs(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The report's columns: tokenloom's run, then the baseline's when there is one."""
    return [result["tokenloom"]] + ([result["baseline"]] if "baseline" in result else [])
