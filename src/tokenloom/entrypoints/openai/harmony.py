"""gpt-oss's harmony format in replies (`--reasoning-parser gpt_oss`, `--tool-call-parser openai`,
vLLM's names): a reply is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>the reasoning<|end|>
    <|start|>assistant<|channel|>final<|message|>the answer<|return|>

(the prompt's `<|start|>assistant` opens the first), and a tool call is a message to a function:
`<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Oslo"}<|call|>`
(the recipient may also stand before the channel). The `analysis` channel is the reasoning
(`reasoning_content`), a message to `functions.NAME` a call (`tool_calls`), any other the content.

The markers are special tokens, which the server keeps in the reply's text for these parsers
(skip_special_tokens=False). Parsing the text, not the token ids, keeps one path for streamed and
whole replies, as the other parsers; the token-level StreamableParser of `openai_harmony` needs its
tokenizer's vocabulary file, which it downloads on first use.

The split gives the reasoning, and the content with each call kept as one canonical harmony
message (`<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>`),
which the `openai` tool parser (tool_parsers.HarmonyToolParser) reads back into calls. A message whose header is not complete yet
is held back (its role is not known), and so is a tail that may be the beginning of a marker.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from tokenloom.entrypoints.openai.reasoning_parsers import Split, partial_tail

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, RETURN, CALL = "<|end|>", "<|return|>", "<|call|>"
_ENDS = (END, RETURN, CALL)
MARKERS = (START, CHANNEL, MESSAGE, CONSTRAIN, *_ENDS)
_RECIPIENT = re.compile(r"\bto=(\S+?)(?=\s|<\||$)")


@dataclass(slots=True)
class HarmonyMessage:
    channel: str
    recipient: str | None  # "functions.NAME" for a tool call
    content: str
    complete: bool  # its end marker was seen

    @property
    def function(self) -> str | None:
        r = self.recipient
        return r.removeprefix("functions.") if r is not None and r.startswith("functions.") else None

    def canonical(self) -> str:
        """The message as one call of the content a tool parser reads (see the module docstring)."""
        return (f"{START}assistant to={self.recipient}{CHANNEL}{self.channel} json{MESSAGE}{self.content}"
                + (CALL if self.complete else ""))


def _header(text: str) -> tuple[str, str | None]:
    """(channel, recipient) of a header: `[assistant][ to=R]<|channel|>C[ to=R][ json|<|constrain|>json]`."""
    channel = ""
    at = text.find(CHANNEL)
    if at >= 0:
        channel = re.split(r"\s|<\|", text[at + len(CHANNEL):].lstrip(), maxsplit=1)[0]
    m = _RECIPIENT.search(text)
    return channel, (m.group(1) if m else None)


def parse_messages(text: str, final: bool = True) -> list[HarmonyMessage]:
    """The messages of a reply so far. With `final` False, a message whose header is incomplete
    is left out and a body's tail that may begin an end marker is held back."""
    messages = []
    pos = 0
    while pos < len(text):
        if text.startswith(START, pos):
            pos += len(START)
        body = text.find(MESSAGE, pos)
        if body < 0:
            # A reply without any marker (the model ignored the format) is content; a header
            # cut short (max_tokens) says nothing.
            if final and pos == 0 and not any(m in text for m in MARKERS):
                messages.append(HarmonyMessage("final", None, text, False))
            break
        channel, recipient = _header(text[pos:body])
        body += len(MESSAGE)
        ends = [(i, m) for m in _ENDS if (i := text.find(m, body)) >= 0]
        if ends:
            end, marker = min(ends)
            messages.append(HarmonyMessage(channel, recipient, text[body:end], True))
            pos = end + len(marker)
            continue
        tail = len(text)
        if not final:
            tail -= max(partial_tail(text[body:], m) for m in (*_ENDS, START))
        messages.append(HarmonyMessage(channel, recipient, text[body:tail], False))
        break
    return messages


def split_harmony(text: str, final: bool = True) -> Split:
    """(reasoning: the analysis channel's text; content: every other message's, calls in their
    canonical form)."""
    reasoning, content = [], []
    for m in parse_messages(text, final):
        if m.function is not None:
            content.append(m.canonical())
        elif m.channel == "analysis":
            reasoning.append(m.content)
        else:
            content.append(m.content)
    return Split("".join(reasoning), "".join(content))


class HarmonyStream:
    """One streamed choice (ReasoningStream's interface): each delta of the reply's text becomes
    (reasoning delta, content delta)."""

    def __init__(self, opened: bool = False) -> None:
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        self.text += new_text
        split = split_harmony(self.text, final=finished)
        reasoning, content = split.reasoning[self.sent_reasoning:], split.content[self.sent_content:]
        self.sent_reasoning, self.sent_content = len(split.reasoning), len(split.content)
        return reasoning, content
