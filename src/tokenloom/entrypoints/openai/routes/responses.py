"""POST /v1/responses, and the stored responses: GET and DELETE /v1/responses/{id}, POST
.../cancel, GET .../input_items."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import ResponsesRequest
from tokenloom.entrypoints.openai.request_body import body_schema, parse_body
from tokenloom.entrypoints.openai.routes import bool_param, int_param, server_state

router = APIRouter()

# OpenAPI links: a created response's id is what the stored-response routes take. They document
# the API's data flows, and give schemathesis' stateful phase chains to follow.
_RESPONSE_LINKS = {
    name: {"operationId": op, "parameters": {"response_id": "$response.body#/id"}}
    for name, op in (("Retrieve", "retrieve_response"), ("Delete", "delete_response"), ("Cancel", "cancel_response"),
                     ("InputItems", "list_input_items"))
}


@router.post("/v1/responses", operation_id="create_response", openapi_extra=body_schema(ResponsesRequest),
             responses={200: {"description": "The response (or its events, streamed)", "links": _RESPONSE_LINKS}})
async def create_response(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, ResponsesRequest, state.max_request_body_bytes, state.engine)
    return await state.responses.create_response(req, request)


@router.get("/v1/responses/{response_id}", operation_id="retrieve_response")
async def retrieve_response(response_id: str, request: Request) -> Response:
    q = request.query_params
    stream = bool_param(q, "stream")
    after = int_param(q, "starting_after", -1, limit=1 << 62) if "starting_after" in q else None
    return await server_state(request).responses.retrieve(response_id, stream, after)


@router.delete("/v1/responses/{response_id}", operation_id="delete_response")
async def delete_response(response_id: str, request: Request) -> Response:
    return await server_state(request).responses.delete(response_id)


@router.post("/v1/responses/{response_id}/cancel", operation_id="cancel_response")
async def cancel_response(response_id: str, request: Request) -> Response:
    return await server_state(request).responses.cancel(response_id)


@router.get("/v1/responses/{response_id}/input_items", operation_id="list_input_items")
async def list_input_items(response_id: str, request: Request) -> Response:
    q = request.query_params
    return server_state(request).responses.input_items(response_id, q.get("order", "desc"), q.get("after"),
                                                       int_param(q, "limit", 20, limit=100))
