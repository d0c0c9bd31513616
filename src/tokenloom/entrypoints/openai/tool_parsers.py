"""Tool calls in free text (`tool_choice="auto"`): how a model wrote its calls, by model family.

`--tool-call-parser` picks one:
- `hermes` (Hermes, Qwen2/2.5/3, SmolLM3 and other ChatML tool templates): each call is
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, possibly after some text;
- `json` (alias `llama3_json`): the whole reply is one call object, or a list of them, with
  `arguments` or `parameters`;
- `pythonic` (Llama 3.2 and 4, and templates written for it): the whole reply is a Python list
  of calls with keyword arguments, `[get_weather(city="Paris", days=2)]`, read with `ast`
  (literal values only: nothing in the reply is ever evaluated);
- `openai` (gpt-oss): harmony messages to `functions.NAME` (harmony.py).

A reply that does not parse as calls is plain content: a model that chose to answer in text, or
wrote a broken call, is answered as text, never with a made-up call.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from tokenloom.entrypoints.openai import harmony


@dataclass(slots=True)
class ParsedToolCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


def _call_of(obj: object) -> ParsedToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def calls_of_json(text: str) -> list[ParsedToolCall] | None:
    """A JSON call object or list of them; None when `text` is not that."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    items = obj if isinstance(obj, list) else [obj]
    calls = [_call_of(item) for item in items]
    if not calls or any(c is None for c in calls):
        return None
    return calls  # type: ignore[return-value]


class ToolParser:
    name = ""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """(content, calls) of a finished reply; calls [] means the reply is all content."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of a reply so far may be streamed as content now: everything before the point
        where a call starts or may be starting (the rest is held until the reply ends)."""
        raise NotImplementedError


class HermesToolParser(ToolParser):
    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for block in self._BLOCK.findall(text[start:]):
            call = _call_of(_loads(block.strip()))
            if call is None:
                return text, []
            calls.append(call)
        content = text[:start].strip()
        return (content or None), calls

    def content_end(self, text: str) -> int:
        start = text.find(self.START)
        if start >= 0:
            return start
        # Hold back a tail that could be the beginning of "<tool_call>".
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class JsonToolParser(ToolParser):
    """The whole reply is calls (or it is content): held back while it starts like them."""
    name = "json"
    starts = "{["  # what a reply of calls begins with

    @staticmethod
    def calls_of(text: str) -> list[ParsedToolCall] | None:
        return calls_of_json(text)

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        calls = self.calls_of(text.strip())
        return (text, []) if calls is None else (None, calls)

    def content_end(self, text: str) -> int:
        stripped = text.lstrip()
        return 0 if not stripped or stripped[0] in self.starts else len(text)


class PythonicToolParser(JsonToolParser):
    name = "pythonic"
    starts = "["

    @staticmethod
    def calls_of(text: str) -> list[ParsedToolCall] | None:
        return _pythonic_calls(text)


def _pythonic_calls(text: str) -> list[ParsedToolCall] | None:
    """`[f(a=1), g(b="x")]` as calls; None when the text is not a non-empty list of calls of
    plain names with literal keyword arguments."""
    import ast

    if not text.startswith("["):
        return None
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            try:
                args[kw.arg] = ast.literal_eval(kw.value)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
        try:
            arguments = json.dumps(args, ensure_ascii=False)
        except (TypeError, ValueError):  # a set, bytes or complex literal: not JSON
            return None
        calls.append(ParsedToolCall(node.func.id, arguments))
    return calls


def _loads(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


class HarmonyToolParser(ToolParser):
    """`--tool-call-parser openai`: the calls in content that `split_harmony` wrote (or in a raw
    harmony reply, without the reasoning parser); the text before the first call is the content."""
    name = "openai"

    @staticmethod
    def _first_marker(text: str) -> int:
        found = [i for m in harmony.MARKERS if (i := text.find(m)) >= 0]
        return min(found) if found else -1

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        start = self._first_marker(text)
        if start < 0:
            return text, []
        calls, rest = [], []
        for m in harmony.parse_messages(text[start:]):
            if m.function is None:
                rest.append(m.content)
                continue
            try:
                args = json.loads(m.content) if m.content.strip() else {}
            except json.JSONDecodeError:
                return text, []  # a broken call: the reply is text (tool_parsers' rule)
            if not isinstance(args, dict):
                return text, []
            calls.append(ParsedToolCall(m.function, json.dumps(args, ensure_ascii=False)))
        if not calls:
            return text, []
        content = (text[:start] + "".join(rest)).strip()
        return (content or None), calls

    def content_end(self, text: str) -> int:
        start = self._first_marker(text)
        if start >= 0:
            return start
        return len(text) - max(harmony.partial_tail(text, m) for m in harmony.MARKERS)


TOOL_PARSERS: dict[str, type[ToolParser]] = {"hermes": HermesToolParser, "json": JsonToolParser,
                                             "llama3_json": JsonToolParser, "pythonic": PythonicToolParser,
                                             "openai": HarmonyToolParser}
