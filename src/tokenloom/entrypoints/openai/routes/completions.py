"""POST /v1/completions."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import CompletionRequest
from tokenloom.entrypoints.openai.request_body import body_schema, parse_body
from tokenloom.entrypoints.openai.routes import server_state

router = APIRouter()


@router.post("/v1/completions", operation_id="create_completion", openapi_extra=body_schema(CompletionRequest))
async def create_completion(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, CompletionRequest, state.max_request_body_bytes, state.engine)
    return await state.completions.create_completion(req, request)
