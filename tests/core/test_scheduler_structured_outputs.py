"""The scheduler's side of structured outputs, with the real grammar manager (xgrammar, the
SmolLM2 vocabulary) and hand-made runner outputs that pick tokens the bitmask allows: a request
waits for its grammar without holding anyone up, bitmask rows go only to requests that sample,
a completed grammar finishes its request, and preemption keeps every matcher consistent."""
from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from sched_helpers import check_block_invariants, make_request

from tokenloom.config import EngineConfig
from tokenloom.core.request import RequestStatus
from tokenloom.core.scheduler import Scheduler
from tokenloom.model.loader import load_tokenizer
from tokenloom.runner_output import ModelRunnerOutput
from tokenloom.sampling_params import StructuredOutputsParams as SO
from tokenloom.sched_output import WaitReason
from tokenloom.structured_output import StructuredOutputManager

VOCAB = 49152
EOS = 2


class GatedManager(StructuredOutputManager):
    """The real manager, whose compilations wait for `gate` (to hold a request in compilation)."""

    def __init__(self, tokenizer) -> None:
        super().__init__(tokenizer, VOCAB, [EOS], max_num_seqs=16)
        self.gate = threading.Event()
        self.gate.set()

    def _compile(self, params):
        self.gate.wait(60)
        return super()._compile(params)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def scheduler_with(manager, **kw) -> Scheduler:
    config = EngineConfig(block_size=4, max_num_batched_tokens=kw.pop("budget", 64), max_num_seqs=16)
    return Scheduler(config, num_kv_blocks=kw.pop("num_blocks", 64), max_model_len=1024,
                     structured_output_manager=manager)


def allowed(row) -> np.ndarray:
    return np.flatnonzero(np.unpackbits(row.numpy().view(np.uint8), bitorder="little"))[:VOCAB]


def step(s: Scheduler, pick=lambda allowed_ids: int(allowed_ids[-1] if allowed_ids[-1] != EOS or len(allowed_ids) == 1 else allowed_ids[0])):
    """One step whose 'model' takes, for a constrained request, a token its bitmask row allows
    (preferring a non-EOS one, so the grammar runs to its end), and 7 for the others."""
    so = s.schedule()
    rows = {r: so.grammar_bitmask[i] for i, r in enumerate(so.structured_output_req_ids)}
    req_ids = [r.req_id for r in so.scheduled_new_reqs] + list(so.scheduled_cached_reqs.req_ids)
    sampled = []
    for req_id in req_ids:
        request = s.requests[req_id]
        if request.num_computed_tokens < request.num_tokens:
            assert req_id not in rows  # a prefill chunk short of the end samples nothing
            sampled.append([])
        elif req_id in rows:
            sampled.append([pick(allowed(rows[req_id]))])
        else:
            assert request.structured_output is None
            sampled.append([7])
    out = ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)}, sampled_token_ids=sampled)
    return so, s.update_from_output(so, out)


TOKENS: dict[str, list[int]] = {}


def shortest(allowed_ids: np.ndarray) -> int:
    """The lowest allowed id but EOS (single bytes come first in the vocabulary): long outputs."""
    rest = allowed_ids[allowed_ids != EOS]
    return int(rest[0]) if rest.size else EOS


def run_to_end(s: Scheduler, max_steps: int = 300, **kw) -> dict:
    """Steps until every request finished; their final outputs, and each one's tokens in TOKENS."""
    finished = {}
    TOKENS.clear()
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            return finished
        so, outs = step(s, **kw)
        for o in outs.outputs:
            TOKENS.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finished[o.request_id] = o
        check_block_invariants(s)
        if not so.total_num_scheduled_tokens:
            s.wait_for_grammars(0.5)  # what the engine core's loop does meanwhile
    raise AssertionError("did not finish")


def test_a_request_waits_for_its_grammar_and_the_others_run(tokenizer):
    manager = GatedManager(tokenizer)
    manager.gate.clear()
    s = scheduler_with(manager)
    s.add_request(make_request("json", 5, structured_outputs=SO(regex="[a-z]{3}")))
    s.add_request(make_request("free", 5))
    so, outs = step(s)
    assert list(so.num_scheduled_tokens) == ["free"]
    assert so.wait_reasons["json"] == WaitReason.GRAMMAR_COMPILE
    assert so.grammar_bitmask is None and outs.scheduler_stats.num_waiting_reqs == 1
    so, _ = step(s)
    assert so.wait_reasons["json"] == WaitReason.GRAMMAR_COMPILE and "free" in so.num_scheduled_tokens
    manager.gate.set()
    s.requests["json"].structured_output.future.result(timeout=60)
    so, _ = step(s)
    assert "json" in so.num_scheduled_tokens and "json" not in so.wait_reasons
    assert so.structured_output_req_ids == ["json"]


def test_a_batch_without_structured_requests_gets_no_bitmask(tokenizer):
    s = scheduler_with(StructuredOutputManager(tokenizer, VOCAB, [EOS], 16))
    s.add_request(make_request("a", 5))
    so, _ = step(s)
    assert so.grammar_bitmask is None and so.structured_output_req_ids == []


def test_rows_only_for_requests_that_sample(tokenizer):
    s = scheduler_with(StructuredOutputManager(tokenizer, VOCAB, [EOS], 16), budget=8)
    s.add_request(make_request("long", 20, structured_outputs=SO(choice=["yes", "no"])))
    s.requests["long"].structured_output.future.result(timeout=60)
    so, _ = step(s)
    assert so.num_scheduled_tokens == {"long": 8} and so.grammar_bitmask is None  # a chunk: nothing sampled
    step(s)
    so, _ = step(s)  # the last 4 prompt tokens: sampled
    assert so.structured_output_req_ids == ["long"] and so.grammar_bitmask.shape == (1, -(-VOCAB // 32))


def test_a_completed_grammar_finishes_with_stop_and_the_text_matches(tokenizer):
    s = scheduler_with(StructuredOutputManager(tokenizer, VOCAB, [EOS], 16))
    specs = {"choice": SO(choice=["sunny", "rainy"]), "regex": SO(regex="[0-9]{2}-[a-z]{2}")}
    for name, so in specs.items():
        s.add_request(make_request(name, 6, max_tokens=40, structured_outputs=so))
    finished = run_to_end(s)
    for name, out in finished.items():
        req_text = tokenizer.decode([t for t in TOKENS[name] if t != EOS])
        assert str(out.finish_reason) == "stop"
        if name == "choice":
            assert req_text in ("sunny", "rainy")
        else:
            assert re.fullmatch("[0-9]{2}-[a-z]{2}", req_text), req_text


def test_preemption_keeps_each_matcher_consistent(tokenizer):
    # 6 blocks of 4 tokens for three requests that each grow to ~12 tokens: preemptions happen.
    s = scheduler_with(StructuredOutputManager(tokenizer, VOCAB, [EOS], 16), num_blocks=6)
    regex = "[a-z]{16}"
    for name in ("a", "b", "c"):
        s.add_request(make_request(name, 3, max_tokens=40, structured_outputs=SO(regex=regex)))
    for name in ("a", "b", "c"):
        s.requests[name].structured_output.future.result(timeout=60)
    finished = run_to_end(s, pick=shortest)
    assert s.num_preemptions > 0
    for name in ("a", "b", "c"):
        assert str(finished[name].finish_reason) == "stop"
        text = tokenizer.decode([t for t in TOKENS[name] if t != EOS])
        assert re.fullmatch(regex, text), text


def test_a_token_outside_the_grammar_fails_the_request_alone(tokenizer):
    s = scheduler_with(StructuredOutputManager(tokenizer, VOCAB, [EOS], 16))
    s.add_request(make_request("bad", 4, structured_outputs=SO(regex="[0-9]+")))
    s.add_request(make_request("ok", 4))
    s.requests["bad"].structured_output.future.result(timeout=60)
    bad_token = tokenizer.encode("x", add_special_tokens=False)[0]
    _, outs = step(s, pick=lambda ids: bad_token)
    by_id = {o.request_id: o for o in outs.outputs}
    assert str(by_id["bad"].finish_reason) == "error" and "structured_outputs.regex" in by_id["bad"].error
    assert not by_id["ok"].finished


def test_a_grammar_that_fails_to_compile_fails_its_request_alone(tokenizer):
    """The compilation fails after the request was queued for it: the request ends with ERROR
    and the compiler's message, holds no block, and the others run on."""
    manager = GatedManager(tokenizer)
    manager.gate.clear()
    s = scheduler_with(manager)
    s.add_request(make_request("broken", 5, structured_outputs=SO(json='{"type": "nonsense-type"}')))
    s.add_request(make_request("free", 5))
    step(s)
    manager.gate.set()
    with pytest.raises(Exception):
        s.requests["broken"].structured_output.future.result(timeout=60)
    _, outs = step(s)
    by_id = {o.request_id: o for o in outs.outputs}
    assert str(by_id["broken"].finish_reason) == "error" and by_id["broken"].error
    assert "broken" not in s.requests and not s.grammars.compiling
    assert "free" in by_id and not by_id["free"].finished
    check_block_invariants(s)


def test_a_request_aborted_while_its_grammar_compiles_never_runs(tokenizer):
    manager = GatedManager(tokenizer)
    manager.gate.clear()
    s = scheduler_with(manager)
    s.add_request(make_request("json", 5, structured_outputs=SO(regex="[a-z]{3}")))
    step(s)
    s.finish_requests("json", RequestStatus.FINISHED_ABORTED)
    assert not s.grammars.compiling and "json" not in s.requests
    manager.gate.set()
    so, outs = step(s)
    assert so.num_scheduled_tokens == {} and outs.outputs == [] and not s.has_unfinished_requests()
