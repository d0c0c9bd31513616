"""POST /v1/chat/completions."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest
from tokenloom.entrypoints.openai.request_body import body_schema, parse_body
from tokenloom.entrypoints.openai.routes import server_state

router = APIRouter()


@router.post(
    "/v1/chat/completions", operation_id="create_chat_completion", openapi_extra=body_schema(ChatCompletionRequest)
)
async def create_chat_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ChatCompletionRequest, state.max_request_body_bytes, state.engine)
    return await state.chat.create_chat_completion(req, request)
