"""Reasoning in chat replies (`--reasoning-parser`): the `<think>` part of a reply is the
message's reasoning_content, the rest its content, streamed or not. The split's rules (with any
chunking of a stream), then the real server with the official client, the embedded model made
to write a thinking reply by a regex grammar."""
from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import httpx
import pytest
from conftest import ServerProcess
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from model_helpers import save_hf_dir, tiny_hf_model  # noqa: E402

from tokenloom.entrypoints.openai.reasoning_parsers import ReasoningStream, opens_reasoning, split_reasoning  # noqa: E402

SERVER_ARGS = ["--reasoning-parser", "qwen3", "--tool-call-parser", "pythonic", "--num-kv-blocks", "256",
               "--trust-request-chat-template"]


@pytest.mark.parametrize("text, opened, reasoning, content", [
    ("<think>\nplan\n</think>\n\nThe answer.", False, "\nplan\n", "\n\nThe answer."),  # Qwen3 thinking
    ("\n<think>plan</think>answer", False, "plan", "answer"),
    ("The answer, no thinking.", False, "", "The answer, no thinking."),  # enable_thinking=False
    ("a < b and <think> later", False, "", "a < b and <think> later"),  # a tag not at the start is text
    ("plan</think>answer", True, "plan", "answer"),  # DeepSeek-R1: the prompt opened <think>
    ("a plan cut short", True, "a plan cut short", ""),  # no </think>: all reasoning
    ("<think>cut short", False, "cut short", ""),
])
def test_split(text, opened, reasoning, content):
    split = split_reasoning(text, opened)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_where_a_prompt_leaves_the_reply():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")  # DeepSeek-R1, Qwen3 thinking-only models
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, thinking off
    assert not opens_reasoning("<|im_start|>assistant\n")
    assert opens_reasoning("<think>old</think> turn <think>")


def test_a_stream_holds_back_what_a_later_delta_decides():
    s = ReasoningStream(opened=False)
    assert s.feed("<th", False) == ("", "")  # may be the opening tag
    assert s.feed("ink>pl", False) == ("pl", "")
    assert s.feed("an</th", False) == ("an", "")  # may be the closing tag
    assert s.feed("ink>Hi", False) == ("", "Hi")
    assert s.feed("", True) == ("", "")
    s = ReasoningStream(opened=False)
    assert s.feed("<", False) == ("", "")
    assert s.feed("b>bold", True) == ("", "<b>bold")  # not a tag after all: content, nothing lost
    s = ReasoningStream(opened=True)
    assert s.feed("cut </thi", False) == ("cut ", "")
    assert s.feed("", True) == ("</thi", "")  # the reply ended: the held text is reasoning


_TEXT = st.text(alphabet="ab <>/\nthink", max_size=12)


@settings(max_examples=300, deadline=None)
@given(lead=st.sampled_from(["", "\n", " "]), start=st.booleans(), reasoning=_TEXT, end=st.booleans(),
       content=_TEXT, opened=st.booleans(), cuts=st.lists(st.integers(0, 60), max_size=8))
def test_any_chunking_of_a_stream_adds_up_to_the_whole_reply(lead, start, reasoning, end, content, opened, cuts):
    text = lead + ("<think>" if start else "") + reasoning + ("</think>" if end else "") + content
    whole = split_reasoning(text, opened)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream = ReasoningStream(opened)
    got_reasoning = got_content = ""
    for i, (a, b) in enumerate(zip(bounds, bounds[1:] + [len(text)])):
        r, c = stream.feed(text[a:b], finished=i == len(bounds) - 1)
        got_reasoning, got_content = got_reasoning + r, got_content + c
    assert (got_reasoning, got_content) == (whole.reasoning, whole.content)
    assert len(whole.reasoning) + len(whole.content) <= len(text)


# The embedded model writes what the grammar lets it: a thinking reply, then an answer.
THINKING = r"<think>[a-z ]{4,30}</think>[A-Z][a-z ]{3,30}\."


def _chat(client, **kw):
    kw = {"max_tokens": 48} | kw
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0,
                                          messages=[{"role": "user", "content": "Is Paris the capital of France?"}],
                                          **kw)


def test_reasoning_content_streamed_or_not(server):
    client = server.client()
    whole = _chat(client, extra_body={"structured_outputs": {"regex": THINKING}}).choices[0]
    reasoning, content = whole.message.reasoning_content, whole.message.content
    assert re.fullmatch(r"[a-z ]{4,30}", reasoning) and re.fullmatch(r"[A-Z][a-z ]{3,30}\.", content)
    assert whole.message.model_extra["reasoning"] == reasoning and whole.finish_reason == "stop"
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in _chat(client, stream=True, extra_body={"structured_outputs": {"regex": THINKING}}):
        for choice in chunk.choices:
            for key in streamed:
                streamed[key] += getattr(choice.delta, key, None) or ""
    assert streamed == {"reasoning_content": reasoning, "content": content}
    # include_reasoning false: the reasoning is dropped, the content is the same.
    dropped = _chat(client, extra_body={"structured_outputs": {"regex": THINKING}, "include_reasoning": False})
    assert dropped.choices[0].message.content == content
    assert "reasoning_content" not in (dropped.choices[0].message.model_extra or {})
    # A reply without <think> is all content.
    plain = _chat(client, extra_body={"structured_outputs": {"regex": r"[A-Z][a-z ]{3,30}\."}}).choices[0].message
    assert plain.reasoning_content is None and re.fullmatch(r"[A-Z][a-z ]{3,30}\.", plain.content)


def test_a_prompt_that_opens_think_and_a_tool_call_after_reasoning(server):
    client = server.client()
    # DeepSeek-R1's shape: the template ends the prompt inside <think>.
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
                "<|im_start|>assistant\n<think>\n")
    out = _chat(client, extra_body={"structured_outputs": {"regex": r"[a-z ]{4,30}</think>[A-Z][a-z ]{3,30}\."},
                                    "chat_template": template}).choices[0].message
    assert re.fullmatch(r"[a-z ]{4,30}", out.reasoning_content) and re.fullmatch(r"[A-Z][a-z ]{3,30}\.", out.content)
    # Tool calls are read from the content, after the reasoning (here in Llama 3.2's pythonic form).
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
    call = r'<think>[a-z ]{4,20}</think>\[get_weather\(city="Paris"\)\]'
    for stream in (False, True):
        kw = dict(tools=[weather], tool_choice="auto", max_tokens=96, extra_body={"structured_outputs": {"regex": call}})
        if not stream:
            choice = _chat(client, **kw).choices[0]
            reasoning, calls, finish = choice.message.reasoning_content, choice.message.tool_calls, choice.finish_reason
            assert choice.message.content is None
        else:
            reasoning, calls, finish = "", [], None
            for chunk in _chat(client, stream=True, **kw):
                for ch in chunk.choices:
                    reasoning += getattr(ch.delta, "reasoning_content", None) or ""
                    assert not ch.delta.content
                    calls += ch.delta.tool_calls or []
                    finish = ch.finish_reason or finish
        assert re.fullmatch(r"[a-z ]{4,20}", reasoning) and finish == "tool_calls"
        assert [(c.function.name, c.function.arguments) for c in calls] == [("get_weather", '{"city": "Paris"}')]


@pytest.fixture(scope="module")
def thinking_server(tmp_path_factory, smollm2_path):
    """A tiny random model whose vocabulary has `<think>` and `</think>` as tokens of their own
    (as Qwen3's has: added, not special, so they stay in the text), served with the qwen3 parser."""
    from tokenloom.model.loader import load_tokenizer

    tokenizer = load_tokenizer(smollm2_path)
    tokenizer.add_tokens(["<think>", "</think>"])
    model = tiny_hf_model("qwen3", vocab_size=len(tokenizer), seed=21)
    directory = save_hf_dir(model, tokenizer, str(tmp_path_factory.mktemp("thinking") / "model"))
    srv = ServerProcess(["--model", directory, "--reasoning-parser", "qwen3", "--dtype", "float32",
                         "--max-model-len", "256", "--num-kv-blocks", "64", "--served-model-name", "thinker",
                         "--trust-request-chat-template"], None)
    try:
        yield srv, tokenizer.convert_tokens_to_ids(["<think>", "</think>"])
    finally:
        srv.stop()
        os.unlink(srv.log.name)


def _think_chat(client, bias: dict[int, float], **kw):
    return client.chat.completions.create(
        model="thinker", temperature=0, logprobs=True, messages=[{"role": "user", "content": "Yes or no?"}],
        logit_bias={str(k): v for k, v in bias.items()}, **kw).choices[0]


def test_a_grammar_waits_for_the_reasoning_to_end(thinking_server):
    """As vLLM's: under a reasoning parser a grammar constrains the answer, not the reasoning.
    The random model is steered by logit_bias; the grammar only lets it answer yes or no."""
    srv, (start, end) = thinking_server
    client = srv.client()
    choice = {"structured_outputs": {"choice": ["yes", "no"]}}
    opened = "{% for m in messages %}{{ m.content }}\n{% endfor %}<think>\n"
    # Inside a prompt-opened <think> nothing is constrained: `</think>` (pushed up) ends it, then
    # the grammar rules the answer.
    out = _think_chat(client, {end: 100}, max_tokens=8, extra_body=choice | {"chat_template": opened})
    assert out.logprobs.content[0].token == "</think>" and out.finish_reason == "stop"
    assert out.message.content in ("yes", "no") and out.message.reasoning_content is None
    # The first token may open <think> instead of starting the answer; inside, <think> again is
    # reasoning too (the grammar would refuse it), up to max_tokens.
    out = _think_chat(client, {start: 100}, max_tokens=4, extra_body=choice)
    assert [t.token for t in out.logprobs.content] == ["<think>"] * 4 and out.finish_reason == "length"
    assert out.message.reasoning_content == "<think>" * 3 and out.message.content is None
    # The same in the Responses API: the reasoning is unconstrained there too.
    response = client.responses.create(model="thinker", input="Yes or no?", temperature=0, max_output_tokens=4,
                                       extra_body=choice | {"logit_bias": {str(start): 100}})
    assert [item.type for item in response.output] == ["reasoning"] and response.status == "incomplete"
    assert response.output[0].content[0].text == "<think>" * 3
    # The token ids are the server's to set, not a request's.
    r = httpx.post(srv.url("/v1/chat/completions"), timeout=30, json={
        "messages": [{"role": "user", "content": "hi"}],
        "structured_outputs": {"choice": ["yes"], "_reasoning": [10**9, 0, True]}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"
    # A reply that does not open <think> (pushed down) is constrained from its first token.
    out = _think_chat(client, {start: -100}, max_tokens=8, extra_body=choice)
    assert out.message.content in ("yes", "no") and out.message.reasoning_content is None
    assert out.finish_reason == "stop"


def test_responses_api_gives_a_reasoning_item(server):
    """/v1/responses under the parser: the reasoning is a `reasoning` item ahead of the message,
    streamed as response.reasoning_text.* events; the same split as chat's for the same prompt."""
    client = server.client()
    chat = _chat(client, extra_body={"structured_outputs": {"regex": THINKING}}).choices[0].message
    kw = dict(model="SmolLM2-135M-Instruct", input="Is Paris the capital of France?", temperature=0,
              max_output_tokens=48, extra_body={"structured_outputs": {"regex": THINKING}})
    response = client.responses.create(**kw)
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].type == "reasoning_text"
    assert response.output[0].content[0].text == chat.reasoning_content
    assert response.output_text == chat.content
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    events = list(client.responses.create(stream=True, **kw))
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    answer = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert (thought, answer) == (chat.reasoning_content, chat.content)
    kinds = [e.type for e in events]
    # The reasoning item is done before the message starts.
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert final.status == "completed" and [item.type for item in final.output] == ["reasoning", "message"]
