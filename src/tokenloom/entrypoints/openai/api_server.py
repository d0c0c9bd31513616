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
instead of being cut off mid-body. This module builds the app (its routes: routes/, one
APIRouter per resource); serve.py runs the process around it (socket, engine, uvicorn, the drain
and the engine watchdog).
"""
from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

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
from tokenloom.entrypoints.openai.protocol import OpenAIServingError
from tokenloom.entrypoints.openai.routes import ServerState
from tokenloom.entrypoints.openai.routes import chat as chat_routes
from tokenloom.entrypoints.openai.routes import completions as completion_routes
from tokenloom.entrypoints.openai.routes import health as health_routes
from tokenloom.entrypoints.openai.routes import invocations as invocation_routes
from tokenloom.entrypoints.openai.routes import models as model_routes
from tokenloom.entrypoints.openai.routes import observe as observe_routes
from tokenloom.entrypoints.openai.routes import pooling as pooling_routes
from tokenloom.entrypoints.openai.routes import profile as profile_routes
from tokenloom.entrypoints.openai.routes import responses as response_routes
from tokenloom.entrypoints.openai.routes import tokens as token_routes
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenloom.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from tokenloom.entrypoints.openai.serving_lora import LoRAModules
from tokenloom.entrypoints.openai.serving_responses import DEFAULT_STORE_SIZE, OpenAIServingResponses
from tokenloom.entrypoints.openai import serving_engine as serving_engine_module
from tokenloom.entrypoints.openai.serving_engine import DEFAULT_MAX_PROMPTS_PER_REQUEST, engine_dead_error
from tokenloom.entrypoints.openai.serving_tokens import OpenAIServingTokenization
from tokenloom.entrypoints.openai.request_body import error_response, validation_error
from tokenloom.entrypoints.openai.reasoning_parsers import REASONING_PARSERS
from tokenloom.entrypoints.openai.tool_parsers import TOOL_PARSERS
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
    # /docs, /redoc and /openapi.json as vLLM serves them (open, like /health; --disable-fastapi-docs).
    app = FastAPI(title="tokenloom", version=tokenloom.__version__,
                  lifespan=_lifespan(engine, renderer, shutdown_engine_on_exit), root_path=root_path,
                  **({} if enable_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}))
    app.state.renderer = renderer  # serve.py ends its renders when the server stops
    app.state.server = _serving_state(
        engine, renderer, served_model_names,
        max_request_body_bytes=max_request_body_bytes, max_waiting_requests=max_waiting_requests,
        max_prompts_per_request=max_prompts_per_request, tool_call_parser=tool_call_parser,
        reasoning_parser=reasoning_parser, chat_template=chat_template, response_role=response_role,
        log_requests=log_requests, default_sampling_params=default_sampling_params,
        enable_prompt_tokens_details=enable_prompt_tokens_details,
        return_tokens_as_token_ids=return_tokens_as_token_ids, responses_store_size=responses_store_size,
        lora_modules=lora_modules, max_log_len=max_log_len, force_include_usage=force_include_usage,
        trust_request_chat_template=trust_request_chat_template,
    )

    # The last one added runs first: the key is checked before the engine's state is revealed,
    # and a browser's CORS preflight (which carries no key) is answered before either.
    app.add_middleware(EngineDeadMiddleware, engine=engine)
    api_keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, api_keys=api_keys)
    app.add_middleware(CORSMiddleware, allow_origins=allowed_origins or ["*"], allow_methods=allowed_methods or ["*"],
                       allow_headers=allowed_headers or ["*"], allow_credentials=allow_credentials)

    for error, handler in _EXCEPTION_HANDLERS:
        app.add_exception_handler(error, handler)

    # In this order: it is the order of the OpenAPI document's paths.
    for routes in (completion_routes, chat_routes, response_routes, pooling_routes, invocation_routes, token_routes,
                   model_routes, health_routes):
        app.include_router(routes.router)
    if configured_torch_profiler_dir() is not None:
        # vLLM's profiling routes, there only when a trace folder is set (as in vLLM).
        app.include_router(profile_routes.router)
    app.include_router(observe_routes.router)

    app.state.engine = engine
    return app


def _lifespan(engine: AsyncLLM, renderer: ChatTemplateRenderer,
              shutdown_engine_on_exit: bool) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        renderer.start()
        # The output handler reads the core's heartbeats: from the start, so the first /health
        # already knows whether the core is heard from.
        with contextlib.suppress(EngineDeadError):  # EngineDeadMiddleware answers for a dead one
            engine.start()
        yield
        await renderer.aclose()
        if shutdown_engine_on_exit:
            engine.shutdown()

    return lifespan


def _serving_state(
    engine: AsyncLLM,
    renderer: ChatTemplateRenderer,
    served_model_names: list[str],
    *,
    max_request_body_bytes: int,
    max_waiting_requests: int | None,
    max_prompts_per_request: int,
    tool_call_parser: str,
    reasoning_parser: str | None,
    chat_template: str | None,
    response_role: str,
    log_requests: bool,
    default_sampling_params: dict[str, Any] | None,
    enable_prompt_tokens_details: bool,
    return_tokens_as_token_ids: bool,
    responses_store_size: int,
    lora_modules: dict[str, str] | None,
    max_log_len: int,
    force_include_usage: bool,
    trust_request_chat_template: bool,
) -> ServerState:
    """The serving objects build_app's arguments describe, configured and sharing one renderer."""
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
    return ServerState(engine=engine, served_model_names=served_model_names,
                       max_request_body_bytes=max_request_body_bytes, renderer=renderer, completions=completions,
                       chat=chat, responses=responses, embeddings=embeddings, tokens=tokens, adapters=adapters)


async def _openai_error(_: Request, e: OpenAIServingError) -> Response:
    return error_response(e)


async def _engine_dead(_: Request, e: EngineDeadError) -> Response:
    # Raised where no route catches it: the engine shut down (or died) while the request
    # was still being parsed or tokenized.
    return error_response(engine_dead_error(e))


async def _request_validation(_: Request, e: RequestValidationError) -> Response:
    return error_response(validation_error(e))


async def _http_error(_: Request, e: StarletteHTTPException) -> Response:
    kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
    return error_response(OpenAIServingError(str(e.detail), e.status_code, kind))


async def _internal(_: Request, e: Exception) -> Response:
    logger.exception("internal error")
    return error_response(OpenAIServingError(f"Internal server error: {e!r}", 500, "server_error", None, "internal_error"))


# Every error leaves in OpenAI's shape, whatever raised it.
_EXCEPTION_HANDLERS: tuple[tuple[type[Exception], Any], ...] = (
    (OpenAIServingError, _openai_error),
    (EngineDeadError, _engine_dead),
    (RequestValidationError, _request_validation),
    (StarletteHTTPException, _http_error),
    (Exception, _internal),
)
