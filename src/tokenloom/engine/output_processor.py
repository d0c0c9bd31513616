"""The caller's side of the output path: `EngineCoreOutput`s in, `RequestOutput`s out.

Per request in flight the processor keeps a `RequestState` (its detokenizer, logprobs, timeline);
per step `process_outputs` turns the core's new tokens into text, applies stop strings, converts
logprobs, folds the children of an n > 1 request together and shapes the result by output kind.
Every request the processor accepted leaves it with exactly one final output: finished by the
core, by a stop string, by `abort_requests`, or by `fail_all` when the engine core died.

Outputs go to the request's `RequestOutputCollector` when it has one (AsyncLLM: the consumer
awaits it), otherwise into the returned list (LLMEngine.step).
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tokenloom.engine.accounts import Account, Accounts
from tokenloom.engine.detokenizer import IncrementalDetokenizer, backend_tokenizer
from tokenloom.engine.parallel_sampling import ParentRequest
from tokenloom.messages import EngineCoreOutput, EngineCoreRequest, FinishReason, LogprobsLists, PooledData, now
from tokenloom.metrics.timeline import settle
from tokenloom.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestMetrics,
    RequestOutput,
    SampleLogprobs,
)
from tokenloom.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """The per-request mailbox between the output processor and one consumer.

    Holds at most one `RequestOutput`: a newer one replaces a CUMULATIVE/FINAL_ONLY output the
    consumer has not read yet (it is a superset), and is merged into a pending DELTA output, so a
    consumer that falls behind loses nothing and never faces a backlog. `put` and `get_nowait`
    need no event loop and may be called from any thread; `get()` is a coroutine that sleeps on a
    future until `put` wakes it (no polling).
    """

    def __init__(self, output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE) -> None:
        self.aggregate = output_kind == RequestOutputKind.DELTA
        self._output: RequestOutput | BaseException | None = None
        self._lock = threading.Lock()
        self._waiter: asyncio.Future[None] | None = None

    def put(self, output: RequestOutput | BaseException) -> None:
        """Stores an output (or an exception for the consumer to raise) and wakes the consumer."""
        with self._lock:
            if self._output is None or isinstance(output, BaseException):
                self._output = output
            elif isinstance(self._output, RequestOutput):
                self._output.add(output, aggregate=self.aggregate)
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            _wake(waiter)

    def get_nowait(self) -> RequestOutput | None:
        """The pending output, or None; raises the exception that was put, if any."""
        with self._lock:
            output, self._output = self._output, None
        if isinstance(output, BaseException):
            raise output
        return output

    def ready(self) -> bool:
        return self._output is not None

    async def get(self) -> RequestOutput:
        while True:
            with self._lock:
                if self._output is None:
                    waiter = asyncio.get_running_loop().create_future()
                    self._waiter = waiter
                else:
                    waiter = None
            if waiter is None:
                output = self.get_nowait()
                if output is not None:
                    return output
                continue
            try:
                await waiter
            finally:
                with self._lock:
                    if self._waiter is waiter:
                        self._waiter = None


def _wake(waiter: asyncio.Future[None]) -> None:
    def set_result() -> None:
        if not waiter.done():
            waiter.set_result(None)

    loop = waiter.get_loop()
    try:
        same_loop = asyncio.get_running_loop() is loop
    except RuntimeError:
        same_loop = False
    if same_loop:
        set_result()
    elif not loop.is_closed():
        loop.call_soon_threadsafe(set_result)


@dataclass(slots=True)
class OutputProcessorOutput:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Requests a stop string finished: the engine core is still generating for them.
    reqs_to_abort: list[str] = field(default_factory=list)


class RequestState:
    """One engine-core request (a plain request or one child of an n > 1 request)."""

    __slots__ = (
        "request_id",
        "parent",
        "request_index",
        "prompt",
        "prompt_token_ids",
        "output_kind",
        "detokenizer",
        "detokenize",
        "logprobs",
        "cumulative_logprob",
        "prompt_logprobs",
        "prompt_logprobs_sent",
        "num_tokens_sent",
        "num_logprobs_sent",
        "metrics",
        "num_cached_tokens",
        "queue",
        "error",
        "account",
        "pooling_output",
    )

    def __init__(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        detokenizer: IncrementalDetokenizer,
        parent: ParentRequest | None,
        request_index: int,
        queue: RequestOutputCollector | None,
    ) -> None:
        params = request.sampling_params
        self.request_id = request.request_id
        self.parent = parent
        self.request_index = request_index
        self.prompt = prompt
        self.prompt_token_ids = request.prompt_token_ids
        self.output_kind = params.output_kind
        self.detokenizer = detokenizer
        self.detokenize = params.detokenize
        self.logprobs: SampleLogprobs | None = None if params.logprobs is None else []
        self.cumulative_logprob: float | None = None if params.logprobs is None else 0.0
        self.prompt_logprobs: PromptLogprobs | None = None if params.prompt_logprobs is None else [None]
        self.prompt_logprobs_sent = False
        self.num_tokens_sent = 0
        self.num_logprobs_sent = 0
        # Registered right after tokenizing and validating: the ledger's "tokenized" stamp.
        self.metrics = RequestMetrics(
            request.arrival_time, num_prompt_tokens=len(request.prompt_token_ids), tokenized_time=now(),
            max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
        )
        self.num_cached_tokens = 0
        self.queue = queue
        self.error: str | None = None
        self.pooling_output: PooledData | None = None
        # Its metrics' account (engine/accounts.py); a child's is its parent's.
        self.account = Account(self.metrics) if parent is None else parent.account

    @property
    def external_id(self) -> str:
        return self.request_id if self.parent is None else self.parent.request_id

    def make_completion_output(
        self, finish_reason: FinishReason | None, stop_reason: int | str | None, has_new_tokens: bool
    ) -> CompletionOutput | None:
        """This request's completion for the step, shaped by its output kind; None when there is
        nothing to report (FINAL_ONLY before the end, or no new tokens)."""
        finished = finish_reason is not None
        if not finished and (self.output_kind == RequestOutputKind.FINAL_ONLY or not has_new_tokens):
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        detok = self.detokenizer
        text = detok.get_next_output_text(finished, delta)
        token_ids = detok.output_token_ids
        logprobs = self.logprobs
        if delta:
            token_ids = token_ids[self.num_tokens_sent :]
            if logprobs is not None:
                logprobs = logprobs[self.num_logprobs_sent :]
        else:
            # Copies: the caller may keep an output while this request keeps growing.
            token_ids = list(token_ids)
            logprobs = None if logprobs is None else list(logprobs)
        self.num_tokens_sent = len(detok.output_token_ids)
        self.num_logprobs_sent = 0 if self.logprobs is None else len(self.logprobs)
        return CompletionOutput(
            index=self.request_index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=None if finish_reason is None else str(finish_reason),
            stop_reason=stop_reason,
        )

    def pop_prompt_logprobs(self) -> PromptLogprobs | None:
        """DELTA outputs carry the prompt logprobs once, on the first output; the others every time
        (they are complete once generation has begun)."""
        if self.output_kind != RequestOutputKind.DELTA:
            return self.prompt_logprobs
        if self.prompt_logprobs_sent:
            return None
        self.prompt_logprobs_sent = True
        return self.prompt_logprobs


class OutputProcessor:
    """Turns the engine core's outputs into `RequestOutput`s, request by request."""

    def __init__(self, tokenizer: Any, expect_timing: bool = False) -> None:
        """`expect_timing`: the engine core's ledger is on, so every core request's account
        comes (late for aborted ones); metrics of a request are ready only with it."""
        self.tokenizer = tokenizer
        self.accounts = Accounts(expect_timing)
        self._backend = backend_tokenizer(tokenizer) if tokenizer is not None else None
        self.request_states: dict[str, RequestState] = {}
        self.parent_requests: dict[str, ParentRequest] = {}
        self._parent_queues: dict[str, RequestOutputCollector] = {}
        # Logprobs name their tokens; a token's text never changes, so it is decoded once.
        self._token_text: dict[int, str] = {}

    # ------------------------------------------------------------------------------ requests

    def add_user_request(self, request: EngineCoreRequest, prompt: str | None,
                         queue: RequestOutputCollector | None = None,
                         trace_headers: dict[str, str] | None = None) -> list[EngineCoreRequest]:
        """Registers a user's request and returns what to send to the engine core: the request
        itself, or with n > 1 its n children. They share the prompt (and so its KV blocks, via
        the prefix cache); their outputs are folded back into one RequestOutput per step.
        `trace_headers`: its W3C trace context, kept in its metrics for its span (metrics/otel.py)."""
        children = self._add_user_request(request, prompt, queue)
        if trace_headers:
            state = self.request_states.get(request.request_id)
            parent = self.parent_requests.get(request.request_id)
            metrics = state.metrics if state is not None else parent.metrics if parent is not None else None
            if metrics is not None:
                metrics.trace_headers = dict(trace_headers)
        return children

    def _add_user_request(self, request: EngineCoreRequest, prompt: str | None,
                          queue: RequestOutputCollector | None) -> list[EngineCoreRequest]:
        # The user's id, whatever n it came with: an n = 1 request and the parent of an n > 1
        # one under the same id would both be answered as that id.
        if request.request_id in self.parent_requests or request.request_id in self.request_states:
            raise ValueError(f"request_id {request.request_id!r} is already in flight.")
        if request.sampling_params.n == 1:
            self.add_request(request, prompt, queue=queue)
            return [request]
        parent = ParentRequest(request.request_id, request.sampling_params)
        # All or nothing: a child id already in flight (a request named "1_<id>") must fail
        # this request before any of its children is registered.
        taken = [cid for cid in parent.child_ids if cid in self.request_states]
        if taken:
            raise ValueError(f"request_id {request.request_id!r} clashes with request {taken[0]!r}, "
                             "which is in flight.")
        children = []
        for index, (child_id, child_params) in enumerate(parent.child_requests()):
            child = msgspec.structs.replace(request, request_id=child_id, sampling_params=child_params)
            self.add_request(child, prompt, parent, index, queue)
            children.append(child)
        return children

    def add_request(
        self,
        request: EngineCoreRequest,
        prompt: str | None,
        parent: ParentRequest | None = None,
        request_index: int = 0,
        queue: RequestOutputCollector | None = None,
    ) -> None:
        """Registers a request sent to the engine core (for n > 1: each child, with its parent and
        index). `queue`: where its outputs go instead of `process_outputs`' return value; for the
        children of one parent pass the same collector."""
        request_id = request.request_id
        if request_id in self.request_states:
            raise ValueError(f"request_id {request_id!r} is already in flight.")
        params = request.sampling_params
        if parent is not None and not 0 <= request_index < parent.n:
            raise ValueError(f"request_index must be in [0, {parent.n}) (the parent's n), got {request_index}.")
        if params.detokenize and self.tokenizer is None:
            raise ValueError("detokenize=True needs a tokenizer; this OutputProcessor has none.")
        detokenizer = IncrementalDetokenizer(self.tokenizer, params, request.prompt_token_ids)
        if parent is not None:
            if self.parent_requests.setdefault(parent.request_id, parent) is not parent:
                raise ValueError(f"request_id {parent.request_id!r} is already in flight.")
            if parent.metrics is None:
                parent.prompt = prompt
                parent.prompt_token_ids = request.prompt_token_ids
                parent.metrics = RequestMetrics(
                    request.arrival_time, num_prompt_tokens=len(request.prompt_token_ids), tokenized_time=now(),
                    n=parent.n, max_tokens=params.max_tokens, temperature=params.temperature, top_p=params.top_p,
                )
                parent.account = Account(parent.metrics)
            if queue is not None:
                self._parent_queues[parent.request_id] = queue
        # A child's outputs go out through its parent, and so to the parent's collector.
        state = RequestState(request, prompt, detokenizer, parent, request_index, queue if parent is None else None)
        self.request_states[request_id] = state

    def has_unfinished_requests(self) -> bool:
        return bool(self.request_states)

    def owes_timing(self) -> bool:
        """Finished requests whose core account has not arrived yet (see engine/accounts.py)."""
        return bool(self.accounts)

    def pop_ready(self) -> list[RequestOutput]:
        """Final outputs whose metrics are complete: record each now (it appears here once)."""
        return self.accounts.pop_ready()

    def get_num_unfinished_requests(self) -> int:
        """Engine-core requests in flight (as vLLM: each child of an n > 1 request counts)."""
        return len(self.request_states)

    # ------------------------------------------------------------------------------- outputs

    def process_outputs(self, outputs: list[EngineCoreOutput], timestamp: float | None = None) -> OutputProcessorOutput:
        """The only function that loops over engine outputs: one pass does everything per request
        (detokenize, stop strings, logprobs, output kind), so each output is touched once.

        Outputs for ids no longer known (finished by a stop string or aborted here while the core
        was still producing) are dropped.
        """
        t = now() if timestamp is None else timestamp
        result = OutputProcessorOutput()
        parents: dict[str, ParentRequest] = {}  # touched this step, in first-seen order
        accounts = self.accounts
        for out in outputs:
            # An aborted request's late account comes before anything of a request that reuses
            # its id (the core sends it first).
            if out.timing is not None and accounts.owes(out.request_id):
                accounts.pay(out)
                continue
            state = self.request_states.get(out.request_id)
            if state is None:
                continue
            new_token_ids = out.new_token_ids
            state.metrics.record_tokens(len(new_token_ids), t)
            if state.parent is not None and state.parent.metrics is not None:
                state.parent.metrics.record_tokens(len(new_token_ids), t)
            if out.num_cached_tokens:
                state.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs is not None and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._convert_logprobs(out.new_prompt_logprobs, state))
            finish_reason, stop_reason = out.finish_reason, out.stop_reason
            num_before = len(state.detokenizer.output_token_ids)
            stop_str = state.detokenizer.update(
                new_token_ids,
                finished=finish_reason is not None,
                stop_terminated=finish_reason == FinishReason.STOP,
            )
            if out.new_logprobs is not None and state.logprobs is not None:
                # Those of the tokens kept: a stop string among several new tokens ends it early.
                self._add_sample_logprobs(state, out.new_logprobs,
                                          len(state.detokenizer.output_token_ids) - num_before)
            if stop_str is not None:
                if finish_reason is None:
                    result.reqs_to_abort.append(out.request_id)
                finish_reason, stop_reason = FinishReason.STOP, stop_str
            if out.error is not None:
                state.error = out.error
            if out.pooling_output is not None:
                state.pooling_output = out.pooling_output
            if out.timing is not None:
                state.metrics.core = out.timing

            completion = state.make_completion_output(finish_reason, stop_reason, bool(new_token_ids))
            if finish_reason is not None:
                self._finish(state, t)
            if completion is not None:
                self._route(state, completion, result.request_outputs, parents)
        for parent in parents.values():
            self._emit_parent(parent, result.request_outputs, t)
        return result

    def abort_requests(self, request_ids: str | Iterable[str]) -> tuple[list[RequestOutput], list[str]]:
        """Finishes the given requests with finish_reason "abort".

        Accepts user-facing ids (a parent id aborts all its children) and engine-core ids.
        Returns the final outputs of those still known (those with a collector get theirs there
        instead) and the engine-core ids the core must abort. Unknown ids are ignored: the
        request already finished and had its final output.
        """
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        return self._finish_requests(request_ids, FinishReason.ABORT, None)

    def fail_all(self, error: str) -> list[RequestOutput]:
        """The engine core died: every request in flight gets one final output with
        finish_reason "error" and `error` set, and the processor is left empty."""
        ids = list(self.parent_requests) + [s.request_id for s in self.request_states.values() if s.parent is None]
        outputs, _ = self._finish_requests(ids, FinishReason.ERROR, error)
        self.accounts.forgive_all()
        return outputs

    def fail_requests(self, core_ids: list[str], error: str) -> list[RequestOutput]:
        """One data-parallel replica died: the user requests it was computing (any of whose core
        requests are in `core_ids`) get one final output with finish_reason "error", as in
        `fail_all`. A parent whose other children live elsewhere fails whole."""
        ids: dict[str, None] = {}
        for core_id in core_ids:
            state = self.request_states.get(core_id)
            if state is not None:
                ids[state.external_id] = None
        outputs, failed_core_ids = self._finish_requests(list(ids), FinishReason.ERROR, error)
        self.accounts.forgive(failed_core_ids)
        return outputs

    # ------------------------------------------------------------------------------ internals

    def _finish_requests(
        self, request_ids: Iterable[str], reason: FinishReason, error: str | None
    ) -> tuple[list[RequestOutput], list[str]]:
        t = now()
        outputs: list[RequestOutput] = []
        core_ids: list[str] = []
        parents: dict[str, ParentRequest] = {}
        for request_id in request_ids:
            parent = self.parent_requests.get(request_id)
            if parent is not None:
                states = [self.request_states[c] for c in parent.child_ids if c in self.request_states]
            elif request_id in self.request_states:
                states = [self.request_states[request_id]]
            else:
                continue
            for state in states:
                core_ids.append(state.request_id)
                if error is not None:
                    state.error = error
                state.detokenizer.update((), finished=True)
                completion = state.make_completion_output(reason, None, False)
                self._finish(state, t)
                assert completion is not None  # finished: every output kind reports
                self._route(state, completion, outputs, parents)
        for parent in parents.values():
            self._emit_parent(parent, outputs, t)
        return outputs, core_ids

    def _finish(self, state: RequestState, t: float) -> None:
        del self.request_states[state.request_id]
        metrics = state.metrics
        metrics.finished_time = t
        metrics.detokenized_time = now()  # its final completion has just been built
        settle(metrics)
        # The child that finishes last is the parent's critical path: its stamps are the
        # parent's (the others ran alongside it).
        self.accounts.finished(state.account, state.request_id, metrics)
        parent = state.parent
        if parent is not None and parent.metrics is not None:
            parent.metrics.detokenized_time = metrics.detokenized_time
            parent.metrics.completion_tokens.append(metrics.num_generation_tokens)
        else:
            metrics.completion_tokens.append(metrics.num_generation_tokens)

    def _route(self, state: RequestState, completion: CompletionOutput, sink: list[RequestOutput],
               parents: dict[str, ParentRequest]) -> None:
        """A request with n=1 emits its completion now; a child's goes into its parent, which
        emits once per step (`_emit_parent`) after all its children's completions are in."""
        parent = state.parent
        if parent is None:
            output = self._request_output(state, [completion])
            if output.finished:
                self.accounts.emitted(state.account, output)
            self._emit(output, state.queue, sink)
            return
        parents[parent.request_id] = parent
        if parent.prompt_logprobs is None and state.prompt_logprobs is not None:
            parent.prompt_logprobs = state.prompt_logprobs
        parent.num_cached_tokens = max(parent.num_cached_tokens, state.num_cached_tokens)
        if state.error is not None:
            parent.error = state.error
        parent.add_child_output(completion)

    def _emit_parent(self, parent: ParentRequest, sink: list[RequestOutput], t: float) -> None:
        got = parent.get_outputs()
        if got is None:
            return
        completions, finished = got
        if finished:
            del self.parent_requests[parent.request_id]
            if parent.metrics is not None:
                parent.metrics.finished_time = t
                settle(parent.metrics)
        prompt_logprobs = parent.prompt_logprobs
        if parent.output_kind == RequestOutputKind.DELTA:
            prompt_logprobs = None if parent.prompt_logprobs_sent else prompt_logprobs
            parent.prompt_logprobs_sent = parent.prompt_logprobs_sent or prompt_logprobs is not None
        output = RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=prompt_logprobs,
            outputs=completions,
            finished=finished,
            metrics=parent.metrics,
            num_cached_tokens=parent.num_cached_tokens,
            error=parent.error,
        )
        if finished and parent.account is not None:
            self.accounts.emitted(parent.account, output)
        queues = self._parent_queues
        queue = queues.pop(parent.request_id, None) if finished else queues.get(parent.request_id)
        self._emit(output, queue, sink)

    def _request_output(self, state: RequestState, completions: list[CompletionOutput]) -> RequestOutput:
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=state.pop_prompt_logprobs(),
            outputs=completions,
            finished=completions[0].finished(),
            metrics=state.metrics,
            num_cached_tokens=state.num_cached_tokens,
            error=state.error,
            pooling_output=state.pooling_output,
        )

    @staticmethod
    def _emit(output: RequestOutput, queue: RequestOutputCollector | None, sink: list[RequestOutput]) -> None:
        if queue is not None:
            queue.put(output)
        else:
            sink.append(output)

    # ------------------------------------------------------------------------------- logprobs

    def _add_sample_logprobs(self, state: RequestState, lists: LogprobsLists, num_kept: int) -> None:
        assert state.logprobs is not None and state.cumulative_logprob is not None
        if num_kept < len(lists.token_ids):
            lists = LogprobsLists(token_ids=lists.token_ids[:num_kept], logprobs=lists.logprobs[:num_kept],
                                  ranks=lists.ranks[:num_kept])
        state.logprobs.extend(self._convert_logprobs(lists, state))
        state.cumulative_logprob += sum(position[0] for position in lists.logprobs if position)

    def _convert_logprobs(self, lists: LogprobsLists, state: RequestState) -> list[dict[int, Logprob]]:
        """vLLM's layout: per position, the chosen token first (with its rank in the whole
        distribution), then the top-k in order (ranks 1..k)."""
        decode = self._decode_token if state.detokenize else None
        result: list[dict[int, Logprob]] = []
        for token_ids, logprobs, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
            position: dict[int, Logprob] = {}
            for i, (token_id, logprob) in enumerate(zip(token_ids, logprobs)):
                if token_id not in position:
                    position[token_id] = Logprob(
                        logprob, rank if i == 0 else i, None if decode is None else decode(token_id)
                    )
            result.append(position)
        return result

    def _decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            assert self._backend is not None
            text = self._token_text[token_id] = self._backend.decode([token_id], skip_special_tokens=False)
        return text
