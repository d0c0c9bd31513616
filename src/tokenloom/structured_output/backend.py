"""The one place that knows xgrammar's API: a `StructuredOutputsParams` to a grammar.

Two uses: `validate` checks a spec's size against the engine's limits, parses it into a grammar
and compiles that against a stand-in vocabulary of the 256 bytes (cheap: the caller's input
processor runs it so a bad, oversized or unsatisfiable schema, regex or grammar is refused with a
message naming the field before anything is queued), and `compile_spec` compiles it against the
model's vocabulary (the engine core's compile threads).
"""
from __future__ import annotations

import json
import sys
import threading
from typing import TYPE_CHECKING, Any

from tokenloom.config import StructuredOutputLimits
from tokenloom.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar as xgr


def load_xgrammar() -> Any:
    """The xgrammar module, imported on first use (below)."""
    # Imported on first use: xgrammar pulls in transformers and TVM's FFI (seconds of CPU),
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


_WHAT = {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar", "choice": "choice list"}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _too_large(field: str, what: str, size: int, name: str, limit: int) -> ValueError:
    return ValueError(f"{field} is too large: {what} {size}, more than the limit of {limit} "
                      f"({name}, {_flag(name)}).")


def _depth(value: Any) -> int:
    """How deeply a JSON value nests objects and arrays (iterative: a deep one is the point)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        stack.extend((child, depth + 1) for child in children)
    return deepest


def check_limits(params: StructuredOutputsParams, limits: StructuredOutputLimits | None) -> None:
    """Raises ValueError naming the field, the limit and its flag when the spec is larger than
    `limits` allow (None: no limits). Cheap, and done before anything parses the spec: a compile's
    time grows faster than linearly with a grammar's rules and a schema's nesting."""
    if limits is None:
        return
    kind = params.kind
    field = f"structured_outputs.{kind}"
    if kind in ("regex", "grammar"):
        text = getattr(params, kind)
        name = "structured_outputs_max_grammar_chars"
        if len(text) > limits.structured_outputs_max_grammar_chars:
            raise _too_large(field, "characters", len(text), name, limits.structured_outputs_max_grammar_chars)
    elif kind == "choice":
        choices = params.choice or []
        total = sum(len(c) for c in choices)
        if len(choices) > limits.structured_outputs_max_choices:
            raise _too_large(field, "choices", len(choices), "structured_outputs_max_choices",
                             limits.structured_outputs_max_choices)
        if total > limits.structured_outputs_max_choice_chars:
            raise _too_large(field, "characters in all choices", total, "structured_outputs_max_choice_chars",
                             limits.structured_outputs_max_choice_chars)
    elif kind == "json":
        schema = params.json
        text = schema if isinstance(schema, str) else None
        if text is None or len(text) <= limits.structured_outputs_max_schema_chars:
            try:
                text = _schema_text(params)  # a dict's size is its JSON text's
                depth = _depth(json.loads(text) if isinstance(schema, str) else schema)
            except RecursionError:  # nested past Python's parser: far past any depth limit
                depth = sys.getrecursionlimit()
        name = "structured_outputs_max_schema_chars"
        if len(text) > limits.structured_outputs_max_schema_chars:
            raise _too_large(field, "characters of JSON", len(text), name, limits.structured_outputs_max_schema_chars)
        name = "structured_outputs_max_schema_depth"
        if depth > limits.structured_outputs_max_schema_depth:
            raise _too_large(field, "nesting depth", depth, name, limits.structured_outputs_max_schema_depth)


def validate(params: StructuredOutputsParams, limits: StructuredOutputLimits | None = None) -> None:
    """Raises ValueError naming the field: the spec is larger than `limits` (check_limits), cannot
    be compiled (malformed, or using a feature the backend does not support: the compiler's
    message is quoted), or allows no output at all (a grammar or regex whose start cannot be
    matched; checked up to STAND_IN_MAX_CHARS)."""
    check_limits(params, limits)
    key = spec_key(params)
    if key in _VALID:
        return
    kind, text, _ = key
    xgr = load_xgrammar()
    grammar = None
    try:
        if kind == "json":
            grammar = xgr.Grammar.from_json_schema(text, **_whitespace(params))
        elif kind == "regex":
            grammar = xgr.Grammar.from_regex(text)
        elif kind in ("grammar", "choice"):
            grammar = xgr.Grammar.from_ebnf(text if kind == "grammar" else _choice_ebnf(params.choice or []))
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"structured_outputs.{kind} is not a valid {_WHAT[kind]}: {_compiler_message(e)}") from None
    if kind in ("grammar", "regex") and len(text) <= STAND_IN_MAX_CHARS and not _satisfiable(grammar):
        why = " (a rule that only refers to itself, or to rules that match nothing, is never complete)"
        raise ValueError(f"structured_outputs.{kind} matches no text: no output can start it"
                         f"{why if kind == 'grammar' else ''}.")
    if len(_VALID) >= _MAX_VALID:
        del _VALID[next(iter(_VALID))]
    _VALID[key] = None


# The 256 bytes (and an end token) stand in for a model's vocabulary: any text tokenizes into
# them, so the start state allows a byte exactly when the grammar's language has a text that
# starts with it, and compiling against 257 tokens is cheap next to a model's vocabulary.
_STAND_IN_EOS = 256
# The stand-in compile costs about what the real one does for a grammar with many rules (the time
# goes to the grammar, not the vocabulary), and it runs in the caller (a server's event loop):
# longer grammars (allowed by a raised limit) are checked while generating instead (a bitmask row
# that allows no token fails the request naming the field).
STAND_IN_MAX_CHARS = 8192
_stand_in: list[Any] = []  # [GrammarCompiler], built on first use
_stand_in_lock = threading.Lock()


def _stand_in_compiler() -> Any:
    with _stand_in_lock:
        if not _stand_in:
            xgr = load_xgrammar()
            info = xgr.TokenizerInfo([bytes([b]) for b in range(256)] + [b"</s>"], xgr.VocabType.RAW,
                                     stop_token_ids=[_STAND_IN_EOS])
            _stand_in.append(xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False))
        return _stand_in[0]


def _satisfiable(grammar: Any) -> bool:
    """Whether the grammar's start state allows a byte or is already complete (the empty text)."""
    xgr = load_xgrammar()
    matcher = xgr.GrammarMatcher(_stand_in_compiler().compile_grammar(grammar))
    if matcher.is_completed():
        return True
    bitmask = xgr.allocate_token_bitmask(1, _STAND_IN_EOS + 1)
    matcher.fill_next_token_bitmask(bitmask)
    return bool(bitmask.any())


def _compiler_message(e: BaseException) -> str:
    # xgrammar prefixes its messages with "[time] /path/file.cc:line: "; the reader needs the rest.
    message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    head, sep, rest = message.partition(": ")
    return rest if sep and ".cc:" in head else message


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> xgr.TokenizerInfo:
    """The vocabulary as xgrammar sees it. `vocab_size` is the model's logits width, which may
    exceed the tokenizer's (padded embeddings): the ids past the tokenizer are never allowed. A
    tokenizer that lists its own vocabulary for grammars (tokenizer_mode="mistral") gives it."""
    xgr = load_xgrammar()
    own = getattr(tokenizer, "grammar_vocab", None)
    if own is not None:
        vocab, byte_fallback = own()
        return xgr.TokenizerInfo(vocab, xgr.VocabType.BYTE_FALLBACK if byte_fallback else xgr.VocabType.RAW,
                                 vocab_size=vocab_size, stop_token_ids=stop_token_ids, add_prefix_space=byte_fallback)
    return xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)


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
