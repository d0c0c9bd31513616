"""The engine core's warm-up before it reports ready.

A fresh engine's first forward pays one-time work: the first touch of every weight page and of
the KV cache, the kernels' first calls (a C library's lazy symbols, oneDNN's packing of a new
shape), the sampler's first buffers. Paid by the first request, it would be booked as that
request's prefill and inflate its time to first token. So the core runs a dummy request through
its own steps before ready: a prompt of a block's tokens, prefilled, then one decode, on the real
scheduler, runner and KV cache (its blocks freed at its end and the prefix cache reset, so no
request can hit them), with the ledger not yet built. Then the same again, now warm: that pass's
prefill step is the measure of a warm step, handed to the ledger, which books whatever the first
real step takes beyond it as "first_step" (metrics/core_ledger.py), never as prefill.

Not for pooling engines (their requests need a resolved PoolingParams; their first request keeps
its cost, booked as before). A warm-up that fails is logged and skipped: the engine still starts,
and its first request pays as it did.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from tokenloom.core.request import Request
from tokenloom.messages import EngineCoreRequest, now
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_REQUEST_ID = "__tokenloom_warmup__"


@dataclass(frozen=True, slots=True)
class WarmUp:
    seconds: float  # the whole warm-up, both passes
    cold_seconds: float  # the first pass: what the first request would have paid
    num_tokens: int  # the warm pass's prefill step: its tokens
    step_seconds: float  # and how long it took


def _one_pass(core: Any, prompt: list[int], tag: str) -> list[float]:
    """`core`: the EngineCore (not imported: it imports this). Runs the dummy request to its end; the duration of each step that computed tokens."""
    core.scheduler.add_request(_request(prompt, tag))
    durations = []
    while core.scheduler.has_unfinished_requests():
        t = time.perf_counter()
        out = core.step()
        if out.scheduler_stats is None or out.scheduler_stats.num_prefill_tokens + out.scheduler_stats.num_decode_tokens:
            durations.append(time.perf_counter() - t)
    return durations


def _request(prompt: list[int], tag: str) -> Request:
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    return Request.from_engine_core_request(
        EngineCoreRequest(f"{WARMUP_REQUEST_ID}{tag}", prompt, params, None, now()))


def warm_up(core: Any) -> WarmUp | None:
    """Runs the warm-up in `core` (before its ledger exists) and puts the scheduler back as a
    fresh one is: no blocks held, nothing cached, its counters at zero. None when skipped."""
    if core.config.is_pooling:
        return None
    scheduler = core.scheduler
    n = max(1, min(core.config.block_size, scheduler.max_num_batched_tokens - 1, scheduler.max_request_len - 2))
    vocab = max(core.info.vocab_size, 2)
    t0 = time.perf_counter()
    try:
        cold = _one_pass(core, [(i % (vocab - 1)) + 1 for i in range(n)], "cold")
        scheduler.kv_cache_manager.reset_prefix_cache()
        warm = _one_pass(core, [((i + n) % (vocab - 1)) + 1 for i in range(n)], "warm")
    except Exception:  # noqa: BLE001 - the engine starts without it; its first request pays
        logger.exception("the warm-up failed; the first request pays the engine's one-time work")
        return None
    finally:
        scheduler.kv_cache_manager.reset_prefix_cache()
        kv = scheduler.kv_cache_manager
        kv.prefix_cache_queries = kv.prefix_cache_hits = 0
        scheduler.step = 0
    result = WarmUp(time.perf_counter() - t0, sum(cold), n, warm[0] if warm else 0.0)
    logger.info("warm-up before ready: %.3fs (its first pass %.3fs; a warm prefill of %d tokens %.3fs)",
                result.seconds, result.cold_seconds, result.num_tokens, result.step_seconds)
    return result
