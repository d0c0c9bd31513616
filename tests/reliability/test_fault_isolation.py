"""A fault while admitting or sampling one request fails that request alone (defence in depth,
issue 21): it ends with finish_reason "error" and a reason naming it, the engine core and every
other request keep running, and nothing it held is left behind.

The door (SamplingParams, the input processor) refuses every value known to break the sampler, so
these tests reach past it the only ways a value can: a SamplingParams changed after it was
checked (attributes of a msgspec Struct are plain assignments), and, across the process boundary,
a message whose parameters fail the core's own check when it decodes them. Faults that can corrupt
shared state (the model forward, the KV cache) still end the core; that contract is tested in
test_engine_death.py.
"""
from __future__ import annotations

import json

import time
from collections import defaultdict

import httpx
import pytest
from reliability_helpers import SMALL_SERVER_ARGS, running_server, wait_until

from tokenloom.config import EngineConfig
from tokenloom.messages import EngineCoreRequest, FinishReason, now
from tokenloom.sampling_params import SamplingParams

PROMPT = [1, 504, 3458, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary


@pytest.fixture(scope="module")
def core():
    from tokenloom.core.engine_core import EngineCore

    return EngineCore(EngineConfig(max_model_len=256, num_kv_blocks=32, max_num_seqs=8, enable_ledger=False))


def _request(request_id: str, params: SamplingParams) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id, prompt_token_ids=list(PROMPT), sampling_params=params, eos_token_id=None, arrival_time=now()
    )


def _run(core, *requests: EngineCoreRequest) -> tuple[dict, dict]:
    """Adds the requests and steps until none is left: (final output, token ids) per request."""
    for r in requests:
        core.add_request(r)
    finals, tokens = {}, defaultdict(list)
    for _ in range(100):
        if not core.has_unfinished_requests():
            break
        for out in core.step().outputs:
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finals[out.request_id] = out
    return finals, tokens


def _good(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, **kw)


def _assert_clean(core) -> None:
    state = core.get_state()
    assert state["num_requests"] == state["num_runner_requests"] == 0, state
    assert state["num_free_blocks"] == state["num_total_blocks"], state


def test_a_fault_admitting_one_request_fails_only_that_request(core):
    _, alone = _run(core, _request("alone", _good()))
    bad = SamplingParams(temperature=0.0, max_tokens=4)
    bad.repetition_penalty = 1e39  # past the door: float32 cannot hold it (the crash)
    finals, tokens = _run(core, _request("bad", bad), _request("good", _good()))
    assert finals["bad"].finish_reason == FinishReason.ERROR and tokens["bad"] == []
    assert "request bad" in finals["bad"].error and "overflow" in finals["bad"].error, finals["bad"].error
    assert finals["good"].finish_reason == FinishReason.LENGTH
    assert tokens["good"] == alone["alone"]  # the failure did not disturb its neighbour
    _assert_clean(core)


def test_a_fault_in_the_batched_sampler_fails_only_the_offending_row(core):
    """No accepted parameter makes the batched draw raise any more, so the fault is planted: once
    the request is admitted, its row's top-k is set past the vocabulary, as a bug in the sampler's
    bookkeeping would. The whole batch's draw then raises; each row is drawn again on its own, and
    only the planted one fails."""
    _, alone = _run(core, _request("alone-lp", _good(logprobs=2)))
    for r in (_request("good-lp", _good(logprobs=2)), _request("bad-k", SamplingParams(temperature=0.8, top_k=5, max_tokens=4, seed=3)), _request("good2", _good())):
        core.add_request(r)
    first = core.step()  # the prefill: one token each
    sampler = core.executor.driver_worker.model_runner.sampler
    row = core.executor.driver_worker.model_runner.input_batch.req_id_to_row["bad-k"]
    sampler._top_k[row] = sampler.top_k[row] = sampler.vocab_size + 10
    finals, tokens = _run(core)
    for out in first.outputs:
        tokens[out.request_id][:0] = out.new_token_ids
    assert finals["bad-k"].finish_reason == FinishReason.ERROR, finals["bad-k"]
    assert "request bad-k" in finals["bad-k"].error and "sampling" in finals["bad-k"].error, finals["bad-k"].error
    assert finals["good-lp"].finish_reason == finals["good2"].finish_reason == FinishReason.LENGTH
    assert tokens["good-lp"] == tokens["good2"] == alone["alone-lp"]
    assert finals["good-lp"].new_logprobs is not None  # logprobs survive the row-by-row draw
    _assert_clean(core)
    # And the core goes on serving, the same as before.
    _, again = _run(core, _request("after", _good()))
    assert again["after"] == alone["alone-lp"]


def test_a_request_the_core_cannot_decode_fails_alone(offline_llm):
    """Across the process boundary: the core's input thread decodes (and so validates) every
    request. One that fails there used to kill that thread, leaving the core deaf to everyone."""
    engine = offline_llm.llm_engine
    request, text = engine.input_processor.process("undecodable", "Hello", SamplingParams(max_tokens=2), now())
    request.sampling_params.repetition_penalty = 1e39  # encoded as is; refused when decoded
    engine.output_processor.add_request(request, text)
    engine.engine_core.add_request(request)
    engine.add_request("fine", "Hello", SamplingParams(max_tokens=2, temperature=0.0))
    finals = {}
    deadline = time.monotonic() + 120
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert set(finals) == {"undecodable", "fine"}, finals
    bad = finals["undecodable"]
    assert bad.outputs[0].finish_reason == "error" and "repetition_penalty" in bad.error and "undecodable" in bad.error
    assert finals["fine"].outputs[0].finish_reason == "length"
    assert not engine.is_dead


@pytest.fixture(scope="module")
def unchunked_server():
    """Chunked prefill off: a prompt longer than the step's token budget can never be scheduled,
    which the core reports as that request's error."""
    with running_server([*SMALL_SERVER_ARGS, "--no-enable-chunked-prefill", "--max-num-batched-tokens", "32"]) as srv:
        yield srv


def test_an_isolated_error_is_a_500_naming_the_request_and_is_counted(unchunked_server):
    srv = unchunked_server
    before = srv.metrics().get("tokenloom:request_errors_total", 0.0)
    body = {"prompt": "word " * 60, "max_tokens": 2, "request_id": "too-long-for-a-step"}
    r = httpx.post(srv.url("/v1/completions"), json=body, timeout=120)
    assert r.status_code == 500, r.text
    error = r.json()["error"]
    assert "too-long-for-a-step" in error["message"] and "max_num_batched_tokens" in error["message"], error
    assert srv.metrics()["tokenloom:request_errors_total"] == before + 1
    # /v1/responses: a 500 too, and streamed, a response.failed event that says why.
    body = {"input": "word " * 60, "max_output_tokens": 2, "request_id": "resp_too_long"}
    r = httpx.post(srv.url("/v1/responses"), json=body, timeout=120)
    assert r.status_code == 500 and "resp_too_long" in r.json()["error"]["message"], r.text
    r = httpx.post(srv.url("/v1/responses"), json={**body, "request_id": "resp_too_long_2", "stream": True}, timeout=120)
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "response.failed"], events
    assert "max_num_batched_tokens" in events[-1]["response"]["error"]["message"]
    assert srv.metrics()["tokenloom:request_errors_total"] == before + 3
    # The engine is still up and serving.
    assert httpx.get(srv.url("/health"), timeout=30).status_code == 200
    r = httpx.post(srv.url("/v1/completions"), json={"prompt": "Hi", "max_tokens": 2}, timeout=120)
    assert r.status_code == 200, r.text
    assert wait_until(lambda: srv.metrics()["tokenloom:num_requests_in_engine_core"] == 0, 30)
