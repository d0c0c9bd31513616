"""The request fields that ask for structured outputs, as one `StructuredOutputsParams`.

OpenAI's `response_format` (`json_object`, `json_schema`; the Responses API's `text.format`), vLLM's `structured_outputs` object and
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. A request may use
one of them; the spec must be within the engine's size limits, compile and match some text
(checked here, so the 400 names the request's own field and the limit, or quotes the compiler).
"""
from __future__ import annotations

from typing import Any

from tokenloom.config import StructuredOutputLimits
from tokenloom.entrypoints.openai.protocol import OpenAIServingError, _SamplingFields, bad_request
from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.structured_output import validate

_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(rf: dict[str, Any]) -> tuple[StructuredOutputsParams | None, str]:
    kind = rf.get("type")
    if kind == "text":
        return None, "response_format"
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True), "response_format"
    if kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request("response_format.json_schema must be an object with a 'schema'.",
                              param="response_format.json_schema")
        strict = spec.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise bad_request("response_format.json_schema.strict must be a bool.",
                              param="response_format.json_schema.strict")
        schema = spec.get("schema")
        if schema is None:  # OpenAI allows a schema-less json_schema: any JSON object
            return StructuredOutputsParams(json_object=True), "response_format"
        if not isinstance(schema, dict):
            raise bad_request("response_format.json_schema.schema must be a JSON schema object.",
                              param="response_format.json_schema.schema")
        # Enforced by the grammar whatever `strict` says: the output always follows the schema.
        try:
            return StructuredOutputsParams(json=schema), "response_format.json_schema.schema"
        except ValueError as e:
            param = "response_format.json_schema.schema"
            raise bad_request(str(e).replace("structured_outputs.json", param), param=param) from None
    raise bad_request(f"response_format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                      param="response_format.type")


def text_format_of(text: Any) -> tuple[StructuredOutputsParams, str] | None:
    """The Responses API's `text.format` ({"type": "text" | "json_object" | "json_schema", ...}:
    the json_schema's name, schema and strict sit in the format itself, not under `json_schema`
    as in response_format), or None for free text."""
    if text is None:
        return None
    fmt = text.get("format") if isinstance(text, dict) else None
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise bad_request("text.format must be an object with a 'type'.", param="text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        for name, kinds, what in (("schema", dict, "a JSON schema object"), ("strict", bool, "a bool"),
                                  ("name", str, "a string")):
            if fmt.get(name) is not None and not isinstance(fmt[name], kinds):
                raise bad_request(f"text.format.{name} must be {what}.", param=f"text.format.{name}")
        if fmt.get("schema") is None:
            raise bad_request("text.format.schema is required for type 'json_schema'.", param="text.format.schema")
        fmt = {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    elif kind not in ("text", "json_object"):
        raise bad_request(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}.",
                          param="text.format.type")
    try:
        so, _ = _from_response_format(fmt)
    except OpenAIServingError as e:  # said of response_format's fields: name text.format's
        raise bad_request(e.message.replace("response_format.json_schema.", "text.format."),
                          param="text.format.schema") from None
    return None if so is None else (so, "text.format.schema" if kind == "json_schema" else "text.format")


def structured_outputs_of(req: _SamplingFields, *extras: tuple[StructuredOutputsParams, str] | None,
                          limits: StructuredOutputLimits | None = None) -> StructuredOutputsParams | None:
    """The request's one structured-output spec (None: free text). `extras` are those the
    endpoint adds itself (a tool choice's schema, the Responses API's `text.format`), each named
    by the field that asked for it; None entries are skipped. A spec larger than `limits` is a 400
    naming the field, the limit and its flag."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if req.response_format is not None:
        so, param = _from_response_format(req.response_format)
        if so is not None:
            found.append((so, param))
    if req.structured_outputs is not None:
        private = sorted(k for k in req.structured_outputs if str(k).startswith("_"))
        if private:  # the server's own (e.g. _reasoning, set under --reasoning-parser)
            raise bad_request(f"structured_outputs has an unknown field: {private[0]!r}.", param="structured_outputs")
        try:
            found.append((StructuredOutputsParams(**req.structured_outputs), "structured_outputs"))
        except TypeError as e:  # an unknown key
            raise bad_request(f"structured_outputs has an unknown field: {e}", param="structured_outputs") from None
        except ValueError as e:
            raise bad_request(str(e), param="structured_outputs") from None
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            try:
                found.append((StructuredOutputsParams(**{kind: value}), name))
            except ValueError as e:
                raise bad_request(str(e).replace(f"structured_outputs.{kind}", name), param=name) from None
    found += [extra for extra in extras if extra is not None]
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise bad_request(f"Only one kind of structured output may be requested, got {len(found)}: {names}.",
                          param=found[1][1])
    if not found:
        return None
    so, param = found[0]
    try:
        validate(so, limits)
    except ValueError as e:
        raise bad_request(str(e).replace(f"structured_outputs.{so.kind}", param, 1), param=param) from None
    return so
