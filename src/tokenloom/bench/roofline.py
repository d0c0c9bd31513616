"""The memory roofline next to each decode figure of `bench latency|throughput`.

A decode step reads every weight once (shared by the batch) and each sequence's KV cache; at the
batch sizes people run on a CPU that makes it bound by the memory's read bandwidth. The report
gives the bytes one step reads per token it produces, the bandwidth the measured step time
implies, and that as a fraction of the machine's ceiling, which `read_bandwidth` measures once
per process: every usable core streaming through a buffer larger than the last-level cache
(torch's multithreaded sum), the best of three passes: a second or less on an idle machine.
"""
from __future__ import annotations

import functools
import os
import time
from collections.abc import Sequence
from typing import Any

# Past the last-level cache (a quarter more), within bounds that keep the measurement cheap.
_MIN_BUFFER = 256 << 20
_MAX_BUFFER = 1 << 30
_PASSES = 3
_KV_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "int8": 1,
                     "q8_0": 1}


def last_level_cache_bytes() -> int:
    """The largest cache of CPU 0 (Linux sysfs); 0 where unknown."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        try:
            text = open(os.path.join(base, name, "size")).read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        try:
            best = max(best, int(text.rstrip("KMG")) * scale)
        except ValueError:
            continue
    return best


@functools.lru_cache(maxsize=1)
def read_bandwidth() -> dict[str, Any]:
    """The machine's streaming read bandwidth in bytes/s, all usable cores (measured once per
    process), with the buffer size and thread count it was measured with."""
    import torch

    size = min(_MAX_BUFFER, max(_MIN_BUFFER, last_level_cache_bytes() * 5 // 4)) // 4096 * 4096
    threads = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buf = torch.ones(size // 4, dtype=torch.float32)  # written (first touch) by every thread
        best = float("inf")
        for _ in range(_PASSES):
            t0 = time.perf_counter()
            buf.sum()
            best = min(best, time.perf_counter() - t0)
        del buf
    finally:
        torch.set_num_threads(before)
    return {"bytes_per_s": size / best, "buffer_bytes": size, "threads": threads}


def kv_bytes_per_sequence(config: Any, kv_cache_dtype: str, context: int) -> int:
    """Bytes of K and V one sequence of `context` tokens has read per decode step (every layer;
    a sliding-window layer reads at most its window)."""
    per_token_layer = 2 * config.num_key_value_heads * config.head_dim * _KV_ELEMENT_BYTES.get(kv_cache_dtype, 2)
    layer_types = getattr(config, "layer_types", None) or ()
    window = getattr(config, "sliding_window", None)
    total = 0
    for i in range(config.num_hidden_layers):
        sliding = i < len(layer_types) and layer_types[i] == "sliding_attention" and window
        total += per_token_layer * (min(context, window) if sliding else context)
    return total


def decode_roofline(weight_bytes: int, kv_bytes_per_step: float, tokens_per_step: float, step_s: float,
                    ceiling: float) -> dict[str, float]:
    """One decode figure against the ceiling: the bytes a step reads (weights once, plus every
    sequence's KV), per token it produces; the bandwidth its time implies; the fraction of
    `ceiling` (bytes/s)."""
    step_bytes = weight_bytes + kv_bytes_per_step
    implied = step_bytes / step_s if step_s > 0 else 0.0
    return {"bytes_per_token": step_bytes / max(tokens_per_step, 1e-9), "bytes_per_step": step_bytes,
            "kv_bytes_per_step": kv_bytes_per_step, "implied_bytes_per_s": implied,
            "ceiling_bytes_per_s": ceiling, "fraction_of_ceiling": implied / ceiling if ceiling > 0 else 0.0}


def decode_steps_roofline(stats: Sequence[Any], weight_bytes: int, kv_bytes_at: Any,
                          ceiling: float) -> dict[str, float] | None:
    """The roofline of the decode-only steps a run's engine took (`SchedulerStats`): their total
    bytes (weights once a step, `kv_bytes_at(n)` for n sequences) over their total time; None
    without any."""
    steps = [s for s in stats if s.num_prefill_tokens == 0 and s.num_decode_tokens > 0 and s.step_time > 0]
    if not steps:
        return None
    total_s = sum(s.step_time for s in steps)
    tokens = sum(s.num_decode_tokens for s in steps)
    kv = sum(kv_bytes_at(s.num_decode_tokens) for s in steps) / len(steps)
    out = decode_roofline(weight_bytes, kv, tokens / len(steps), total_s / len(steps), ceiling)
    out["decode_tokens_per_s"] = tokens / total_s
    return out


def format_roofline(label: str, r: dict[str, float] | None) -> str:
    if not r:
        return f"{label}: -"
    return (f"{label}: {r['bytes_per_token'] / 1e6:.1f} MB read / token ({r['bytes_per_step'] / 1e6:.1f} MB / step, "
            f"KV {r['kv_bytes_per_step'] / 1e6:.1f}), {r['implied_bytes_per_s'] / 1e9:.1f} GB/s = "
            f"{100 * r['fraction_of_ceiling']:.0f}% of the measured {r['ceiling_bytes_per_s'] / 1e9:.1f} GB/s")
