"""POST /v1/chat/completions: the model's chat template, then the same engine path."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenloom.engine.async_llm import RequestStream
from tokenloom.engine.core_client import EngineDeadError
from tokenloom.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    OpenAIServingError,
    bad_request,
    random_id,
    unix_time,
)
from tokenloom.entrypoints.openai.structured import structured_outputs_of
from tokenloom.entrypoints.openai.tool_parsers import ToolParser
from tokenloom.entrypoints.openai.tools import (
    ToolChoice,
    ToolStream,
    constrained_calls,
    openai_tool_calls,
    resolve_tools,
    template_message,
)
from tokenloom.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EngineStreamingResponse,
    OpenAIServing,
    check_output_error,
    engine_dead_error,
    json_response,
    run_until_disconnected,
    sse_event,
    usage,
)
from tokenloom.metrics.otel import trace_headers_of
from tokenloom.outputs import RequestOutput
from tokenloom.sampling_params import StructuredOutputsParams


class OpenAIServingChat(OpenAIServing):
    def __init__(self, *args: Any, tool_parser: ToolParser, response_role: str = "assistant", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tool_parser = tool_parser  # reads `tool_choice="auto"` replies (--tool-call-parser)
        self.response_role = response_role  # --response-role, as vLLM's (OpenAI: "assistant")

    def _tools(self, req: ChatCompletionRequest) -> tuple[ToolChoice, StructuredOutputsParams | None]:
        choice, extra = resolve_tools(req.tools or [], req.tool_choice, req.parallel_tool_calls)
        return choice, structured_outputs_of(req, extra, limits=self.so_limits)

    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(req.model)
        choice, structured = self._tools(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        as_ids = self.tokens_as_ids(req)
        if req.use_beam_search:
            beam = self.beam_search_params(req, structured)
        else:
            params = self.sampling_params(
                req,
                max_tokens=max_tokens,
                logprobs=num_top,
                field_names={"max_tokens": max_name, "logprobs": "top_logprobs"},
                structured_outputs=structured,
            )
            params = self.keep_harmony_markers(params)
        self.check_fan_out(1, req.n, "n")
        self.check_capacity(req.n)
        conversation = [template_message(m, i) for i, m in enumerate(req.messages)]
        processor = self.engine.input_processor
        try:
            # The rendered prompt holds every message's text: their length alone may rule it out
            # (unless only its end is kept).
            if req.truncate_prompt_tokens is None:
                processor.check_prompt_chars(sum(len(m["content"]) for m in conversation), "conversation")
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None
        # A prompt's text, or (tokenizer_mode="mistral") the dict of its token ids and text.
        prompt = await self.render_conversation(req, conversation, raw_request=raw_request, as_prompt=True)
        # With a reasoning parser, whether the reply starts inside <think> (the prompt opened it).
        reasoning = self.reasoning_opened(prompt if isinstance(prompt, str) else prompt["prompt"])
        if not req.use_beam_search:
            self.grammar_after_reasoning(params, reasoning)
        # vLLM's echo: the reply repeats the last message first when it is the assistant's own.
        last = req.messages[-1]
        echo = last.text() if req.echo and last.role == "assistant" else ""
        self.check_capacity(req.n)  # again: other requests were admitted while it was rendered
        request_id = req.request_id or random_id("chatcmpl")
        if req.use_beam_search:
            streams = await self.start_beam_searches(request_id, [prompt], beam, max_tokens, req.priority, "messages",
                                                     max_name, lora_request=self.lora_of(model))
        else:
            streams = await self.add_requests(request_id, [prompt], params, req.priority, "messages",
                                              {"max_tokens": max_name}, lora_request=self.lora_of(model),
                                              trace_headers=trace_headers_of(raw_request.headers))
        created = unix_time()
        if req.stream:
            options = req.stream_options
            include_usage = bool(options and options.include_usage) or self.force_include_usage
            continuous_usage = bool(include_usage and options and options.continuous_usage_stats)
            body = self._stream(request_id, model, created, streams[0], num_top, include_usage, choice, echo,
                                continuous_usage, as_ids, reasoning, req.include_reasoning)
            return EngineStreamingResponse(body, on_close=lambda: self.abort_streams(streams))
        result = await run_until_disconnected(raw_request, self.collect_final(streams))
        if result is None:
            return Response(status_code=499)
        return self._chat_completion(req, request_id, model, created, result[0], num_top, as_ids, choice, echo,
                                     reasoning)

    def _chat_completion(self, req: ChatCompletionRequest, request_id: str, model: str, created: int,
                         out: RequestOutput, num_top: int | None, as_ids: bool, choice: ToolChoice, echo: str,
                         reasoning: bool | None) -> Response:
        """The chat.completion body of a finished (not streamed) request."""
        choices = []
        for c in out.outputs:
            text, thought = c.text, None
            if reasoning is not None:
                split = self.split_reasoning(c.text, reasoning)
                text, thought = split.content, split.reasoning
            message, finish_reason = self._message(text, c.finish_reason, choice)
            if echo and isinstance(message.get("content"), str):
                message["content"] = echo + message["content"]
            if reasoning is not None:
                if message.get("content") == "":
                    message["content"] = None  # the reply was all reasoning (as vLLM)
                if req.include_reasoning:
                    message |= reasoning_fields(thought or None)
            choices.append({
                "index": c.index,
                "message": message,
                "logprobs": None if num_top is None else {"content": self.token_logprobs(c, num_top, as_ids)},
                "finish_reason": finish_reason,
                "stop_reason": c.stop_reason,
            })
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage(len(out.prompt_token_ids or ()), completion_tokens, self.cached_tokens(out.num_cached_tokens)),
            }
        )

    def _message(self, text: str, finish: str | None, choice: ToolChoice) -> tuple[dict[str, Any], str | None]:
        """The assistant message of a finished choice's text (its content, the reasoning taken
        out) and its finish_reason: `tool_calls` when the reply is calls (a reply cut by
        max_tokens keeps its text and `length`), except for a named function, where OpenAI and
        vLLM answer `stop` (and vLLM an empty content)."""
        if choice.mode in ("required", "named"):
            calls = constrained_calls(choice, text) if finish == "stop" else None
            content = "" if choice.mode == "named" else None
        elif choice.mode == "auto":
            content, calls = self.tool_parser.extract(text)
        else:
            return {"role": self.response_role, "content": text}, finish
        if not calls:
            return {"role": self.response_role, "content": text}, finish
        return ({"role": self.response_role, "content": content, "tool_calls": openai_tool_calls(calls)},
                finish if choice.mode == "named" else "tool_calls")

    async def _stream(
        self,
        request_id: str,
        model: str,
        created: int,
        stream: RequestStream,
        num_top: int | None,
        include_usage: bool,
        choice: ToolChoice,
        echo: str = "",
        continuous_usage: bool = False,
        as_ids: bool = False,
        reasoning: bool | None = None,
        include_reasoning: bool = True,
    ) -> AsyncIterator[bytes]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}
        prompt_tokens = completion_tokens = cached = 0
        try:
            # OpenAI opens every choice with a chunk that carries only the role.
            first = [
                {"index": i, "delta": {"role": self.response_role, "content": echo}, "logprobs": None, "finish_reason": None}
                for i in range(stream.num_seqs)
            ]
            yield sse_event({**base, "choices": first, **extra})
            tool_streams = [ToolStream(choice, self.tool_parser) for _ in range(stream.num_seqs)]
            thoughts = [None if reasoning is None else self.reasoning_stream(reasoning) for _ in range(stream.num_seqs)]
            async for _, out in self.merged_outputs([stream]):
                prompt_tokens = len(out.prompt_token_ids or ())
                cached = max(cached, out.num_cached_tokens)
                choices = []
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    if c.finish_reason == "error":
                        check_output_error(out)
                    completion_tokens += len(c.token_ids)
                    text, thought, thoughts_of = c.text, "", thoughts[c.index]
                    if thoughts_of is not None:
                        thought, text = thoughts_of.feed(c.text, c.finish_reason is not None)
                    if choice.mode == "none":
                        delta, finish_reason = ({"content": text} if text else {}), c.finish_reason
                    else:
                        delta, finish_reason = tool_streams[c.index].feed(text, c.finish_reason)
                    if thought and include_reasoning:
                        delta = reasoning_fields(thought) | delta
                    choices.append(
                        {
                            "index": c.index,
                            "delta": delta,
                            "logprobs": None if num_top is None else {"content": self.token_logprobs(c, num_top, as_ids)},
                            "finish_reason": finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    )
                if choices:
                    # vLLM's continuous_usage_stats: the counts so far on every chunk.
                    chunk_usage = ({"usage": usage(prompt_tokens, completion_tokens, self.cached_tokens(cached))}
                                   if continuous_usage else extra)
                    yield sse_event({**base, "choices": choices, **chunk_usage})
            if include_usage:
                yield sse_event({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens, self.cached_tokens(cached))})
        except EngineDeadError as e:
            yield sse_event(engine_dead_error(e).to_dict())
        except OpenAIServingError as e:
            yield sse_event(e.to_dict())
        yield SSE_DONE


def reasoning_fields(reasoning: str | None) -> dict[str, str | None]:
    """A message's (or delta's) reasoning under both of vLLM's names: `reasoning_content` (also
    DeepSeek's API's, which most clients read) and `reasoning`, its newer one."""
    return {"reasoning_content": reasoning, "reasoning": reasoning}
