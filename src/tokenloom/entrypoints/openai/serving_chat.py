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
from tokenloom.entrypoints.openai.serving_engine import (
    SSE_DONE,
    EngineStreamingResponse,
    OpenAIServing,
    check_output_error,
    engine_dead_error,
    json_response,
    run_until_disconnected,
    sse_event,
    token_text,
    top_entries,
    usage,
)
from tokenloom.outputs import CompletionOutput


class OpenAIServingChat(OpenAIServing):
    async def create_chat_completion(self, req: ChatCompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(req.model)
        if req.tools:
            raise bad_request("tools are not supported by this server.", param="tools")
        if req.top_logprobs is not None and not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
        max_name = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        num_top = (req.top_logprobs or 0) if req.logprobs else None
        params = self.sampling_params(
            req,
            max_tokens=max_tokens,
            logprobs=num_top,
            field_names={"max_tokens": max_name, "logprobs": "top_logprobs"},
        )
        self.check_capacity(params.n)
        conversation = [{"role": m.role, "content": m.text()} for m in req.messages]
        processor = self.engine.input_processor
        try:
            # The rendered prompt holds every message's text: their length alone may rule it out.
            processor.check_prompt_chars(sum(len(m["content"]) for m in conversation), "conversation")
        except ValueError as e:
            raise bad_request(str(e), param="messages") from None
        try:
            prompt = await self.engine.run_off_loop(processor.apply_chat_template, conversation, req.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - a template error is the conversation's fault
            raise bad_request(f"messages could not be rendered with the chat template: {e}", param="messages") from None
        self.check_capacity(params.n)  # again: other requests were admitted while it was rendered
        request_id = req.request_id or random_id("chatcmpl")
        streams = await self.add_requests(request_id, [prompt], params, req.priority, "messages")
        created = unix_time()
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(request_id, model, created, streams[0], num_top, include_usage)
            return EngineStreamingResponse(body, on_close=lambda: self.engine.abort_nowait(streams[0].request_id))
        result = await run_until_disconnected(raw_request, self.collect_final(streams))
        if result is None:
            return Response(status_code=499)
        out = result[0]
        choices = [
            {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": None if num_top is None else {"content": self._logprobs(c, num_top)},
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            for c in out.outputs
        ]
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return json_response(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage(len(out.prompt_token_ids or ()), completion_tokens),
            }
        )

    async def _stream(
        self,
        request_id: str,
        model: str,
        created: int,
        stream: RequestStream,
        num_top: int | None,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
        extra = {"usage": None} if include_usage else {}
        prompt_tokens = completion_tokens = 0
        try:
            # OpenAI opens every choice with a chunk that carries only the role.
            first = [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(stream.num_seqs)
            ]
            yield sse_event({**base, "choices": first, **extra})
            async for _, out in self.merged_outputs([stream]):
                prompt_tokens = len(out.prompt_token_ids or ())
                choices = []
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    if c.finish_reason == "error":
                        check_output_error(out)
                    completion_tokens += len(c.token_ids)
                    choices.append(
                        {
                            "index": c.index,
                            "delta": {"content": c.text} if c.text else {},
                            "logprobs": None if num_top is None else {"content": self._logprobs(c, num_top)},
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    )
                if choices:
                    yield sse_event({**base, "choices": choices, **extra})
            if include_usage:
                yield sse_event({**base, "choices": [], "usage": usage(prompt_tokens, completion_tokens)})
        except EngineDeadError as e:
            yield sse_event(engine_dead_error(e).to_dict())
        except OpenAIServingError as e:
            yield sse_event(e.to_dict())
        yield SSE_DONE

    def _logprobs(self, c: CompletionOutput, num_top: int) -> list[dict[str, Any]]:
        """OpenAI's chat logprobs `content`: one entry per generated token."""
        tokenizer = self.engine.tokenizer
        content = []
        for token_id, position in zip(c.token_ids, c.logprobs or ()):
            lp = position.get(token_id)
            text = token_text(tokenizer, token_id, lp)
            content.append(
                {
                    "token": text,
                    "logprob": None if lp is None else lp.logprob,
                    "bytes": list(text.encode("utf-8")),
                    "top_logprobs": [
                        {"token": t_text, "logprob": l.logprob, "bytes": list(t_text.encode("utf-8"))}
                        for t_text, l in ((token_text(tokenizer, t, l), l) for t, l in top_entries(position, num_top))
                    ],
                }
            )
        return content
