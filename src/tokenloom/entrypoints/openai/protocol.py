"""Request bodies of the OpenAI-compatible API (pydantic) and the OpenAI error shape.

Only requests are modelled: responses are built as plain dicts (see serving.py), which keeps
the streaming path free of per-chunk model validation.

Unknown fields are ignored, as OpenAI-compatible servers usually do, so newer clients that send
fields this server does not know still work. Fields whose meaning this server cannot honour
(`suffix`, `best_of` other than n) are rejected with a 400 naming them instead of being silently
dropped.

Types are strict (pydantic's strict mode): `"max_tokens": "16"`, `"max_tokens": true`,
`"stream": "yes"` and `"n": 2.0` get a 400 instead of being coerced. The one leniency kept on
purpose: a float field takes an integer (`"temperature": 1`), because JSON has one number type
and every client writes whole numbers that way.

Numeric ranges are those of `SamplingParams` (its constants), declared here too so that the
OpenAPI document states them and a value out of range is refused before anything else runs.
"""
from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tokenloom.sampling_params import (
    INT64_MAX,
    INT64_MIN,
    MAX_LENGTH_PENALTY,
    MAX_LOGPROBS,
    MAX_N,
    MAX_PENALTY,
    MAX_REPETITION_PENALTY,
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MIN_REPETITION_PENALTY,
    UINT64_MAX,
)

Int64 = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
# A logit_bias key: a token id as a JSON object key, ASCII digits only (" 1 ", "1_0" and "٣" are
# refused: Python's int() would read them).
TokenIdKey = Annotated[str, Field(pattern=r"^[0-9]{1,10}$")]


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
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)  # None: OpenAI's default, 1.0
    # None: 1.0. Its float32 floor (MIN_TOP_P) is SamplingParams' check, whose message reads better.
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=INT64_MIN, le=UINT64_MAX)
    presence_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_PENALTY, le=MAX_PENALTY)
    logit_bias: dict[TokenIdKey, float] | None = None  # values clamped to [-100, 100] (as OpenAI)
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1, le=INT64_MAX)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=INT64_MAX)
    stop_token_ids: list[TokenId] | None = None
    priority: Int64 = 0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    request_id: str | None = Field(default=None, description="optional caller-chosen id (vLLM extra)")
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: all that fit)
    # vLLM's beam search (entrypoints/beam_search.py): the n best sequences, n the beam width.
    use_beam_search: bool = False
    # vLLM's: logprobs' tokens as "token_id:<id>" (None: the server's --return-tokens-as-token-ids).
    return_tokens_as_token_ids: bool | None = None
    length_penalty: float = Field(1.0, ge=-MAX_LENGTH_PENALTY, le=MAX_LENGTH_PENALTY)
    # Structured outputs: OpenAI's response_format, vLLM's structured_outputs and guided_* (one
    # of them; see structured.py). Plain dicts, checked there with errors naming the field.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    # 16: OpenAI's default for completions. 0 only together with echo (return the prompt, generate
    # nothing, as vLLM); serving_completion refuses it without echo, naming max_tokens.
    max_tokens: int | None = Field(16, ge=0, le=INT64_MAX)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False  # the choice's text (and logprobs) start with the prompt's
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # vLLM extra
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_N)


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool result's call

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        # Said here, before the union's "Input should be a valid string" for every member.
        if isinstance(content, list):
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind != "text":
                    raise ValueError(f"content[{j}] is a {kind!r} part: this server's model reads text only "
                                     "(parts of type 'text').")
        return content

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as vLLM joins text parts


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=INT64_MAX)  # None: up to max_model_len
    # OpenAI's newer name; wins over max_tokens
    max_completion_tokens: int | None = Field(None, ge=1, le=INT64_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None  # none | auto | required | a named function
    parallel_tool_calls: bool = True
    # vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # continue the last message (an assistant prefill)
    echo: bool = False  # the reply starts with the last message, when that is the assistant's
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    include_reasoning: bool = True  # with --reasoning-parser: false drops the reasoning


class TokenizeRequest(_Request):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered by the chat template as
    /v1/chat/completions renders them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    # None: the generation endpoints' own tokenization (the tokenizer's special tokens, no second
    # BOS in front of a template's); True / False: exactly that, as in transformers.
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize (vLLM's): token ids back to text."""

    model: str | None = None
    tokens: list[TokenId]


class ResponsesRequest(_SamplingFields):
    """POST /v1/responses (OpenAI's Responses API). `input` is a string (one user message) or a
    list of items (messages, function calls and their outputs), checked item by item in
    serving_responses.py so that a 400 names `input[i]`. OpenAI's fields first; the sampling
    fields of the other endpoints (vLLM's extras: top_k, min_p, seed, stop, priority, ...) apply
    too, except those that have another name here (`max_output_tokens`, `text.format`) or no
    meaning (`n`, beam search), which serving_responses refuses by name."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=INT64_MAX)  # None: up to max_model_len
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # with include: message.output_text.logprobs
    include: list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    max_tool_calls: int | None = Field(None, ge=1, le=INT64_MAX)  # OpenAI's: built-in tools only, echoed
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    store: bool = True
    background: bool = False
    metadata: dict[str, str] | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    reasoning: dict[str, Any] | None = None  # echoed: this server's models do not reason apart
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    conversation: str | dict[str, Any] | None = None  # refused: see serving_responses.py
    prompt: dict[str, Any] | None = None  # refused: reusable prompts live on OpenAI's side
    # vLLM extras, as on /v1/chat/completions
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class _ChatInput(_Request):
    """vLLM's chat form of a pooling request: `messages` instead of `input`, rendered by the chat
    template into one input (by default without a generation prompt and without the tokenizer's
    special tokens on top of the template's, as vLLM's EmbeddingChatRequest)."""

    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_generation_prompt: bool = False
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # None: True for `input` (the tokenizer's BOS), False for `messages` (the template has its own)
    add_special_tokens: bool | None = None


class EmbeddingRequest(_ChatInput):
    """POST /v1/embeddings (OpenAI's; needs an engine with --runner pooling): `input` is a text,
    a list of texts, one prompt's token ids or a list of them, or (vLLM's) chat `messages`;
    vLLM's extras after OpenAI's."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    # The official client asks for base64 unless told otherwise: little-endian float32 bytes.
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)  # Matryoshka models only
    user: str | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    normalize: bool | None = None  # vLLM extra; None: the model's
    use_activation: bool | None = None  # vLLM's newer name for normalize
    priority: Int64 = 0  # vLLM extra


class ClassificationRequest(_ChatInput):
    """POST /classify (vLLM's; needs a sequence classifier run with --runner pooling): `input` or
    `messages` as /v1/embeddings takes them; each input gets its label probabilities and its most
    likely label."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    use_activation: bool | None = None  # False: the logits instead of probabilities
    user: str | None = None
    priority: Int64 = 0


class PoolingRequest(_ChatInput):
    """POST /pooling (vLLM's): each input's pooled tensor for `task`, by default the model's
    token-level one (token_embed for an embedding model, token_classify for a classifier: one
    row per prompt token), as nested lists of floats or base64 of little-endian float32."""

    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]] | None = None
    task: str | None = None  # embed | token_embed | classify | token_classify
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    normalize: bool | None = None
    use_activation: bool | None = None
    user: str | None = None
    priority: Int64 = 0


class ScoreRequest(_Request):
    """POST /score (vLLM's): `text_1` against each of `text_2` (1:N), or two lists of the same
    length pairwise; an embedding model scores by cosine similarity, a one-label classifier (a
    cross-encoder) by its probability for the pair."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    priority: Int64 = 0


class RerankRequest(_Request):
    """POST /rerank (vLLM's, the Jina / Cohere shape): `documents` ordered by their score against
    `query`, the `top_n` best (0 or none: all)."""

    model: str | None = None
    query: str
    documents: list[str]
    top_n: int | None = Field(None, ge=0, le=INT64_MAX)
    return_documents: bool = True
    truncate_prompt_tokens: int | None = Field(None, ge=-1, le=INT64_MAX)
    priority: Int64 = 0
