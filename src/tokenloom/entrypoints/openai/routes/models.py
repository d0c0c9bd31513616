"""GET /v1/models (the served models and their LoRA adapters), POST /v1/load_lora_adapter and
/v1/unload_lora_adapter."""
from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import unix_time
from tokenloom.entrypoints.openai.request_body import parse_body
from tokenloom.entrypoints.openai.routes import server_state
from tokenloom.entrypoints.openai.serving_engine import json_response
from tokenloom.entrypoints.openai.serving_lora import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

router = APIRouter()

# OpenAPI links: a model id that /v1/models lists is what the generation routes take as `model`.
# They document the API's data flows, and give schemathesis' stateful phase chains to follow.
_MODEL_LINKS = {
    name: {"operationId": op, "requestBody": {"model": "$response.body#/data/0/id"}}
    for name, op in (("Complete", "create_completion"), ("Chat", "create_chat_completion"),
                     ("Respond", "create_response"))
}


@router.get("/v1/models", operation_id="list_models", responses={200: {"description": "The served models", "links": _MODEL_LINKS}})
async def list_models(request: Request) -> Response:
    state = server_state(request)
    engine, served_model_names = state.engine, state.served_model_names
    created = unix_time()
    data = [
        {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tokenloom",
            "root": engine.config.model_name,  # the model as given (vLLM's): a hub id, not its cache folder
            "parent": None,
            "max_model_len": engine.max_model_len,
            # What the matmuls compute with (EngineInfo.quantization): "none" or e.g.
            # "gguf Q4_1x210+Q8_0x1 avx512_vnni".
            "quantization": engine.engine_core.info.quantization,
        }
        for name in served_model_names
    ]
    data += [{"id": name, "object": "model", "created": created, "owned_by": "tokenloom", "root": lora.lora_path,
              "parent": served_model_names[0], "max_model_len": engine.max_model_len}
             for name, lora in state.adapters.requests.items()]
    return json_response({"object": "list", "data": data})


@router.post("/v1/load_lora_adapter", operation_id="load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, LoadLoRAAdapterRequest, state.max_request_body_bytes, state.engine)
    return await state.adapters.load(req.lora_name, req.lora_path)


@router.post("/v1/unload_lora_adapter", operation_id="unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state = server_state(request)
    req = await parse_body(request, UnloadLoRAAdapterRequest, state.max_request_body_bytes, state.engine)
    return state.adapters.unload(req.lora_name)
