"""Tool calling on /v1/chat/completions (and /v1/responses, whose flat tools serving_responses.py
puts in chat's shape): the request's `tools` and `tool_choice`, the schema that constrains a
`required` or named choice, the reply turned into OpenAI's `tool_calls`, and a streamed reply read
as text and calls (`ToolStream`).

`tool_choice`:
- `none`: the tools are still rendered into the prompt (as OpenAI), and the reply is text;
- `auto` (the default when tools are given): the model decides; its reply goes through the
  server's tool parser (`--tool-call-parser`, tool_parsers.py);
- `required`: the reply is constrained to a JSON list of `{"name", "parameters"}` objects, one of
  the tools each (vLLM's shape), so it always parses;
- a named function (`{"type": "function", "function": {"name": ...}}`): the reply is constrained
  to that function's parameter schema and is its arguments.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenloom.entrypoints.openai.protocol import bad_request, random_id
from tokenloom.entrypoints.openai.tool_parsers import ParsedToolCall, ToolParser, calls_of_json
from tokenloom.sampling_params import StructuredOutputsParams


@dataclass(slots=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    function: str | None = None  # the named function


def check_tools(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """name -> parameter schema, with a 400 naming the first malformed tool."""
    by_name: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}.', param=f"tools[{i}]")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string.", param=f"tools[{i}].function.name")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.",
                              param=f"tools[{i}].function.parameters")
        by_name[name] = params
    return by_name


def tool_choice_of(choice: str | dict[str, Any] | None, tools: dict[str, dict[str, Any]]) -> ToolChoice:
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}.",
                              param="tool_choice")
        if choice != "none" and not tools:
            raise bad_request(f"tool_choice={choice!r} needs tools.", param="tool_choice")
        return ToolChoice(choice)
    fn = choice.get("function") if choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise bad_request('tool_choice must be {"type": "function", "function": {"name": ...}} to name a function.',
                          param="tool_choice")
    if name not in tools:
        raise bad_request(f"tool_choice names function {name!r}, which is not among the tools.", param="tool_choice")
    return ToolChoice("named", name)


def constraint_schema(choice: ToolChoice, tools: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any] | None:
    """The JSON schema the reply must follow, or None when it is free text (`none`, `auto`)."""
    if choice.mode == "named":
        assert choice.function is not None
        return tools[choice.function]
    if choice.mode != "required":
        return None
    one_call = [
        {"type": "object", "properties": {"name": {"const": name}, "parameters": params},
         "required": ["name", "parameters"]}
        for name, params in tools.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": one_call[0] if len(one_call) == 1 else {"anyOf": one_call}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def resolve_tools(tools: list[dict[str, Any]], tool_choice: str | dict[str, Any] | None, parallel: bool
                  ) -> tuple[ToolChoice, tuple[StructuredOutputsParams, str] | None]:
    """A request's tools (chat's shape) and tool_choice: the choice, and the structured output
    that constrains the reply to calls (`required`, a named function; None otherwise), named
    `tools` for the 400 a bad schema gets."""
    by_name = check_tools(tools)
    choice = tool_choice_of(tool_choice, by_name)
    schema = constraint_schema(choice, by_name, parallel)
    if schema is None:
        return choice, None
    try:
        return choice, (StructuredOutputsParams(json=schema), "tools")
    except ValueError as e:  # a parameter schema that cannot cross to the core
        raise bad_request(str(e).replace("structured_outputs.json", "tools"), param="tools") from None


def constrained_calls(choice: ToolChoice, text: str) -> list[ParsedToolCall] | None:
    """The calls of a constrained reply; None when it is incomplete (cut by max_tokens)."""
    if choice.mode == "named":
        assert choice.function is not None
        try:
            args = json.loads(text)
        except json.JSONDecodeError:
            return None
        return [ParsedToolCall(choice.function, json.dumps(args, ensure_ascii=False))] if isinstance(args, dict) else None
    return calls_of_json(text)


def openai_tool_calls(calls: list[ParsedToolCall]) -> list[dict[str, Any]]:
    return [{"id": random_id("call"), "type": "function",
             "function": {"name": c.name, "arguments": c.arguments}} for c in calls]


def template_message(message: Any, index: int) -> dict[str, Any]:
    """A request message as chat templates expect it: tool calls' arguments as objects (the
    templates serialize them), a tool result with its call id."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name is not None:
        out["name"] = message.name
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for call in message.tool_calls:
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(f"messages[{index}].tool_calls must be a list of "
                                  '{"type": "function", "function": {"name": ..., "arguments": ...}}.',
                                  param="messages")
            fn = dict(fn)
            if isinstance(fn.get("arguments"), str):
                try:
                    fn["arguments"] = json.loads(fn["arguments"])
                except json.JSONDecodeError:
                    pass
            calls.append({**call, "function": fn})
        out["tool_calls"] = calls
    return out


class ToolStream:
    """One streamed choice of a request with tools: content deltas while the reply is text, and
    OpenAI's `delta.tool_calls` for calls. A named function's arguments stream as they are
    generated; calls in a `required` list or in free text (`auto`) go out when the reply ends
    (only then is it known whether they parse), one delta per call with its whole arguments."""

    def __init__(self, choice: ToolChoice, parser: ToolParser) -> None:
        self.choice = choice
        self.parser = parser
        self.text = ""
        self.sent = 0  # characters of `text` already sent as content (auto) or arguments (named)
        self.call_id: str | None = None

    def feed(self, new_text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        self.text += new_text
        mode = self.choice.mode
        if mode == "named":
            delta: dict[str, Any] = {}
            if new_text:
                fn: dict[str, Any] = {"arguments": new_text}
                call: dict[str, Any] = {"index": 0, "function": fn}
                if self.call_id is None:
                    self.call_id = random_id("call")
                    call.update(id=self.call_id, type="function")
                    fn["name"] = self.choice.function
                delta = {"tool_calls": [call]}
            return delta, finish  # `stop` for a named function, as OpenAI and vLLM send it
        if finish is None:
            if mode == "required":
                return {}, None
            end = self.parser.content_end(self.text)
            if end > self.sent:
                content = self.text[self.sent:end]
                self.sent = end
                return {"content": content}, None
            return {}, None
        # The reply has ended: what was held back is calls, or text after all.
        if mode == "required":
            calls = constrained_calls(self.choice, self.text) if finish == "stop" else None
            content = None if calls else self.text
        else:
            _, calls = self.parser.extract(self.text)
            # Without calls, all that was held back is text; with them, the text before them.
            end = self.parser.content_end(self.text) if calls else len(self.text)
            content = self.text[self.sent:end]
        delta = {}
        if content:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(openai_tool_calls(calls))]
            return delta, "tool_calls"
        return delta, finish

