"""Grammars compiled off the busy loop, one matcher per request, and the step's bitmask.

`request_grammar` starts (or finds in the cache) a request's compilation on the manager's thread
pool and returns at once; the scheduler keeps the request out of its waiting queue until
`StructuredOutputRequest.ready()` (ledger: `queue_grammar_compile`), so the others keep running.
The cache is keyed by `spec_key`: the n children of one request, and every later request with the
same schema, share one compilation.

Each request owns a matcher that has accepted exactly its output tokens so far: the scheduler
advances it with every token it appends, and since preemption keeps a request's output tokens (they
are recomputed, not resampled), the matcher needs no rollback there.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from tokenloom.sampling_params import StructuredOutputsParams
from tokenloom.structured_output import backend

if TYPE_CHECKING:
    import xgrammar as xgr

logger = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 256


# Where a request with reasoning (StructuredOutputsParams._reasoning) is: its first output token
# may open `<think>` or start the grammar's text; inside the reasoning nothing is constrained;
# after `</think>` (or from the start, without reasoning) the grammar rules.
UNDECIDED, REASONING, GRAMMAR = 0, 1, 2


@dataclass(slots=True, eq=False)
class StructuredOutputRequest:
    """One request's grammar: its compilation, then its matcher."""

    params: StructuredOutputsParams
    future: Future
    stop_token_ids: list[int]
    key: tuple = ()
    # When (time.monotonic()) the request stops waiting for its compile, and the limit it names.
    deadline: float = float("inf")
    timeout: float = float("inf")
    # Whether the compiler exists: the clock starts once it does (xgrammar's import and the
    # vocabulary, loaded with the first grammar, are the engine's start-up, not this spec's).
    compiler_ready: Callable[[], bool] = lambda: True
    matcher: xgr.GrammarMatcher | None = None
    error: str | None = field(default=None)
    phase: int = GRAMMAR
    # Set when the grammar allowed no token at all for the request's next one (see GrammarQueue).
    dead_end: bool = False

    def __post_init__(self) -> None:
        if self.params._reasoning is not None:
            self.phase = REASONING if self.params._reasoning[2] else UNDECIDED

    def ready(self) -> bool:
        """True once the matcher exists; False while compiling. A failed compilation, or one past
        the time limit, sets `error` and returns True (the scheduler then fails the request)."""
        if self.matcher is not None or self.error is not None:
            return True
        if not self.future.done():
            if not self.compiler_ready():
                self.deadline = time.monotonic() + self.timeout
            if time.monotonic() < self.deadline:
                return False
            self.error = (f"structured_outputs.{self.params.kind} did not compile within the time limit of "
                          f"{self.timeout:g} s (structured_outputs_compile_timeout, "
                          "--structured-outputs-compile-timeout); a smaller spec compiles sooner")
            return True
        exc = self.future.exception()
        if exc is not None:
            self.error = f"structured_outputs.{self.params.kind} could not be compiled: {exc}"
            return True
        self.matcher = backend.load_xgrammar().GrammarMatcher(
            self.future.result(), override_stop_tokens=self.stop_token_ids)
        return True

    def accept(self, token_ids: list[int]) -> bool:
        """Advances the matcher; False when a token breaks the grammar (it is not accepted).
        Tokens of the reasoning (and the tags around it) are not the grammar's."""
        matcher = self.matcher
        assert matcher is not None
        for token in token_ids:
            if self.phase != GRAMMAR:
                start, end, _ = self.params._reasoning  # type: ignore[misc]
                if self.phase == REASONING:
                    self.phase = GRAMMAR if token == end else REASONING
                    continue
                if token == start:  # UNDECIDED: the reply opens its reasoning
                    self.phase = REASONING
                    continue
                self.phase = GRAMMAR  # the reply starts with the grammar's text
            if not matcher.accept_token(token):
                return False
        return True

    @property
    def constrains_next(self) -> bool:
        """Whether the next token gets a bitmask row (not inside the reasoning)."""
        return self.phase != REASONING

    @property
    def is_terminated(self) -> bool:
        return self.phase == GRAMMAR and self.matcher is not None and self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_num_seqs: int,
                 *, num_compile_threads: int = 2, compile_timeout: float = float("inf"),
                 tokenizer_loader: Callable[[], Any] | None = None) -> None:
        """`tokenizer`, or None and `tokenizer_loader` to build it with the first grammar (on the
        compile thread); its EOS joins `stop_token_ids` then. A request waits at most
        `compile_timeout` seconds for its grammar."""
        self._tokenizer = tokenizer
        self._tokenizer_loader = tokenizer_loader
        self.vocab_size = vocab_size
        # Shared with every request (StructuredOutputRequest.stop_token_ids) and completed in
        # place by `_get_compiler`, which runs before any compilation can finish, so a request's
        # matcher (built once its compilation is done) sees the full list.
        self.stop_token_ids = sorted(set(stop_token_ids))
        self.max_num_seqs = max_num_seqs
        # Several compile threads, so that one slow compile does not hold every other request's
        # grammar behind it. A running compile cannot be interrupted (xgrammar's C++ holds no
        # cancellation point); rather than a compile process to kill (a second copy of xgrammar
        # and the vocabulary, and compiled grammars serialized across), the caller's size limits
        # keep every compile short, a request stops waiting at `compile_timeout`, and a compile
        # nobody waits for any more is cancelled before it starts (`release`).
        self._pool = ThreadPoolExecutor(max_workers=num_compile_threads, thread_name_prefix="grammar")
        self.compile_timeout = compile_timeout
        self._waiters: dict[tuple, int] = {}  # requests waiting on each pending compile
        self._compiler: xgr.GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        # xgrammar and its view of the vocabulary load with the first structured request, on
        # the compile thread (the import, then the vocabulary: benchmarks/CHANGELOG.md, "Server start-up"),
        # as vLLM builds its grammar backend: an engine that never sees one never pays for it,
        # and the busy loop never waits for it (the request waits in `queue_grammar_compile`).
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._bitmask: torch.Tensor | None = None  # [max_num_seqs, ceil(V/32)], on first use
        self._batch_matcher: xgr.BatchGrammarMatcher | None = None

    def _get_compiler(self) -> xgr.GrammarCompiler:
        with self._compiler_lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    assert self._tokenizer_loader is not None
                    self._tokenizer = self._tokenizer_loader()
                    eos = getattr(self._tokenizer, "eos_token_id", None)
                    if eos is not None and eos not in self.stop_token_ids:
                        self.stop_token_ids.append(eos)
                        self.stop_token_ids.sort()
                info = backend.tokenizer_info(self._tokenizer, self.vocab_size, self.stop_token_ids)
                self._compiler = backend.load_xgrammar().GrammarCompiler(info, max_threads=1)
            return self._compiler

    def _compile(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        return backend.compile_spec(self._get_compiler(), params)  # on the pool's thread

    def request_grammar(self, params: StructuredOutputsParams) -> StructuredOutputRequest:
        key = backend.spec_key(params)
        future = self._cache.get(key)
        if future is None:
            future = self._pool.submit(self._compile, params)
            self._cache[key] = future
            if len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        if not future.done():
            self._waiters[key] = self._waiters.get(key, 0) + 1
        return StructuredOutputRequest(params=params, future=future, stop_token_ids=self.stop_token_ids, key=key,
                                       deadline=time.monotonic() + self.compile_timeout, timeout=self.compile_timeout,
                                       compiler_ready=self._compiler_ready)

    def _compiler_ready(self) -> bool:
        return self._compiler is not None

    def release(self, request: StructuredOutputRequest) -> None:
        """The request no longer waits for its compile (it got it, failed, or was aborted): a
        compile that nobody waits for and that has not started is cancelled and forgotten, so an
        aborted request's compile does not hold the threads."""
        count = self._waiters.get(request.key)
        if count is None:
            return
        if count > 1:
            self._waiters[request.key] = count - 1
            return
        del self._waiters[request.key]
        if request.future.cancel() and self._cache.get(request.key) is request.future:
            del self._cache[request.key]

    def grammar_bitmask(self, requests: list[StructuredOutputRequest]) -> torch.Tensor:
        """Rows 0..len(requests)-1 of the bitmask filled for the requests' next tokens (a view
        of a buffer allocated once; valid until the next call)."""
        if self._bitmask is None:
            xgr = backend.load_xgrammar()
            self._bitmask = xgr.allocate_token_bitmask(self.max_num_seqs, self.vocab_size)
            self._batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
        bitmask = self._bitmask[: len(requests)]
        matchers = [r.matcher for r in requests]
        assert self._batch_matcher is not None and all(m is not None for m in matchers)
        self._batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask)
        for row, r in enumerate(requests):
            if r.phase == UNDECIDED:  # the grammar's first tokens, or `<think>`
                start = r.params._reasoning[0]  # type: ignore[index]
                bit = 1 << (start % 32)
                bitmask[row, start // 32] |= bit - (1 << 32) if bit >= 1 << 31 else bit  # int32 words
        return bitmask

    def wait_any(self, requests: list[StructuredOutputRequest], timeout: float) -> None:
        """Blocks up to `timeout` seconds until one of the compilations ends (for a busy loop
        that has nothing else to do meanwhile)."""
        from concurrent.futures import FIRST_COMPLETED, wait

        wait([r.future for r in requests], timeout=timeout, return_when=FIRST_COMPLETED)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
