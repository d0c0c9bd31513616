"""Request bodies in, error bodies out: what every route of the HTTP server shares. A body is read
with a size limit, decoded (msgspec, then json for what msgspec refuses), checked for lone
surrogates, and validated by a pydantic model; every failure is an OpenAI-shaped error naming the
field."""
from __future__ import annotations

import json
import logging
from typing import Any

import msgspec
import pydantic
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.requests import ClientDisconnect
from starlette.responses import Response

from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.openai.protocol import OpenAIServingError, bad_request
from tokenloom.entrypoints.openai.serving_engine import json_response

logger = logging.getLogger("tokenloom.serve")


def body_too_large(limit: int) -> OpenAIServingError:
    return OpenAIServingError(
        f"The request body is larger than {limit} bytes (--max-request-body-bytes).",
        413,
        "invalid_request_error",
        None,
        "request_too_large",
    )


def client_gone() -> OpenAIServingError:
    """The client left before its body was whole: nobody reads the answer, and it is no error
    of the server's (nginx's 499)."""
    return OpenAIServingError("The client closed the connection before sending the whole request body.", 499,
                              "invalid_request_error", None, "client_closed_request")


def error_response(e: OpenAIServingError) -> Response:
    return json_response(e.to_dict(), status_code=e.status_code)


def validation_error(e: pydantic.ValidationError | RequestValidationError) -> OpenAIServingError:
    """The first pydantic error as a 400 naming the field (`param` is its dotted path)."""
    errors = e.errors()
    if not errors:
        return bad_request("invalid request body.")
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) if loc else None
    # For a union type pydantic reports one error per member; the field and first reason suffice.
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else first.get("msg", "invalid request body")
    if "input" in first and param:
        message += f" (got {json.dumps(first['input'], default=str)[:200]})"
    extra = f" ({len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return bad_request(message + extra, param=loc[0] if loc else None)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or a 413 as soon as it is known to exceed `limit`: from Content-Length before
    reading anything, else while the chunks arrive (nothing past the limit is buffered)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise body_too_large(limit)
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise body_too_large(limit)
            chunks.append(chunk)
    except ClientDisconnect:
        # A client's own choice (or its network's), common and harmless: one debug line.
        logger.debug("%s %s: the client left after %d of its body's bytes", request.method, request.url.path, size)
        raise client_gone() from None
    return b"".join(chunks)


# Bodies at least this big are parsed on the tokenizer pool. The parsers hold the GIL while they
# run, but between their steps (JSON decode, surrogate scan, validation) the loop gets it back, so
# a 20 MB body never holds it for all of them at once; small ones are not worth the thread hop.
_PARSE_OFF_LOOP_BYTES = 1 << 20


async def parse_body(
    request: Request, model: type[pydantic.BaseModel], max_body_bytes: int, engine: AsyncLLM
) -> Any:
    return await parse_raw(await read_body(request, max_body_bytes), model, engine)


async def parse_raw(raw: bytes, model: type[pydantic.BaseModel], engine: AsyncLLM) -> Any:
    """A body already read, as `model` (a big one parsed off the event loop)."""
    if len(raw) >= _PARSE_OFF_LOOP_BYTES:
        return await engine.run_off_loop(decode_body, raw, model)
    return decode_body(raw, model)


def decode_body(raw: bytes, model: type[pydantic.BaseModel]) -> Any:
    try:
        # msgspec first: twice as fast on big bodies. What it refuses (the NaN and Infinity literals
        # Python's json reads, lone surrogate escapes, invalid input) goes to json for the
        # same result, or the same error message, as before.
        data = msgspec.json.decode(raw)
    except (msgspec.DecodeError, RecursionError):
        data = None
    try:
        if data is None:
            data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"The request body is not valid JSON: {e}") from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    bad = lone_surrogate_path(data)
    if bad is not None:
        bad = bad.encode("utf-8", "backslashreplace").decode()  # the path itself may hold one
        raise bad_request(
            f"{bad}: the string holds a lone UTF-16 surrogate (an escape in \\ud800-\\udfff), which is not "
            "valid Unicode text.",
            param=bad.split(".")[0],
        )
    try:
        parsed = model.model_validate(data)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None
    # Unknown fields are ignored, as vLLM does (with the same warning), so that newer clients work.
    unknown = data.keys() - model.model_fields.keys()
    if unknown:
        logger.warning("The following fields were present in the request but ignored: %s", sorted(unknown)[:20])
    return parsed


def lone_surrogate_path(data: dict[str, Any]) -> str | None:
    """The dotted path of a string (key or value) holding a lone UTF-16 surrogate, or None. JSON can
    escape one (`"\\ud800"`) and Python decodes it, but it is not Unicode text: tokenizers and UTF-8
    encoders fail on it far downstream. Iterative: the body may nest as deep as the JSON parser allows."""
    stack: list[tuple[str, Any]] = [(str(k), v) for k, v in data.items()] + [(str(k), k) for k in data]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not value.isascii():
                try:
                    value.encode("utf-8")
                except UnicodeEncodeError:
                    return path
        elif isinstance(value, dict):
            for k, v in value.items():
                stack.append((f"{path}.{k}", v))
                stack.append((f"{path}.{k}", k))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))
    return None


def body_schema(model: type[pydantic.BaseModel]) -> dict[str, Any]:
    """`openapi_extra` documenting a route's JSON body. The routes parse their bodies themselves
    (`_parse_body`, for OpenAI-shaped errors), so FastAPI cannot see the model; pydantic's schema
    refers to its sub-models under `$defs`, which an OpenAPI document does not have: inline them."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.removeprefix("#/$defs/")])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
