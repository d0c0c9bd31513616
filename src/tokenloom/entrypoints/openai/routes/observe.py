"""What scrapers and people read: GET /metrics (Prometheus) and /ledger (the ledger's live view)."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import OpenAIServingError
from tokenloom.entrypoints.openai.routes import int_param, server_state
from tokenloom.entrypoints.openai.serving_engine import json_response
from tokenloom.metrics.prometheus import CONTENT_TYPE

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    engine = server_state(request).engine
    if engine.metrics is None:
        return Response(status_code=404)
    await engine.refresh_metrics()
    return Response(engine.metrics.render(), media_type=CONTENT_TYPE)


@router.get("/ledger")
async def ledger(request: Request) -> Response:
    """The ledger's live view: `?steps=N` (default 100) last steps, the requests in flight
    with their current state (queued and why, prefill, decode, preempted), `?requests=M`
    (default 20) last finished requests; `?format=trace` the recent past as a trace (what
    `tokenloom explain --url` reads)."""
    engine = server_state(request).engine
    q = request.query_params
    if q.get("format", "json") == "trace":
        trace = engine.get_ledger_trace()
        if trace is None:
            raise OpenAIServingError("The ledger is off (--no-ledger).", 404, "not_found_error")
        return json_response(trace)
    num_steps, num_requests = int_param(q, "steps", 100), int_param(q, "requests", 20)
    view = await engine.get_ledger_view(num_steps, num_requests)
    if view is None:
        raise OpenAIServingError("The ledger is off (--no-ledger).", 404, "not_found_error")
    return json_response(view)
