"""The caller's side of the input path: a prompt and SamplingParams in, an `EngineCoreRequest` out.

Everything that can be wrong with a request is found here, in the caller, with an error that names
the field and the limit, before anything is queued in the engine core.
"""
from __future__ import annotations

import hashlib
import logging
import operator
from collections.abc import Sequence
from typing import Any

from tokenloom.config import StructuredOutputLimits
from tokenloom.engine.chat_template import ChatRender
from tokenloom.engine.chat_template import render as render_chat
from tokenloom.engine.chat_template import tools_dropped
from tokenloom.lora_request import LoRARequest
from tokenloom.messages import EngineCoreRequest
from tokenloom.model.config import ModelArchConfig
from tokenloom.model.lora_config import read_adapter_config
from tokenloom.pooling_params import PoolerConfig, PoolingParams, check_dimensions
from tokenloom.sampling_params import RequestOutputKind, SamplingParams
from tokenloom.structured_output import validate as validate_structured_outputs

logger = logging.getLogger(__name__)

Conversation = list[dict[str, Any]]

# Arguments of a render that a request's chat_template_kwargs may not override (transformers'
# apply_chat_template gives its own keyword arguments the last word the same way).
_RENDER_ARGUMENTS = frozenset({"tokenize", "add_generation_prompt", "tools", "documents", "continue_final_message",
                               "chat_template", "conversation", "conversations", "return_assistant_tokens_mask"})

# What a pooling request carries to the engine core as its SamplingParams: the core's bookkeeping
# (stop checks, the sampler's row) reads one from every request; a pooling request finishes
# when its prompt has run, before anything is sampled.
POOLING_SAMPLING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False,
                                         output_kind=RequestOutputKind.FINAL_ONLY)


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        model_config: ModelArchConfig,
        max_model_len: int,
        *,
        num_kv_blocks: int | None = None,
        block_size: int | None = None,
        kv_cache_capacity_tokens: int | None = None,
        scheduling_policy: str | None = None,
        enable_lora: bool = False,
        max_lora_rank: int = 16,
        pooler_config: PoolerConfig | None = None,
        structured_output_limits: StructuredOutputLimits | None = None,
        max_logprobs: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        # The engine's max_logprobs (None: SamplingParams' own ceiling only).
        self.max_logprobs = max_logprobs
        # How large a structured output's spec may be (None: unlimited); see backend.check_limits.
        self.structured_output_limits = structured_output_limits
        # Set for an engine with runner="pooling": it takes PoolingParams requests only.
        self.pooler_config = pooler_config
        if pooler_config is not None and pooler_config.dimensions is not None:
            check_dimensions(pooler_config.dimensions, pooler_config, model_config.hidden_size)
        self.enable_lora = enable_lora
        self.max_lora_rank = max_lora_rank
        self._lora_checked: dict[int, str] = {}  # adapter id -> the path whose config passed
        # Hashes of the chat templates seen dropping a request's tools: warned about once each.
        self._templates_dropping_tools: set[str] = set()
        # Under "fcfs" a priority would be silently ignored: refused, as vLLM does (None: unknown).
        self.scheduling_policy = scheduling_policy
        self.model_config = model_config
        self.max_model_len = max_model_len
        # The whole KV cache, in tokens (None: unknown, not checked). The scheduler would reject a
        # longer prompt too, but only once it is queued; here the caller gets a ValueError.
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        # With sliding-window layers every KV cache group takes blocks, so one request holds
        # fewer tokens than num_kv_blocks x block_size: the engine says how many (EngineInfo).
        self.kv_cache_capacity_tokens = kv_cache_capacity_tokens
        self.vocab_size = model_config.vocab_size
        # The primary EOS is the tokenizer's (the one chat templates end a turn with); a model may
        # list more (Llama 3: end_of_text, eom, eot) and must stop at any of them.
        tokenizer_eos = getattr(tokenizer, "eos_token_id", None)
        eos_ids = [tokenizer_eos] if tokenizer_eos is not None else []
        eos_ids += [t for t in model_config.eos_token_ids if t != tokenizer_eos]
        self.eos_token_id: int | None = eos_ids[0] if eos_ids else None
        self.eos_token_ids: list[int] = eos_ids
        self.max_chars_per_token = _max_chars_per_token(tokenizer)

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt accepted: shorter than max_model_len (as long as it for a pooling
        engine, which generates nothing after it), within the whole KV cache."""
        limit = self.max_model_len - (0 if self.pooler_config is not None else 1)
        if self.kv_cache_capacity_tokens is not None:
            limit = min(limit, self.kv_cache_capacity_tokens)
        elif self.num_kv_blocks is not None and self.block_size is not None:
            limit = min(limit, self.num_kv_blocks * self.block_size)
        return limit

    def check_prompt_chars(self, num_chars: int, what: str = "prompt") -> None:
        """Rejects a text too long to fit before tokenizing it: no token spans more than
        `max_chars_per_token` characters, so the text has at least num_chars / that many tokens.
        A 20 MB prompt is refused at once instead of after seconds of tokenizing."""
        per_token = self.max_chars_per_token
        if per_token is None:
            return
        min_tokens = -(-num_chars // per_token)
        if min_tokens > self.max_prompt_tokens:
            raise ValueError(
                f"The {what} is {num_chars} characters long, so at least {min_tokens} tokens (no token of this "
                f"tokenizer spans more than {per_token} characters), but a prompt may have at most "
                f"{self.max_prompt_tokens} tokens (max_model_len is {self.max_model_len})."
            )

    def process(
        self,
        request_id: str,
        prompt: str | list[int] | dict[str, Any],
        params: SamplingParams,
        arrival_time: float,
        priority: int = 0,
        max_tokens_within_context: bool = False,
        lora_request: LoRARequest | None = None,
        pooling_task: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """Tokenizes and validates one request. Returns the request for the engine core and the
        prompt text (None when the prompt was given as token ids only). `params` is not changed:
        the request carries a copy completed with max_tokens and the token-id caches.
        `max_tokens_within_context`: refuse a max_tokens that the context cannot hold after the
        prompt, as vLLM's and OpenAI's servers do (offline, such a request ends at the context
        with finish_reason "length", as in vLLM's LLM)."""
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}.")
        if isinstance(priority, bool) or not isinstance(priority, int) or not -(1 << 63) <= priority < (1 << 63):
            # It crosses the process boundary as a msgpack int64.
            raise ValueError(f"priority must be an integer in [-2**63, 2**63), got {priority!r}.")
        if priority != 0 and self.scheduling_policy == "fcfs":
            raise ValueError(f"priority is {priority} but the engine schedules first come, first served: "
                             "start it with scheduling_policy='priority' (--scheduling-policy priority) to use priorities.")
        self.check_lora(lora_request)
        pooling_params = self._pooling_params(params, pooling_task)
        prompt_text, prompt_token_ids = self._tokenize_prompt(prompt, self._truncation(params))
        prompt_len = len(prompt_token_ids)
        if pooling_params is not None and isinstance(prompt, dict) and prompt.get("token_type_ids") is not None:
            pooling_params = pooling_params.clone(token_type_start=_token_type_start(prompt, prompt_len))
        within = max_tokens_within_context and isinstance(params, SamplingParams)
        self.check_lengths(prompt_len, params.max_tokens if within else None)
        params = POOLING_SAMPLING_PARAMS if pooling_params is not None else self._complete_params(params, prompt_len)
        request = EngineCoreRequest(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time,
            priority=priority,
            lora_request=lora_request,
            pooling_params=pooling_params,
        )
        return request, prompt_text

    def _pooling_params(self, params: Any, task: str | None) -> PoolingParams | None:
        """A pooling request's parameters as the engine core runs them (None for generation);
        each kind of request only on the engine that runs it, refused here naming the remedy."""
        if isinstance(params, PoolingParams):
            if self.pooler_config is None:
                raise ValueError("This model generates (runner='generate'): embeddings need an engine started with "
                                 "runner='pooling' (LLM(..., runner='pooling'), tokenloom serve --runner pooling).")
            labels = self.model_config.classifier_labels
            default = "embed" if labels is None else "classify"
            return params.resolve(task or params.task or default, self.pooler_config, self.model_config.hidden_size,
                                  labels)
        if self.pooler_config is not None and isinstance(params, SamplingParams):
            raise ValueError("This engine embeds (runner='pooling'): it does not generate text. Use LLM.embed() or "
                             "LLM.encode() (the /v1/embeddings route), or start another engine with runner='generate'.")
        return None

    def check_lora(self, lora_request: Any) -> None:
        """A request's LoRA adapter, checked in the caller (its config: the rank, the options);
        the engine core loads its weights on first use."""
        if lora_request is None:
            return
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a tokenloom.LoRARequest, got {type(lora_request).__name__}.")
        if not self.enable_lora:
            raise ValueError("lora_request needs LoRA adapters turned on: LLM(enable_lora=True) or --enable-lora.")
        # Read once per adapter id, not once per request (a server's requests name the same few).
        if self._lora_checked.get(lora_request.lora_int_id) != lora_request.lora_path:
            read_adapter_config(lora_request.lora_path, self.max_lora_rank)
            self._lora_checked[lora_request.lora_int_id] = lora_request.lora_path

    def apply_chat_template(
        self,
        messages: Conversation | Sequence[Conversation],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """The prompt text of a conversation (a list of {"role", "content"} messages), or the list
        of prompt texts of a list of conversations, rendered here, in the caller's thread (the
        server renders `chat_render_jobs` in its render workers instead). A tokenizer that encodes
        conversations itself (tokenizer_mode="mistral": mistral_common's request encoding, no
        template) gives prompt dicts of token ids and their text instead."""
        if hasattr(self.tokenizer, "encode_chat") and chat_template is None:
            single = isinstance(messages[0], dict)
            encoded = [dict(zip(("prompt_token_ids", "prompt"), self.tokenizer.encode_chat(
                [_text_message(m, i) for i, m in enumerate(conv)], tools, continue_final_message)))
                for conv in ([messages] if single else messages)]
            return encoded[0] if single else encoded
        jobs = self.chat_render_jobs(messages, add_generation_prompt, tools, continue_final_message=continue_final_message,
                                     chat_template=chat_template, chat_template_kwargs=chat_template_kwargs)
        prompts = [render_chat(job) for job in jobs]
        for job in (job for job, prompt in zip(jobs, prompts) if tools_dropped(job, prompt)):
            self.warn_tools_dropped(job)
        return prompts[0] if isinstance(messages[0], dict) else prompts

    def chat_render_jobs(
        self,
        messages: Conversation | Sequence[Conversation],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[ChatRender]:
        """One render job per conversation, by the tokenizer's chat template (or `chat_template`,
        a Jinja template of one's own). `tools` (OpenAI's function definitions) are rendered as
        the template renders them (transformers' `apply_chat_template(tools=...)`); a template
        without tool support leaves them out. `continue_final_message` leaves the last message
        open for the model to continue (an assistant prefill), as in vLLM and transformers;
        `chat_template_kwargs` are the template's own variables (e.g. Qwen3's `enable_thinking`).
        A message's content may be OpenAI's list of text parts: they are joined with newlines,
        as vLLM joins them."""
        if chat_template is None and getattr(self.tokenizer, "chat_template", None) is None:
            raise ValueError("The tokenizer has no chat template; pass prompts as text or token ids, "
                             "or give a chat_template.")
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a non-empty list of messages or of conversations.")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be true: the "
                             "first continues the last message, the second opens a new assistant turn.")
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, dict):
            raise TypeError(f"chat_template_kwargs must be a dict, got {type(chat_template_kwargs).__name__}.")
        single = isinstance(messages[0], dict)
        conversations: Sequence[Conversation] = [messages] if single else messages  # type: ignore[list-item]
        # A named template (a tokenizer's dict of them, e.g. "tool_use") is picked as transformers picks it.
        template = self.tokenizer.get_chat_template(chat_template, tools)
        # The tokenizer's special tokens, then the caller's own variables; the render's own
        # arguments (what this call means) are not the caller's to set.
        variables = {**self.tokenizer.special_tokens_map,
                     **{k: v for k, v in (chat_template_kwargs or {}).items() if k not in _RENDER_ARGUMENTS}}
        jobs = []
        for conversation in conversations:
            if not isinstance(conversation, (list, tuple)) or not all(isinstance(m, dict) for m in conversation):
                raise ValueError("each conversation must be a list of {'role': ..., 'content': ...} dicts.")
            if continue_final_message and not conversation:
                raise ValueError("continue_final_message needs a conversation with a last message to continue.")
            jobs.append(ChatRender(template, [_text_message(m, i) for i, m in enumerate(conversation)],
                                   add_generation_prompt, continue_final_message, tools, variables))
        return jobs

    def warn_tools_dropped(self, job: ChatRender) -> None:
        """One warning per chat template (by the hash of its text) that drops a request's
        `tools` (chat_template.tools_dropped): the model never sees them, so `tool_choice="auto"`
        never calls one, and nothing else would say so."""
        digest = hashlib.sha256(job.template.encode()).hexdigest()[:12]
        if digest in self._templates_dropping_tools:
            return
        self._templates_dropping_tools.add(digest)
        logger.warning(
            "The chat template (sha256 %s...) drops the request's tools: none of their names is in the rendered "
            "prompt, so the model cannot call them (tool_choice='auto' answers in text). Use a tool-aware template: "
            "`tokenloom serve --chat-template <name or path>` or LLM.chat(chat_template=...), e.g. the shipped "
            "'hermes' (ChatML, read by --tool-call-parser hermes) or 'llama3_json' (Llama 3.x, --tool-call-parser "
            "json). Warned once per template; the server counts each such request in "
            "tokenloom:tool_requests_without_tools_in_prompt_total.", digest)

    # ------------------------------------------------------------------------------ internals

    def _truncation(self, params: Any) -> int | None:
        """How many of the prompt's last tokens `params.truncate_prompt_tokens` keeps, or None."""
        keep = params.truncate_prompt_tokens if isinstance(params, (SamplingParams, PoolingParams)) else None
        if keep == -1:
            return self.max_prompt_tokens
        if keep is not None and keep > self.max_model_len:
            raise ValueError(
                f"truncate_prompt_tokens is {keep} but max_model_len is {self.max_model_len}: select a smaller "
                f"truncation size (-1 keeps the longest prompt the model takes, {self.max_prompt_tokens} tokens)."
            )
        return keep

    def check_lengths(self, prompt_len: int, max_tokens: int | None = None) -> None:
        """A ValueError for a prompt the engine could never run (no room for a token in the
        context, or more than the KV cache holds for one request) and, when given, a max_tokens
        the context cannot hold after it (what vLLM's and OpenAI's servers refuse)."""
        if self.pooler_config is not None and prompt_len > self.max_model_len:
            raise ValueError(
                f"The prompt is {prompt_len} tokens long but max_model_len is {self.max_model_len}: a prompt may be "
                f"at most {self.max_model_len} tokens (the model's maximum positions); truncate_prompt_tokens=-1 "
                "keeps its last max_model_len tokens."
            )
        if self.pooler_config is None and prompt_len >= self.max_model_len:
            raise ValueError(
                f"The prompt is {prompt_len} tokens long but max_model_len is {self.max_model_len}: "
                f"a prompt must be shorter than max_model_len (at most {self.max_model_len - 1} tokens) "
                "to leave room for at least one generated token."
            )
        if self.kv_cache_capacity_tokens is not None and prompt_len > self.kv_cache_capacity_tokens:
            raise ValueError(
                f"The prompt is {prompt_len} tokens long but the KV cache holds at most "
                f"{self.kv_cache_capacity_tokens} tokens of one request (num_kv_blocks={self.num_kv_blocks} "
                f"x block_size={self.block_size}, shared by the model's KV cache groups): it could never be "
                "scheduled. Shorten the prompt or give the KV cache more memory."
            )
        if self.num_kv_blocks is not None and self.block_size is not None:
            capacity = self.num_kv_blocks * self.block_size
            if prompt_len > capacity:
                raise ValueError(
                    f"The prompt is {prompt_len} tokens long but the KV cache holds only {capacity} tokens "
                    f"(num_kv_blocks={self.num_kv_blocks} x block_size={self.block_size}): it could never be "
                    "scheduled. Shorten the prompt or give the KV cache more memory."
                )
        if max_tokens is not None and max_tokens > self.max_model_len - prompt_len:
            raise ValueError(
                f"max_tokens is too large: {max_tokens}. This model's maximum context length is "
                f"{self.max_model_len} tokens and the request has {prompt_len} input tokens "
                f"({max_tokens} > {self.max_model_len} - {prompt_len})."
            )

    def tokenize_prompt(self, prompt: Any) -> tuple[str | None, list[int]]:
        """A prompt (str, token ids or prompt dict) as `process` reads it: its text (None for
        token ids) and checked token ids. For callers that build requests from a prompt's tokens
        (beam search)."""
        return self._tokenize_prompt(prompt)

    def _tokenize_prompt(self, prompt: Any, truncate: int | None = None) -> tuple[str | None, list[int]]:
        """The prompt's text (None for token ids) and token ids. With `truncate`, only the last
        `truncate` tokens are kept (a text prompt keeps its BOS in front, as a tokenizer truncating
        on the left does); the text returned is then the kept tokens' decoded text."""
        prompt_text: str | None = None
        token_ids: Any = None
        truncated = False
        if isinstance(prompt, dict):
            if "prompt_token_ids" not in prompt and "prompt" not in prompt:
                raise ValueError(
                    f"A prompt dict needs a 'prompt' (text) or 'prompt_token_ids' key, got keys {sorted(prompt)!r}."
                )
            token_ids = prompt.get("prompt_token_ids")
            prompt_text = prompt.get("prompt")
            if prompt_text is not None and not isinstance(prompt_text, str):
                raise ValueError(f"prompt must be a str, got {type(prompt_text).__name__}.")
        elif isinstance(prompt, str):
            prompt_text = prompt
        elif isinstance(prompt, (list, tuple)):
            token_ids = prompt
        else:
            raise ValueError(
                f"A prompt is a str, a list of token ids, or a dict with 'prompt' or 'prompt_token_ids'; "
                f"got {type(prompt).__name__}."
            )
        if token_ids is None:
            assert prompt_text is not None
            if not prompt_text:
                raise ValueError("prompt must not be empty.")
            if truncate is None:  # a truncated prompt may be as long as it likes
                self.check_prompt_chars(len(prompt_text))
            token_ids = self.encode_prompt(prompt_text)
            if not token_ids:
                raise ValueError(f"prompt {prompt_text!r} tokenizes to no tokens.")
            if truncate is not None and len(token_ids) > truncate:
                bos_id = getattr(self.tokenizer, "bos_token_id", None)
                head = token_ids[:1] if bos_id is not None and token_ids[0] == bos_id else []
                token_ids = head + token_ids[len(token_ids) - max(truncate - len(head), 0):]
                truncated = True
        elif truncate is not None and isinstance(token_ids, (list, tuple)) and len(token_ids) > truncate:
            token_ids = token_ids[-truncate:]
            truncated = prompt_text is not None  # a text given with its ids: the text of those kept
        ids = self._check_token_ids(token_ids)
        return (self.tokenizer.decode(ids) if truncated else prompt_text), ids

    def encode_prompt(self, text: str) -> list[int]:
        """Tokenizes with the tokenizer's own special tokens (a BOS where it adds one), but not a
        second BOS in front of a prompt that already starts with it (a chat template's output)."""
        ids = list(self.tokenizer.encode(text))
        bos_id = getattr(self.tokenizer, "bos_token_id", None)
        bos = getattr(self.tokenizer, "bos_token", None)
        if bos_id is not None and bos and len(ids) >= 2 and ids[0] == ids[1] == bos_id and text.startswith(bos):
            ids = ids[1:]
        return ids

    def _check_token_ids(self, token_ids: Any) -> list[int]:
        requirement = f"a non-empty list of token ids in [0, {self.vocab_size}) (vocab_size={self.vocab_size})"
        if not isinstance(token_ids, (list, tuple)):
            raise ValueError(f"prompt_token_ids must be {requirement}, got {type(token_ids).__name__}.")
        if not token_ids:
            raise ValueError("prompt_token_ids must not be empty.")
        if len(token_ids) >= self.max_model_len:  # before looking at millions of elements
            self.check_lengths(len(token_ids))
        ids: list[int] = []
        for t in token_ids:
            try:
                if isinstance(t, bool):
                    raise TypeError
                ids.append(operator.index(t))
            except TypeError:
                raise ValueError(f"prompt_token_ids must be {requirement}, got an element {t!r}.") from None
        bad = [(i, t) for i, t in enumerate(ids) if not 0 <= t < self.vocab_size]
        if bad:
            shown = ", ".join(f"{t} at position {i}" for i, t in bad[:8])
            raise ValueError(
                f"prompt_token_ids must hold token ids in [0, {self.vocab_size}) "
                f"(vocab_size={self.vocab_size}); got out-of-vocabulary id(s): {shown}."
            )
        return ids

    def _complete_params(self, params: SamplingParams, prompt_len: int) -> SamplingParams:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}.")
        self._check_logprobs(params)
        changes: dict[str, Any] = {}
        if params.max_tokens is None:
            changes["max_tokens"] = self.max_model_len - prompt_len
        eos_ids = [] if params.ignore_eos else self.eos_token_ids
        stop_token_ids = list(params.stop_token_ids or ())
        extra_eos = [t for t in eos_ids if t != self.eos_token_id and t not in stop_token_ids]
        if extra_eos:
            # The core stops at `eos_token_id` and at `stop_token_ids`; the model's other EOS ids
            # join the latter (as in vLLM), and are reported as the stop_reason.
            changes["stop_token_ids"] = stop_token_ids + extra_eos
        changes["_all_stop_token_ids"] = sorted(set(eos_ids) | set(stop_token_ids))
        if params.bad_words:
            changes["_bad_words_token_ids"] = self._bad_words_token_ids(params.bad_words)
        params = params.clone(**changes)
        params.verify_against_vocab(self.vocab_size)
        if params.structured_outputs is not None:
            # The schema, regex or grammar must be within the limits and compile: refused here
            # with a message naming the field (and the limit, or quoting the compiler).
            validate_structured_outputs(params.structured_outputs, self.structured_output_limits)
        return params

    def _check_logprobs(self, params: SamplingParams) -> None:
        """vLLM's max_logprobs: the most logprobs a request of this engine may ask for."""
        if self.max_logprobs is None:
            return
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name}={value} is more than this engine's max_logprobs ({self.max_logprobs}); "
                                 "start it with a larger max_logprobs (--max-logprobs).")

    def _bad_words_token_ids(self, bad_words: list[str]) -> list[list[int]]:
        """Each bad word as it reads at the start of a text and after a space: the two often
        tokenize differently (BPE folds the space into the word's first token). A spaced variant
        that is only the plain one behind separate space tokens adds nothing and is left out."""
        result: list[list[int]] = []
        for word in bad_words:
            word = word.lstrip()
            if not word:
                continue
            plain = list(self.tokenizer.encode(word, add_special_tokens=False))
            spaced = list(self.tokenizer.encode(" " + word, add_special_tokens=False))
            for ids in (plain, spaced):
                if not ids or ids in result:
                    continue
                if ids is spaced and plain and spaced[-len(plain) :] == plain:
                    continue
                result.append(ids)
        return result


def check_vllm_only_args(tokenization_kwargs: Any = None, data_parallel_rank: Any = None) -> None:
    """vLLM's request arguments that code written for it passes, often as None: None is accepted,
    anything else is refused by name rather than ignored (a prompt is cut with
    SamplingParams.truncate_prompt_tokens; replicas are chosen by load)."""
    if tokenization_kwargs is not None:
        raise ValueError("tokenization_kwargs is not supported: to cut a prompt, set "
                         "SamplingParams(truncate_prompt_tokens=k).")
    if data_parallel_rank is not None:
        raise ValueError("data_parallel_rank is not supported: requests go to the least loaded replica.")


def _text_message(message: dict[str, Any], index: int) -> dict[str, Any]:
    """A message whose content is OpenAI's list of parts, with the parts' text joined by newlines
    (as vLLM does for a text-only model; the templates of text models expect a string)."""
    content = message.get("content")
    if not isinstance(content, list):
        return message
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text" or not isinstance(part.get("text"), str):
            got = repr(kind) if kind is not None else type(part).__name__
            raise ValueError(f"messages[{index}].content[{j}] must be a text part {{'type': 'text', 'text': str}}: "
                             f"this model reads text only, got {got}.")
        texts.append(part["text"])
    return {**message, "content": "\n".join(texts)}


def _max_chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, or None when that is unknown. A
    vocabulary entry's string has one character per byte it encodes (byte-level BPE) or more
    (sentencepiece's byte tokens "<0x41>"), and text has at least one byte per character, so the
    longest entry bounds it from above. Only without a normalizer, which could shrink the text
    before it is split (collapsing whitespace, say)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.normalizer is not None:
        return None
    longest = max((len(t) for t in tokenizer.get_vocab()), default=0)
    return longest or None


def _token_type_start(prompt: dict[str, Any], kept: int) -> int | None:
    """Where a prompt's `token_type_ids` (zeros, then ones: a pair's first and second text) turn
    to 1, counted in the `kept` last tokens that truncation left; None when they never do."""
    types, ids = prompt["token_type_ids"], prompt.get("prompt_token_ids")
    if ids is None or not isinstance(types, (list, tuple)) or len(types) != len(ids):
        raise ValueError("token_type_ids must come with prompt_token_ids, one type per token.")
    start = next((i for i, t in enumerate(types) if t != 0), None)
    if start is None:
        return None
    if any(t != 1 for t in types[start:]):
        raise ValueError("token_type_ids must be 0s followed by 1s (a pair's first text, then its second).")
    return max(start - (len(ids) - kept), 0)
