"""The request fields that ask for structured outputs, as one `StructuredOutputsParams`.

OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` object and
its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`. A request may use
one of them; the spec must compile (checked here, so the 400 names the request's own field and
quotes the compiler).
"""
from __future__ import annotations

from typing import Any

from tokenloom.entrypoints.openai.protocol import _SamplingFields, bad_request
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


def structured_outputs_of(req: _SamplingFields, extra: tuple[StructuredOutputsParams, str] | None = None
                          ) -> StructuredOutputsParams | None:
    """The request's one structured-output spec (None: free text). `extra` is one the endpoint
    adds itself (a tool choice's schema), named by the field that asked for it."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    if req.response_format is not None:
        so, param = _from_response_format(req.response_format)
        if so is not None:
            found.append((so, param))
    if req.structured_outputs is not None:
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
    if extra is not None:
        found.append(extra)
    if len(found) > 1:
        names = ", ".join(param for _, param in found)
        raise bad_request(f"Only one kind of structured output may be requested, got {len(found)}: {names}.",
                          param=found[1][1])
    if not found:
        return None
    so, param = found[0]
    try:
        validate(so)
    except ValueError as e:
        raise bad_request(str(e).replace(f"structured_outputs.{so.kind}", param, 1), param=param) from None
    return so
