"""Tool-aware chat templates shipped with the package, as vLLM ships its
`examples/tool_chat_template_*.jinja`: for models whose own template drops a request's `tools`
(the embedded SmolLM2's does), so `tool_choice="auto"` has tools to call.

`--chat-template NAME` (and `LLM.chat(chat_template=NAME)`) picks one by its name, the name of
the `--tool-call-parser` that reads its calls back: `hermes` (ChatML, `<tool_call>{...}</tool_call>`)
and `llama3_json` (Llama 3.x headers, a JSON call object). The file name
(`tool_chat_template_hermes.jinja`, with or without `.jinja`) names it too.
"""
from __future__ import annotations

import os
from importlib import resources

_PREFIX, _SUFFIX = "tool_chat_template_", ".jinja"
# name -> the --tool-call-parser that reads the template's calls (docs and errors say it).
SHIPPED_TEMPLATES: dict[str, str] = {"hermes": "hermes", "llama3_json": "llama3_json"}


def shipped_template(name: str) -> str | None:
    """The text of the shipped template `name` (also its file name, with or without `.jinja`);
    None when no shipped template has that name."""
    key = name.removesuffix(_SUFFIX).removeprefix(_PREFIX)
    if key not in SHIPPED_TEMPLATES:
        return None
    return resources.files(__name__).joinpath(f"{_PREFIX}{key}{_SUFFIX}").read_text(encoding="utf-8")


def resolve_chat_template(value: str | None, field: str = "--chat-template",
                          named: tuple[str, ...] = ()) -> str | None:
    """A chat-template option as given: a file's content when it names a file (vLLM's rule), a
    shipped template's text when it is one's name, the value itself when it is a Jinja template
    or one of `named` (a tokenizer's own named templates, which it picks by name). Anything else
    is a ValueError naming `field` and the shipped names."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    text = shipped_template(value)
    if text is not None:
        return text
    if "{" in value or value in named:
        return value
    names = ", ".join(SHIPPED_TEMPLATES)
    raise ValueError(f"{field} {value!r} is neither a file, a shipped chat template ({names}), nor a Jinja template.")
