"""The server's routes, one APIRouter per resource (build_app in api_server.py includes them):
completions, chat, responses, pooling (embeddings, pooling, classify, score, rerank), invocations,
tokens (tokenize, detokenize), models (and LoRA adapters), health (the probes, version), profile
and observe (metrics, ledger). A route finds what it serves with in `ServerState`, which build_app keeps on
`app.state.server`: no module holds state of its own."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi import Request

from tokenloom.engine.async_llm import AsyncLLM
from tokenloom.entrypoints.openai.chat_render import ChatTemplateRenderer
from tokenloom.entrypoints.openai.protocol import bad_request
from tokenloom.entrypoints.openai.serving_chat import OpenAIServingChat
from tokenloom.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tokenloom.entrypoints.openai.serving_embedding import OpenAIServingEmbedding
from tokenloom.entrypoints.openai.serving_lora import LoRAModules
from tokenloom.entrypoints.openai.serving_responses import OpenAIServingResponses
from tokenloom.entrypoints.openai.serving_tokens import OpenAIServingTokenization


@dataclass(frozen=True)
class ServerState:
    """The serving objects of one app, built once by build_app from its arguments."""

    engine: AsyncLLM
    served_model_names: list[str]
    max_request_body_bytes: int
    renderer: ChatTemplateRenderer
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    responses: OpenAIServingResponses
    embeddings: OpenAIServingEmbedding
    tokens: OpenAIServingTokenization
    adapters: LoRAModules


def server_state(request: Request) -> ServerState:
    """The state of the app that received `request`."""
    return request.app.state.server


def int_param(query: Any, name: str, default: int, limit: int = 100_000) -> int:
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


def bool_param(query: Any, name: str) -> bool:
    raw = query.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise bad_request(f"{name} must be true or false, got {query.get(name)!r}.", param=name)
    return raw in ("true", "1")
