"""What both OpenAI endpoints share: request fields -> SamplingParams, admission (model name,
capacity, a live engine), usage and logprobs in OpenAI's shapes, SSE framing, and running
requests against the engine with client disconnects turned into aborts."""
from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from tokenloom.engine.async_llm import AsyncLLM, RequestStream
from tokenloom.engine.chat_template import tools_dropped
from tokenloom.engine.core_client import EngineDeadError, EngineShutDownError
from tokenloom.entrypoints.beam_search import BeamSearch, run_beam_search
from tokenloom.entrypoints.openai.chat_render import ChatTemplateRenderer, RenderError
from tokenloom.entrypoints.openai.protocol import OpenAIServingError, _SamplingFields, bad_request
from tokenloom.entrypoints.openai.harmony import HarmonyStream, split_harmony
from tokenloom.entrypoints.openai.reasoning_parsers import (
    HARMONY_PARSERS,
    ReasoningStream,
    Split,
    opens_reasoning,
    split_reasoning,
)
from tokenloom.lora_request import LoRARequest
from tokenloom.messages import EngineCoreRequest
from tokenloom.outputs import CompletionOutput, Logprob, RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

_json = msgspec.json.Encoder()  # encodes -inf logprobs as null instead of emitting invalid JSON
# --max-prompts-per-request's default: far above the batches clients send in one request (tens to
# hundreds of prompts), low enough that one request's prompts are tokenized, held and answered in
# bounded time and memory. Past the window, a big request no longer holds the queue (add_requests).
DEFAULT_MAX_PROMPTS_PER_REQUEST = 2048
_FIELD_IN_MESSAGE = re.compile(r"^([a-z_][a-z_0-9]*) (?:must|has|is)\b")


def json_response(obj: Any, status_code: int = 200) -> Response:
    return Response(_json.encode(obj), status_code=status_code, media_type="application/json")


def sse_event(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"

# The longest render accepted where the tokenizer cannot say how many characters a token spans.
MAX_RENDERED_CHARS = 64 * 1024**2


def engine_dead_error(e: BaseException | None = None) -> OpenAIServingError:
    if isinstance(e, EngineShutDownError):
        return OpenAIServingError("The server is shutting down: the request was ended before it finished.",
                                  503, "service_unavailable_error", None, "server_shutting_down")
    detail = f": {str(e).splitlines()[0]}" if e is not None and str(e) else ""
    return OpenAIServingError(
        f"The engine core is dead{detail}", 503, "service_unavailable_error", None, "engine_dead"
    )


def error_from_value_error(e: ValueError, field_names: dict[str, str] | None = None, prompt_param: str = "prompt") -> OpenAIServingError:
    """A ValueError from SamplingParams or the input processor, as a 400 whose `param` is the
    request field the message names (`field_names` maps SamplingParams names to request names)."""
    message = str(e)
    match = _FIELD_IN_MESSAGE.match(message)
    param: str | None = None
    if match:
        name = match.group(1)
        if not name.startswith("_"):
            param = (field_names or {}).get(name, name)
            message = param + message[len(name) :]  # the request's own name for the field
    elif "max_model_len" in message or "prompt" in message.lower():
        param = prompt_param
    return bad_request(message, param=param)


class BeamSearchStream:
    """A beam search running as a task (entrypoints/beam_search.py), where an engine request's
    RequestStream would stand: its one output is the finished search."""

    def __init__(self, request_id: str, task: asyncio.Future, num_seqs: int) -> None:
        self.request_id = request_id
        self.task = task
        self.num_seqs = num_seqs  # the choices it returns (the beam width), as RequestStream's

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        try:
            yield await asyncio.shield(self.task)
        finally:
            self.task.cancel()  # nothing once it has finished; a reader gone early ends the search


class WindowedStream:
    """One prompt of a request that has more prompts than fit its window (see
    OpenAIServing.add_requests): processed already, queued in the engine only when one of the
    request's earlier prompts has finished, so that other clients' requests arriving meanwhile
    join the engine's queue between them."""

    def __init__(self, engine: AsyncLLM, request_id: str, num_seqs: int, slots: asyncio.Semaphore,
                 held: tuple[EngineCoreRequest, str | None] | None = None, stream: RequestStream | None = None,
                 trace_headers: dict[str, str] | None = None) -> None:
        """Either `stream` (queued at once, holding one of the window's `slots`) or `held` (the
        processed request and its prompt text, queued when it gets a slot, with its W3C
        `trace_headers`)."""
        self._trace_headers = trace_headers
        self.engine = engine
        self.request_id = request_id
        self.num_seqs = num_seqs
        self._request, self._prompt_text = held or (None, None)
        self._slots = slots  # released by each of the request's prompts as it ends
        self.stream = stream  # in the engine (None: not yet)
        self._closed = False
        if self._request is not None:
            engine.num_deferred_seqs += num_seqs

    def _undefer(self) -> EngineCoreRequest | None:
        request, self._request = self._request, None
        if request is not None:
            self.engine.num_deferred_seqs -= self.num_seqs
        return request

    async def outputs(self) -> AsyncGenerator[RequestOutput, None]:
        holds_slot = self.stream is not None  # queued at once: it holds one of the window's slots
        try:
            if self.stream is None:
                await self._slots.acquire()
                holds_slot = True
                request = self._undefer()
                if self._closed or request is None:
                    return
                try:
                    # Arrives now, as a request sent now would: after those that came meanwhile.
                    self.stream = await self.engine.add_processed_request(request, self._prompt_text, arrives_now=True,
                                                                          trace_headers=self._trace_headers)
                except ValueError as e:  # its id came in flight meanwhile (a client-given request_id)
                    raise bad_request(str(e), param="request_id") from None
            gen = self.engine.stream_outputs(self.stream)
            try:
                async for out in gen:
                    yield out
            finally:
                await gen.aclose()
        finally:
            if holds_slot:
                self._slots.release()

    def close(self) -> None:
        """Ends the prompt: never queued if it has not been, aborted if it is in flight."""
        self._closed = True
        self._undefer()
        if self.stream is not None:
            self.engine.abort_nowait(self.stream.request_id)


class OpenAIServing:
    """Base of the endpoint handlers."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str], max_waiting_requests: int | None,
                 chat_template: str | None = None) -> None:
        self.engine = engine
        self.served_model_names = served_model_names
        self.max_waiting_requests = max_waiting_requests
        # --chat-template: the server's template where a request names none (None: the tokenizer's).
        self.chat_template = chat_template
        # Where every chat template renders (build_app shares one; chat_render.py says why), and
        # whether a request may bring its own template (--trust-request-chat-template, as vLLM).
        self.renderer = ChatTemplateRenderer()
        self.trust_request_chat_template = False
        self.log_requests = False  # --enable-log-requests: one INFO line per accepted request
        # --structured-outputs-max-*: checked before a spec is parsed (a 400 naming field and limit).
        self.so_limits = engine.input_processor.structured_output_limits
        self.max_log_len = 200  # --max-log-len: the most of a prompt that line shows
        self.force_include_usage = False  # --enable-force-include-usage: streams end with usage
        # --generation-config: what a request that leaves a sampling field unset gets (the
        # model's generation_config.json, as vLLM), and the most max_tokens any may ask for.
        self.default_sampling_params: dict[str, Any] = {}
        self.max_tokens_cap: int | None = None
        # vLLM's --enable-prompt-tokens-details and --return-tokens-as-token-ids.
        self.enable_prompt_tokens_details = False
        self.return_tokens_as_token_ids = False
        # LoRA adapters served under their own model names (--lora-modules, /v1/load_lora_adapter):
        # one dict shared by every endpoint's handler.
        self.lora_modules: dict[str, LoRARequest] = {}
        # --reasoning-parser (chat and responses; reasoning_parsers.py): None, all of a reply is content.
        self.reasoning_parser: str | None = None
        # --max-prompts-per-request: the most sequences (prompts times n) one request may ask for.
        self.max_prompts_per_request = DEFAULT_MAX_PROMPTS_PER_REQUEST

    def reasoning_opened(self, prompt: str) -> bool | None:
        """Under a reasoning parser, whether the rendered prompt leaves the reply inside `<think>`;
        None without one."""
        return None if self.reasoning_parser is None else opens_reasoning(prompt)

    def split_reasoning(self, text: str, opened: bool) -> Split:
        """A finished reply's reasoning and content, by the server's reasoning parser."""
        if self.reasoning_parser in HARMONY_PARSERS:
            return split_harmony(text)
        return split_reasoning(text, opened)

    def reasoning_stream(self, opened: bool) -> ReasoningStream | HarmonyStream:
        """A streamed reply's splitter, by the server's reasoning parser."""
        return HarmonyStream() if self.reasoning_parser in HARMONY_PARSERS else ReasoningStream(opened)

    def keep_harmony_markers(self, params: SamplingParams) -> SamplingParams:
        """Under gpt-oss's parsers (harmony.py), the reply's text keeps its special tokens: they
        mark its channels and calls."""
        tool_parser = getattr(getattr(self, "tool_parser", None), "name", None)
        if self.reasoning_parser in HARMONY_PARSERS or tool_parser == "openai":
            return params.clone(skip_special_tokens=False)
        return params

    def grammar_after_reasoning(self, params: SamplingParams, opened: bool | None) -> None:
        """Under a reasoning parser, a request's grammar constrains its answer, not its reasoning
        (StructuredOutputsParams._reasoning), where `<think>` and `</think>` are tokens of their
        own; elsewhere it constrains the whole reply."""
        think = self._think_token_ids
        if opened is not None and think is not None and params.structured_outputs is not None:
            params.structured_outputs = msgspec.structs.replace(params.structured_outputs, _reasoning=(*think, opened))

    @functools.cached_property
    def _think_token_ids(self) -> tuple[int, int] | None:
        """The ids of `<think>` and `</think>` when each is one token of the vocabulary (Qwen3's,
        DeepSeek-R1's); None otherwise."""
        tokenizer = self.engine.tokenizer
        tags = ("<think>", "</think>")
        ids = [tokenizer.convert_tokens_to_ids(t) for t in tags]
        ok = all(isinstance(i, int) and tokenizer.convert_ids_to_tokens(i) == t for i, t in zip(ids, tags))
        return (ids[0], ids[1]) if ok else None

    def resolve_max_tokens(self, requested: int | None) -> int | None:
        """The request's max_tokens, else the server's default (a generation config's
        max_new_tokens), at most the server's cap; None: up to the end of the context."""
        max_tokens = requested if requested is not None else self.default_sampling_params.get("max_tokens")
        if self.max_tokens_cap is not None:
            max_tokens = self.max_tokens_cap if max_tokens is None else min(max_tokens, self.max_tokens_cap)
        return max_tokens

    def cached_tokens(self, num_cached_tokens: int) -> int | None:
        """What `usage` reports as prompt_tokens_details.cached_tokens: None unless enabled."""
        return num_cached_tokens if self.enable_prompt_tokens_details else None

    def tokens_as_ids(self, req: _SamplingFields) -> bool:
        return self.return_tokens_as_token_ids if req.return_tokens_as_token_ids is None else req.return_tokens_as_token_ids

    # ---- admission ----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        """The served name a request's `model` asks for: the model's (the first when none is
        given) or a LoRA adapter's (`lora_of` gives its LoRARequest); 404 otherwise."""
        if model is None or model == "":
            return self.served_model_names[0]
        if model not in self.served_model_names and model not in self.lora_modules:
            raise OpenAIServingError(
                f"The model `{model}` does not exist. Served: {', '.join([*self.served_model_names, *self.lora_modules])}.",
                404,
                "invalid_request_error",
                "model",
                "model_not_found",
            )
        return model

    def check_capacity(self, num_new_seqs: int) -> None:
        """503 when the engine is dead, or when admitting `num_new_seqs` more core requests would
        leave more than `max_waiting_requests` of them waiting. Counted on the caller side: the
        unfinished requests minus the `max_num_seqs` the scheduler can run at once."""
        if self.engine.is_dead:
            raise engine_dead_error(self.engine.dead_error)
        if self.max_waiting_requests is None:
            return
        waiting = self.engine.get_num_unfinished_seqs() + num_new_seqs - self.engine.config.max_num_seqs
        if waiting > self.max_waiting_requests:
            raise OpenAIServingError(
                f"The server is overloaded: more than {self.max_waiting_requests} requests would be waiting "
                f"(--max-waiting-requests). Retry later.",
                503,
                "service_unavailable_error",
                None,
                "server_overloaded",
            )

    def check_fan_out(self, num_prompts: int, n: int, param: str) -> None:
        """A 400 naming `param` when a request asks for more sequences (its prompts, each `n`
        times) than --max-prompts-per-request allows."""
        limit = self.max_prompts_per_request
        if num_prompts * n <= limit:
            return
        copies = f" x n={n}" if n > 1 else ""
        raise bad_request(f"{param}: the request asks for {num_prompts} prompt(s){copies} = {num_prompts * n} "
                          f"sequences, more than the {limit} one request may (--max-prompts-per-request); split it "
                          "into several requests.", param=param, code="too_many_prompts")

    async def render_conversation(self, req: Any, conversation: list[dict[str, Any]],
                                  tools: list[dict[str, Any]] | None = None, param: str = "messages",
                                  raw_request: Request | None = None, as_prompt: bool = False) -> Any:
        """The prompt text of `conversation` (a chat request's messages as templates take them),
        rendered in a render worker (chat_render.py) by the request's chat template (only under
        --trust-request-chat-template), else the server's, else the tokenizer's, with the
        request's template options (a request without them: a generation prompt after the last
        message); `tools` in chat's shape (default: the request's). A template that fails or
        passes a render's limits is a 400 naming `param` (`chat_template` for the request's own);
        with `raw_request`, a client that leaves abandons the render (a 499 nobody reads)."""
        own = req.chat_template is not None
        if own and not self.trust_request_chat_template:
            raise bad_request("chat_template: this server does not render a request's own chat template; its "
                              "operator can allow that with --trust-request-chat-template.", param="chat_template")
        processor = self.engine.input_processor
        if hasattr(processor.tokenizer, "encode_chat") and not own and self.chat_template is None:
            return await self._encode_conversation(req, conversation, tools, param, as_prompt)
        try:
            (job,) = await self.engine.run_off_loop(functools.partial(
                processor.chat_render_jobs, conversation,
                getattr(req, "add_generation_prompt", True), (tools if tools is not None else req.tools) or None,
                continue_final_message=getattr(req, "continue_final_message", False),
                chat_template=req.chat_template if own else self.chat_template,
                chat_template_kwargs=req.chat_template_kwargs))
        except (ValueError, TypeError) as e:
            name = "continue_final_message" if "continue_final_message" in str(e) else param
            raise bad_request(f"{param} could not be rendered with the chat template: {e}", param=name) from None
        per_token = processor.max_chars_per_token
        max_chars = processor.max_prompt_tokens * per_token if per_token else MAX_RENDERED_CHARS
        try:
            if raw_request is None:
                return await self.renderer.render(job, max_chars)
            text = await run_until_disconnected(raw_request, self.renderer.render(job, max_chars))
        except RenderError as e:
            if e.kind == "shutdown":
                raise engine_dead_error(EngineShutDownError(str(e))) from None
            if e.kind == "server":
                raise
            name = "chat_template" if own and e.kind != "template" else param
            if "continue_final_message" in str(e):
                name = "continue_final_message"
            raise bad_request(f"{param} could not be rendered with the chat template: {e}", param=name) from None
        if text is None:
            raise OpenAIServingError("The client closed the request.", 499, "invalid_request_error", None, "client_closed")
        if tools_dropped(job, text):  # the model cannot call tools it never sees: say so, and count it
            processor.warn_tools_dropped(job)
            if self.engine.metrics is not None:
                self.engine.metrics.tool_requests_without_tools_in_prompt.inc()
        return text

    async def _encode_conversation(self, req: Any, conversation: list[dict[str, Any]],
                                   tools: list[dict[str, Any]] | None, param: str, as_prompt: bool) -> Any:
        """tokenizer_mode="mistral": mistral_common encodes the conversation to token ids (its
        request encoding, no template); the prompt dict of those ids and their text. A route that
        takes the prompt as text (`as_prompt` False) cannot take those ids: a 400 says so."""
        if not as_prompt:
            raise bad_request(f"{param}: with tokenizer_mode='mistral' a conversation is encoded to token ids by "
                              "mistral_common, which this route does not take; /v1/chat/completions does.", param=param)
        try:
            return await self.engine.run_off_loop(functools.partial(
                self.engine.input_processor.apply_chat_template, conversation,
                tools=(tools if tools is not None else req.tools) or None,
                continue_final_message=getattr(req, "continue_final_message", False)))
        except ValueError as e:
            raise bad_request(f"{param}: {e}", param=param) from None

    # ---- request fields -> SamplingParams -----------------------------------------------------

    def sampling_params(
        self,
        req: _SamplingFields,
        *,
        max_tokens: int | None,
        logprobs: int | None,
        field_names: dict[str, str],
        prompt_logprobs: int | None = None,
        structured_outputs: StructuredOutputsParams | None = None,
    ) -> SamplingParams:
        if req.stream_options is not None and not req.stream:
            # As vLLM: options for a stream that will not be sent are a mistake, not a no-op.
            raise bad_request("stream_options can only be given when stream is true.", param="stream_options")
        # Priority, as vLLM's: the request's value, else the server's default (the model's
        # generation config), else OpenAI's (SamplingParams' own).
        defaults = self.default_sampling_params
        kwargs: dict[str, Any] = {
            "n": req.n,
            "max_tokens": self.resolve_max_tokens(max_tokens),
            "logprobs": logprobs,
            "prompt_logprobs": prompt_logprobs,
            "seed": req.seed,
            "stop": req.stop,
            "stop_token_ids": req.stop_token_ids,
            "ignore_eos": req.ignore_eos,
            "min_tokens": req.min_tokens,
            "include_stop_str_in_output": req.include_stop_str_in_output,
            "skip_special_tokens": req.skip_special_tokens,
            "spaces_between_special_tokens": req.spaces_between_special_tokens,
            "logit_bias": req.logit_bias,
            "allowed_token_ids": req.allowed_token_ids,
            "bad_words": req.bad_words,
            "truncate_prompt_tokens": req.truncate_prompt_tokens,
            "output_kind": RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY,
            "structured_outputs": structured_outputs,
        }
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "top_k", "min_p",
                     "repetition_penalty"):
            value = getattr(req, name)
            if value is None:
                value = defaults.get(name)
            if value is not None:
                kwargs[name] = value
        try:
            return SamplingParams(**kwargs)
        except ValueError as e:
            raise error_from_value_error(e, field_names) from None

    # Fields that beam search does not use (vLLM ignores them silently): refused by name instead,
    # with the value each must keep.
    _NOT_FOR_BEAM_SEARCH = {"top_p": None, "top_k": None, "min_p": None, "presence_penalty": None,
                            "frequency_penalty": None, "repetition_penalty": None, "stop": None,
                            "stop_token_ids": None, "min_tokens": 0, "logit_bias": None, "allowed_token_ids": None,
                            "bad_words": None, "truncate_prompt_tokens": None}

    def beam_search_params(self, req: _SamplingFields, structured_outputs: StructuredOutputsParams | None) -> BeamSearchParams:
        """vLLM's `use_beam_search`: `n` is the beam width, and the temperature is the request's,
        else the server's default, else OpenAI's 1.0 (as vLLM's). Its max_tokens is set per
        prompt by `start_beam_searches`."""
        for name, unset in self._NOT_FOR_BEAM_SEARCH.items():
            if getattr(req, name, unset) != unset:
                raise bad_request(f"{name} cannot be combined with use_beam_search (beam search ranks whole "
                                  "sequences by their log probability and uses no other sampling field).", param=name)
        if structured_outputs is not None or getattr(req, "prompt_logprobs", None) is not None:
            param = "prompt_logprobs" if structured_outputs is None else "response_format"
            raise bad_request(f"{param} cannot be combined with use_beam_search.", param=param)
        temperature = req.temperature if req.temperature is not None else self.default_sampling_params.get("temperature", 1.0)
        try:
            return BeamSearchParams(beam_width=req.n, max_tokens=1, temperature=temperature, ignore_eos=req.ignore_eos,
                                    length_penalty=req.length_penalty,
                                    include_stop_str_in_output=req.include_stop_str_in_output,
                                    skip_special_tokens=req.skip_special_tokens)
        except ValueError as e:
            raise error_from_value_error(e, {"beam_width": "n"}) from None

    async def start_beam_searches(self, base_id: str, prompts: list[Any], params: BeamSearchParams,
                                  max_tokens: int | None, priority: int, prompt_param: str,
                                  max_name: str = "max_tokens", lora_request: LoRARequest | None = None
                                  ) -> list[BeamSearchStream]:
        """One beam search per prompt, each a task on the loop (`run_beam_search`). Its length is
        the request's max_tokens (a 400 when the context cannot hold it, as for sampling), else
        the server's default, else the rest of the context, and at most the server's cap."""
        processor = self.engine.input_processor
        max_model_len = self.engine.max_model_len
        searches = []
        for prompt in prompts:
            try:
                text, ids = await self.engine.run_off_loop(processor.tokenize_prompt, prompt)
                processor.check_lengths(len(ids), max_tokens)
            except ValueError as e:
                names = {"prompt": prompt_param, "prompt_token_ids": prompt_param, "max_tokens": max_name}
                raise error_from_value_error(e, names, prompt_param=prompt_param) from None
            length = min(n for n in (max_model_len - len(ids), self.resolve_max_tokens(max_tokens)) if n is not None)
            searches.append(BeamSearch(ids, msgspec.structs.replace(params, max_tokens=length),
                                       processor.eos_token_ids, text))
        streams = []
        # As add_requests' window: at most --max-num-seqs beams of one request in the engine at once.
        slots = asyncio.Semaphore(max(1, self.engine.config.max_num_seqs // params.beam_width))
        for i, search in enumerate(searches):
            request_id = base_id if len(searches) == 1 else f"{base_id}-{i}"
            task = asyncio.ensure_future(_beam_search_in_window(slots, self.engine, request_id, search, priority,
                                                                lora_request))
            streams.append(BeamSearchStream(request_id, task, params.beam_width))
        if self.log_requests:
            logger.info("Received request %s: %d prompt(s), beam search: %s", base_id, len(prompts), params)
        return streams

    def token_logprobs(self, c: CompletionOutput, num_top: int, as_ids: bool = False) -> list[dict[str, Any]]:
        """OpenAI's logprobs of chat (`content`) and of the Responses API's output text: one
        entry per token of `c` with its `num_top` most likely alternatives (tokens as
        `token_id:<id>` with `as_ids`)."""
        tokenizer = self.engine.tokenizer
        content = []
        for token_id, position in zip(c.token_ids, c.logprobs or ()):
            lp = position.get(token_id)
            text = token_text(tokenizer, token_id, lp, as_ids)
            content.append(
                {
                    "token": text,
                    "logprob": None if lp is None else lp.logprob,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {"token": t_text, "logprob": l.logprob, "bytes": list(t_text.encode("utf-8"))}
                        for t_text, l in ((token_text(tokenizer, t, l, as_ids), l) for t, l in top_entries(position, num_top))
                    ],
                }
            )
        return content

    # ---- running requests -----------------------------------------------------------------------

    def lora_of(self, model: str) -> LoRARequest | None:
        return self.lora_modules.get(model)

    async def add_requests(
        self, base_id: str, prompts: list[Any], params: SamplingParams | PoolingParams, priority: int,
        prompt_param: str, field_names: dict[str, str] | None = None, lora_request: LoRARequest | None = None,
        trace_headers: dict[str, str] | None = None,
    ) -> list[RequestStream] | list[WindowedStream]:
        """Queues one engine request per prompt (ids `base_id` or `base_id-i`); all or nothing. A
        max_tokens that does not fit in the context after a prompt is a 400, as in vLLM's server
        (`field_names`: the request's name for max_tokens, as in `sampling_params`). Every prompt
        is checked first; past a window of --max-num-seqs sequences the rest are queued one as
        each earlier one ends (WindowedStream), so that one request cannot hold the queue.
        `trace_headers`: the client's W3C trace context (trace_headers_of), its spans' parent."""
        n = params.n if isinstance(params, SamplingParams) else 1
        window = max(1, self.engine.config.max_num_seqs // n)
        streams: list[RequestStream] = []
        held: list[tuple[EngineCoreRequest, str | None]] = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                request, text = await self.engine.process_request(
                    request_id, prompt, params, priority, max_tokens_within_context=True, lora_request=lora_request)
                if i < window:  # the first run while the rest are checked
                    streams.append(await self.engine.add_processed_request(request, text, trace_headers=trace_headers))
                else:
                    held.append((request, text))
        except ValueError as e:
            self.engine.abort_nowait(*[s.request_id for s in streams])
            # The input processor speaks of `prompt` and `prompt_token_ids`: the request's field is
            # `prompt_param` (prompt or messages).
            names = {**(field_names or {}), "prompt": prompt_param, "prompt_token_ids": prompt_param}
            raise error_from_value_error(e, names, prompt_param=prompt_param) from None
        except EngineDeadError as e:
            raise engine_dead_error(e) from None
        except BaseException:
            self.engine.abort_nowait(*[s.request_id for s in streams])
            raise
        if self.log_requests:
            shown = repr(prompts[0])[:self.max_log_len] if len(prompts) == 1 else f"{len(prompts)} prompts"
            logger.info("Received request %s: prompt: %s, params: %s", base_id, shown, params)
        if not held:
            return streams
        slots = asyncio.Semaphore(0)
        return ([WindowedStream(self.engine, stream.request_id, stream.num_seqs, slots, stream=stream)
                 for stream in streams]
                + [WindowedStream(self.engine, request.request_id, request.sampling_params.n, slots, (request, text),
                                  trace_headers=trace_headers)
                   for request, text in held])

    async def merged_outputs(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, output) from every stream, in arrival order. Closing it early (or an
        error in one stream) aborts the requests that have not finished."""
        if len(streams) == 1:
            gen = self._outputs(streams[0])
            try:
                async for out in gen:
                    yield 0, out
            finally:
                await gen.aclose()  # runs its abort synchronously: safe under cancellation
            return
        queue: asyncio.Queue = asyncio.Queue()
        gens = [self._outputs(s) for s in streams]

        async def pump(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
            try:
                async for out in gen:
                    queue.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
        try:
            remaining = len(tasks)
            while remaining:
                i, item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for task in tasks:
                task.cancel()
            self.abort_streams(streams)

    def _outputs(self, stream: RequestStream | BeamSearchStream | WindowedStream
                 ) -> AsyncGenerator[RequestOutput, None]:
        if isinstance(stream, (BeamSearchStream, WindowedStream)):
            return stream.outputs()
        return self.engine.stream_outputs(stream)

    def abort_streams(self, streams: list[RequestStream] | list[BeamSearchStream] | list[WindowedStream]) -> None:
        """Ends the requests (or beam searches) that have not finished; nothing for those that have."""
        for stream in streams:
            if isinstance(stream, BeamSearchStream):
                stream.task.cancel()
            elif isinstance(stream, WindowedStream):
                stream.close()
        self.engine.abort_nowait(*[s.request_id for s in streams if isinstance(s, RequestStream)])

    async def collect_final(self, streams: list[RequestStream]) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for i, out in self.merged_outputs(streams):
                if finals[i] is None or out.finished:
                    finals[i] = out
        except EngineDeadError as e:
            raise engine_dead_error(e) from None
        for out in finals:
            assert out is not None
            check_output_error(out)
        return finals  # type: ignore[return-value]


# How the engine core starts the error of a request it failed for its structured output (a
# grammar that never compiled in time, or that allows no next token): the client's spec.
_GRAMMAR_ERROR = re.compile(r"structured_outputs\.(json_object|json|regex|choice|grammar) ")


async def _beam_search_in_window(slots: asyncio.Semaphore, *args: Any) -> RequestOutput:
    async with slots:
        return await run_beam_search(*args)


def check_output_error(out: RequestOutput) -> None:
    """A request the engine failed on its own (the engine keeps running): a 500 that names the
    request and the cause (counted in tokenloom:request_errors_total); a failure of the request's
    own structured output is a 400 naming that field."""
    grammar = _GRAMMAR_ERROR.match(out.error or "")
    if grammar is not None:
        raise bad_request(f"Request {out.request_id} failed: {out.error}",
                          param=f"structured_outputs.{grammar.group(1)}")
    if out.error is not None or any(c.finish_reason == "error" for c in out.outputs):
        raise OpenAIServingError(
            f"The engine failed request {out.request_id}: {out.error or 'unknown error'}",
            500,
            "server_error",
            None,
            "engine_error",
        )


class EngineStreamingResponse(StreamingResponse):
    """An SSE response that aborts its requests however it ends, even if the body iterator never
    started (a client gone before the first byte)."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def run_until_disconnected(request: Request, work: Any) -> Any:
    """Awaits `work` unless the HTTP client goes away first; then `work` is cancelled (which
    aborts its engine requests) and None is returned (there is nobody to answer)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        try:
            await task
        except (asyncio.CancelledError, Exception):  # noqa: BLE001 - the client is gone
            pass
        return None
    return task.result()


async def _wait_for_disconnect(request: Request) -> None:
    # The body has been read, so the next ASGI message can only be the disconnect.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


def prompt_list(value: Any, param: str) -> list[Any]:
    """OpenAI's four prompt forms (a text, texts, token ids, lists of token ids) as a list of
    prompts (a str or a list of token ids each); an empty one is a 400 naming `param`."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise bad_request(f"{param} must not be empty.", param=param)
    if all(isinstance(x, int) for x in value):
        return [list(value)]
    if all(isinstance(x, list) for x in value) and not all(x for x in value):
        raise bad_request(f"{param} must not contain an empty list of token ids.", param=param)
    return list(value)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens` (--enable-prompt-tokens-details) adds how many prompt tokens
    the prefix cache served, as OpenAI's `prompt_tokens_details.cached_tokens`."""
    counts: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                              "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


def token_text(tokenizer: Any, token_id: int, lp: Logprob | None, as_id: bool = False) -> str:
    """A logprobs entry's token: its text, or vLLM's `token_id:<id>` (return_tokens_as_token_ids,
    for callers that need the id of a token whose text is not valid UTF-8 on its own)."""
    if as_id:
        return f"token_id:{token_id}"
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def top_entries(position: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most likely tokens at one position, most likely first."""
    return sorted(position.items(), key=lambda item: -item[1].logprob)[:k]
