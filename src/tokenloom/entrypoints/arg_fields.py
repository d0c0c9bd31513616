"""Arguments declared once, as dataclass fields, and what is generated from them.

`arg(help, ...)` declares one field of an arguments dataclass (EngineArgs) with its help text and
how the command line spells it; `add_dataclass_args` builds the argparse options from those
fields and `reference_markdown` the configuration reference (docs/configuration.md). Nothing here
knows any particular argument: the names live in the dataclass alone.

vLLM's command-line spellings are the rules here too: sizes such as `8k` (`human_int`), JSON
objects for dict-valued options (`json_dict`), `--x` / `--no-x` for a switch that is on by default.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

# A field whose default is this takes the default of the config field of its name (see
# EngineArgs): defaults are written once, where the engine core reads them.
FROM_CONFIG: Any = object()

_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)$")


def human_int(text: str) -> int:
    """An integer, or one with vLLM's size suffixes: k/m/g are powers of 1000, K/M/G of 1024
    ("8k" = 8000, "8K" = 8192, "1.5k" = 1500)."""
    match = _HUMAN_INT.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 8k or 8K, got {text!r}")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def json_dict(text: str) -> dict:
    """A JSON object given on the command line (vLLM's --override-generation-config)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"temperature\": 0.5}}': {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def arg(help: str, *, default: Any = FROM_CONFIG, flags: tuple[str, ...] | None = None,
        negative: tuple[str, ...] | None = None, negative_help: str | None = None,
        parse: Callable[[str], Any] | None = None,
        choices: Iterable[Any] | None = None, metavar: str | None = None, group: str | None = "engine",
        cli: bool = True, positional: bool = False) -> Any:
    """One argument: a dataclass field carrying its help text and its command-line spelling.

    `flags`: the option strings that set it (default `--field-name`; `()` for none); for a bool,
    `negative` are those that clear it (default `--no-field-name` when it defaults to True), with
    `negative_help` as their help when they need their own.
    `parse`: the type argparse converts the text with (default: from the field's annotation).
    `group`: the --help section (None: the parser itself). `cli=False`: not a command-line
    option (a keyword of `LLM(...)` only, or a flag a command adds itself)."""
    metadata = dict(help=help, flags=flags, negative=negative, negative_help=negative_help, parse=parse,
                    choices=None if choices is None else tuple(choices), metavar=metavar, group=group, cli=cli)
    return dataclasses.field(default=default, kw_only=not positional, metadata=metadata)


def is_switch(field: dataclasses.Field) -> bool:
    return str(field.type).replace(" ", "") in ("bool", "bool|None")


def option_strings(field: dataclasses.Field) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the flags that set the field, the flags that clear it: a switch's negative spellings)."""
    meta = field.metadata
    positive = meta["flags"] if meta["flags"] is not None else ("--" + field.name.replace("_", "-"),)
    negative: tuple[str, ...] = ()
    if is_switch(field):
        negative = meta["negative"] if meta["negative"] is not None else (
            ("--no-" + field.name.replace("_", "-"),) if field.default is True else ())
    return positive, negative


def _parse_type(field: dataclasses.Field) -> Callable[[str], Any]:
    if field.metadata["parse"] is not None:
        return field.metadata["parse"]
    base = str(field.type).split("|")[0].strip()
    if base.startswith("dict"):
        return json_dict
    return {"int": int, "float": float}.get(base, str)


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type,
                       include: Callable[[dataclasses.Field], bool] = lambda f: True) -> None:
    """Adds the command-line options of `cls`'s fields (those with `cli=True` that `include`
    takes), each in its --help group, in field order."""
    groups: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata or not field.metadata["cli"] or not include(field):
            continue
        name = field.metadata["group"]
        target = parser if name is None else groups.get(name) or groups.setdefault(name, parser.add_argument_group(name))
        _add_field(target, field)


def _add_field(target: Any, field: dataclasses.Field) -> None:
    meta = field.metadata
    positive, negative = option_strings(field)
    if is_switch(field):
        default = field.default
        if positive:
            target.add_argument(*positive, dest=field.name, action="store_true", default=default, help=meta["help"])
        if negative:
            # The positive flag's help already says what it does; an option only clearing it says
            # so only when it is the field's sole spelling.
            target.add_argument(*negative, dest=field.name, action="store_false", default=default,
                                help=meta["negative_help"] or (None if positive else meta["help"]))
        return
    kwargs: dict[str, Any] = dict(dest=field.name, type=_parse_type(field), default=field.default, help=meta["help"])
    if kwargs["type"] is str:  # argparse's own default: the text as given
        del kwargs["type"]
    if meta["choices"] is not None:
        kwargs["choices"] = list(meta["choices"])
    if meta["metavar"] is not None:
        kwargs["metavar"] = meta["metavar"]
    target.add_argument(*positive, **kwargs)


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def reference_markdown(cls: type, title: str, intro: str) -> str:
    """The configuration reference of `cls`'s fields: one table per --help group, one row per
    field (its `LLM(...)` keyword, its flags, type, default and help)."""
    sections: dict[str, list[str]] = {}
    for field in dataclasses.fields(cls):
        if "help" not in field.metadata:
            continue
        meta = field.metadata
        positive, negative = option_strings(field) if meta["cli"] else ((), ())
        flags = ", ".join(f"`{f}`" for f in positive + negative) or "(keyword only)"
        help_text = meta["help"]
        if meta["choices"] is not None:
            help_text += " (one of: " + ", ".join(str(c) for c in meta["choices"]) + ")"
        row = f"| `{field.name}` | {flags} | `{_cell(field.type)}` | `{field.default!r}` | {_cell(help_text)} |"
        sections.setdefault(meta["group"] or "other", []).append(row)
    lines = [f"# {title}", "", intro, ""]
    for group, rows in sections.items():
        lines += [f"## {group[0].upper() + group[1:]}", "", "| Keyword | Flags | Type | Default | Meaning |",
                  "| --- | --- | --- | --- | --- |", *rows, ""]
    return "\n".join(lines)
