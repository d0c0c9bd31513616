"""Request bodies of the OpenAI-compatible API (pydantic) and the OpenAI error shape.

Only requests are modelled: responses are built as plain dicts (see serving.py), which keeps
the streaming path free of per-chunk model validation.

Unknown fields are ignored, as OpenAI-compatible servers usually do, so newer clients that send
fields this server does not know still work. Fields whose meaning this server cannot honour
(`echo`, `suffix`, `best_of` > n, tools) are rejected with a 400 naming them instead of being
silently dropped.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class OpenAIServingError(Exception):
    """An error the client should see in OpenAI's shape, with its HTTP status."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIServingError:
    return OpenAIServingError(message, 400, "invalid_request_error", param, code)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def unix_time() -> int:
    return int(time.time())


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float | None = None  # None: 1.0
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    priority: int = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    request_id: str | None = Field(default=None, description="optional caller-chosen id (vLLM extra)")


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: up to max_model_len
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True  # vLLM extra
