"""`tokenloom serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) over one AsyncLLM.

Routes: POST /v1/completions, POST /v1/chat/completions, POST /v1/responses (and GET, DELETE
/v1/responses/{id}, GET .../input_items, POST .../cancel), with --runner pooling POST
/v1/embeddings, /pooling, /classify, /score and /rerank (serving_embedding.py), GET /v1/models, POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (serving_lora.py), POST /tokenize,
POST /detokenize, GET /health (and vLLM's /ping), GET /version, GET /metrics, GET /ledger (the
ledger's live view). Every error leaves in OpenAI's shape `{"error": {"message", "type", "param",
"code"}}` with its HTTP status.

Shutting down (SIGTERM, SIGINT): no new connections; requests in flight get `DRAIN_S` to finish,
then end with a 503 (`server_shutting_down`; a stream with that error event and `[DONE]`)
instead of being cut off mid-body. This module builds the app; serve.py runs the process around
it (socket, engine, uvicorn, the drain and the engine watchdog).
"""
from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import tokenloom
from tokenloom.config import configured_torch_profiler_dir
from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.engine.core_client import EngineDeadError
from tokenloom.entrypoints.openai.chat_render import ChatTemplateRenderer, RenderLimits
from tokenloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ClassificationRequest,
    CompletionRequest,
    DetokenizeRequest,
    EmbeddingRequest,
    RerankRequest,
    OpenAIServingError,
    PoolingRequest,
    ResponsesRequest,
    ScoreRequest,
    TokenizeRequest,
    bad_request,
    unix_time,
)
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenloom.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from tokenloom.entrypoints.openai.serving_lora import (
    LoadLoRAAdapterRequest,
    LoRAModules,
    UnloadLoRAAdapterRequest,
)
from tokenloom.entrypoints.openai.serving_responses import DEFAULT_STORE_SIZE, OpenAIServingResponses
from tokenloom.entrypoints.openai import serving_engine as serving_engine_module
from tokenloom.entrypoints.openai.serving_engine import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    engine_dead_error,
    json_response,
)
from tokenloom.entrypoints.openai.serving_tokens import OpenAIServingTokenization
from tokenloom.entrypoints.openai.request_body import (
    body_schema,
    error_response,
    parse_body,
    parse_raw,
    read_body,
    validation_error,
)
from tokenloom.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from tokenloom.entrypoints.openai.tool_parsers import TOOL_PARSERS
from tokenloom.metrics.prometheus import CONTENT_TYPE
from tokenloom.model.generation_config import default_sampling_params as generation_defaults
from tokenloom.model.generation_config import max_tokens_cap

logger = logging.getLogger("tokenloom.serve")

# Paths that stay open when --api-key is set: probes and scrapers carry no key.
_OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics", "/docs", "/docs/oauth2-redirect", "/redoc",
                         "/openapi.json"})
# Shutting down: how long requests in flight may still run before they are ended with a 503.
DRAIN_S = 5.0
# --max-request-body-bytes: far above any real prompt (a 128k-token prompt is about 1 MiB of
# JSON), low enough that parsing a body never holds the event loop for long (see README).
DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024


# OpenAPI links: a model id that /v1/models lists is what the generation routes take as `model`,
# and a created response's id is what the stored-response routes take. They document the API's
# data flows, and give schemathesis' stateful phase chains to follow.
_MODEL_LINKS = {
    name: {"operationId": op, "requestBody": {"model": "$response.body#/data/0/id"}}
    for name, op in (("Complete", "create_completion"), ("Chat", "create_chat_completion"),
                     ("Respond", "create_response"))
}
_RESPONSE_LINKS = {
    name: {"operationId": op, "parameters": {"response_id": "$response.body#/id"}}
    for name, op in (("Retrieve", "retrieve_response"), ("Delete", "delete_response"), ("Cancel", "cancel_response"),
                     ("InputItems", "list_input_items"))
}


class ApiKeyMiddleware:
    """Pure ASGI (no BaseHTTPMiddleware): it only gates requests and passes `receive` through
    untouched, so client disconnects still reach the endpoints."""

    def __init__(self, app: Any, api_keys: list[str]) -> None:
        self.app = app
        self.expected = [key.encode() for key in api_keys]  # any of them (vLLM's --api-key K1 K2)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in _OPEN_PATHS:
            return await self.app(scope, receive, send)
        given = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                given = value
                break
        # The scheme is case-insensitive (RFC 9110 section 11.1): "bearer KEY" is as good.
        scheme, _, token = given.strip().partition(b" ")
        if scheme.lower() != b"bearer":
            token = b""
        # Constant time in the key's content: no early exit on the first differing byte, and
        # every key compared (which one matched is not told by the time taken).
        token = token.strip()
        if not any([hmac.compare_digest(token, key) for key in self.expected]):  # a list: no short cut
            error = OpenAIServingError("Invalid or missing API key.", 401, "invalid_request_error", None, "invalid_api_key")
            return await error_response(error)(scope, receive, send)
        return await self.app(scope, receive, send)


class EngineDeadMiddleware:
    """Once the engine core is dead, every new request gets a 503 (`engine_dead`), whatever the
    route: /health, /version, /metrics and /v1/models too, so that no probe mistakes a server
    that can no longer generate for a healthy one. Responses already in flight are not touched
    (their streams end with the engine_dead error event)."""

    def __init__(self, app: Any, engine: AsyncLLM) -> None:
        self.app = app
        self.engine = engine

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and self.engine.is_dead:
            return await error_response(engine_dead_error(self.engine.dead_error))(scope, receive, send)
        return await self.app(scope, receive, send)


class _InvocationFields(msgspec.Struct):
    """The fields /invocations dispatches on, kept as raw JSON (other fields are skipped)."""

    messages: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    prompt: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    input: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    text_1: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET
    query: msgspec.Raw | msgspec.UnsetType = msgspec.UNSET


async def _profile(call: Any) -> Any:
    """A profiler call's result; its refusal (started twice, stopped unstarted) is a 400."""
    try:
        return await call
    except RuntimeError as e:
        raise bad_request(str(e)) from None


def build_app(
    engine: AsyncLLM,
    *,
    served_model_names: list[str],
    api_key: str | list[str] | None = None,
    max_waiting_requests: int | None = None,
    shutdown_engine_on_exit: bool = False,
    max_request_body_bytes: int = DEFAULT_MAX_REQUEST_BODY_BYTES,
    max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    tool_call_parser: str = "hermes",
    reasoning_parser: str | None = None,
    chat_template: str | None = None,
    response_role: str = "assistant",
    allowed_origins: list[str] | None = None,
    allowed_methods: list[str] | None = None,
    allowed_headers: list[str] | None = None,
    allow_credentials: bool = False,
    root_path: str = "",
    log_requests: bool = False,
    default_sampling_params: dict[str, Any] | None = None,
    enable_prompt_tokens_details: bool = False,
    return_tokens_as_token_ids: bool = False,
    responses_store_size: int = DEFAULT_STORE_SIZE,
    lora_modules: dict[str, str] | None = None,
    max_log_len: int = 200,
    force_include_usage: bool = False,
    enable_docs: bool = True,
    trust_request_chat_template: bool = False,
    render_limits: RenderLimits | None = None,
) -> FastAPI:
    """The app. CORS as vLLM's: by default any origin may call the API from a browser (the
    preflight is answered before the key is checked; the request itself still needs the key)."""
    renderer = ChatTemplateRenderer(render_limits)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        renderer.start()
        # The output handler reads the core's heartbeats: from the start, so the first /health
        # already knows whether the core is heard from.
        with contextlib.suppress(EngineDeadError):  # EngineDeadMiddleware answers for a dead one
            engine.start()
        yield
        renderer.close()
        if shutdown_engine_on_exit:
            engine.shutdown()

    # /docs, /redoc and /openapi.json as vLLM serves them (open, like /health; --disable-fastapi-docs).
    app = FastAPI(title="tokenloom", version=tokenloom.__version__, lifespan=lifespan, root_path=root_path,
                  **({} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.renderer = renderer  # serve.py ends its renders when the server stops
    completions = OpenAIServingCompletion(engine, served_model_names, max_waiting_requests)
    if tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {tool_call_parser!r}.")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_PARSERS)} (or None), "
                         f"got {reasoning_parser!r}.")
    chat = OpenAIServingChat(engine, served_model_names, max_waiting_requests,
                             tool_parser=TOOL_PARSERS[tool_call_parser](), chat_template=chat_template,
                             response_role=response_role)
    responses = OpenAIServingResponses(engine, served_model_names, max_waiting_requests,
                                       tool_parser=TOOL_PARSERS[tool_call_parser](), chat_template=chat_template,
                                       store_size=responses_store_size)
    tokens = OpenAIServingTokenization(engine, served_model_names, max_waiting_requests, chat_template=chat_template)
    embeddings = OpenAIServingEmbedding(engine, served_model_names, max_waiting_requests, chat_template=chat_template)
    completions.log_requests = chat.log_requests = responses.log_requests = embeddings.log_requests = log_requests
    if log_requests:  # asked for: shown under the default --log-level warning too
        request_logger = logging.getLogger(serving_engine_module.__name__)
        if request_logger.getEffectiveLevel() > logging.INFO:
            request_logger.setLevel(logging.INFO)
    chat.reasoning_parser = responses.reasoning_parser = reasoning_parser
    for serving in (completions, chat, responses, tokens, embeddings):
        serving.renderer = renderer
        serving.trust_request_chat_template = trust_request_chat_template
    for serving in (completions, chat, responses, embeddings):
        serving.max_log_len = max_log_len
        serving.max_prompts_per_request = max_prompts_per_request
        serving.force_include_usage = force_include_usage
    # LoRA adapters under their own model names (--lora-modules; /v1/load_lora_adapter adds more
    # when runtime updates are allowed): one dict shared by every endpoint.
    adapters = LoRAModules(engine, served_model_names, lora_modules or {})
    for serving in (completions, chat, responses, tokens, embeddings):
        serving.lora_modules = adapters.requests
    embeddings.enable_prompt_tokens_details = enable_prompt_tokens_details
    config = engine.config
    if default_sampling_params is None:
        default_sampling_params = generation_defaults(config.model, config.generation_config,
                                                      config.override_generation_config)
    for serving in (completions, chat, responses):
        serving.enable_prompt_tokens_details = enable_prompt_tokens_details
        serving.return_tokens_as_token_ids = return_tokens_as_token_ids
        serving.default_sampling_params = default_sampling_params
        serving.max_tokens_cap = max_tokens_cap(config.generation_config, default_sampling_params,
                                                config.override_generation_config)

    # The last one added runs first: the key is checked before the engine's state is revealed,
    # and a browser's CORS preflight (which carries no key) is answered before either.
    app.add_middleware(EngineDeadMiddleware, engine=engine)
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins or ["*"], allow_methods=allowed_methods or ["*"],
                       allow_headers=allowed_headers or ["*"], allow_credentials=allow_credentials)

    @app.exception_handler(OpenAIServingError)
    async def _openai_error(_: Request, e: OpenAIServingError) -> Response:
        return error_response(e)

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, e: EngineDeadError) -> Response:
        # Raised where no route catches it: the engine shut down (or died) while the request
        # was still being parsed or tokenized.
        return error_response(engine_dead_error(e))

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, e: RequestValidationError) -> Response:
        return error_response(validation_error(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(OpenAIServingError(str(e.detail), e.status_code, kind))

    @app.exception_handler(Exception)
    async def _internal(_: Request, e: Exception) -> Response:
        logger.exception("internal error")
        return error_response(OpenAIServingError(f"Internal server error: {e!r}", 500, "server_error", None, "internal_error"))

    @app.post("/v1/completions", operation_id="create_completion", openapi_extra=body_schema(CompletionRequest))
    async def create_completion(request: Request) -> Response:
        req = await parse_body(request, CompletionRequest, max_request_body_bytes, engine)
        return await completions.create_completion(req, request)

    @app.post(
        "/v1/chat/completions", operation_id="create_chat_completion", openapi_extra=body_schema(ChatCompletionRequest)
    )
    async def create_chat_completion(request: Request) -> Response:
        req = await parse_body(request, ChatCompletionRequest, max_request_body_bytes, engine)
        return await chat.create_chat_completion(req, request)

    @app.post("/v1/responses", operation_id="create_response", openapi_extra=body_schema(ResponsesRequest),
              responses={200: {"description": "The response (or its events, streamed)", "links": _RESPONSE_LINKS}})
    async def create_response(request: Request) -> Response:
        req = await parse_body(request, ResponsesRequest, max_request_body_bytes, engine)
        return await responses.create_response(req, request)

    @app.get("/v1/responses/{response_id}", operation_id="retrieve_response")
    async def retrieve_response(response_id: str, request: Request) -> Response:
        q = request.query_params
        stream = _bool_param(q, "stream")
        after = _int_param(q, "starting_after", -1, limit=1 << 62) if "starting_after" in q else None
        return await responses.retrieve(response_id, stream, after)

    @app.delete("/v1/responses/{response_id}", operation_id="delete_response")
    async def delete_response(response_id: str) -> Response:
        return await responses.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel", operation_id="cancel_response")
    async def cancel_response(response_id: str) -> Response:
        return await responses.cancel(response_id)

    @app.get("/v1/responses/{response_id}/input_items", operation_id="list_input_items")
    async def list_input_items(response_id: str, request: Request) -> Response:
        q = request.query_params
        return responses.input_items(response_id, q.get("order", "desc"), q.get("after"),
                                     _int_param(q, "limit", 20, limit=100))

    @app.post("/v1/embeddings", operation_id="create_embedding", openapi_extra=body_schema(EmbeddingRequest))
    async def create_embedding(request: Request) -> Response:
        req = await parse_body(request, EmbeddingRequest, max_request_body_bytes, engine)
        return await embeddings.create_embedding(req, request)

    @app.post("/pooling", operation_id="create_pooling", openapi_extra=body_schema(PoolingRequest))
    async def create_pooling(request: Request) -> Response:
        req = await parse_body(request, PoolingRequest, max_request_body_bytes, engine)
        return await embeddings.create_pooling(req, request)

    @app.post("/classify", operation_id="create_classify", openapi_extra=body_schema(ClassificationRequest))
    @app.post("/v1/classify", openapi_extra=body_schema(ClassificationRequest), include_in_schema=False)
    async def create_classify(request: Request) -> Response:
        req = await parse_body(request, ClassificationRequest, max_request_body_bytes, engine)
        return await embeddings.create_classify(req, request)

    @app.post("/score", operation_id="create_score", openapi_extra=body_schema(ScoreRequest))
    @app.post("/v1/score", openapi_extra=body_schema(ScoreRequest), include_in_schema=False)
    async def create_score(request: Request) -> Response:
        req = await parse_body(request, ScoreRequest, max_request_body_bytes, engine)
        return await embeddings.create_score(req, request)

    @app.post("/rerank", operation_id="create_rerank", openapi_extra=body_schema(RerankRequest))
    @app.post("/v1/rerank", include_in_schema=False)
    @app.post("/v2/rerank", include_in_schema=False)
    async def create_rerank(request: Request) -> Response:
        req = await parse_body(request, RerankRequest, max_request_body_bytes, engine)
        return await embeddings.create_rerank(req, request)

    @app.post("/invocations", operation_id="invocations")
    async def invocations(request: Request) -> Response:
        """SageMaker's one route (vLLM serves it too): the body's own fields say which API it is
        for: `messages` chat (embeddings or classification on a pooling server), `prompt`
        completions, `input` embeddings or classification, `text_1`/`text_2` score, `query` with
        `documents` rerank."""
        raw = await read_body(request, max_request_body_bytes)
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

    @app.post("/tokenize", operation_id="tokenize", openapi_extra=body_schema(TokenizeRequest))
    async def tokenize(request: Request) -> Response:
        req = await parse_body(request, TokenizeRequest, max_request_body_bytes, engine)
        return await tokens.tokenize(req)

    @app.post("/detokenize", operation_id="detokenize", openapi_extra=body_schema(DetokenizeRequest))
    async def detokenize(request: Request) -> Response:
        req = await parse_body(request, DetokenizeRequest, max_request_body_bytes, engine)
        return await tokens.detokenize(req)

    @app.get("/v1/models", operation_id="list_models", responses={200: {"description": "The served models", "links": _MODEL_LINKS}})
    async def list_models() -> Response:
        created = unix_time()
        data = [
            {
                "id": name,
                "object": "model",
                "created": created,
                "owned_by": "tokenloom",
                "root": engine.config.model or "SmolLM2-135M-Instruct",
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
                 for name, lora in adapters.requests.items()]
        return json_response({"object": "list", "data": data})

    @app.post("/v1/load_lora_adapter", operation_id="load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        req = await parse_body(request, LoadLoRAAdapterRequest, max_request_body_bytes, engine)
        return await adapters.load(req.lora_name, req.lora_path)

    @app.post("/v1/unload_lora_adapter", operation_id="unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        req = await parse_body(request, UnloadLoRAAdapterRequest, max_request_body_bytes, engine)
        return adapters.unload(req.lora_name)

    @app.api_route("/ping", methods=["GET", "POST"])  # vLLM's (SageMaker's) name for /health
    @app.get("/health")
    async def health() -> Response:
        # A dead engine is answered by EngineDeadMiddleware (503). A live one that cannot serve in
        # time is a 503 too, saying why (AsyncLLM.health_problem): its core not heard from (stopped,
        # hung), or every tokenizer thread (or every chat-template render worker) stuck. With data parallelism the server is healthy while
        # any replica lives and is heard from: 200, with a body that says which are up ("degraded"
        # once one died or stalled), so a probe keeps routing to it and a person can see why.
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

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": tokenloom.__version__})

    if configured_torch_profiler_dir() is not None:
        # vLLM's profiling routes, there only when a trace folder is set (as in vLLM).
        @app.post("/start_profile")
        async def start_profile() -> Response:
            await _profile(engine.start_profile())
            return Response(status_code=200)

        @app.post("/stop_profile")
        async def stop_profile() -> Response:
            return json_response({"traces": await _profile(engine.stop_profile())})

    @app.get("/metrics")
    async def metrics() -> Response:
        if engine.metrics is None:
            return Response(status_code=404)
        await engine.refresh_metrics()
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/ledger")
    async def ledger(request: Request) -> Response:
        """The ledger's live view: `?steps=N` (default 100) last steps, the requests in flight
        with their current state (queued and why, prefill, decode, preempted), `?requests=M`
        (default 20) last finished requests; `?format=trace` the recent past as a trace (what
        `tokenloom explain --url` reads)."""
        q = request.query_params
        if q.get("format", "json") == "trace":
            trace = engine.get_ledger_trace()
            if trace is None:
                raise OpenAIServingError("The ledger is off (--no-ledger).", 404, "not_found_error")
            return json_response(trace)
        num_steps, num_requests = _int_param(q, "steps", 100), _int_param(q, "requests", 20)
        view = await engine.get_ledger_view(num_steps, num_requests)
        if view is None:
            raise OpenAIServingError("The ledger is off (--no-ledger).", 404, "not_found_error")
        return json_response(view)

    app.state.engine = engine
    return app


def _int_param(query: Any, name: str, default: int, limit: int = 100_000) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise bad_request(f"{name} must be an integer, got {raw!r}.", param=name) from None
    if not 0 <= value <= limit:
        raise bad_request(f"{name} must be in [0, {limit}], got {value}.", param=name)
    return value


def _bool_param(query: Any, name: str) -> bool:
    raw = query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise bad_request(f"{name} must be true or false, got {query.get(name)!r}.", param=name)
    return raw in ("true", "1")
