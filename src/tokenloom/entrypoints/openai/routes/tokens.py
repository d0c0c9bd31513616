"""POST /tokenize and /detokenize."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from tokenloom.entrypoints.openai.request_body import body_schema, parse_body
from tokenloom.entrypoints.openai.routes import server_state

router = APIRouter()


@router.post("/tokenize", operation_id="tokenize", openapi_extra=body_schema(TokenizeRequest))
async def tokenize(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, TokenizeRequest, state.max_request_body_bytes, state.engine)
    return await state.tokens.tokenize(req)


@router.post("/detokenize", operation_id="detokenize", openapi_extra=body_schema(DetokenizeRequest))
async def detokenize(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, DetokenizeRequest, state.max_request_body_bytes, state.engine)
    return await state.tokens.detokenize(req)
