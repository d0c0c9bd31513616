"""POST /invocations: SageMaker's one route, dispatched on the body's fields."""
from __future__ import annotations

import msgspec
from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
    ScoreRequest,
    bad_request,
)
from tokenloom.entrypoints.openai.request_body import parse_raw, read_body
from tokenloom.entrypoints.openai.routes import server_state

router = APIRouter()


class _InvocationFields(msgspec.Struct):
    """The fields /invocations dispatches on, kept as raw JSON (other fields are skipped)."""

    messages: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    prompt: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    input: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    text_1: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    query: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


@router.post("/invocations", operation_id="invocations")
async def invocations(request: Request) -> Response:
    """SageMaker's one route (vLLM serves it too): the body's own fields say which API it is
    for: `messages` chat (embeddings or classification on a pooling server), `prompt`
    completions, `input` embeddings or classification, `text_1`/`text_2` score, `query` with
    `documents` rerank."""
    state = server_state(request)
    engine, chat, completions, embeddings = state.engine, state.chat, state.completions, state.embeddings
    raw = await read_body(request, state.max_request_body_bytes)
    try:  # which fields are there, their values left unparsed (the route's model parses them once)
        fields = msgspec.json.decode(raw, type=_InvocationFields)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        await parse_raw(raw, ChatCompletionRequest, engine)  # says what is wrong with it (JSON, an object)
        fields = _InvocationFields()
    keys = {f for f in _InvocationFields.__struct_fields__ if getattr(fields, f) is not msgspec.UNSET}
    pooling = engine.config.is_pooling
    classifier = engine.model_config.classifier_labels is not None and pooling
    if "messages" in keys and not pooling:
        return await chat.create_chat_completion(await parse_raw(raw, ChatCompletionRequest, engine), request)
    if "prompt" in keys and not pooling:
        return await completions.create_completion(await parse_raw(raw, CompletionRequest, engine), request)
    if ("input" in keys or "messages" in keys) and classifier:
        return await embeddings.create_classify(await parse_raw(raw, ClassificationRequest, engine), request)
    if "input" in keys or "messages" in keys:
        return await embeddings.create_embedding(await parse_raw(raw, EmbeddingRequest, engine), request)
    if "text_1" in keys:
        return await embeddings.create_score(await parse_raw(raw, ScoreRequest, engine), request)
    if "query" in keys:
        return await embeddings.create_rerank(await parse_raw(raw, RerankRequest, engine), request)
    raise bad_request("The body is none of the requests /invocations takes: a chat (messages), completion "
                      "(prompt), embedding or classification (input), score (text_1, text_2) or rerank "
                      "(query, documents) request.")
