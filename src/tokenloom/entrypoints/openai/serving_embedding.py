"""POST /v1/embeddings (OpenAI's), served by an engine started with `--runner pooling`: one
embedding per input, pooled and normalized in the engine core (worker/pooler.py), sent as floats
or as base64 of little-endian float32 bytes (what the official client asks for by default).
Torch-free: the vectors arrive as bytes and leave as JSON or base64 through numpy."""
from __future__ import annotations

import base64
import functools
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import EmbeddingRequest, OpenAIServingError, random_id, unix_time
from tokenloom.entrypoints.openai.serving_engine import (
    OpenAIServing,
    error_from_value_error,
    json_response,
    prompt_list,
    run_until_disconnected,
    usage,
)
from tokenloom.outputs import RequestOutput, pooled_array
from tokenloom.pooling_params import PoolingParams


class OpenAIServingEmbedding(OpenAIServing):
    async def create_embedding(self, req: EmbeddingRequest, raw_request: Request) -> Response:
        model = self.check_model(req.model)
        if not self.engine.is_pooling:
            raise OpenAIServingError(
                "This model generates text (--runner generate): embeddings need a server started with "
                "--runner pooling.", 400, "invalid_request_error", "model", "model_not_embedding")
        prompts = prompt_list(req.input, "input")
        if not req.add_special_tokens:  # the texts' own tokens, no BOS (token ids pass as given)
            encode = functools.partial(self.engine.tokenizer.encode, add_special_tokens=False)
            prompts = [p if isinstance(p, list) else list(await self.engine.run_off_loop(encode, p)) for p in prompts]
        try:
            params = PoolingParams(dimensions=req.dimensions, normalize=req.normalize,
                                   use_activation=req.use_activation,
                                   truncate_prompt_tokens=req.truncate_prompt_tokens)
        except ValueError as e:
            raise error_from_value_error(e) from None
        self.check_capacity(len(prompts))
        request_id = random_id("embd")
        streams = await self.add_requests(request_id, prompts, params, req.priority, "input",
                                          lora_request=self.lora_of(model))
        outs = await run_until_disconnected(raw_request, self.collect_final(streams))
        if outs is None:
            return Response(status_code=499)  # nobody is listening; the requests were aborted
        return json_response(self._response(request_id, model, outs, req.encoding_format))

    def _response(self, request_id: str, model: str, outs: list[RequestOutput], encoding_format: str
                  ) -> dict[str, Any]:
        data = []
        for i, out in enumerate(outs):
            assert out.pooling_output is not None  # collect_final raised for a failed request
            vec = pooled_array(out.pooling_output)
            embedding: Any = (base64.b64encode(vec.tobytes()).decode("ascii") if encoding_format == "base64"
                              else vec.tolist())
            data.append({"index": i, "object": "embedding", "embedding": embedding})
        prompt_tokens = sum(len(o.prompt_token_ids or ()) for o in outs)
        cached = self.cached_tokens(sum(o.num_cached_tokens for o in outs))
        return {"id": request_id, "object": "list",
                "created": unix_time(), "model": model, "data": data, "usage": usage(prompt_tokens, 0, cached)}
