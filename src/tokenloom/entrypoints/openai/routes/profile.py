"""vLLM's profiling routes, POST /start_profile and /stop_profile: build_app includes them only
when a trace folder is set (as in vLLM)."""
from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import bad_request
from tokenloom.entrypoints.openai.routes import server_state
from tokenloom.entrypoints.openai.serving_engine import json_response

router = APIRouter()


async def _profile(call: Any) -> Any:
    """A profiler call's result; its refusal (started twice, stopped unstarted) is a 400."""
    try:
        return await call
    except RuntimeError as e:
        raise bad_request(str(e)) from None


@router.post("/start_profile")
async def start_profile(request: Request) -> Response:
    await _profile(server_state(request).engine.start_profile())
    return Response(status_code=200)


@router.post("/stop_profile")
async def stop_profile(request: Request) -> Response:
    return json_response({"traces": await _profile(server_state(request).engine.stop_profile())})
