"""POST /v1/completions (OpenAI's legacy text completions)."""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenloom.engine.async_llm import RequestStream
from tokenloom.engine.core_client import EngineDeadError
from tokenloom.entrypoints.openai.protocol import CompletionRequest, OpenAIServingError, bad_request, random_id, unix_time
from tokenloom.entrypoints.openai.structured import structured_outputs_of
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


def _prompts(req: CompletionRequest) -> list[Any]:
    """OpenAI's four prompt forms -> a list of prompts (a str or a list of token ids each)."""
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise bad_request("prompt must not be empty.", param="prompt")
    if all(isinstance(x, int) for x in p):
        return [list(p)]
    if all(isinstance(x, list) for x in p) and not all(x for x in p):  # type: ignore[union-attr]
        raise bad_request("prompt must not contain an empty list of token ids.", param="prompt")
    return list(p)


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(req.model)
        if req.echo:
            raise bad_request("echo is not supported by this server.", param="echo")
        if req.suffix:
            raise bad_request("suffix is not supported by this server.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of must equal n ({req.n}) on this server, got {req.best_of}.", param="best_of")
        prompts = _prompts(req)
        params = self.sampling_params(req, max_tokens=req.max_tokens, logprobs=req.logprobs, field_names={},
                                      structured_outputs=structured_outputs_of(req))
        self.check_capacity(params.n * len(prompts))
        request_id = req.request_id or random_id("cmpl")
        streams = await self.add_requests(request_id, prompts, params, req.priority, "prompt")
        created = unix_time()
        num_top = req.logprobs
        if req.stream:
            include_usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(request_id, model, created, streams, params.n, num_top, include_usage)
            return EngineStreamingResponse(body, on_close=lambda: self.engine.abort_nowait(*[s.request_id for s in streams]))
        result = await run_until_disconnected(raw_request, self.collect_final(streams))
        if result is None:
            return Response(status_code=499)  # nobody is listening
        choices = []
        prompt_tokens = completion_tokens = 0
        for i, out in enumerate(result):
            prompt_tokens += len(out.prompt_token_ids or ())
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(
                    {
                        "index": i * params.n + c.index,
                        "text": c.text,
                        "logprobs": None if num_top is None else self._logprobs(c, num_top, 0),
                        "finish_reason": c.finish_reason,
                        "stop_reason": c.stop_reason,
                    }
                )
        return json_response(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens),
            }
        )

    async def _stream(
        self,
        request_id: str,
        model: str,
        created: int,
        streams: list[RequestStream],
        n: int,
        num_top: int | None,
        include_usage: bool,
    ) -> AsyncIterator[bytes]:
        text_offsets: dict[int, int] = {}
        prompt_tokens: dict[int, int] = {}
        completion_tokens = 0
        base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        try:
            async for i, out in self.merged_outputs(streams):
                prompt_tokens[i] = len(out.prompt_token_ids or ())
                choices = []
                for c in out.outputs:
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    if c.finish_reason == "error":
                        check_output_error(out)
                    index = i * n + c.index
                    completion_tokens += len(c.token_ids)
                    logprobs = None
                    if num_top is not None:
                        logprobs = self._logprobs(c, num_top, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + len(c.text)
                    choices.append(
                        {
                            "index": index,
                            "text": c.text,
                            "logprobs": logprobs,
                            "finish_reason": c.finish_reason,
                            "stop_reason": c.stop_reason,
                        }
                    )
                if choices:
                    chunk = {**base, "choices": choices}
                    if include_usage:
                        chunk["usage"] = None
                    yield sse_event(chunk)
            if include_usage:
                yield sse_event({**base, "choices": [], "usage": usage(sum(prompt_tokens.values()), completion_tokens)})
        except EngineDeadError as e:
            yield sse_event(engine_dead_error(e).to_dict())
        except OpenAIServingError as e:
            yield sse_event(e.to_dict())
        yield SSE_DONE

    def _logprobs(self, c: CompletionOutput, num_top: int, text_offset: int) -> dict[str, Any]:
        """OpenAI's completions logprobs: parallel lists over the generated tokens."""
        tokenizer = self.engine.tokenizer
        tokens: list[str] = []
        token_logprobs: list[float | None] = []
        top_logprobs: list[dict[str, float]] = []
        text_offsets: list[int] = []
        for token_id, position in zip(c.token_ids, c.logprobs or ()):
            lp = position.get(token_id)
            text = token_text(tokenizer, token_id, lp)
            tokens.append(text)
            token_logprobs.append(None if lp is None else lp.logprob)
            top = {token_text(tokenizer, t, l): l.logprob for t, l in top_entries(position, num_top)}
            if not top and lp is not None:
                top = {text: lp.logprob}
            top_logprobs.append(top)
            text_offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": text_offsets}
