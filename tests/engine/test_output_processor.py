"""The output processor fed hand-made EngineCoreOutputs with real SmolLM2 token ids: no engine."""
from __future__ import annotations

import asyncio
import threading

import pytest

from tokenloom.engine.output_processor import OutputProcessor, RequestOutputCollector
from tokenloom.engine.parallel_sampling import ParentRequest
from tokenloom.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists, now
from tokenloom.outputs import Logprob, RequestOutput
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

EOS = 2  # <|im_end|>
CUMULATIVE, DELTA, FINAL_ONLY = RequestOutputKind.CUMULATIVE, RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY


@pytest.fixture
def processor(tokenizer):
    return OutputProcessor(tokenizer)


def make_request(tokenizer, request_id: str = "r", prompt: str = "Say something:", **params) -> EngineCoreRequest:
    return EngineCoreRequest(
        request_id=request_id,
        prompt_token_ids=tokenizer.encode(prompt, add_special_tokens=False),
        sampling_params=SamplingParams(**params),
        eos_token_id=EOS,
        arrival_time=now(),
    )


def add(processor, tokenizer, request_id="r", prompt="Say something:", **params) -> EngineCoreRequest:
    request = make_request(tokenizer, request_id, prompt, **params)
    processor.add_request(request, prompt)
    return request


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def run_tokens(processor, request_id: str, ids: list[int], finish: FinishReason | None = None, stop_reason=None):
    """Feeds one token per step (the last step finishing with `finish`); returns every step's
    OutputProcessorOutput."""
    results = []
    for i, token_id in enumerate(ids):
        last = i == len(ids) - 1
        out = EngineCoreOutput(
            request_id, [token_id], finish_reason=finish if last else None, stop_reason=stop_reason if last else None
        )
        results.append(processor.process_outputs([out]))
    return results


def outputs_of(results) -> list[RequestOutput]:
    return [o for r in results for o in r.request_outputs]


# ----------------------------------------------------------------------------- detokenizing


@pytest.mark.parametrize("kind", [CUMULATIVE, DELTA])
def test_streamed_text_equals_one_shot_decode(processor, tokenizer, kind):
    text = " Voilà: 😀🎉 中文字符，日本語 and naïve code `x = {1: 'é'}`"
    ids = ids_of(tokenizer, text)
    add(processor, tokenizer, output_kind=kind, max_tokens=len(ids))
    outs = outputs_of(run_tokens(processor, "r", ids, FinishReason.LENGTH))
    assert len(outs) == len(ids)  # one output per step that produced a token
    assert all(len(o.outputs) == 1 and o.request_id == "r" for o in outs)
    if kind == DELTA:
        assert "".join(o.outputs[0].text for o in outs) == tokenizer.decode(ids)
        assert [t for o in outs for t in o.outputs[0].token_ids] == ids
    else:
        assert outs[-1].outputs[0].text == tokenizer.decode(ids)
        assert outs[-1].outputs[0].token_ids == ids
        texts = [o.outputs[0].text for o in outs]
        assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))
    assert not any("\ufffd" in o.outputs[0].text for o in outs)
    final = outs[-1]
    assert final.finished and [o.finished for o in outs].count(True) == 1
    assert final.outputs[0].finish_reason == "length" and final.outputs[0].stop_reason is None
    assert final.prompt == "Say something:" and final.prompt_token_ids == ids_of(tokenizer, "Say something:")
    assert not processor.has_unfinished_requests()


def test_final_only_gives_one_output(processor, tokenizer):
    ids = ids_of(tokenizer, " hello 世界")
    add(processor, tokenizer, output_kind=FINAL_ONLY)
    outs = outputs_of(run_tokens(processor, "r", ids, FinishReason.LENGTH))
    assert len(outs) == 1 and outs[0].finished
    assert outs[0].outputs[0].text == " hello 世界" and outs[0].outputs[0].token_ids == ids


def test_eos_finish_reports_stop_and_leaves_eos_text_out(processor, tokenizer):
    ids = ids_of(tokenizer, " Done.") + [EOS]
    add(processor, tokenizer, skip_special_tokens=False)
    outs = outputs_of(run_tokens(processor, "r", ids, FinishReason.STOP))
    final = outs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason) == ("stop", None)
    assert final.text == " Done." and final.token_ids == ids


def test_stop_token_id_is_the_stop_reason(processor, tokenizer):
    ids = ids_of(tokenizer, " a b")
    add(processor, tokenizer, stop_token_ids=[ids[-1]])
    outs = outputs_of(run_tokens(processor, "r", ids, FinishReason.STOP, stop_reason=ids[-1]))
    final = outs[-1].outputs[0]
    assert (final.finish_reason, final.stop_reason, final.text) == ("stop", ids[-1], " a")


def test_finished_request_is_forgotten(processor, tokenizer):
    add(processor, tokenizer)
    processor.process_outputs([EngineCoreOutput("r", [100], finish_reason=FinishReason.LENGTH)])
    assert processor.get_num_unfinished_requests() == 0
    # A late output for it (the core had not heard yet) is dropped, not turned into a second final.
    assert processor.process_outputs([EngineCoreOutput("r", [101])]).request_outputs == []
    assert processor.abort_requests(["r"]) == ([], [])


def test_duplicate_request_id_is_rejected(processor, tokenizer):
    add(processor, tokenizer)
    with pytest.raises(ValueError, match="already in flight"):
        add(processor, tokenizer)


@pytest.mark.parametrize("first_n, second_n", [(1, 2), (2, 1), (2, 2)])
def test_a_user_id_in_flight_is_rejected_whatever_its_n(tokenizer, first_n, second_n):
    """An n = 1 request and an n > 1 one under one id would both finish as that id (and an abort
    would reach only one): the second is refused, whichever came first."""
    processor = OutputProcessor(tokenizer)
    processor.add_user_request(make_request(tokenizer, "same", n=first_n, temperature=1.0), None)
    with pytest.raises(ValueError, match="'same' is already in flight"):
        processor.add_user_request(make_request(tokenizer, "same", n=second_n, temperature=1.0), None)


def test_outputs_of_several_requests_in_one_step(processor, tokenizer):
    add(processor, tokenizer, "a")
    add(processor, tokenizer, "b", output_kind=DELTA)
    result = processor.process_outputs(
        [
            EngineCoreOutput("a", ids_of(tokenizer, " x")),
            EngineCoreOutput("b", ids_of(tokenizer, " y"), finish_reason=FinishReason.LENGTH),
        ]
    )
    assert [(o.request_id, o.outputs[0].text, o.finished) for o in result.request_outputs] == [
        ("a", " x", False),
        ("b", " y", True),
    ]
    assert processor.get_num_unfinished_requests() == 1


# ----------------------------------------------------------------------------- stop strings


def test_stop_string_finishes_and_aborts_in_core(processor, tokenizer):
    ids = ids_of(tokenizer, " The cat sat on the mat. Then more text follows")
    add(processor, tokenizer, stop=["mat"])
    results = run_tokens(processor, "r", ids)
    finals = [o for o in outputs_of(results) if o.finished]
    assert len(finals) == 1
    final = finals[0].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (" The cat sat on the ", "stop", "mat")
    # Token ids keep everything up to the token that completed the match.
    assert tokenizer.decode(final.token_ids).endswith("mat")
    aborted = [r.reqs_to_abort for r in results if r.reqs_to_abort]
    assert aborted == [["r"]]
    assert not processor.has_unfinished_requests()


def test_stop_string_in_the_step_the_core_finishes_is_not_aborted(processor, tokenizer):
    add(processor, tokenizer, stop=["end"])
    result = processor.process_outputs(
        [EngineCoreOutput("r", ids_of(tokenizer, " the end!"), finish_reason=FinishReason.LENGTH)]
    )
    final = result.request_outputs[0].outputs[0]
    assert (final.text, final.finish_reason, final.stop_reason) == (" the ", "stop", "end")
    assert result.reqs_to_abort == []


def test_earliest_stop_string_wins_over_list_order(processor, tokenizer):
    add(processor, tokenizer, stop=["world", "llo"])
    result = processor.process_outputs([EngineCoreOutput("r", ids_of(tokenizer, " hello world"))])
    final = result.request_outputs[0].outputs[0]
    assert (final.text, final.stop_reason) == (" he", "llo")


def test_stop_string_spanning_the_previous_text_and_the_new_delta(processor, tokenizer):
    ids = ids_of(tokenizer, " big world")
    assert len(ids) == 2
    add(processor, tokenizer, stop=["g wo"], output_kind=DELTA)
    first = processor.process_outputs([EngineCoreOutput("r", ids[:1])])
    assert first.request_outputs[0].outputs[0].text == " "  # "big" may be the start of "g wo"
    second = processor.process_outputs([EngineCoreOutput("r", ids[1:])])
    out = second.request_outputs[0].outputs[0]
    assert (out.text, out.stop_reason, out.finish_reason) == ("bi", "g wo", "stop")  # " " came before
    assert second.reqs_to_abort == ["r"]


@pytest.mark.parametrize("include", [False, True])
def test_delta_stream_holds_back_and_concatenates_to_final(processor, tokenizer, include):
    text = " one two three four five six seven eight"
    ids = ids_of(tokenizer, text)
    add(processor, tokenizer, stop=["five six", "never!"], include_stop_str_in_output=include, output_kind=DELTA)
    outs = outputs_of(run_tokens(processor, "r", ids))
    streamed = ""
    for o in outs:
        streamed += o.outputs[0].text
        # A partial match ("five", "five s") never leaks while it could still complete.
        if not o.finished and not include:
            assert "five" not in streamed
    assert outs[-1].finished and outs[-1].outputs[0].stop_reason == "five six"
    assert streamed == (" one two three four five six" if include else " one two three four ")


def test_held_back_text_is_released_at_finish(processor, tokenizer):
    ids = ids_of(tokenizer, " almost sto")
    add(processor, tokenizer, stop=["stop"], output_kind=DELTA)
    outs = outputs_of(run_tokens(processor, "r", ids, FinishReason.LENGTH))
    assert "".join(o.outputs[0].text for o in outs) == " almost sto"
    assert outs[-1].outputs[0].finish_reason == "length"


# ---------------------------------------------------------------------------------- logprobs


def test_logprobs_conversion(processor, tokenizer):
    ids = ids_of(tokenizer, " cat dog")
    top = ids_of(tokenizer, " the a")
    add(processor, tokenizer, logprobs=2, output_kind=DELTA)
    lists = LogprobsLists(
        token_ids=[[ids[0], top[0], top[1]], [ids[1], ids[1], top[0]]],
        logprobs=[[-2.0, -0.5, -1.0], [-0.25, -0.25, -3.0]],
        ranks=[3, 1],
    )
    result = processor.process_outputs([EngineCoreOutput("r", ids, new_logprobs=lists)])
    out = result.request_outputs[0].outputs[0]
    assert out.logprobs == [
        {ids[0]: Logprob(-2.0, 3, " cat"), top[0]: Logprob(-0.5, 1, " the"), top[1]: Logprob(-1.0, 2, " a")},
        {ids[1]: Logprob(-0.25, 1, " dog"), top[0]: Logprob(-3.0, 2, " the")},
    ]
    assert out.cumulative_logprob == pytest.approx(-2.25)
    # DELTA: the next output carries only the next position's logprobs; the sum keeps counting.
    more = LogprobsLists(token_ids=[[EOS, top[0], top[1]]], logprobs=[[-1.0, -0.5, -0.75]], ranks=[3])
    result = processor.process_outputs(
        [EngineCoreOutput("r", [EOS], new_logprobs=more, finish_reason=FinishReason.STOP)]
    )
    out = result.request_outputs[0].outputs[0]
    assert [list(d) for d in out.logprobs] == [[EOS, top[0], top[1]]]
    assert out.logprobs[0][EOS].decoded_token == "<|im_end|>"
    assert out.cumulative_logprob == pytest.approx(-3.25)


def test_no_logprobs_requested_means_none(processor, tokenizer):
    add(processor, tokenizer)
    out = processor.process_outputs([EngineCoreOutput("r", [100])]).request_outputs[0].outputs[0]
    assert out.logprobs is None and out.cumulative_logprob is None


def test_logprobs_without_detokenize_have_no_text(processor, tokenizer):
    add(processor, tokenizer, logprobs=0, detokenize=False)
    lists = LogprobsLists(token_ids=[[100]], logprobs=[[-0.5]], ranks=[1])
    out = processor.process_outputs([EngineCoreOutput("r", [100], new_logprobs=lists)]).request_outputs[0]
    assert out.outputs[0].text == "" and out.outputs[0].logprobs == [{100: Logprob(-0.5, 1, None)}]


def test_prompt_logprobs_arrive_in_chunks_and_start_with_none(processor, tokenizer):
    request = add(processor, tokenizer, prompt="one two three", prompt_logprobs=1, output_kind=DELTA)
    p = request.prompt_token_ids
    assert len(p) == 3
    chunk1 = LogprobsLists(token_ids=[[p[1], 5]], logprobs=[[-3.0, -0.1]], ranks=[7])
    chunk2 = LogprobsLists(token_ids=[[p[2], p[2]]], logprobs=[[-0.2, -0.2]], ranks=[1])
    # A prefill chunk with no sampled token yet produces no RequestOutput.
    assert processor.process_outputs([EngineCoreOutput("r", [], new_prompt_logprobs=chunk1)]).request_outputs == []
    outs = processor.process_outputs([EngineCoreOutput("r", [100], new_prompt_logprobs=chunk2)]).request_outputs
    assert outs[0].prompt_logprobs == [
        None,
        {p[1]: Logprob(-3.0, 7, " two"), 5: Logprob(-0.1, 1, "<file_sep>")},
        {p[2]: Logprob(-0.2, 1, " three")},
    ]
    # DELTA sends them once.
    later = processor.process_outputs([EngineCoreOutput("r", [101])]).request_outputs
    assert later[0].prompt_logprobs is None


# ------------------------------------------------------------------------- n > 1 (children)


def add_parent(processor, tokenizer, request_id="p", queue=None, **params) -> ParentRequest:
    request = make_request(tokenizer, request_id, **params)
    parent = ParentRequest(request_id, request.sampling_params)
    for index, (child_id, child_params) in enumerate(parent.child_requests()):
        child = EngineCoreRequest(child_id, request.prompt_token_ids, child_params, EOS, request.arrival_time)
        processor.add_request(child, "Say something:", parent, index, queue=queue)
    return parent


def test_child_requests_ids_and_seeds():
    parent = ParentRequest("req", SamplingParams(n=3, seed=10, temperature=0.8))
    children = parent.child_requests()
    assert [cid for cid, _ in children] == ["0_req", "1_req", "2_req"]
    assert [p.seed for _, p in children] == [10, 11, 12]
    assert all(p.n == 1 and p.temperature == 0.8 for _, p in children)
    unseeded = ParentRequest("u", SamplingParams(n=2)).child_requests()
    assert [p.seed for _, p in unseeded] == [None, None]


def test_n2_cumulative_aggregates_into_one_output(processor, tokenizer):
    add_parent(processor, tokenizer, n=2)
    a, b = ids_of(tokenizer, " red apple"), ids_of(tokenizer, " 😀")
    assert len(b) == 2  # the emoji's bytes arrive in two tokens
    step1 = processor.process_outputs([EngineCoreOutput("0_p", a[:1]), EngineCoreOutput("1_p", b[:1])])
    assert len(step1.request_outputs) == 1
    out = step1.request_outputs[0]
    assert out.request_id == "p" and not out.finished
    assert [(c.index, c.text) for c in out.outputs] == [(0, " red"), (1, "")]
    step2 = processor.process_outputs(
        [EngineCoreOutput("1_p", b[1:], finish_reason=FinishReason.LENGTH)]
    )
    out = step2.request_outputs[0]
    assert not out.finished
    assert [(c.text, c.finish_reason) for c in out.outputs] == [(" red", None), (" 😀", "length")]
    step3 = processor.process_outputs([EngineCoreOutput("0_p", a[1:], finish_reason=FinishReason.LENGTH)])
    out = step3.request_outputs[0]
    assert out.finished
    assert [(c.index, c.text, c.token_ids) for c in out.outputs] == [(0, " red apple", a), (1, " 😀", b)]
    assert not processor.has_unfinished_requests() and not processor.parent_requests


def test_n2_delta_carries_only_new_parts(processor, tokenizer):
    add_parent(processor, tokenizer, n=2, output_kind=DELTA)
    a, b = ids_of(tokenizer, " one two"), ids_of(tokenizer, " three four")
    steps = [
        [EngineCoreOutput("0_p", a[:1]), EngineCoreOutput("1_p", b[:1])],
        [EngineCoreOutput("1_p", b[1:], finish_reason=FinishReason.LENGTH)],
        [EngineCoreOutput("0_p", a[1:], finish_reason=FinishReason.LENGTH)],
    ]
    outs = [o for step in steps for o in processor.process_outputs(step).request_outputs]
    assert [[(c.index, c.text) for c in o.outputs] for o in outs] == [
        [(0, " one"), (1, " three")],
        [(1, " four")],
        [(0, " two")],
    ]
    assert [o.finished for o in outs] == [False, False, True]


def test_n2_final_only_waits_for_all_children(processor, tokenizer):
    add_parent(processor, tokenizer, n=2, output_kind=FINAL_ONLY, stop=["!"])
    a, b = ids_of(tokenizer, " hi! more"), ids_of(tokenizer, " yo")
    outs = processor.process_outputs([EngineCoreOutput("0_p", a)])
    assert outs.request_outputs == [] and outs.reqs_to_abort == ["0_p"]
    outs = processor.process_outputs([EngineCoreOutput("1_p", b, finish_reason=FinishReason.LENGTH)])
    assert len(outs.request_outputs) == 1
    out = outs.request_outputs[0]
    assert out.finished
    assert [(c.index, c.text, c.finish_reason, c.stop_reason) for c in out.outputs] == [
        (0, " hi", "stop", "!"),
        (1, " yo", "length", None),
    ]


# ------------------------------------------------------------------------ abort and failure


def test_abort_gives_one_final_output_per_request(processor, tokenizer):
    add(processor, tokenizer, "a", stop=["zzz"], output_kind=DELTA)
    add(processor, tokenizer, "b")
    add_parent(processor, tokenizer, "p", n=3)
    processor.process_outputs([EngineCoreOutput("a", ids_of(tokenizer, " hello")), EngineCoreOutput("1_p", [100])])
    outputs, core_ids = processor.abort_requests(["a", "p", "unknown", "a"])
    assert sorted(core_ids) == ["0_p", "1_p", "2_p", "a"]
    assert [(o.request_id, o.finished) for o in outputs] == [("a", True), ("p", True)]
    # "a" streams DELTA with a 3-char stop string: the 2 chars held back come out at the abort.
    assert outputs[0].outputs[0].text == "lo"
    assert all(c.finish_reason == "abort" for o in outputs for c in o.outputs)
    assert len(outputs[1].outputs) == 3
    assert processor.get_num_unfinished_requests() == 1  # "b"


def test_abort_releases_held_back_delta_text(processor, tokenizer):
    add(processor, tokenizer, stop=["zzz"], output_kind=DELTA)
    first = processor.process_outputs([EngineCoreOutput("r", ids_of(tokenizer, " hello"))]).request_outputs
    outputs, _ = processor.abort_requests(["r"])
    assert first[0].outputs[0].text + outputs[0].outputs[0].text == " hello"


def test_abort_one_child_keeps_the_parent_going(processor, tokenizer):
    add_parent(processor, tokenizer, "p", n=2)
    outputs, core_ids = processor.abort_requests(["1_p"])
    assert core_ids == ["1_p"]
    assert [c.finish_reason for c in outputs[0].outputs] == [None, "abort"] and not outputs[0].finished
    final = processor.process_outputs([EngineCoreOutput("0_p", [100], finish_reason=FinishReason.LENGTH)])
    assert final.request_outputs[0].finished
    assert [c.finish_reason for c in final.request_outputs[0].outputs] == ["length", "abort"]


def test_fail_all_finishes_everything_once(processor, tokenizer):
    add(processor, tokenizer, "a")
    add(processor, tokenizer, "b", output_kind=FINAL_ONLY)
    add_parent(processor, tokenizer, "p", n=2, output_kind=DELTA)
    processor.process_outputs(
        [EngineCoreOutput("a", [100]), EngineCoreOutput("0_p", [100], finish_reason=FinishReason.LENGTH)]
    )
    outputs = processor.fail_all("engine core died (exit code -9)")
    assert sorted(o.request_id for o in outputs) == ["a", "b", "p"]
    for o in outputs:
        assert o.finished and o.error == "engine core died (exit code -9)"
    by_id = {o.request_id: o for o in outputs}
    assert [c.finish_reason for c in by_id["a"].outputs] == ["error"]
    assert [(c.index, c.finish_reason) for c in by_id["p"].outputs] == [(1, "error")]  # DELTA: the changed one
    assert not processor.has_unfinished_requests() and not processor.parent_requests
    assert processor.fail_all("again") == []
    assert processor.process_outputs([EngineCoreOutput("a", [101])]).request_outputs == []


def test_core_error_is_reported(processor, tokenizer):
    add(processor, tokenizer)
    result = processor.process_outputs(
        [EngineCoreOutput("r", [], finish_reason=FinishReason.ERROR, error="prompt can never fit the KV cache")]
    )
    out = result.request_outputs[0]
    assert out.finished and out.outputs[0].finish_reason == "error"
    assert out.error == "prompt can never fit the KV cache"


# --------------------------------------------------------------------------------- metrics


def test_metrics_timeline(processor, tokenizer):
    request = add(processor, tokenizer)
    processor.process_outputs([EngineCoreOutput("r", [100])], timestamp=request.arrival_time + 1.0)
    out = processor.process_outputs(
        [EngineCoreOutput("r", [101, 102], finish_reason=FinishReason.LENGTH)], timestamp=request.arrival_time + 3.0
    ).request_outputs[0]
    m = out.metrics
    assert m.num_prompt_tokens == len(request.prompt_token_ids) and m.num_generation_tokens == 3
    assert m.time_to_first_token == pytest.approx(1.0)
    assert m.last_token_time == m.finished_time == request.arrival_time + 3.0
    assert m.e2e_latency == pytest.approx(3.0)


# ---------------------------------------------------------------------- RequestOutputCollector


def test_collector_merges_delta_outputs_when_consumer_falls_behind(processor, tokenizer):
    queue = RequestOutputCollector(DELTA)
    request = make_request(tokenizer, output_kind=DELTA)
    processor.add_request(request, "Say something:", queue=queue)
    ids = ids_of(tokenizer, " a b c d")
    for r in run_tokens(processor, "r", ids, FinishReason.LENGTH):
        assert r.request_outputs == []  # they went to the collector
    merged = queue.get_nowait()
    assert merged.finished and merged.outputs[0].text == " a b c d" and merged.outputs[0].token_ids == ids
    assert queue.get_nowait() is None


def test_collector_keeps_newest_cumulative_output(processor, tokenizer):
    queue = RequestOutputCollector(CUMULATIVE)
    add_parent(processor, tokenizer, "p", queue=queue, n=2)
    processor.process_outputs([EngineCoreOutput("0_p", ids_of(tokenizer, " x"))])
    processor.process_outputs([EngineCoreOutput("1_p", ids_of(tokenizer, " y"), finish_reason=FinishReason.LENGTH)])
    out = queue.get_nowait()
    assert [c.text for c in out.outputs] == [" x", " y"] and not out.finished
    outputs, _ = processor.abort_requests(["p"])
    assert outputs == []
    final = queue.get_nowait()
    assert final.finished and [c.finish_reason for c in final.outputs] == ["abort", "length"]


def test_collector_wakes_an_awaiting_consumer_from_another_thread(processor, tokenizer):
    queue = RequestOutputCollector(DELTA)
    processor.add_request(make_request(tokenizer, output_kind=DELTA), "Say something:", queue=queue)
    ids = ids_of(tokenizer, " ping pong")

    async def consume() -> str:
        text = ""
        while True:
            out = await asyncio.wait_for(queue.get(), timeout=10)
            text += out.outputs[0].text
            if out.finished:
                return text

    def produce() -> None:
        run_tokens(processor, "r", ids, FinishReason.LENGTH)

    async def main() -> str:
        consumer = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)  # the consumer is now waiting on its future
        thread = threading.Thread(target=produce)
        thread.start()
        text = await consumer
        thread.join()
        return text

    assert asyncio.run(main()) == " ping pong"


def test_collector_raises_a_put_exception():
    queue = RequestOutputCollector()
    queue.put(RuntimeError("engine dead"))
    with pytest.raises(RuntimeError, match="engine dead"):
        asyncio.run(queue.get())
