"""POST /v1/embeddings (OpenAI's), served by an engine started with `--runner pooling`: one
embedding per input, pooled and normalized in the engine core (worker/pooler.py), sent as floats
or as base64 of little-endian float32 bytes (what the official client asks for by default).
And vLLM's pooling routes beside it: POST /pooling (any task's pooled tensor; by default the
token-level one), POST /classify with a sequence classifier (each input's label probabilities and
its most likely label), /score and /rerank with either kind of model (cosine
similarities of embeddings, or a one-label classifier's probability for each pair read together:
entrypoints/score_utils.py). Torch-free: the vectors arrive as bytes, numpy does the rest."""
from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from starlette.requests import Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import (
    ClassificationRequest,
    EmbeddingRequest,
    OpenAIServingError,
    PoolingRequest,
    RerankRequest,
    ScoreRequest,
    bad_request,
    random_id,
    unix_time,
)
from tokenloom.entrypoints.openai.serving_engine import (
    OpenAIServing,
    error_from_value_error,
    json_response,
    prompt_list,
    run_until_disconnected,
    usage,
)
from tokenloom.entrypoints.openai.tools import template_message
from tokenloom.entrypoints.score_utils import (
    check_cross_encoder,
    cosine_scores,
    cross_encoder_inputs,
    score_pairs,
    text_pairs,
)
from tokenloom.outputs import RequestOutput, pooled_array
from tokenloom.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, req: EmbeddingRequest, raw_request: Request) -> Response:
        model = self._check_pooling_model(req.model)
        if self.engine.model_config.classifier_labels is not None:
            raise OpenAIServingError("This model is a sequence classifier: it classifies (/classify) and, with one "
                                     "label, scores pairs (/score, /rerank); it does not embed.", 400,
                                     "invalid_request_error", "model", "model_not_embedding")
        params = self._params(dimensions=req.dimensions, normalize=req.normalize, use_activation=req.use_activation,
                              truncate_prompt_tokens=req.truncate_prompt_tokens)
        return await self._list("embd", req, model, params, raw_request, lambda i, vec: {
            "index": i, "object": "embedding", "embedding": _encoded(vec, req.encoding_format)})

    async def create_classify(self, req: ClassificationRequest, raw_request: Request) -> Response:
        model = self._check_pooling_model(req.model)
        labels = self.engine.model_config.classifier_labels
        if labels is None:
            raise OpenAIServingError("This model embeds: /classify needs a sequence classifier (a checkpoint whose "
                                     "config.json names *ForSequenceClassification).", 400, "invalid_request_error",
                                     "model", "model_not_classifier")
        params = self._params(task="classify", use_activation=req.use_activation,
                              truncate_prompt_tokens=req.truncate_prompt_tokens)
        return await self._list("classify", req, model, params, raw_request, lambda i, probs: {
            "index": i, "label": labels[int(probs.argmax())], "probs": probs.tolist(), "num_classes": len(labels)})

    async def create_pooling(self, req: PoolingRequest, raw_request: Request) -> Response:
        model = self._check_pooling_model(req.model)
        default = "token_embed" if self.engine.model_config.classifier_labels is None else "token_classify"
        params = self._params(task=req.task or default, dimensions=req.dimensions, normalize=req.normalize,
                              use_activation=req.use_activation, truncate_prompt_tokens=req.truncate_prompt_tokens)
        return await self._list("pool", req, model, params, raw_request, lambda i, arr: {
            "index": i, "object": "pooling", "data": _encoded(arr, req.encoding_format)})

    async def create_score(self, req: ScoreRequest, raw_request: Request) -> Response:
        scored = await self._score("score", req, req.text_1, req.text_2, ("text_1", "text_2"), raw_request)
        if scored is None:
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        request_id, model, scores, usage_ = scored
        return json_response({"id": request_id, "object": "list", "created": unix_time(), "model": model,
                              "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                              "usage": usage_})

    async def create_rerank(self, req: RerankRequest, raw_request: Request) -> Response:
        scored = await self._score("rerank", req, req.query, req.documents, ("query", "documents"), raw_request)
        if scored is None:
            return Response(status_code=499)
        request_id, model, scores, usage_ = scored
        order = sorted(range(len(scores)), key=lambda i: -scores[i])[: req.top_n or None]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": req.documents[i]}} if req.return_documents else {})} for i in order]
        return json_response({"id": request_id, "model": model, "results": results,
                              "usage": {"total_tokens": usage_["total_tokens"]}})

    # ---- shared ---------------------------------------------------------------------------------

    def _check_pooling_model(self, model: str | None) -> str:
        model = self.check_model(model)
        if not self.engine.config.is_pooling:
            raise OpenAIServingError(
                "This model generates text (--runner generate): embeddings and scores need a server started with "
                "--runner pooling.", 400, "invalid_request_error", "model", "model_not_embedding")
        return model

    async def _list(self, prefix: str, req: EmbeddingRequest | ClassificationRequest | PoolingRequest, model: str,
                    params: PoolingParams, raw_request: Request, item: Callable[[int, np.ndarray], dict[str, Any]]
                    ) -> Response:
        """The list every one-input-one-result route answers (embeddings, classify, pooling): one
        engine request per input, `item(index, pooled array)` for each, usage; 499 when the
        client went away first."""
        prompts = await self._inputs(req)
        request_id = random_id(prefix)
        outs = await self._embed(request_id, prompts, params, req.priority, "input", model, raw_request)
        if outs is None:
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        # (collect_final raised for a failed request: each has its pooled result)
        data = [item(i, pooled_array(o.pooling_output)) for i, o in enumerate(outs)]  # type: ignore[arg-type]
        prompt_tokens = sum(len(o.prompt_token_ids or ()) for o in outs)
        cached = self.cached_tokens(sum(o.num_cached_tokens for o in outs))
        return json_response({"id": request_id, "object": "list", "created": unix_time(), "model": model,
                              "data": data, "usage": usage(prompt_tokens, 0, cached)})

    async def _inputs(self, req: EmbeddingRequest | ClassificationRequest | PoolingRequest) -> list[Any]:
        """The request's engine inputs: each of `input` (texts tokenized with the tokenizer's
        special tokens unless add_special_tokens is false; token ids as given), or `messages`
        rendered by the chat template into one input, tokenized without them unless asked."""
        if (req.input is None) == (req.messages is None):
            raise bad_request("Give exactly one of input and messages.", param="input")
        if req.messages is not None:
            conversation = [template_message(m, i) for i, m in enumerate(req.messages)]
            text = await self.render_conversation(req, conversation, tools=[])
            encode = functools.partial(self.engine.tokenizer.encode, add_special_tokens=bool(req.add_special_tokens))
            return [list(await self.engine.run_off_loop(encode, text))]
        prompts = prompt_list(req.input, "input")
        self.check_fan_out(len(prompts), 1, "input")
        if req.add_special_tokens is False:  # the texts' own tokens, no BOS (token ids pass as given)
            encode = functools.partial(self.engine.tokenizer.encode, add_special_tokens=False)
            prompts = [p if isinstance(p, list) else list(await self.engine.run_off_loop(encode, p)) for p in prompts]
        return prompts

    @staticmethod
    def _params(**fields: Any) -> PoolingParams:
        try:
            return PoolingParams(**fields)
        except ValueError as e:
            raise error_from_value_error(e) from None

    async def _embed(self, request_id: str, prompts: list[Any], params: PoolingParams, priority: int,
                     prompt_param: str, model: str, raw_request: Request) -> list[RequestOutput] | None:
        """One engine request per prompt, awaited; None when the client went away first."""
        self.check_capacity(len(prompts))
        streams = await self.add_requests(request_id, prompts, params, priority, prompt_param,
                                          lora_request=self.lora_of(model))
        return await run_until_disconnected(raw_request, self.collect_final(streams))

    async def _score(self, kind: str, req: Any, data_1: Any, data_2: Any, names: tuple[str, str],
                     raw_request: Request) -> tuple[str, str, list[float], dict[str, Any]] | None:
        """(request id, model, each pair's score, usage) of a score or rerank request: the cosine
        similarity of embeddings, or a cross-encoder's probability; None when the client went
        away first."""
        model = self._check_pooling_model(req.model)
        request_id = random_id(kind)
        try:
            cross_encoder = check_cross_encoder(self.engine.model_config.classifier_labels)
        except ValueError as e:
            raise OpenAIServingError(str(e), 400, "invalid_request_error", "model", "model_not_scorer") from None
        try:
            if cross_encoder:
                pairs = text_pairs(data_1, data_2, *names)  # tokenized off the loop, in one call
                self.check_fan_out(len(pairs), 1, names[1])
                render = None if self.chat_template is None else functools.partial(
                    self.engine.input_processor.apply_chat_template, add_generation_prompt=False,
                    chat_template=self.chat_template)  # the server's --chat-template is its score template
                inputs = await self.engine.run_off_loop(cross_encoder_inputs, self.engine.tokenizer, pairs,
                                                        self.engine.model_config.use_sep_token, render)
                params = self._params(task="classify", truncate_prompt_tokens=req.truncate_prompt_tokens)
            else:
                inputs, index_pairs = score_pairs(data_1, data_2, *names)
                self.check_fan_out(len(inputs), 1, names[1])
                params = self._params(truncate_prompt_tokens=req.truncate_prompt_tokens)
        except ValueError as e:
            raise error_from_value_error(e) from None
        outs = await self._embed(request_id, inputs, params, req.priority, names[0], model, raw_request)
        if outs is None:
            return None
        vectors = [pooled_array(o.pooling_output) for o in outs]  # type: ignore[arg-type]
        prompt_tokens = sum(len(o.prompt_token_ids or ()) for o in outs)
        scores = ([float(v[0]) for v in vectors] if params.task == "classify"
                  else cosine_scores(vectors, index_pairs))
        return request_id, model, scores, usage(prompt_tokens, 0)


def _encoded(arr: np.ndarray, encoding_format: str) -> Any:
    """A pooled array as floats (nested lists for a matrix) or base64 of its little-endian float32 bytes."""
    return base64.b64encode(arr.tobytes()).decode("ascii") if encoding_format == "base64" else arr.tolist()
