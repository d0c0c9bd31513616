"""OpenAI's Responses API on `tokenloom serve`, with the official `openai` client: POST
/v1/responses plain, streamed (the client's strict `responses.stream` state machine) and in the
background; stored responses (retrieve, delete, input_items, previous_response_id); tools,
text.format and logprobs; errors that name their field. Greedy replies are checked against
/v1/chat/completions on the same conversation, which renders through the same chat template."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

SERVER_ARGS = ["--num-kv-blocks", "512", "--max-num-seqs", "16", "--max-model-len", "1024"]

WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
                          "required": ["city", "unit"]}}
CHAT_WEATHER = {"type": "function", "function": {k: WEATHER[k] for k in ("name", "description", "parameters")}}
ASK = "What is the weather in Paris?"
GREEDY = dict(model="", temperature=0)


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def chat_text(client, messages, max_tokens, **kwargs) -> tuple[str, object]:
    r = client.chat.completions.create(messages=messages, max_tokens=max_tokens, **GREEDY, **kwargs)
    return r.choices[0].message.content, r.usage


def test_a_response_is_the_chat_reply_to_the_same_conversation(client):
    r = client.responses.create(input="Name three primary colors.", instructions="Answer briefly.",
                                max_output_tokens=40, **GREEDY)
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.instructions == "Answer briefly." and r.max_output_tokens == 40 and r.temperature == 0
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    text, usage = chat_text(client, [{"role": "system", "content": "Answer briefly."},
                                     {"role": "user", "content": "Name three primary colors."}], 40)
    assert r.output_text == text and text
    assert (r.usage.input_tokens, r.usage.output_tokens) == (usage.prompt_tokens, usage.completion_tokens)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_streamed_events_build_the_same_response(client):
    kwargs = dict(input="Say hello to Ada.", max_output_tokens=60, **GREEDY)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed"
    # The client's own state machine checks the order and identity of every item and part.
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens and final.id != whole.id


def test_max_output_tokens_makes_it_incomplete(client):
    r = client.responses.create(input="Write a long poem about the sea.", max_output_tokens=5, **GREEDY)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 5
    events = list(client.responses.create(input="Write a long poem about the sea.", max_output_tokens=5,
                                          stream=True, **GREEDY))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == r.output_text


def test_previous_response_id_continues_the_conversation(client):
    first = client.responses.create(input="My name is Ada. Say hi.", max_output_tokens=20, **GREEDY)
    second = client.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=20,
                                     **GREEDY)
    assert second.previous_response_id == first.id
    text, usage = chat_text(client, [{"role": "user", "content": "My name is Ada. Say hi."},
                                     {"role": "assistant", "content": first.output_text},
                                     {"role": "user", "content": "What is my name?"}], 20)
    assert second.output_text == text and second.usage.input_tokens == usage.prompt_tokens
    # The same conversation again: its prompt is served by the prefix cache.
    again = client.responses.create(input="What is my name?", previous_response_id=first.id, max_output_tokens=20,
                                    **GREEDY)
    assert again.output_text == text and again.usage.input_tokens_details.cached_tokens > 0
    # input_items lists the response's own input, newest first by default.
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "What is my name?")]


def test_stored_responses_retrieve_and_delete(client):
    r = client.responses.create(input="Hi", max_output_tokens=8, metadata={"k": "v"}, **GREEDY)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump() and got.metadata == {"k": "v"}
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)
    unstored = client.responses.create(input="Hi", max_output_tokens=4, store=False, **GREEDY)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.create(input="Hi", previous_response_id=unstored.id, max_output_tokens=4, **GREEDY)
    assert e.value.body["param"] == "previous_response_id"
    plain = client.responses.create(input="Hi", max_output_tokens=2, **GREEDY)
    with pytest.raises(openai.BadRequestError) as e:  # only a background response's events are kept
        list(client.responses.retrieve(plain.id, stream=True))
    assert e.value.body["param"] == "stream"


def test_input_items_with_function_calls_render_as_chat_tool_messages(client):
    first = client.responses.create(input=ASK, tools=[WEATHER], tool_choice="required", max_output_tokens=120,
                                    **GREEDY)
    assert first.status == "completed"
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and all(c.name == "get_weather" and c.call_id for c in calls)
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), WEATHER["parameters"])
    result = json.dumps({"temperature": 21, "sky": "sunny"})
    follow = [{"type": "function_call_output", "call_id": c.call_id, "output": result} for c in calls]
    logprobs = dict(include=["message.output_text.logprobs"], top_logprobs=0)
    second = client.responses.create(input=follow, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
                                     max_output_tokens=30, **logprobs, **GREEDY)
    # The same exchange as chat messages: the call as an assistant tool call, its output a tool message.
    messages = [{"role": "user", "content": ASK},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                    for c in calls]}]
    messages += [{"role": "tool", "tool_call_id": c.call_id, "content": result} for c in calls]
    chat = client.chat.completions.create(messages=messages, max_tokens=30, tools=[CHAT_WEATHER], tool_choice="none",
                                          logprobs=True, **GREEDY).choices[0]
    text = chat.message.content
    assert second.output_text == text and text
    # The same prompt, not just the same reply: each token's logprob agrees (within the GGUF
    # path's kernel differences: the second request's prompt is mostly served by the prefix cache,
    # so its last tokens run through other matmul kernels than the first's; a tool output sent as
    # a user message moves the first logprob by ~0.5).
    assert [e.logprob for e in second.output[0].content[0].logprobs] == \
        pytest.approx([c.logprob for c in chat.logprobs.content], abs=0.05)
    # Sent as one input list instead of through previous_response_id: the same reply.
    items = [{"role": "user", "content": ASK}] + [
        {"type": "function_call", "call_id": c.call_id, "name": c.name, "arguments": c.arguments} for c in calls] + follow
    third = client.responses.create(input=items, tools=[WEATHER], tool_choice="none", max_output_tokens=30, **GREEDY)
    assert third.output_text == text


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_weather"}])
def test_streamed_function_call_is_the_plain_one(client, tool_choice):
    kwargs = dict(input=ASK, tools=[WEATHER], tool_choice=tool_choice, max_output_tokens=120, **GREEDY)
    whole = [(o.name, json.loads(o.arguments)) for o in client.responses.create(**kwargs).output]
    with client.responses.stream(**kwargs) as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.function_call_arguments.delta")
        final = stream.get_final_response()
    assert [(o.name, json.loads(o.arguments)) for o in final.output] == whole
    assert all(o.type == "function_call" and o.status == "completed" for o in final.output)
    if isinstance(tool_choice, dict):  # a named call's arguments stream as they are generated
        assert json.loads(deltas) == whole[0][1]


def test_auto_tool_choice_reads_a_hermes_call(client):
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}</tool_call>'
    regex = "Checking\\. " + "".join("\\" + ch if ch in "{}[]().*+?^$|\\" else ch for ch in call)
    r = client.responses.create(input=ASK, tools=[WEATHER], max_output_tokens=200, extra_body={"guided_regex": regex},
                                **GREEDY)
    # The text before the call (as streamed: up to the call's markup) is the message, the call an item.
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text.strip() == "Checking."
    assert json.loads(r.output[1].arguments) == {"city": "Paris", "unit": "celsius"}


def test_text_format_parses_into_a_pydantic_model(client):
    class City(BaseModel):
        name: str
        population: int

    r = client.responses.parse(input="Give a city and its population as JSON.", text_format=City,
                               max_output_tokens=60, **GREEDY)
    assert r.status == "completed" and isinstance(r.output_parsed, City)
    assert r.text.format.type == "json_schema"


def test_logprobs_ride_on_the_output_text(client):
    kwargs = dict(input="Hi", max_output_tokens=6, include=["message.output_text.logprobs"], top_logprobs=3, **GREEDY)
    r = client.responses.create(**kwargs)
    entries = r.output[0].content[0].logprobs
    assert len(entries) == r.usage.output_tokens and "".join(e.token for e in entries) == r.output_text
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob == e.logprob for e in entries)  # greedy
    chat = client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], max_tokens=6, logprobs=True,
                                          top_logprobs=3, **GREEDY).choices[0].logprobs.content
    assert [e.token for e in entries] == [c.token for c in chat]
    assert [e.logprob for e in entries] == pytest.approx([c.logprob for c in chat], abs=1e-4)
    streamed = [e for e in client.responses.create(stream=True, **kwargs)]
    assert [lp.token for e in streamed if e.type == "response.output_text.delta" for lp in e.logprobs] == \
        [e.token for e in entries]
    assert not client.responses.create(input="Hi", max_output_tokens=4, **GREEDY).output[0].content[0].logprobs


def test_background_response_runs_on_and_replays_its_events(client):
    kwargs = dict(input="Count from one to three in words.", max_output_tokens=60, **GREEDY)
    plain = client.responses.create(**kwargs)
    r = client.responses.create(background=True, **kwargs)
    assert r.background and r.status in ("queued", "in_progress") and not r.output
    deadline = time.monotonic() + 120
    while r.status in ("queued", "in_progress") and time.monotonic() < deadline:
        time.sleep(0.2)
        r = client.responses.retrieve(r.id)
    assert r.status == plain.status and r.output_text == plain.output_text
    # Its events again, from any point: sequence numbers follow on, the text adds up.
    events = list(client.responses.retrieve(r.id, stream=True, starting_after=3))
    assert [e.sequence_number for e in events] == list(range(4, 4 + len(events)))
    assert events[-1].type == f"response.{plain.status}" and events[-1].response.output_text == plain.output_text
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(background=True, store=False, **kwargs)
    assert e.value.body["param"] == "background"


def test_cancelling_a_background_response_stops_it(client, server):
    r = client.responses.create(input="Write a very long story about a dragon.", background=True,
                                max_output_tokens=900, **GREEDY)
    deadline = time.monotonic() + 60
    while not client.responses.retrieve(r.id).output_text and time.monotonic() < deadline:
        time.sleep(0.1)
    cancelled = client.responses.cancel(r.id)
    assert cancelled.status == "cancelled"
    m = server.wait_idle()
    assert m["tokenloom:num_requests_running"] == 0 and m["tokenloom:num_kv_blocks_used"] == 0
    later = client.responses.retrieve(r.id)
    assert later.status == "cancelled" and later.output_text == cancelled.output_text
    assert len(later.output_text) < 900 * 3
    with pytest.raises(openai.BadRequestError):  # only background responses can be cancelled
        client.responses.cancel(client.responses.create(input="Hi", max_output_tokens=2, **GREEDY).id)


def test_truncation_auto_drops_the_oldest_items(client):
    long = [{"role": "user", "content": f"Remember fact {i}: " + "the sky was blue that day. " * 12} for i in range(12)]
    items = long + [{"role": "user", "content": "Say OK."}]
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(input=items, max_output_tokens=8, **GREEDY)
    assert e.value.body["param"] == "input"
    r = client.responses.create(input=items, max_output_tokens=8, truncation="auto", **GREEDY)
    assert r.status in ("completed", "incomplete") and r.truncation == "auto"
    assert r.usage.input_tokens + 8 <= 1024 < sum(len(m["content"]) for m in items) // 4


@pytest.mark.parametrize("body, param", [
    ({"input": "Hi", "n": 2}, "n"),
    ({"input": "Hi", "response_format": {"type": "json_object"}}, "response_format"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "Hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": "Hi", "include": ["nope"]}, "include"),
    ({"input": "Hi", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 5000}, "max_output_tokens"),
    ({"input": "Hi", "top_logprobs": 99}, "top_logprobs"),
    ({"input": []}, "input"),
])
def test_bad_requests_name_their_field(server, body, param):
    r = httpx.post(server.url("/v1/responses"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param.split("[")[0].split(".")[0] in error["message"] or param in error["message"], error


def test_unknown_response_ids_are_404(server):
    for method, path in (("GET", "/v1/responses/resp_x"), ("DELETE", "/v1/responses/resp_x"),
                         ("POST", "/v1/responses/resp_x/cancel"), ("GET", "/v1/responses/resp_x/input_items")):
        r = httpx.request(method, server.url(path), timeout=30)
        assert r.status_code == 404 and r.json()["error"]["code"] == "response_not_found", (path, r.text)
