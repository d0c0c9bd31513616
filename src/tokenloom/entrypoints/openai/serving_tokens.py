"""POST /tokenize and POST /detokenize, as vLLM's server has them: clients count a prompt's tokens
(or a conversation's, through the chat template) before they send it, with the tokenizer and the
template the engine will use."""
from __future__ import annotations

import functools
from typing import Any

from starlette.responses import Response

from tokenloom.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest, bad_request
from tokenloom.entrypoints.openai.serving_engine import OpenAIServing, json_response
from tokenloom.entrypoints.openai.tools import template_message


class OpenAIServingTokenization(OpenAIServing):
    async def tokenize(self, req: TokenizeRequest) -> Response:
        self.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Give exactly one of prompt and messages.", param="prompt")
        processor = self.engine.input_processor
        text = req.prompt
        if req.messages is not None:  # rendered as /v1/chat/completions renders them
            text = await self.render_conversation(req, [template_message(m, i) for i, m in enumerate(req.messages)])
        assert text is not None
        tokenizer = self.engine.tokenizer
        if req.add_special_tokens is None:
            encode = processor.encode_prompt  # what the generation endpoints count
        else:
            encode = functools.partial(tokenizer.encode, add_special_tokens=req.add_special_tokens)
        ids = list(await self.engine.run_off_loop(encode, text)) if text else []
        body: dict[str, Any] = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids,
                                "token_strs": tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None}
        return json_response(body)

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        self.check_model(req.model)
        vocab_size = self.engine.input_processor.vocab_size
        bad = [t for t in req.tokens if t >= vocab_size]
        if bad:
            raise bad_request(f"tokens must hold token ids in [0, {vocab_size}) (vocab_size={vocab_size}); "
                              f"got {bad[:8]}.", param="tokens")
        text = await self.engine.run_off_loop(self.engine.tokenizer.decode, req.tokens)
        return json_response({"prompt": text})
