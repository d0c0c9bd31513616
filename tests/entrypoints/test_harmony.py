"""gpt-oss's harmony replies (`--reasoning-parser openai_gptoss`, `--tool-call-parser openai`): the
analysis channel is the message's reasoning_content, the final channel its content, a message to
`functions.NAME` a tool call; streamed or not, with any chunking of a stream. Then the real server
with the official client, the embedded model made to write harmony replies by a regex grammar
(its vocabulary spells the markers in several tokens, so they stay in the text).

The replies are spelled out here in the harmony format as OpenAI documents it: openai_harmony's
encoder would render them, but it downloads its vocabulary file on first use, which a test cannot."""
from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.entrypoints.openai.harmony import HarmonyStream, parse_messages, split_harmony
from tokenloom.entrypoints.openai.tool_parsers import HarmonyToolParser

SERVER_ARGS = ["--reasoning-parser", "openai_gptoss", "--tool-call-parser", "openai", "--num-kv-blocks", "256"]

ANALYSIS = "<|channel|>analysis<|message|>The user asks about Oslo.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>It is cold in Oslo."
CALL = '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>'


@pytest.mark.parametrize("text, reasoning, content", [
    (ANALYSIS + FINAL, "The user asks about Oslo.", "It is cold in Oslo."),
    (ANALYSIS + FINAL + "<|return|>", "The user asks about Oslo.", "It is cold in Oslo."),
    ("<|channel|>final<|message|>Hi.", "", "Hi."),  # reasoning effort low: no analysis
    ("<|channel|>analysis<|message|>cut short", "cut short", ""),  # max_tokens inside the reasoning
    ("Plain text, no harmony.", "", "Plain text, no harmony."),
    ("<|channel|>analysis<|message|>plan<|end|><|start|>assistant<|channel|>comm", "plan", ""),  # a header cut short
])
def test_split(text, reasoning, content):
    split = split_harmony(text)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_a_call_with_the_recipient_before_or_after_the_channel():
    before = '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Oslo"}<|call|>'
    for text in (ANALYSIS + CALL, ANALYSIS + before):
        (_, call) = parse_messages(text)
        assert (call.function, call.channel, call.content) == ("get_weather", "commentary", '{"city": "Oslo"}')
        content, calls = HarmonyToolParser().extract(split_harmony(text).content)
        assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


def test_a_broken_call_is_text_and_a_preamble_is_content():
    parser = HarmonyToolParser()
    broken = '<|start|>assistant to=functions.f<|channel|>commentary json<|message|>{"city": <|call|>'
    assert parser.extract(broken) == (broken, [])
    preamble = "<|channel|>commentary<|message|>Let me check.<|end|>" + CALL
    content, calls = parser.extract(split_harmony(preamble).content)
    assert content == "Let me check." and [c.name for c in calls] == ["get_weather"]


def test_a_stream_holds_back_what_a_later_delta_decides():
    s = HarmonyStream()
    assert s.feed("<|chan", False) == ("", "")
    assert s.feed("nel|>analysis<|mess", False) == ("", "")  # the header is not complete yet
    assert s.feed("age|>plan<|e", False) == ("plan", "")  # "<|e" may be <|end|>
    assert s.feed("nd|><|start|>assistant<|channel|>final<|message|>Hi", False) == ("", "Hi")
    assert s.feed("!", True) == ("", "!")


_PIECES = st.sampled_from(["<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "<|start|>assistant",
                           "a b", "<", "|", "x", " to=functions.f", "commentary", "{}", "<|call|>"])


@settings(max_examples=300, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=14), cuts=st.lists(st.integers(0, 120), max_size=8))
def test_any_chunking_of_a_stream_adds_up_to_the_whole_reply(pieces, cuts):
    text = "".join(pieces)
    whole = split_harmony(text)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    stream = HarmonyStream()
    got_reasoning = got_content = ""
    for i, (a, b) in enumerate(zip(bounds, bounds[1:] + [len(text)])):
        r, c = stream.feed(text[a:b], finished=i == len(bounds) - 1)
        got_reasoning, got_content = got_reasoning + r, got_content + c
    assert (got_reasoning, got_content) == (whole.reasoning, whole.content)


# The embedded model writes what the grammar lets it: harmony replies.
REPLY = r"<\|channel\|>analysis<\|message\|>[a-z]{2,8}<\|end\|><\|start\|>assistant<\|channel\|>final<\|message\|>[A-Z][a-z]{1,8}\."
TOOL_REPLY = (r"<\|channel\|>analysis<\|message\|>[a-z]{2,8}<\|end\|><\|start\|>assistant<\|channel\|>commentary "
              r'to=functions\.get_weather <\|constrain\|>json<\|message\|>\{"city": "Oslo"\}<\|call\|>')
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def _chat(client, regex: str, **kw):
    return client.chat.completions.create(model="SmolLM2-135M-Instruct", temperature=0, max_tokens=160,
                                          messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                          extra_body={"structured_outputs": {"regex": regex}}, **kw)


@pytest.mark.slow
def test_the_server_reads_harmony_replies(server):
    client = server.client().with_options(timeout=600)  # a grammar-led reply of ~70 tokens
    whole = _chat(client, REPLY).choices[0]
    reasoning, content = whole.message.reasoning_content, whole.message.content
    assert re.fullmatch(r"[a-z]{2,8}", reasoning) and re.fullmatch(r"[A-Z][a-z]{1,8}\.", content)
    streamed = {"reasoning_content": "", "content": ""}
    for chunk in _chat(client, REPLY, stream=True):
        for choice in chunk.choices:
            for key in streamed:
                streamed[key] += getattr(choice.delta, key, None) or ""
    assert streamed == {"reasoning_content": reasoning, "content": content}
    # The Responses API: the analysis channel is a reasoning item ahead of the message.
    response = client.responses.create(model="SmolLM2-135M-Instruct", input="Weather in Oslo?", temperature=0,
                                       max_output_tokens=160, extra_body={"structured_outputs": {"regex": REPLY}})
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == reasoning and response.output_text == content
    for stream in (False, True):
        if not stream:
            choice = _chat(client, TOOL_REPLY, tools=[WEATHER]).choices[0]
            calls, finish, text = choice.message.tool_calls, choice.finish_reason, choice.message.content
        else:
            calls, finish, text = [], None, ""
            for chunk in _chat(client, TOOL_REPLY, tools=[WEATHER], stream=True):
                for ch in chunk.choices:
                    text += ch.delta.content or ""
                    calls += ch.delta.tool_calls or []
                    finish = ch.finish_reason or finish
        assert not text and finish == "tool_calls", (text, finish)
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]
