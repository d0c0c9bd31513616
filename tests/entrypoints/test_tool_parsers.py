"""Tool calls read from free text (tool_choice="auto"): hermes and bare-JSON replies, and what is
held back while streaming."""
from __future__ import annotations

import json

from tokenloom.entrypoints.openai.tool_parsers import HermesToolParser, JsonToolParser

CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'


def test_hermes_reads_calls_after_text():
    content, calls = HermesToolParser().extract(f"Let me check.\n<tool_call>\n{CALL}\n</tool_call>\n"
                                                 '<tool_call>{"name": "get_time", "arguments": "{}"}</tool_call>')
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]


def test_hermes_reads_a_call_the_model_did_not_close():
    content, calls = HermesToolParser().extract(f"<tool_call>{CALL}")
    assert content is None and calls[0].name == "get_weather"


def test_hermes_leaves_text_and_broken_calls_as_content():
    assert HermesToolParser().extract("Just text.") == ("Just text.", [])
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    assert HermesToolParser().extract(text) == (text, [])
    text = '<tool_call>{"arguments": {}}</tool_call>'  # no name
    assert HermesToolParser().extract(text) == (text, [])


def test_hermes_streaming_holds_back_a_possible_call_start():
    p = HermesToolParser()
    assert p.content_end("Hello") == 5
    assert p.content_end("Hello <tool_") == len("Hello ")
    assert p.content_end(f"Hi <tool_call>{CALL[:10]}") == len("Hi ")
    assert p.content_end("a < b") == len("a < b")


def test_json_parser_reads_one_call_or_a_list():
    p = JsonToolParser()
    assert p.extract(CALL)[1][0].name == "get_weather"
    content, calls = p.extract(f'[{CALL}, {{"name": "get_time", "parameters": {{"tz": "UTC"}}}}]')
    assert content is None and [json.loads(c.arguments) for c in calls] == [{"city": "Paris"}, {"tz": "UTC"}]
    assert p.extract('{"city": "Paris"}') == ('{"city": "Paris"}', [])  # JSON, but not a call
    assert p.extract("The weather is fine.") == ("The weather is fine.", [])
    assert p.content_end("  {") == 0 and p.content_end("The") == 3


def test_pythonic_reads_a_list_of_calls_with_literal_arguments():
    from tokenloom.entrypoints.openai.tool_parsers import PythonicToolParser

    p = PythonicToolParser()
    content, calls = p.extract('[get_weather(city="Paris", unit="celsius"), get_time(tz=None, days=[1, 2], '
                               'opts={"a": True}, ratio=-0.5)]')
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}),
        ("get_time", {"tz": None, "days": [1, 2], "opts": {"a": True}, "ratio": -0.5})]
    assert p.extract("[get_time()]")[1][0].arguments == "{}"
    # Not calls: answered as text, never evaluated.
    for text in ["The weather is fine.", "[1, 2, 3]", "[]", '[get_weather("Paris")]', "[os.system(x='ls')]",
                 "[f(x=open('y'))]", "[f(**kw)]", "[f(x={1, 2})]", "[get_weather(city='Paris')", "[f(x=true)]"]:
        assert p.extract(text) == (text, []), text


def test_pythonic_streaming_holds_back_a_reply_that_may_be_calls():
    from tokenloom.entrypoints.openai.tool_parsers import PythonicToolParser
    from tokenloom.entrypoints.openai.tools import ToolChoice, ToolStream

    p = PythonicToolParser()
    assert p.content_end("  [get_") == 0 and p.content_end("Sure") == 4 and p.content_end("") == 0
    stream = ToolStream(ToolChoice("auto"), p)
    reply = '[get_weather(city="Paris")]'
    deltas = [stream.feed(reply[i:i + 5], None) for i in range(0, len(reply), 5)]
    assert all(d == ({}, None) for d in deltas)  # held back: it may be calls
    delta, finish = stream.feed("", "stop")
    assert finish == "tool_calls" and delta["tool_calls"][0]["function"] == {"name": "get_weather",
                                                                            "arguments": '{"city": "Paris"}'}
    stream = ToolStream(ToolChoice("auto"), p)
    assert stream.feed("[1] is a footnote", None) == ({}, None)
    assert stream.feed("", "stop") == ({"content": "[1] is a footnote"}, "stop")  # text after all
