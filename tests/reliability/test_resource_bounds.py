"""Resource bounds, offline: a prompt that can never fit the KV cache is refused at once (in the
caller with a ValueError, and by the engine core itself should one reach it), and under FCFS a
long generation delays the requests behind it but never starves them."""
from __future__ import annotations

import time

import pytest

from tokenloom import SamplingParams
from tokenloom.messages import EngineCoreRequest, FinishReason, now

CAPACITY = 8 * 16  # offline_llm: num_kv_blocks=8, block_size=16


def _state(llm) -> dict:
    return llm.llm_engine.engine_core.call_utility("get_state")


def _assert_idle(llm) -> None:
    state = _state(llm)
    assert state["num_requests"] == 0 and state["num_runner_requests"] == 0, state
    assert state["num_free_blocks"] == state["num_total_blocks"] == 8, state
    assert not llm.llm_engine.has_unfinished_requests()


def test_prompt_larger_than_the_kv_cache_is_a_value_error(offline_llm):
    too_long = [504 + i for i in range(CAPACITY + 1)]  # shorter than max_model_len (256)
    with pytest.raises(ValueError, match=r"KV cache holds only 128 tokens.*num_kv_blocks=8"):
        offline_llm.generate({"prompt_token_ids": too_long}, SamplingParams(max_tokens=1), use_tqdm=False)
    _assert_idle(offline_llm)
    # The largest prompt that fits runs, and stops where the cache ends.
    out = offline_llm.generate(
        {"prompt_token_ids": too_long[:CAPACITY]}, SamplingParams(max_tokens=5, temperature=0), use_tqdm=False
    )[0]
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 1
    _assert_idle(offline_llm)


def test_engine_core_rejects_a_never_fitting_prompt_itself(offline_llm):
    """Defence in depth: a request that skipped the caller's check (another client) is finished
    with an error naming the cache, not left waiting forever."""
    client = offline_llm.llm_engine.engine_core
    request = EngineCoreRequest(
        request_id="too-long",
        prompt_token_ids=[504 + i for i in range(CAPACITY + 16)],
        sampling_params=SamplingParams(max_tokens=1),
        eos_token_id=None,
        arrival_time=now(),
    )
    client.add_request(request)
    deadline = time.monotonic() + 120
    final = None
    while final is None and time.monotonic() < deadline:
        final = next((o for o in client.get_output(timeout=1.0).outputs if o.request_id == "too-long"), None)
    assert final is not None, "no output for a prompt that can never fit"
    assert final.finish_reason == FinishReason.ERROR and "KV cache blocks" in (final.error or ""), final
    _assert_idle(offline_llm)


def test_fcfs_long_generation_does_not_starve_the_queue(offline_llm):
    """max_num_seqs=1: one long generation, four short ones queued behind it. All finish, in
    arrival order."""
    engine = offline_llm.llm_engine
    long_params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    short_params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    ids = ["long", "short-0", "short-1", "short-2", "short-3"]
    for rid in ids:
        engine.add_request(rid, f"Request {rid} says", long_params if rid == "long" else short_params)
    finished: list[str] = []
    deadline = time.monotonic() + 300
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        finished += [out.request_id for out in engine.step(timeout=1.0) if out.finished]
    assert finished == ids
    _assert_idle(offline_llm)
