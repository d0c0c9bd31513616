"""The one place that knows xgrammar's API: a `StructuredOutputsParams` to a grammar.

Two uses: `validate` parses a spec into a grammar without a tokenizer (cheap, ~1 ms; the caller's
input processor runs it so a bad schema, regex or grammar is refused with the compiler's message
before anything is queued), and `compile_spec` compiles it against the model's vocabulary (the
engine core's compile threads).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from tokenloom.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr


def load_xgrammar() -> Any:
    """The xgrammar module, imported on first use (below)."""
    # Imported on first use: xgrammar pulls in transformers and TVM's FFI (~1.3-1.5 s of CPU),
    # which neither the caller's process (a server's front end, an `LLM`) nor the engine core
    # needs until a request asks for a structured output (as vLLM loads its grammar backend).
    import xgrammar

    return xgrammar

# With free whitespace allowed, a small model can pad JSON with spaces and newlines until
# max_tokens; a run of whitespace between two JSON tokens is capped at this many characters
# (room for a newline and a deep indent, not for an endless run).
MAX_WHITESPACE = 12


def _schema_text(params: StructuredOutputsParams) -> str:
    schema = params.json
    # Key order is kept: it is the order the grammar writes the properties in.
    if isinstance(schema, dict):
        return json.dumps(schema)
    assert isinstance(schema, str)
    try:
        parsed = json.loads(schema)
    except json.JSONDecodeError as e:
        raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise ValueError(
            f"structured_outputs.json must be a JSON schema object, got {type(parsed).__name__}."
        )
    return json.dumps(parsed)


def _choice_ebnf(choices: list[str]) -> str:
    # EBNF string literals take JSON's escapes; the alternatives are exact strings.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def spec_key(params: StructuredOutputsParams) -> tuple[str, str, bool]:
    """What identifies a compiled grammar: equal keys compile to the same grammar (a schema dict
    and its JSON text share one)."""
    kind = params.kind
    if kind == "json":
        text = _schema_text(params)
    elif kind == "json_object":
        text = ""
    elif kind == "choice":
        text = json.dumps(params.choice)
    else:
        text = getattr(params, kind)
    return kind, text, params.disable_any_whitespace


def _whitespace(params: StructuredOutputsParams) -> dict[str, Any]:
    if params.disable_any_whitespace:
        return {"any_whitespace": False}
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE}


_VALID: dict[tuple[str, str, bool], None] = {}  # specs seen to parse (bounded, oldest out)
_MAX_VALID = 1024


def validate(params: StructuredOutputsParams) -> None:
    """Raises ValueError naming the field and quoting the compiler when the spec cannot be
    compiled (malformed, or using a feature the backend does not support)."""
    key = spec_key(params)
    if key in _VALID:
        return
    kind, text, _ = key
    xgr = load_xgrammar()
    try:
        if kind == "json":
            xgr.Grammar.from_json_schema(text, **_whitespace(params))
        elif kind == "regex":
            xgr.Grammar.from_regex(text)
        elif kind in ("grammar", "choice"):
            xgr.Grammar.from_ebnf(text if kind == "grammar" else _choice_ebnf(params.choice or []))
    except (RuntimeError, ValueError, TypeError) as e:
        what = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar",
                "choice": "choice list"}[kind]
        raise ValueError(f"structured_outputs.{kind} is not a valid {what}: {_compiler_message(e)}") from None
    if len(_VALID) >= _MAX_VALID:
        del _VALID[next(iter(_VALID))]
    _VALID[key] = None


def _compiler_message(e: BaseException) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: "; the reader needs the rest.
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    head, sep, rest = message.partition(": ")
    return rest if sep and ".cc:" in head else message


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar sees it. `vocab_size` is the model's logits width, which may
    exceed the tokenizer's (padded embeddings): the ids past the tokenizer are never allowed."""
    return load_xgrammar().TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


def compile_spec(compiler: xgr.GrammarCompiler, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
    kind, text, _ = spec_key(params)
    if kind == "json":
        return compiler.compile_json_schema(text, **_whitespace(params))
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', **_whitespace(params))
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(_choice_ebnf(params.choice or []))
    return compiler.compile_grammar(text)
