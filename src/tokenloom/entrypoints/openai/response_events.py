"""One response of the Responses API as it is generated: OpenAI's stream of typed events, in
order, and the response object they add up to.

Every way of asking builds the response the same way, so the forms cannot disagree: a stream
sends the events as they come, a plain request returns the object the same events built, and a
background response keeps them to replay (GET /v1/responses/{id}?stream=true).

The events, as OpenAI sends them (each with a `sequence_number` from 0):
`response.created` (and `response.queued` in the background), `response.in_progress`; per output
item `response.output_item.added`, then for a message `response.content_part.added`, its
`response.output_text.delta`s, `response.output_text.done`, `response.content_part.done`, and
for a function call `response.function_call_arguments.delta`s and `.done`; each item closes
with `response.output_item.done`; the response ends with `response.completed`, or
`response.incomplete` (cut by max_output_tokens) or `response.failed`. A cancelled background
response's events just stop (OpenAI has no event for it).
"""
from __future__ import annotations

import asyncio
import copy
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from tokenloom.entrypoints.openai.harmony import HarmonyStream
from tokenloom.entrypoints.openai.reasoning_parsers import ReasoningStream
from tokenloom.entrypoints.openai.tool_parsers import ToolParser
from tokenloom.entrypoints.openai.tools import ToolChoice, ToolStream
from tokenloom.outputs import CompletionOutput

# Statuses after which a response changes no more.
FINAL_STATUSES = frozenset({"completed", "incomplete", "failed", "cancelled"})


def item_id(prefix: str) -> str:
    """OpenAI's id shape: `resp_...`, `msg_...`, `fc_...`."""
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(input_tokens: int, output_tokens: int, cached_tokens: int,
                   reasoning_tokens: int = 0) -> dict[str, Any]:
    """The Responses API's usage. `cache_write_tokens` is 0: the prefix cache keeps computed
    blocks as a side effect of running the prompt, at no extra cost to count."""
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": input_tokens + output_tokens,
    }


class ResponseRun:
    """The response object (`response`) and the events that built it (`events`), fed with the
    engine's outputs for the request's one sequence. `logprobs_of` turns an output's new tokens
    into the Responses API's logprob entries (None: logprobs were not asked for)."""

    def __init__(self, response: dict[str, Any], choice: ToolChoice, parser: ToolParser,
                 logprobs_of: Callable[[CompletionOutput], list[dict[str, Any]]] | None,
                 reasoning: ReasoningStream | HarmonyStream | None = None) -> None:
        self.response = response
        # --reasoning-parser: the reply's reasoning goes to a `reasoning` item ahead of the message.
        self._reasoning = reasoning
        self._thought: dict[str, Any] | None = None  # the reasoning item being written
        # usage's reasoning_tokens: those whose text went to the reasoning (with the tokens held
        # before them, e.g. `<think>`); exact when fed step by step (RequestOutputKind.DELTA).
        self.reasoning_tokens = 0
        self._held_tokens = 0
        self.events: list[dict[str, Any]] = []
        self._changed = asyncio.Event()  # set by every event; replaced once a reader has seen it
        # Without tools all of the text is the message, with its logprobs; with tools the reply
        # may turn out to be calls (ToolStream holds back what may be one), and carries none.
        self._tools = None if choice.mode == "none" else ToolStream(choice, parser)
        self._logprobs_of = logprobs_of if self._tools is None else None
        self._message: dict[str, Any] | None = None  # the message item being written
        self._calls: dict[int, dict[str, Any]] = {}  # tool-call index -> its function_call item
        self._open: list[dict[str, Any]] = []  # items added and not yet done, in output order

    # ---- events ---------------------------------------------------------------------------------

    def _emit(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": len(self.events), **fields})
        self._changed.set()

    def _lifecycle(self, kind: str) -> None:
        self._emit(kind, response=copy.deepcopy(self.response))

    def start(self, background: bool = False) -> None:
        """`response.created` (and `response.queued`: a background response waits its turn)."""
        self.response["status"] = "queued" if background else "in_progress"
        self._lifecycle("response.created")
        self._lifecycle("response.queued" if background else "response.in_progress")

    def begin(self) -> None:
        """A queued response starts running."""
        if self.response["status"] == "queued":
            self.response["status"] = "in_progress"
            self._lifecycle("response.in_progress")

    async def follow(self, after: int = -1) -> AsyncIterator[dict[str, Any]]:
        """The events after sequence number `after`, then each new one as it comes, until the
        response has ended (for a reader apart from the one that feeds it: a background stream)."""
        position = max(after + 1, 0)
        while True:
            while position < len(self.events):
                yield self.events[position]
                position += 1
            if self.done:
                return
            changed = self._changed
            await changed.wait()
            if changed is self._changed:
                self._changed = asyncio.Event()

    @property
    def done(self) -> bool:
        return self.response["status"] in FINAL_STATUSES

    # ---- output -----------------------------------------------------------------------------------

    def _add_item(self, item: dict[str, Any]) -> int:
        output = self.response["output"]
        output.append(item)
        self._open.append(item)
        self._emit("response.output_item.added", output_index=len(output) - 1, item=copy.deepcopy(item))
        return len(output) - 1

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, it in enumerate(self.response["output"]) if it is item)

    def _open_message(self) -> dict[str, Any]:
        if self._message is None:
            self._message = {"id": item_id("msg"), "type": "message", "status": "in_progress",
                             "role": "assistant", "content": []}
            index = self._add_item(self._message)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            self._message["content"].append(part)
            self._emit("response.content_part.added", item_id=self._message["id"], output_index=index,
                       content_index=0, part=copy.deepcopy(part))
        return self._message

    def _text(self, text: str, logprobs: list[dict[str, Any]]) -> None:
        message = self._open_message()
        part = message["content"][0]
        part["text"] += text
        part["logprobs"] += logprobs
        self._emit("response.output_text.delta", item_id=message["id"], output_index=self._index(message),
                   content_index=0, delta=text, logprobs=logprobs)

    def _reason(self, text: str) -> None:
        if self._thought is None:
            self._thought = {"id": item_id("rs"), "type": "reasoning", "summary": [], "content": [],
                             "status": "in_progress"}
            index = self._add_item(self._thought)
            part = {"type": "reasoning_text", "text": ""}
            self._thought["content"].append(part)
            self._emit("response.content_part.added", item_id=self._thought["id"], output_index=index,
                       content_index=0, part=copy.deepcopy(part))
        self._thought["content"][0]["text"] += text
        self._emit("response.reasoning_text.delta", item_id=self._thought["id"],
                   output_index=self._index(self._thought), content_index=0, delta=text)

    def _call_delta(self, delta: dict[str, Any]) -> None:
        fn = delta.get("function") or {}
        item = self._calls.get(delta["index"])
        if item is None:
            self._close(self._message)  # a call follows the text: the message is complete
            item = {"id": item_id("fc"), "type": "function_call", "status": "in_progress",
                    "call_id": delta["id"], "name": fn.get("name", ""), "arguments": ""}
            self._calls[delta["index"]] = item
            self._add_item(item)
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            self._emit("response.function_call_arguments.delta", item_id=item["id"],
                       output_index=self._index(item), delta=fn["arguments"])

    def _close(self, item: dict[str, Any] | None, status: str = "completed") -> None:
        if item is None or item not in self._open:
            return
        self._open.remove(item)
        index = self._index(item)
        item["status"] = status
        if item["type"] in ("message", "reasoning"):
            part = item["content"][0]
            if item["type"] == "message":
                self._emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                           text=part["text"], logprobs=part["logprobs"])
            else:
                self._emit("response.reasoning_text.done", item_id=item["id"], output_index=index,
                           content_index=0, text=part["text"])
            self._emit("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                       part=copy.deepcopy(part))
        else:
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       name=item["name"], arguments=item["arguments"])
        self._emit("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def feed(self, c: CompletionOutput) -> None:
        """An output of the request (new text, or the final one)."""
        self.begin()
        text = c.text
        if self._reasoning is not None:
            thought, text = self._reasoning.feed(c.text, c.finish_reason is not None)
            if thought:
                self._reason(thought)
            if thought and not text:
                self.reasoning_tokens += self._held_tokens + len(c.token_ids)
            self._held_tokens = 0 if thought or text else self._held_tokens + len(c.token_ids)
            if text:
                self._close(self._thought)  # the answer follows the reasoning
            elif c.token_ids and c.finish_reason is None:
                return  # reasoning, or text held back until its role is known
        if self._tools is None:
            logprobs = self._logprobs_of(c) if self._logprobs_of is not None and c.token_ids else []
            if text or logprobs:  # tokens that add no text yet (half a character) keep their logprobs
                self._text(text, logprobs)
            return
        delta, _ = self._tools.feed(text, c.finish_reason)
        if delta.get("content"):
            self._text(delta["content"], [])
        for call in delta.get("tool_calls", ()):
            self._call_delta(call)

    def finish(self, finish_reason: str | None, usage: dict[str, Any]) -> None:
        """The request ended (`stop`, `length`, ...): items close, the response completes (or is
        incomplete when max_output_tokens cut it)."""
        cut = finish_reason == "length"
        if not self.response["output"]:
            self._open_message()  # an empty reply is an empty message, as it is unstreamed
        for item in list(self._open):
            self._close(item, "incomplete" if cut else "completed")
        self.response["usage"] = usage
        self.response["completed_at"] = int(time.time())
        if cut:
            self.response["status"] = "incomplete"
            self.response["incomplete_details"] = {"reason": "max_output_tokens"}
            self._lifecycle("response.incomplete")
        else:
            self.response["status"] = "completed"
            self._lifecycle("response.completed")

    def fail(self, message: str, code: str = "server_error") -> None:
        """The engine failed the request (or died): open items end incomplete, `response.failed`."""
        for item in list(self._open):
            self._close(item, "incomplete")
        self.response["status"] = "failed"
        self.response["error"] = {"code": code, "message": message}
        self._lifecycle("response.failed")

    def cancel(self) -> None:
        """A background response cancelled: it ends where it is, with no further event."""
        if not self.done:
            for item in self._open:
                item["status"] = "incomplete"
            self._open.clear()
            self.response["status"] = "cancelled"
            self._changed.set()
