"""What probes read: GET /health (and vLLM's /ping) and /version."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

import tokenloom
from tokenloom.entrypoints.openai.protocol import OpenAIServingError
from tokenloom.entrypoints.openai.routes import server_state
from tokenloom.entrypoints.openai.serving_engine import json_response

router = APIRouter()


@router.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name for /health
@router.get("/health")
async def health(request: Request) -> Response:
    # A dead engine is answered by EngineDeadMiddleware (503). A live one that cannot serve in
    # time is a 503 too, saying why (AsyncLLM.health_problem): its core not heard from (stopped,
    # hung), or every tokenizer thread (or every chat-template render worker) stuck. With data parallelism the server is healthy while
    # any replica lives and is heard from: 200, with a body that says which are up ("degraded"
    # once one died or stalled), so a probe keeps routing to it and a person can see why.
    state = server_state(request)
    engine, renderer = state.engine, state.renderer
    problem = await engine.health_problem()
    busy = renderer.saturated_for()
    if problem is None and busy > engine.tokenizer_pool_limit_s:
        problem = "chat_template_workers_saturated", (
            f"Every one of the {renderer.limits.num_workers} chat-template render workers has been busy on one "
            f"render for over {busy:.1f} s (limit {engine.tokenizer_pool_limit_s:g} s): chat requests cannot be "
            "rendered.")
    if problem is not None:
        code, message = problem
        raise OpenAIServingError(message, 503, "service_unavailable_error", None, code)
    if engine.data_parallel_size == 1:
        return Response(status_code=200)
    alive = engine.replica_health()
    body: dict[str, Any] = {
        "status": "ok" if all(alive) else "degraded",
        "data_parallel_size": len(alive),
        "replicas_alive": [i for i, up in enumerate(alive) if up],
    }
    stalled = [i for i in engine.engine_core.live_indices() if not alive[i]]
    if stalled:  # alive but not heard from within the heartbeat timeout
        body["replicas_stalled"] = stalled
    return json_response(body)


@router.get("/version")
async def version() -> Response:
    return json_response({"version": tokenloom.__version__})
