"""The offline API: `LLM(...).generate(prompts, sampling_params)`, as in vLLM."""
from __future__ import annotations

import dataclasses
import functools
import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any, Literal

import numpy as np
from tqdm.auto import tqdm

from tokenloom.engine.core_client import EngineDeadError
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.entrypoints.beam_search import BeamSearch, BeamSearchOutput
from tokenloom.entrypoints.chat_templates import resolve_chat_template
from tokenloom.entrypoints.engine_args import EngineArgs
from tokenloom.metrics.stats import Metric
from tokenloom.model.generation_config import default_sampling_params, defaults_source
from tokenloom.lora_request import LoRARequest
from tokenloom.engine.processor import check_vllm_only_args
from tokenloom.entrypoints.score_utils import (
    check_cross_encoder,
    cosine_scores,
    cross_encoder_inputs,
    score_pairs,
    text_pairs,
)
from tokenloom.outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# LLM(...)'s keywords: EngineArgs' fields, `model` aside.
_KEYWORDS = frozenset(f.name for f in dataclasses.fields(EngineArgs)) - {"model"}

PromptType = str | dict[str, Any] | list[int]


class LLM:
    """An engine for offline batched inference.

    `model=None` runs the embedded SmolLM2-135M-Instruct (GGUF); otherwise a GGUF file, a
    Hugging Face directory, or a hub id ("org/name", "org/name-GGUF:Q4_K_M"), downloaded once. The keywords are EngineArgs' fields, the same as the CLI's engine
    options; docs/configuration.md (generated from EngineArgs) lists each with its default and
    meaning. `multiprocess=False` runs the engine core in this process (debugging);
    `runner="pooling"` makes an embedding engine (`embed`, `encode`, `classify`, `score`).
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        """Takes exactly EngineArgs' fields as keywords (docs/configuration.md lists them; any
        other keyword is a TypeError). vLLM's keywords that mean nothing here
        (`gpu_memory_utilization`, `trust_remote_code`, `swap_space`, `disable_log_stats`) are
        taken with a warning."""
        unknown = sorted(set(kwargs) - _KEYWORDS)
        if unknown:
            raise TypeError(f"LLM() got unexpected keyword argument(s) {', '.join(map(repr, unknown))}.")
        self._start(EngineArgs(model=model, **kwargs), spelling="keyword")

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs) -> "LLM":
        """An LLM of arguments built elsewhere (a command line's: warnings spell the flags)."""
        llm = cls.__new__(cls)
        llm._start(engine_args, spelling="flag")
        return llm

    def _start(self, engine_args: EngineArgs, spelling: Literal["flag", "keyword"]) -> None:
        config = engine_args.create_engine_config(spelling=spelling)  # resolved: a hub id downloaded
        # Before the engine starts: a model's unusable generation_config.json is said at once.
        self.default_sampling_params = default_sampling_params(config.model, config.generation_config,
                                                               config.override_generation_config)
        if self.default_sampling_params:  # outputs differ from SamplingParams' defaults: say why, as vLLM warns
            logger.warning("Default sampling parameters %s from %s (generation_config='vllm' keeps SamplingParams' "
                           "own).", self.default_sampling_params,
                           defaults_source(config.generation_config, config.override_generation_config))
        self.llm_engine = LLMEngine(config, multiprocess=engine_args.multiprocess)
        if config.trace_path is not None or config.otlp_traces_endpoint is not None:
            # The trace written (and the spans sent) at shutdown, or at exit if nobody shuts us down.
            weakref.finalize(self, self.llm_engine.flush_trace)

    def get_tokenizer(self) -> Any:
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """A fresh SamplingParams with the defaults `generate` and `chat` apply when given none, to
        change and pass back (vLLM's idiom): the model's generation_config.json's sampling fields
        (`generation_config="auto"`, as vLLM), those of another folder's, or SamplingParams' own
        ("vllm"), with `override_generation_config` on top."""
        return SamplingParams.from_optional(**self.default_sampling_params)

    def get_metrics(self) -> list[Metric]:
        """The engine's `tokenloom:` metrics (counters, gauges, histograms) as plain objects:
        vLLM's basic set plus the ledger's (wait seconds by reason, budget spent per step,
        blocks by state, latency parts). Needs enable_ledger=True."""
        return self.llm_engine.get_metrics()

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block, so the next run computes every prompt anew (for fair
        benchmarks, as vLLM's `LLM.reset_prefix_cache`); False while requests hold blocks."""
        return self.llm_engine.reset_prefix_cache()

    def start_profile(self) -> None:
        """vLLM's `LLM.start_profile`: the torch profiler records the engine's ranks (every op of
        every step, CPU and CUDA) until `stop_profile()`. Needs $TOKENLOOM_TORCH_PROFILER_DIR (or
        vLLM's $VLLM_TORCH_PROFILER_DIR) for the traces."""
        self.llm_engine.start_profile()

    def stop_profile(self) -> list[str]:
        """Stops the profiler and writes its Chrome traces (`*.pt.trace.json.gz`: Perfetto,
        chrome://tracing, TensorBoard), one per rank; returns their paths (vLLM returns None)."""
        return self.llm_engine.stop_profile()

    def flush_trace(self) -> str | None:
        """Writes the trace file now (`trace_path`); returns its path, None when not tracing."""
        return self.llm_engine.flush_trace()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in input order (vLLM's arguments,
        in vLLM's order; `lora_request`: the LoRA adapter of every prompt, or one per prompt,
        with enable_lora=True).

        A prompt is a string, a list of token ids, or a dict with "prompt" or "prompt_token_ids".
        """
        prompt_list = _as_prompt_list(prompts)
        defaults = self.get_default_sampling_params() if sampling_params is None else None
        params_list = _broadcast("sampling_params", sampling_params, len(prompt_list), defaults)
        # Only whole outputs come back from here, as from vLLM's LLM: a DELTA (or CUMULATIVE)
        # request would leave just its last piece in the final output.
        final = RequestOutputKind.FINAL_ONLY
        params_list = [p if p.output_kind == final else p.clone(output_kind=final) for p in params_list]
        prio_list = _broadcast("priority", priority, len(prompt_list), 0, per_item=True)
        lora_list = _broadcast("lora_request", lora_request, len(prompt_list), None, per_item=True)
        return self._run_engine(self._add_requests(prompt_list, params_list, prio_list, lora_list), use_tqdm)

    def _add_requests(self, prompts: list[Any], params: list[Any], priorities: list[int], loras: list[Any],
                      pooling_task: str | None = None) -> list[str]:
        """Queues one request per prompt; all or nothing (a bad prompt mid-list: nothing earlier
        stays queued). Returns their ids, in order."""
        engine = self.llm_engine
        ids: list[str] = []
        try:
            # One message to the core: its first step's batch, and so a greedy run's tokens, do
            # not depend on how the prompts' tokenization raced its first steps.
            with engine.batched_adds():
                for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
                    ids.append(engine.next_request_id())
                    engine.add_request(ids[-1], prompt, p, priority=prio, lora_request=lora,
                                       pooling_task=pooling_task)
        except Exception:
            engine.abort_request(ids)
            raise
        return ids

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: Any = None,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt, in input order (vLLM's `LLM.embed`; needs runner="pooling"):
        `outputs.embedding` is a list of floats, pooled and normalized as the engine's
        pooler_config and `pooling_params` say."""
        outs = self._pool(prompts, pooling_params, "embed", truncate_prompt_tokens, use_tqdm, lora_request,
                          tokenization_kwargs)
        return [EmbeddingRequestOutput.from_request_output(o) for o in outs]

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        pooling_task: str | None = None,
        tokenization_kwargs: Any = None,
    ) -> list[PoolingRequestOutput]:
        """vLLM's `LLM.encode`: the pooled tensor of each prompt (`outputs.data`) for
        `pooling_task` "embed" ([hidden]), "token_embed" ([prompt tokens, hidden]) or, with a
        classifier, "classify" ([labels]) and "token_classify" ([prompt tokens, labels])."""
        if pooling_task is None:
            raise ValueError("pooling_task is required for LLM.encode: 'embed' (one vector per prompt, as "
                             "LLM.embed), 'token_embed' (one per prompt token), 'classify' (a classifier's "
                             "label probabilities, as LLM.classify) or 'token_classify' (those of every token).")
        outs = self._pool(prompts, pooling_params, pooling_task, truncate_prompt_tokens, use_tqdm, lora_request,
                          tokenization_kwargs)
        return [PoolingRequestOutput.from_request_output(o) for o in outs]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
        tokenization_kwargs: Any = None,
    ) -> list[ClassificationRequestOutput]:
        """vLLM's `LLM.classify` with a sequence classifier (`*ForSequenceClassification`, run
        with runner="pooling"): `outputs.probs`, one probability per label in the order of the
        model's id2label (softmax; a sigmoid for a one-label model), in input order."""
        outs = self._pool(prompts, pooling_params, "classify", truncate_prompt_tokens, use_tqdm, lora_request,
                          tokenization_kwargs)
        return [ClassificationRequestOutput.from_request_output(o) for o in outs]

    def score(
        self,
        data_1: PromptType | Sequence[PromptType],
        data_2: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
        tokenization_kwargs: Any = None,
        chat_template: str | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's `LLM.score`, one text against many (1:N) or two equal lists pairwise (N:N). With an
        embedding model (a bi-encoder): the cosine similarity of each pair's embeddings, each
        distinct input embedded once. With a one-label classifier (a cross-encoder): its
        probability for each pair of texts read as one input: the text `chat_template` (a score
        template, e.g. vLLM's qwen3_reranker.jinja) renders from the messages query and
        document, else as score_utils.cross_encoder_inputs reads a pair."""
        model_config = self.llm_engine.model_config
        if check_cross_encoder(model_config.classifier_labels):
            render = None if chat_template is None else functools.partial(
                self.llm_engine.input_processor.apply_chat_template, add_generation_prompt=False,
                chat_template=chat_template)
            pairs = text_pairs(data_1, data_2)
            prompts = cross_encoder_inputs(self.get_tokenizer(), pairs, model_config.use_sep_token, render)
            classified = self.classify(prompts, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens,
                                       use_tqdm=use_tqdm, lora_request=lora_request,
                                       tokenization_kwargs=tokenization_kwargs)
            return [ScoringRequestOutput(o.request_id, ScoringOutput(o.outputs.probs[0]), o.prompt_token_ids)
                    for o in classified]
        inputs, pairs = score_pairs(data_1, data_2)
        if chat_template is not None:
            raise ValueError("chat_template applies to scoring with a cross-encoder (a one-label classifier); "
                             "an embedding model embeds each text as it is.")
        outs = self.embed(inputs, pooling_params, truncate_prompt_tokens=truncate_prompt_tokens, use_tqdm=use_tqdm,
                          lora_request=lora_request, tokenization_kwargs=tokenization_kwargs)
        scores = cosine_scores([np.asarray(o.outputs.embedding) for o in outs], pairs)
        return [ScoringRequestOutput(f"{outs[i].request_id}_{outs[j].request_id}", ScoringOutput(s),
                                     outs[i].prompt_token_ids + outs[j].prompt_token_ids)
                for (i, j), s in zip(pairs, scores)]

    def _pool(self, prompts: Any, pooling_params: Any, task: str, truncate_prompt_tokens: int | None,
              use_tqdm: bool, lora_request: Any, tokenization_kwargs: Any) -> list[RequestOutput]:
        check_vllm_only_args(tokenization_kwargs)
        prompt_list = _as_prompt_list(prompts)
        params_list = _broadcast("pooling_params", pooling_params, len(prompt_list), PoolingParams(),
                                 kind=PoolingParams)
        if truncate_prompt_tokens is not None:
            params_list = [p.clone(truncate_prompt_tokens=truncate_prompt_tokens) for p in params_list]
        lora_list = _broadcast("lora_request", lora_request, len(prompt_list), None, per_item=True)
        ids = self._add_requests(prompt_list, params_list, [0] * len(prompt_list), lora_list, pooling_task=task)
        return self._run_engine(ids, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Applies the model's chat template (or `chat_template`) to one conversation or a list
        of them, then generates, as vLLM's `LLM.chat`. A message's content is a string or
        OpenAI's list of text parts. `continue_final_message=True` (with
        `add_generation_prompt=False`) continues the last message instead of opening a new
        turn; `tools` are OpenAI function definitions, rendered by the template;
        `chat_template_kwargs` are the template's own variables. `chat_template` is a Jinja
        template, a file holding one, or the name of a shipped tool-aware template (`hermes`,
        `llama3_json`: entrypoints/chat_templates)."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        own = getattr(self.llm_engine.input_processor.tokenizer, "chat_template", None)
        chat_template = resolve_chat_template(chat_template, "chat_template",
                                              tuple(own) if isinstance(own, dict) else ())
        prompts = [
            self.llm_engine.input_processor.apply_chat_template(
                conv, add_generation_prompt=add_generation_prompt, tools=tools,
                continue_final_message=continue_final_message, chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs)
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    def beam_search(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the `params.beam_width` most likely sequences over
        `params.max_tokens` tokens (entrypoints/beam_search.py), best first. As in vLLM, a
        sequence's `tokens` and `text` include the prompt's. `concurrency_limit` prompts are
        searched at a time (default: all); each step runs every live beam as one engine request."""
        engine = self.llm_engine
        engine.input_processor.check_lora(lora_request)
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}.")
        if concurrency_limit is not None and (isinstance(concurrency_limit, bool) or not isinstance(concurrency_limit, int)
                                              or concurrency_limit < 1):
            raise ValueError(f"concurrency_limit must be a positive integer or None, got {concurrency_limit!r}.")
        processor = engine.input_processor
        searches = []
        for prompt in _as_prompt_list(prompts):
            text, ids = processor.tokenize_prompt(prompt)
            processor.check_lengths(len(ids), params.max_tokens)  # every step's request must fit
            searches.append(BeamSearch(ids, params, processor.eos_token_ids, text))
        limit = concurrency_limit or max(len(searches), 1)
        steps = tqdm(total=len(searches) * params.max_tokens, desc="Beam search", unit="token", disable=not use_tqdm)
        try:
            for start in range(0, len(searches), limit):
                group = searches[start:start + limit]
                while live := [s for s in group if not s.done]:
                    ids: list[str] = []
                    try:
                        with engine.batched_adds():
                            for search in live:
                                step_params = search.step_params()
                                for beam in search.beams:
                                    ids.append(engine.next_request_id())
                                    engine.add_request(ids[-1], {"prompt_token_ids": beam.tokens}, step_params,
                                                       lora_request=lora_request)
                    except BaseException:
                        engine.abort_request(ids)  # none of the step's requests stays queued
                        raise
                    outputs = iter(self._run_engine(ids, use_tqdm=False))
                    for search in live:
                        before = search.num_steps
                        search.advance([next(outputs) for _ in search.beams])
                        # A search that ends early counts its remaining steps as done.
                        steps.update((params.max_tokens if search.done else search.num_steps) - before)
        finally:
            steps.close()
        return [s.output(engine.tokenizer) for s in searches]

    def _run_engine(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        index = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        num_in = num_out = 0
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    results[index[out.request_id]] = out
                    num_in += len(out.prompt_token_ids or ())
                    num_out += sum(len(c.token_ids) for c in out.outputs)
                    bar.update(1)
                    elapsed = bar.format_dict["elapsed"] or 1e-9
                    bar.set_postfix_str(
                        f"est. speed input: {num_in / elapsed:.2f} toks/s, output: {num_out / elapsed:.2f} toks/s"
                    )
        except BaseException:
            engine.abort_request([rid for rid, r in zip(ids, results) if r is None])
            raise
        finally:
            bar.close()
        if engine.is_dead:
            errors = [r for r in results if r is not None and getattr(r, "error", None)]
            reason = errors[0].error if errors else "engine core died"
            raise EngineDeadError(f"the engine core died while {len(errors)} request(s) were in flight: {reason}")
        return results  # type: ignore[return-value]

    def shutdown(self) -> None:
        self.llm_engine.shutdown()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _as_prompt_list(prompts: Any) -> list[PromptType]:
    requirement = "a prompt (a str, a list of token ids or a dict) or a list of prompts"
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # a single prompt given as token ids
    if isinstance(prompts, (bytes, bytearray)) or not isinstance(prompts, Sequence | Iterable):
        raise TypeError(f"prompts must be {requirement}, got {type(prompts).__name__}: {prompts!r:.80}.")
    prompts = list(prompts)
    if not prompts:
        raise ValueError("prompts must not be empty.")
    return prompts


def _broadcast(name: str, value: Any, n: int, default: Any, per_item: bool = False,
               kind: type = SamplingParams) -> list[Any]:
    if value is None:
        return [default] * n
    if isinstance(value, kind) or (per_item and not isinstance(value, (list, tuple))):
        return [value] * n
    if not per_item and (isinstance(value, (dict, str, bytes)) or not isinstance(value, Iterable)):
        # A dict would otherwise be read as a list of its keys ("got str" further down).
        hint = f" (build one with {kind.__name__}(**{value!r:.60}))" if isinstance(value, dict) else ""
        raise TypeError(
            f"{name} must be a {kind.__name__} or a list of them (one per prompt), got {type(value).__name__}{hint}."
        )
    value = list(value)
    if len(value) != n:
        raise ValueError(f"{name} has {len(value)} entries but there are {n} prompts.")
    if not per_item:
        for i, item in enumerate(value):
            if not isinstance(item, kind):
                raise TypeError(f"{name}[{i}] must be a {kind.__name__}, got {type(item).__name__}.")
    return value
