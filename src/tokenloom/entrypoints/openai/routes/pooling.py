"""The pooling runner's routes: POST /v1/embeddings, /pooling, /classify, /score and /rerank (the
last three under vLLM's other paths too, left out of the OpenAPI document)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
)
from tokenloom.entrypoints.openai.request_body import body_schema, parse_body
from tokenloom.entrypoints.openai.routes import server_state

router = APIRouter()


@router.post("/v1/embeddings", operation_id="create_embedding", openapi_extra=body_schema(EmbeddingRequest))
async def create_embedding(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, EmbeddingRequest, state.max_request_body_bytes, state.engine)
    return await state.embeddings.create_embedding(req, request)


@router.post("/pooling", operation_id="create_pooling", openapi_extra=body_schema(PoolingRequest))
async def create_pooling(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, PoolingRequest, state.max_request_body_bytes, state.engine)
    return await state.embeddings.create_pooling(req, request)


@router.post("/classify", operation_id="create_classify", openapi_extra=body_schema(ClassificationRequest))
@router.post("/v1/classify", openapi_extra=body_schema(ClassificationRequest), include_in_schema=False)
async def create_classify(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ClassificationRequest, state.max_request_body_bytes, state.engine)
    return await state.embeddings.create_classify(req, request)


@router.post("/score", operation_id="create_score", openapi_extra=body_schema(ScoreRequest))
@router.post("/v1/score", openapi_extra=body_schema(ScoreRequest), include_in_schema=False)
async def create_score(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ScoreRequest, state.max_request_body_bytes, state.engine)
    return await state.embeddings.create_score(req, request)


@router.post("/rerank", operation_id="create_rerank", openapi_extra=body_schema(RerankRequest))
@router.post("/v1/rerank", include_in_schema=False)
@router.post("/v2/rerank", include_in_schema=False)
async def create_rerank(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, RerankRequest, state.max_request_body_bytes, state.engine)
    return await state.embeddings.create_rerank(req, request)
