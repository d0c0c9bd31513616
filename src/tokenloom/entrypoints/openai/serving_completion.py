"""POST /v1/completions (OpenAI's legacy text completions).

Echo, as vLLM does it (lm-evaluation-harness scores loglikelihoods this way): with `echo` each
choice's text starts with the prompt's (a token-id prompt decoded), and with `logprobs` its
logprobs cover the prompt's tokens first, from the engine's prompt logprobs (the first prompt
token has none: nothing precedes it to condition on). Streamed, the prompt comes in each
choice's first chunk. `max_tokens: 0` with echo scores the prompt and generates nothing: the
engine cannot run a request for no token, so it runs for one, which is dropped from the text,
the logprobs and the usage. vLLM's `prompt_logprobs: k` extra puts the engine's prompt logprobs
on each choice in vLLM's shape (see `_prompt_logprobs_json`).
"""
from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
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
    prompt_list,
    run_until_disconnected,
    sse_event,
    token_text,
    top_entries,
    usage,
)
from tokenloom.metrics.otel import trace_headers_of
from tokenloom.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput


@dataclass(slots=True)
class _Prompt:
    """What a choice shows of its prompt: the echoed text, and the tokens with the engine's
    prompt logprobs (one per token, None first)."""

    text: str
    token_ids: list[int]
    logprobs: PromptLogprobs | None


def _nothing_generated(c: CompletionOutput) -> CompletionOutput:
    """max_tokens 0: the one token the engine had to generate, dropped. The choice ended on the
    caller's limit ("length"), whatever ended the engine's token (EOS, a stop string)."""
    reason = c.finish_reason if c.finish_reason in (None, "error", "abort") else "length"
    return CompletionOutput(c.index, "", [], None, None if c.logprobs is None else [], reason, None)


def _prompt_logprobs_json(positions: PromptLogprobs, k: int) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or {token id (a JSON key):
    {logprob, rank, decoded_token}}: the prompt's own token, then the k most likely. The engine
    may have computed more than k (echo's `logprobs` asked for more): those with rank > k go."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        result.append(
            {
                str(token_id): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                for j, (token_id, lp) in enumerate(position.items())
                if j == 0 or (lp.rank is not None and lp.rank <= k)  # the prompt's token comes first
            }
        )
    return result


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, req: CompletionRequest, raw_request: Request) -> Response:
        model = self.check_model(req.model)
        if req.suffix:
            raise bad_request("suffix is not supported by this server.", param="suffix")
        if req.best_of is not None and req.best_of != req.n:
            raise bad_request(f"best_of must equal n ({req.n}) on this server, got {req.best_of}.", param="best_of")
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise bad_request("max_tokens must be at least 1, got 0 (0 is allowed only with echo: true, which "
                              "returns the prompt and generates nothing).", param="max_tokens")
        if echo_only and req.min_tokens > 0:
            raise bad_request(f"min_tokens must be <= max_tokens (0), got {req.min_tokens}.", param="min_tokens")
        prompts = prompt_list(req.prompt, "prompt")
        self.check_fan_out(len(prompts), req.n, "prompt" if len(prompts) > 1 else "n")
        # Echo's logprobs come from the prompt logprobs, with as many alternatives as asked for
        # either way.
        prompt_logprobs = req.prompt_logprobs
        if req.echo and req.logprobs is not None:
            prompt_logprobs = max(req.logprobs, prompt_logprobs or 0)
        if req.use_beam_search:
            if echo_only:
                raise bad_request("max_tokens 0 (echo only) cannot be combined with use_beam_search.", param="max_tokens")
            beam = self.beam_search_params(req, structured_outputs_of(req, limits=self.so_limits))
        else:
            params = self.sampling_params(req, max_tokens=1 if echo_only else req.max_tokens, logprobs=req.logprobs,
                                          prompt_logprobs=prompt_logprobs, field_names={},
                                          structured_outputs=structured_outputs_of(req, limits=self.so_limits))
        n = req.n
        self.check_capacity(n * len(prompts))
        request_id = req.request_id or random_id("cmpl")
        if req.use_beam_search:
            streams = await self.start_beam_searches(request_id, prompts, beam, req.max_tokens, req.priority, "prompt",
                                                     lora_request=self.lora_of(model))
        else:
            streams = await self.add_requests(request_id, prompts, params, req.priority, "prompt",
                                              lora_request=self.lora_of(model),
                                              trace_headers=trace_headers_of(raw_request.headers))
        created = unix_time()
        if req.stream:
            options = req.stream_options
            include_usage = bool(options and options.include_usage) or self.force_include_usage
            continuous_usage = bool(include_usage and options and options.continuous_usage_stats)
            body = self._stream(req, request_id, model, created, streams, n, include_usage, continuous_usage)
            return EngineStreamingResponse(body, on_close=lambda: self.abort_streams(streams))
        result = await run_until_disconnected(raw_request, self.collect_final(streams))
        if result is None:
            return Response(status_code=499)  # nobody is listening
        choices = []
        prompt_tokens = completion_tokens = cached = 0
        for i, out in enumerate(result):
            prompt_tokens += len(out.prompt_token_ids or ())
            cached += out.num_cached_tokens
            prompt = await self._prompt(req, out)
            for c in out.outputs:
                if echo_only:
                    c = _nothing_generated(c)
                completion_tokens += len(c.token_ids)
                choices.append(self._choice(req, i * n + c.index, c, prompt, 0))
        return json_response(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, self.cached_tokens(cached)),
            }
        )

    async def _stream(
        self,
        req: CompletionRequest,
        request_id: str,
        model: str,
        created: int,
        streams: list[RequestStream],
        n: int,
        include_usage: bool,
        continuous_usage: bool = False,
    ) -> AsyncIterator[bytes]:
        text_offsets: dict[int, int] = {}  # per choice: where its next chunk's text starts
        prompt_tokens: dict[int, int] = {}
        cached: dict[int, int] = {}  # per prompt: tokens the prefix cache served
        # Per prompt, from its first output: the only one that carries the prompt logprobs (with
        # n > 1 a choice may start in a later output than its prompt's first).
        prompts: dict[int, _Prompt] = {}
        completion_tokens = 0
        shows_prompt = req.echo or req.prompt_logprobs is not None
        base = {"id": request_id, "object": "text_completion", "created": created, "model": model}
        try:
            async for i, out in self.merged_outputs(streams):
                prompt_tokens[i] = len(out.prompt_token_ids or ())
                cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
                if i not in prompts:
                    prompts[i] = await self._prompt(req, out)
                choices = []
                for c in out.outputs:
                    index = i * n + c.index
                    first = index not in text_offsets
                    if not c.text and not c.token_ids and c.finish_reason is None and not (first and shows_prompt):
                        continue
                    if c.finish_reason == "error":
                        check_output_error(out)
                    if req.max_tokens == 0:
                        c = _nothing_generated(c)
                    completion_tokens += len(c.token_ids)
                    choice = self._choice(req, index, c, prompts[i] if first else None, text_offsets.get(index, 0))
                    text_offsets[index] = text_offsets.get(index, 0) + len(choice["text"])
                    choices.append(choice)
                if choices:
                    chunk = {**base, "choices": choices}
                    if include_usage:  # vLLM's continuous_usage_stats: the counts so far on every chunk
                        chunk["usage"] = (usage(sum(prompt_tokens.values()), completion_tokens,
                                                 self.cached_tokens(sum(cached.values()))) if continuous_usage else None)
                    yield sse_event(chunk)
            if include_usage:
                yield sse_event({**base, "choices": [], "usage": usage(sum(prompt_tokens.values()), completion_tokens,
                                                                       self.cached_tokens(sum(cached.values())))})
        except EngineDeadError as e:
            yield sse_event(engine_dead_error(e).to_dict())
        except OpenAIServingError as e:
            yield sse_event(e.to_dict())
        yield SSE_DONE

    async def _prompt(self, req: CompletionRequest, out: RequestOutput) -> _Prompt:
        token_ids = out.prompt_token_ids or []
        text = ""
        if req.echo:
            text = out.prompt
            if text is None:  # a token-id prompt: echoed decoded, as vLLM does
                text = await self.engine.run_off_loop(self.engine.tokenizer.decode, token_ids)
        return _Prompt(text, token_ids, out.prompt_logprobs)

    def _choice(
        self, req: CompletionRequest, index: int, c: CompletionOutput, prompt: _Prompt | None, text_offset: int
    ) -> dict[str, Any]:
        """One choice, or one chunk of a streamed one. `prompt` is given for the choice's first
        (or only) chunk: with echo its text and logprobs come before the completion's, and with
        prompt_logprobs the chunk carries them. `text_offset`: where the chunk's text starts."""
        echoed = prompt if req.echo else None
        logprobs = None
        if req.logprobs is not None:
            logprobs = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
            if echoed is not None:
                self._add_logprobs(logprobs, echoed.token_ids, echoed.logprobs, req.logprobs, text_offset, self.tokens_as_ids(req))
                text_offset += len(echoed.text)
            self._add_logprobs(logprobs, c.token_ids, c.logprobs, req.logprobs, text_offset, self.tokens_as_ids(req))
        choice: dict[str, Any] = {
            "index": index,
            "text": c.text if echoed is None else echoed.text + c.text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if req.prompt_logprobs is not None and prompt is not None:
            choice["prompt_logprobs"] = _prompt_logprobs_json(prompt.logprobs or [], req.prompt_logprobs)
        return choice

    def _add_logprobs(
        self,
        into: dict[str, list[Any]],
        token_ids: Sequence[int],
        positions: Sequence[dict[int, Logprob] | None] | None,
        num_top: int,
        text_offset: int,
        as_ids: bool = False,
    ) -> None:
        """Appends OpenAI's completions logprobs (parallel lists) of `token_ids` to `into`, each
        token scored by its position's logprobs (None for a prompt's first token: its logprob and
        top_logprobs are null, as OpenAI's). The first token starts at `text_offset`."""
        tokenizer = self.engine.tokenizer
        for token_id, position in zip(token_ids, positions or ()):
            lp = None if position is None else position.get(token_id)
            text = token_text(tokenizer, token_id, lp, as_ids)
            top: dict[str, float] | None = None
            if position is not None:
                top = {token_text(tokenizer, t, l, as_ids): l.logprob for t, l in top_entries(position, num_top)}
                if not top and lp is not None:
                    top = {text: lp.logprob}
            into["tokens"].append(text)
            into["token_logprobs"].append(None if lp is None else lp.logprob)
            into["top_logprobs"].append(top)
            into["text_offset"].append(text_offset)
            text_offset += len(text)
