"""POST /v1/responses (OpenAI's Responses API) and the stored responses behind it: GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, POST /v1/responses/{id}/cancel.

A request's `input` (a string, or items: messages, function calls and their outputs) becomes a
conversation rendered by the chat template, as on /v1/chat/completions, and then runs on the same
engine path; `instructions` is a system message in front. Tools are function tools (OpenAI's flat
shape), with chat's `tool_choice` rules (tools.py); `text.format` asks for JSON as chat's
response_format does. The reply is built by `ResponseRun` (response_events.py) for every form:
streamed, plain, or in the background.

Stored responses (`store`, true by default as in OpenAI's API) are kept in memory, the most recent
`--responses-store-size` of them (default 1000; 0: none): `previous_response_id` continues such a
response's conversation (its input and output, not its instructions, as OpenAI), GET returns it.
`background: true` (with `store`) answers at once with a queued response that runs on; GET shows
it as it goes (`?stream=true&starting_after=N` replays its events and follows them), and cancel
ends it. A plain or streamed request whose client goes away is aborted and not stored.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenloom.engine.async_llm import RequestStream
from tokenloom.engine.core_client import EngineDeadError
from tokenloom.entrypoints.openai.protocol import OpenAIServingError, ResponsesRequest, bad_request
from tokenloom.entrypoints.openai.response_events import FINAL_STATUSES, ResponseRun, item_id, response_usage
from tokenloom.entrypoints.openai.serving_engine import (
    EngineStreamingResponse,
    OpenAIServing,
    engine_dead_error,
    json_response,
    run_until_disconnected,
    sse_event,
)
from tokenloom.entrypoints.openai.structured import structured_outputs_of, text_format_of
from tokenloom.entrypoints.openai.tool_parsers import ToolParser
from tokenloom.entrypoints.openai.tools import ToolChoice, resolve_tools
from tokenloom.sampling_params import RequestOutputKind, StructuredOutputsParams

logger = logging.getLogger(__name__)

DEFAULT_STORE_SIZE = 1000
# OpenAI's `include` values. Only the logprobs one changes anything here: the others ask for
# outputs of tools (file search, web search, code interpreter), images or reasoning this server
# does not have, so there is nothing to include.
_LOGPROBS = "message.output_text.logprobs"
INCLUDE_VALUES = frozenset({
    _LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
    "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
})
# OpenAI's limits on `metadata`.
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512
# Fields of the other endpoints that mean nothing here, or have another name.
_REFUSED = {
    "n": "the Responses API returns one reply; use /v1/chat/completions for n > 1",
    "use_beam_search": "use /v1/chat/completions or /v1/completions for beam search",
    "response_format": "the Responses API's name for it is text.format",
    "conversation": "this server keeps no conversations; continue one with previous_response_id",
    "prompt": "reusable prompts are kept by OpenAI, not here; send the input itself",
}


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object (live while a background one runs)
    conversation: list[dict[str, Any]]  # its input and output as chat messages (no instructions)
    input_items: list[dict[str, Any]]  # its own input, as items with ids
    run: ResponseRun | None = None  # a background response's events
    task: asyncio.Task | None = None  # a background response's run


class ResponseStore:
    """The stored responses, least recently stored first; the oldest go once there are more than
    `max_size` (a server up for days keeps a bounded set)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        entry = self._entries.get(response_id)
        if entry is None:
            raise OpenAIServingError(f"No response with id {response_id!r} is stored on this server (responses are "
                                     f"kept when created with store=true, the latest {self.max_size}).",
                                     404, "invalid_request_error", param, "response_not_found")
        return entry

    def __contains__(self, response_id: str) -> bool:
        return response_id in self._entries

    def put(self, response_id: str, entry: StoredResponse) -> None:
        self._entries[response_id] = entry
        while len(self._entries) > self.max_size:
            _, old = self._entries.popitem(last=False)
            if old.task is not None and not old.task.done():
                old.task.cancel()  # a background response pushed out is no longer reachable: stop it

    def pop(self, response_id: str) -> StoredResponse:
        entry = self.get(response_id)
        del self._entries[response_id]
        return entry


# ---- input items -> chat messages --------------------------------------------------------------


def _text_of(content: Any, where: str, part_types: tuple[str, ...]) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of content parts.", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in part_types:
            raise bad_request(f"{where}[{j}] is a {kind!r} part: this server's model reads text only (parts of "
                              f"type {' or '.join(repr(t) for t in part_types)}).", param=where)
        if not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}].text must be a string.", param=where)
        texts.append(part["text"])
    return "\n".join(texts)  # as chat joins text parts


def _call_arguments(arguments: str) -> Any:
    # Templates serialize a call's arguments themselves: an object, as chat gives them.
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        return arguments


def conversation_of(input: str | list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The request's input as chat messages (what chat templates take) and as items with ids
    (what input_items lists). A function call joins the assistant message before it (a reply's
    text and calls are one message); a function call's output is a `tool` message."""
    if isinstance(input, str):
        return ([{"role": "user", "content": input}],
                [{"id": item_id("msg"), "type": "message", "role": "user", "status": "completed",
                  "content": [{"type": "input_text", "text": input}]}])
    messages: list[dict[str, Any]] = []
    items: list[dict[str, Any]] = []
    for i, item in enumerate(input):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (a message or another item).", param=where)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise bad_request(f"{where}.role must be 'user', 'system', 'developer' or 'assistant', got {role!r}.",
                                  param=f"{where}.role")
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text",)
            text = _text_of(item.get("content"), f"{where}.content", parts + ("text",))
            messages.append({"role": role, "content": text})
            part_type = "output_text" if role == "assistant" else "input_text"
            items.append({"id": item.get("id") or item_id("msg"), "type": "message", "role": role, "status": "completed",
                          "content": [{"type": part_type, "text": text}]})
        elif kind == "function_call":
            for name in ("call_id", "name", "arguments"):
                if not isinstance(item.get(name), str):
                    raise bad_request(f"{where}.{name} must be a string.", param=f"{where}.{name}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": _call_arguments(item["arguments"])}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            items.append({"id": item.get("id") or item_id("fc"), "type": "function_call", "status": "completed",
                          "call_id": item["call_id"], "name": item["name"], "arguments": item["arguments"]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where}.call_id must be a string.", param=f"{where}.call_id")
            output = _text_of(item.get("output"), f"{where}.output", ("input_text", "text"))
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
            items.append({"id": item.get("id") or item_id("fco"), "type": "function_call_output", "status": "completed",
                          "call_id": item["call_id"], "output": output})
        elif kind == "reasoning":
            continue  # another server's reasoning, sent back with its output: nothing to render
        else:
            raise bad_request(f"{where}.type {kind!r} is not supported: input items are messages, function_call "
                              "and function_call_output.", param=f"{where}.type")
    if not messages:
        raise bad_request("input holds no message.", param="input")
    return messages, items


def output_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A response's output as the assistant message that continues its conversation."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": _call_arguments(item["arguments"])}}
             for item in output if item["type"] == "function_call"]
    if calls:
        message["tool_calls"] = calls
    return [message]


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The Responses API's function tools (`{"type": "function", "name", "parameters", ...}`)
    in chat's nested shape, which chat templates and tools.py take."""
    out = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise bad_request(f"tools[{i}].type {kind!r} is not supported: this server runs function tools only "
                              "(no web search, file search, code interpreter, MCP or computer use).",
                              param=f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise bad_request(f"tools[{i}].name must be a non-empty string.", param=f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON schema object.", param=f"tools[{i}].parameters")
        out.append({"type": "function", "function": fn})
    return out


def _chat_tool_choice(choice: Any) -> Any:
    """OpenAI's Responses tool_choice (`{"type": "function", "name": ...}` for a named one) in chat's shape."""
    if isinstance(choice, dict):
        if choice.get("type") != "function":
            raise bad_request(f"tool_choice of type {choice.get('type')!r} is not supported: 'none', 'auto', 'required' "
                              'or {"type": "function", "name": ...}.', param="tool_choice")
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, *args: Any, tool_parser: ToolParser, store_size: int = DEFAULT_STORE_SIZE, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser
        self.store = ResponseStore(store_size)

    # ---- checks ---------------------------------------------------------------------------------

    def _check_fields(self, req: ResponsesRequest) -> None:
        for name, why in _REFUSED.items():
            value = getattr(req, name)
            if value not in (None, False) and not (name == "n" and value == 1):
                raise bad_request(f"{name} is not taken by /v1/responses: {why}.", param=name)
        if req.background and not req.store:
            raise bad_request("background requires store to be true (a background response is fetched later).",
                              param="background")
        if req.background and self.store.max_size == 0:
            raise bad_request("background needs stored responses, which this server keeps none of "
                              "(--responses-store-size 0).", param="background")
        for value in req.include or ():
            if value not in INCLUDE_VALUES:
                raise bad_request(f"include: unknown value {value!r} (known: {', '.join(sorted(INCLUDE_VALUES))}).",
                                  param="include")
        metadata = req.metadata or {}
        if len(metadata) > MAX_METADATA_KEYS:
            raise bad_request(f"metadata has {len(metadata)} keys, at most {MAX_METADATA_KEYS} are allowed.",
                              param="metadata")
        for key, value in metadata.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(value) > MAX_METADATA_VALUE_CHARS:
                raise bad_request(f"metadata[{key[:80]!r}]: keys are at most {MAX_METADATA_KEY_CHARS} characters "
                                  f"and values at most {MAX_METADATA_VALUE_CHARS}.", param="metadata")
        if req.request_id is not None and req.request_id in self.store:
            raise bad_request(f"request_id {req.request_id!r} is the id of a stored response.", param="request_id")

    def _tools(self, req: ResponsesRequest) -> tuple[list[dict[str, Any]], ToolChoice, StructuredOutputsParams | None]:
        tools = chat_tools(req.tools)
        choice, extra = resolve_tools(tools, _chat_tool_choice(req.tool_choice), req.parallel_tool_calls)
        return tools, choice, structured_outputs_of(req, text_format_of(req.text), extra,
                                                    limits=self.so_limits)

    # ---- POST /v1/responses -------------------------------------------------------------------------

    async def create_response(self, req: ResponsesRequest, raw_request: Request) -> Response:
        model = self.check_model(req.model)
        self._check_fields(req)
        tools, choice, structured = self._tools(req)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            previous = self.store.get(req.previous_response_id, "previous_response_id")
            if previous.response["status"] not in FINAL_STATUSES:
                raise bad_request(f"Response {req.previous_response_id!r} is still {previous.response['status']}: "
                                  "continue it once it has ended.", param="previous_response_id")
            history = previous.conversation
        messages, input_items = conversation_of(req.input)
        conversation = history + messages
        num_top = (req.top_logprobs or 0) if _LOGPROBS in (req.include or ()) else None
        params = self.sampling_params(req, max_tokens=req.max_output_tokens, logprobs=num_top,
                                      field_names={"max_tokens": "max_output_tokens", "logprobs": "top_logprobs"},
                                      structured_outputs=structured)
        params = self.keep_harmony_markers(params)
        if req.background:  # its events are followed as they come (GET ?stream=true), streamed or not
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        self.check_capacity(1)
        prompt, conversation = await self._render(req, conversation, tools)
        opened = self.reasoning_opened(prompt)
        self.grammar_after_reasoning(params, opened)
        if opened is not None:  # step by step, so that usage can count the reasoning's tokens
            params = params.clone(output_kind=RequestOutputKind.DELTA)
        self.check_capacity(1)  # again: other requests were admitted while it was rendered
        response_id = req.request_id or item_id("resp")
        streams = await self.add_requests(response_id, [prompt], params, req.priority, "input",
                                          {"max_tokens": "max_output_tokens"}, lora_request=self.lora_of(model))
        response = self._response_object(req, response_id, model, params.temperature, params.top_p)
        logprobs_of = None if num_top is None else (lambda c: self.token_logprobs(c, num_top, self.tokens_as_ids(req)))
        run = ResponseRun(response, choice, self.tool_parser, logprobs_of,
                          None if opened is None else self.reasoning_stream(opened))
        entry = StoredResponse(response, conversation, input_items)
        if req.background:
            run.start(background=True)
            entry.run = run
            entry.task = asyncio.ensure_future(self._drive_to_end(run, streams[0], entry))
            self.store.put(response_id, entry)
            if req.stream:
                return self._sse(run.follow())
            return json_response(response)
        if req.stream:
            return EngineStreamingResponse(self._stream(run, streams[0], entry, req.store),
                                           on_close=lambda: self.abort_streams(streams))
        run.start()
        done = await run_until_disconnected(raw_request, self._drive_to_end(run, streams[0], entry, req.store))
        if done is None:
            return Response(status_code=499)
        if response["status"] == "failed":  # the engine died or is shutting down (503), or failed it (500)
            code = response["error"]["code"]
            if code in ("engine_dead", "server_shutting_down"):
                raise OpenAIServingError(response["error"]["message"], 503, "service_unavailable_error", None, code)
            raise OpenAIServingError(f"The engine failed request {response_id}: {response['error']['message']}",
                                     500, "server_error", None, "engine_error")
        return json_response(response)

    async def _render(self, req: ResponsesRequest, conversation: list[dict[str, Any]],
                      tools: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
        """The prompt, and the conversation it holds: with truncation="auto", the oldest items are
        dropped until the prompt and max_output_tokens fit in the context (as OpenAI truncates),
        else one that does not fit is a 400 (from the input processor, naming `input`)."""
        processor = self.engine.input_processor
        system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
        if req.truncation == "disabled" and req.truncate_prompt_tokens is None:
            try:
                processor.check_prompt_chars(sum(len(m["content"]) for m in system + conversation), "input")
            except ValueError as e:
                raise bad_request(str(e), param="input") from None
        while True:
            prompt = await self.render_conversation(req, system + conversation, tools, param="input")
            if req.truncation == "disabled" or len(conversation) == 1:
                return prompt, conversation
            try:  # tokenizing refuses a prompt too long for the context itself
                _, ids = await self.engine.run_off_loop(processor.tokenize_prompt, prompt)
                processor.check_lengths(len(ids), self.resolve_max_tokens(req.max_output_tokens))
                return prompt, conversation
            except ValueError:
                conversation = conversation[1:]

    def _response_object(self, req: ResponsesRequest, response_id: str, model: str, temperature: float,
                         top_p: float) -> dict[str, Any]:
        return {
            "id": response_id, "object": "response", "created_at": int(time.time()), "status": "in_progress",
            "background": req.background, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "max_tool_calls": req.max_tool_calls, "model": model, "output": [],
            "parallel_tool_calls": req.parallel_tool_calls, "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key, "reasoning": req.reasoning,
            "safety_identifier": req.safety_identifier, "service_tier": "default", "store": req.store,
            "temperature": temperature, "text": req.text or {"format": {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
            "tools": req.tools or [], "top_logprobs": req.top_logprobs or 0, "top_p": top_p,
            "truncation": req.truncation, "usage": None, "user": req.user, "metadata": req.metadata or {},
        }

    async def _drive(self, run: ResponseRun, stream: RequestStream) -> Any:
        """Feeds the request's outputs to `run` until it ends; yields after each batch of events."""
        last = None
        output_tokens = 0
        try:
            async for _, out in self.merged_outputs([stream]):
                last = out
                for c in out.outputs:
                    if c.finish_reason == "error" or out.error is not None:
                        run.fail(out.error or "unknown error")
                        yield
                        return
                    output_tokens += len(c.token_ids)  # new tokens (DELTA), or all of them (FINAL_ONLY)
                    run.feed(c)
                yield
        except EngineDeadError as e:
            error = engine_dead_error(e)
            run.fail(error.message, error.code or "engine_dead")
            yield
            return
        c = last.outputs[0] if last is not None and last.outputs else None
        prompt_tokens = len(last.prompt_token_ids or ()) if last is not None else 0
        run.finish(c.finish_reason if c is not None else None,
                   response_usage(prompt_tokens, output_tokens, last.num_cached_tokens if last is not None else 0,
                                  run.reasoning_tokens))
        yield

    async def _drive_to_end(self, run: ResponseRun, stream: RequestStream, entry: StoredResponse,
                            store: bool = True) -> bool:
        try:
            async for _ in self._drive(run, stream):
                pass
        except asyncio.CancelledError:
            run.cancel()
            self.abort_streams([stream])
            raise
        self._stored(entry, run, store)
        return True

    def _stored(self, entry: StoredResponse, run: ResponseRun, store: bool) -> None:
        """A response that has ended joins the store (a background one is there already), its
        output added to its conversation."""
        entry.conversation = entry.conversation + output_messages(run.response["output"])
        if store and run.response["id"] not in self.store:
            self.store.put(run.response["id"], entry)

    async def _stream(self, run: ResponseRun, stream: RequestStream, entry: StoredResponse, store: bool) -> Any:
        run.start()
        sent = 0
        async for _ in self._drive(run, stream):
            for event in run.events[sent:]:
                yield _sse_event(event)
            sent = len(run.events)
        for event in run.events[sent:]:
            yield _sse_event(event)
        self._stored(entry, run, store)

    def _sse(self, events: Any) -> StreamingResponse:
        async def body() -> Any:
            async for event in events:
                yield _sse_event(event)
        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ---- stored responses -------------------------------------------------------------------------

    async def retrieve(self, response_id: str, stream: bool, starting_after: int | None) -> Response:
        entry = self.store.get(response_id)
        if not stream:
            return json_response(entry.response)
        if entry.run is None:
            raise bad_request("stream=true replays the events of a background response; this one was not "
                              "created with background=true.", param="stream")
        return self._sse(entry.run.follow(-1 if starting_after is None else starting_after))

    async def cancel(self, response_id: str) -> Response:
        entry = self.store.get(response_id)
        if entry.task is None:
            raise bad_request("Only a response created with background=true can be cancelled.", param="response_id")
        if not entry.task.done():
            entry.task.cancel()
            try:
                await entry.task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - it is being ended
                pass
        return json_response(entry.response)

    async def delete(self, response_id: str) -> Response:
        entry = self.store.pop(response_id)
        if entry.task is not None and not entry.task.done():
            entry.task.cancel()
        return json_response({"id": response_id, "object": "response", "deleted": True})

    def input_items(self, response_id: str, order: str, after: str | None, limit: int) -> Response:
        items = list(self.store.get(response_id).input_items)
        if order not in ("asc", "desc"):
            raise bad_request(f"order must be 'asc' or 'desc', got {order!r}.", param="order")
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item["id"] for item in items]
            if after not in ids:
                raise bad_request(f"after: no input item {after!r} in response {response_id!r}.", param="after")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return json_response({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                              "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})


def _sse_event(event: dict[str, Any]) -> bytes:
    """OpenAI's Responses SSE framing: the event's type as the SSE event name, and no [DONE]."""
    return b"event: " + event["type"].encode() + b"\n" + sse_event(event)
