"""Reasoning in replies (`--reasoning-parser`, as vLLM's): a thinking model writes its reasoning
between `<think>` and `</think>`, then its answer; the server returns the reasoning as the
message's `reasoning_content` (and `reasoning`, vLLM's newer name) and only the answer as
`content`, which is also the only text read for tool calls.

Where the reasoning starts is the part models differ on: Qwen3 writes `<think>` itself (or its
template writes an empty `<think>\n\n</think>` into the prompt when thinking is off), while
DeepSeek-R1's template and Qwen3's thinking-only models end the prompt with `<think>`, so the
reply starts inside it. Both parsers here decide from the rendered prompt: a prompt that ends
with an open `<think>` starts the reply in reasoning; otherwise a reply that begins with
`<think>` (after white space) reasons until `</think>`, and any other reply is all content.
A reply cut off before `</think>` is all reasoning. The same rule serves streamed and whole
replies, so a stream's deltas always add up to the whole reply's fields.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


def partial_tail(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (held back: the next delta may
    complete it)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass(slots=True)
class Split:
    reasoning: str
    content: str


def split_reasoning(text: str, opened: bool, final: bool = True) -> Split:
    """The reasoning and content of a reply so far. `opened`: the prompt ended inside `<think>`.
    With `final` False, a tail that may be the beginning of a tag (or of the reply's leading
    `<think>`) is held back rather than given a role."""
    if not opened:
        stripped = text.lstrip()
        if stripped.startswith(START):
            text = stripped[len(START):]
        elif not final and START.startswith(stripped):  # "", "<", "<th", ...: may still open
            return Split("", "")
        else:
            return Split("", text)
    end = text.find(END)
    if end >= 0:
        return Split(text[:end], text[end + len(END):])
    held = 0 if final else partial_tail(text, END)
    return Split(text[:len(text) - held], "")


def opens_reasoning(prompt: str) -> bool:
    """Whether a rendered prompt leaves the reply inside `<think>` (DeepSeek-R1's template,
    Qwen3's thinking-only models): its last tag is an open one."""
    return prompt.rfind(START) > prompt.rfind(END)


class ReasoningStream:
    """One streamed choice: each delta of the reply's text becomes (reasoning delta, content
    delta), holding back text whose role a later delta decides."""

    def __init__(self, opened: bool) -> None:
        self.opened = opened
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        self.text += new_text
        split = split_reasoning(self.text, self.opened, final=finished)
        reasoning, content = split.reasoning[self.sent_reasoning:], split.content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(split.reasoning), len(split.content)
        return reasoning, content


# gpt-oss's harmony channels are harmony.py's (vLLM's name openai_gptoss, and gpt_oss).
REASONING_PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss", "gpt_oss")
HARMONY_PARSERS = ("openai_gptoss", "gpt_oss")
