"""One chat-template render as data (`ChatRender`) and the one function that renders it.

The input processor builds the job (it knows the tokenizer: its template, its special tokens); the
job is then rendered where the caller trusts it to run: in the caller's own thread offline
(`LLM.chat`), or in a render worker process with memory and time limits on the server
(entrypoints/openai/chat_render.py), since a template is a program and a request's template is a
stranger's program. Both call `render`, so the server's prompt is the offline one byte for byte.

This module imports only msgspec at load time: the render worker imports it before it sets its
memory limit, and transformers' Jinja helpers only when it renders.
"""
from __future__ import annotations

from typing import Any

import msgspec


class ChatRender(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """Everything a render needs, and nothing that needs the tokenizer: what
    `tokenizer.apply_chat_template(conversation, tokenize=False, ...)` renders, spelled out."""

    template: str
    conversation: list[dict[str, Any]]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[dict[str, Any]] | None = None
    # The tokenizer's special tokens (bos_token, eos_token, ...) under the caller's own
    # chat_template_kwargs, as transformers passes them to the template.
    variables: dict[str, Any] = {}


def render(job: ChatRender) -> str:
    """The prompt text of one job, as transformers' `apply_chat_template(tokenize=False)` renders
    it (its sandboxed Jinja environment, its message normalisation)."""
    from transformers.utils.chat_template_utils import _normalize_chat_messages, render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[_normalize_chat_messages(job.conversation)],
        tools=job.tools,
        chat_template=job.template,
        continue_final_message=job.continue_final_message,
        add_generation_prompt=job.add_generation_prompt,
        **job.variables,
    )
    return rendered[0]


def _tool_name(tool: dict[str, Any]) -> str | None:
    """A tool's name in chat's shape ({"function": {"name"}}) or the Responses API's flat one."""
    fn = tool.get("function")
    name = fn.get("name") if isinstance(fn, dict) else tool.get("name")
    return name if isinstance(name, str) and name else None


def tools_dropped(job: ChatRender, prompt: str) -> bool:
    """Whether `job` carries tools and its rendered `prompt` shows none of them: no tool's name is
    in it more often than the messages themselves hold it (a user who names a tool is not the
    template listing it). The template then drops `tools`, and the model cannot call them."""
    names = [n for n in map(_tool_name, job.tools or ()) if n is not None]
    if not names:
        return False
    said = " ".join([str(m.get("content") or "") for m in job.conversation]
                    + [str(c) for m in job.conversation for c in m.get("tool_calls") or ()])
    return not any(prompt.count(name) > said.count(name) for name in names)
