"""Structured outputs and tool calling through `tokenloom serve` with the official `openai` client:
`response_format` (json_schema, json_object), vLLM's guided_* fields, `beta.chat.completions.parse`
with a Pydantic model, streaming, and tools with tool_choice required / named / auto, under the
shipped tool-aware template (`--chat-template hermes`)."""
from __future__ import annotations

import asyncio
import json
import sys
from enum import Enum
from pathlib import Path

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

sys.path.insert(0, str(Path(__file__).parents[1] / "structured_output"))
from schemas import SCHEMAS, check_json  # noqa: E402

# The shipped hermes template (SmolLM2's own drops `tools`): the model sees the tools it is asked to call.
SERVER_ARGS = ["--num-kv-blocks", "512", "--max-num-seqs", "64", "--tool-call-parser", "hermes",
               "--chat-template", "hermes"]
TOOLS_DROPPED = "tokenloom:tool_requests_without_tools_in_prompt_total"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "pattern": "^[A-Z][a-z]{1,10}/[A-Z][a-z]{1,12}$"}},
                   "required": ["timezone"]}}}
TOOLS = [WEATHER, TIME]
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.mark.slow
def test_response_format_json_schema_over_many_schemas(server):
    async def one(client, prompt, schema):
        r = await client.chat.completions.create(
            model="", messages=[{"role": "user", "content": prompt}], max_tokens=120, temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}})
        return r.choices[0]

    async def run():
        async with server.async_client() as client:
            return await asyncio.gather(*(one(client, p, s) for p, s in SCHEMAS))

    choices = asyncio.run(run())
    finish = [c.finish_reason for c in choices]
    assert finish.count("stop") >= len(SCHEMAS) - 2, finish
    for c, (_, schema) in zip(choices, SCHEMAS):
        if c.finish_reason == "stop":
            check_json(c.message.content, schema)


def test_guided_fields_on_completions(client):
    r = client.completions.create(model="", prompt="Call me at", max_tokens=20, temperature=0,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert r.choices[0].finish_reason == "stop"
    assert len(r.choices[0].text) == 8 and r.choices[0].text[3] == "-"
    r = client.completions.create(model="", prompt="The sky is", max_tokens=5, temperature=0, n=3,
                                  extra_body={"guided_choice": ["blue", "green"], "temperature": 1.0, "seed": 1})
    assert {c.text for c in r.choices} <= {"blue", "green"}
    r = client.completions.create(model="", prompt="A number:", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= [1-9] [0-9] [0-9]'}})
    assert r.choices[0].text.isdigit() and len(r.choices[0].text) == 3
    r = client.chat.completions.create(model="", messages=[{"role": "user", "content": "JSON please"}], max_tokens=80,
                                       temperature=0, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].message.content), dict)


class Kind(str, Enum):
    cat = "cat"
    dog = "dog"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    kind: Kind
    age: int = Field(ge=0, le=30)


class Owner(BaseModel):
    name: str = Field(max_length=12)
    pets: list[Pet] = Field(min_length=1, max_length=2)


def test_beta_parse_with_a_pydantic_model(client):
    r = client.beta.chat.completions.parse(
        model="", messages=[{"role": "user", "content": "Describe a pet owner."}], response_format=Owner,
        max_tokens=150, temperature=0)
    message = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Owner) and 1 <= len(message.parsed.pets) <= 2


def test_streamed_json_reassembles_and_validates(client):
    prompt, schema = SCHEMAS[9]  # nested order with a patterned sku
    stream = client.chat.completions.create(
        model="", messages=[{"role": "user", "content": prompt}], max_tokens=120, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "order", "schema": schema}})
    text, finish = "", None
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    assert finish == "stop"
    check_json(text, schema)


# ---- tools --------------------------------------------------------------------------------------


def _check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id
        assert names is None or call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_tool_choice_required_always_yields_valid_calls(client):
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=120, temperature=temperature, seed=seed)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        _check_calls(c.message.tool_calls)


def test_named_tool_choice(client):
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_time"}})
    c = r.choices[0]
    # OpenAI and vLLM finish a forced named call with "stop" (not "tool_calls"), content "".
    assert c.finish_reason == "stop" and c.message.content == ""
    _check_calls(c.message.tool_calls, {"get_time"})
    assert len(c.message.tool_calls) == 1


def test_two_turn_exchange_with_a_tool_message(client):
    first = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, max_tokens=80, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = first.choices[0].message.tool_calls[0]
    messages = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    second = client.chat.completions.create(model="", messages=messages, tools=TOOLS, tool_choice="none",
                                            max_tokens=20, temperature=0)
    c = second.choices[0]
    assert c.message.content and not c.message.tool_calls
    assert c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_call_deltas_reassemble_to_the_same_call(client, tool_choice):
    kwargs = dict(model="", messages=ASK, tools=TOOLS, tool_choice=tool_choice, max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or ():
                call = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = d.id or call["id"]
                call["name"] += (d.function.name or "") if d.function else ""
                call["arguments"] += (d.function.arguments or "") if d.function else ""
    assert finish == ("tool_calls" if tool_choice == "required" else "stop")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [(w.function.name, json.loads(w.function.arguments)) for w in whole]
    assert all(c["id"] for c in calls.values())


def test_auto_tool_choice_reads_a_hermes_call_or_answers_in_text(client):
    # The reply is steered into the hermes format with a regex, so the parser has a call to read.
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    kwargs = dict(model="", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=200, temperature=0,
                  extra_body={"guided_regex": "Checking\\. " + _escape(call)})
    c = client.chat.completions.create(**kwargs).choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Checking."
    assert c.message.tool_calls[0].function.name == "get_weather"
    assert json.loads(c.message.tool_calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    # Streamed: the text before the call as content, the call (never its markup) as a tool-call delta.
    content, deltas, finish = "", [], None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            deltas += ch.delta.tool_calls or []
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and content.strip() == "Checking." and "<tool_call>" not in content
    assert [d.function.name for d in deltas] == ["get_weather"]
    assert json.loads(deltas[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
    r = client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=8,
                                       temperature=0, extra_body={"guided_choice": ["It is sunny."]})
    assert r.choices[0].message.content == "It is sunny." and not r.choices[0].message.tool_calls


def _escape(text: str) -> str:
    import re

    return re.escape(text)


def test_shipped_template_puts_the_tools_in_the_prompt(server, client):
    """`--chat-template hermes` renders the request's tools into the prompt (read back through
    /tokenize and /detokenize), so nothing is counted as dropped."""
    before = server.metrics()[TOOLS_DROPPED]
    tokens = httpx.post(server.url("/tokenize"), json={"messages": ASK, "tools": TOOLS}, timeout=60).json()["tokens"]
    prompt = httpx.post(server.url("/detokenize"), json={"tokens": tokens}, timeout=60).json()["prompt"]
    assert "<tools>" in prompt and "get_weather" in prompt and "get_time" in prompt and "<tool_call>" in prompt
    client.chat.completions.create(model="", messages=ASK, tools=TOOLS, tool_choice="auto", max_tokens=4, temperature=0)
    assert server.metrics()[TOOLS_DROPPED] == before == 0
