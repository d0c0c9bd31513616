"""AsyncLLM: the asyncio face of the engine (vLLM's V1 `AsyncLLM`), used by the HTTP server.

Everything runs on one event loop, so no locks:
- `generate()` tokenizes and validates in the caller, on a small thread pool (a long prompt or
  chat template never stalls the loop: the tokenizer releases the GIL), then registers a
  `RequestStream` on the loop and sends the request to the core, then yields whatever the stream
  receives;
- one background task, the output handler, is the only reader of the core's outputs: it
  detokenizes them in chunks (yielding to the loop between chunks, so a big batch never stalls
  the HTTP side), feeds the Prometheus metrics and routes each `RequestOutput` to its stream.

Three ways a request ends early, all of which free its KV blocks in the core:
- the consumer stops iterating (`aclose()`, cancellation on client disconnect): `generate()`
  aborts the request before the exception propagates;
- `abort(request_id)`;
- the engine core dies: every stream is failed with `EngineDeadError`, which each `generate()`
  re-raises; `is_dead` turns True and new requests fail fast with the same error.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import os
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any


from tokenloom.config import EngineConfig, torch_profiler_dir
from tokenloom.engine.async_client import AsyncMPClient
from tokenloom.engine.core_client import (
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    ENGINE_SHUT_DOWN,
    EngineDeadError,
    EngineShutDownError,
)
from tokenloom.engine.dp_client import DPAsyncClient, ReplicaDeadError
from tokenloom.engine.frontend import EngineFrontend
from tokenloom.engine.output_processor import RequestOutputCollector
from tokenloom.engine.processor import check_vllm_only_args
from tokenloom.engine.tokenizer_pool import TokenizerPool
from tokenloom.messages import ENGINE_STOPPED_BY_SIGINT, EngineCoreOutputs, EngineCoreRequest, now
from tokenloom.metrics.ledger import FrontendLedger
from tokenloom.metrics.live import live_view
from tokenloom.metrics.prometheus import PrometheusMetrics
from tokenloom.outputs import PoolingRequestOutput, RequestOutput
from tokenloom.lora_request import LoRARequest
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Engine-core outputs detokenized per slice of the output handler before it yields to the loop.
OUTPUT_CHUNK_SIZE = 128
# Threads that tokenize prompts and render chat templates off the event loop. Bounded: more
# would only contend for the same cores as the engine; requests beyond them queue.
NUM_TOKENIZER_THREADS = min(4, os.cpu_count() or 1)
# /health turns red once every tokenizer thread has been on its current job this long: new
# requests cannot even be read. `serve --health-tokenizer-pool-limit`.
DEFAULT_TOKENIZER_POOL_LIMIT_S = 10.0
# How long /health waits for a core that looks stalled to be heard from: the event loop may just
# have been busy, with the heartbeats waiting unread on the socket.
_HEARTBEAT_GRACE_S = 0.2


def _settle_soon(loop: asyncio.AbstractEventLoop, future: asyncio.Future, job: concurrent.futures.Future) -> None:
    try:
        loop.call_soon_threadsafe(_settle, future, job)
    except RuntimeError:  # the loop has closed: nobody awaits the result any more
        pass


def _settle(future: asyncio.Future, job: concurrent.futures.Future) -> None:
    if future.done():  # failed by shutdown() meanwhile
        return
    if job.cancelled():
        future.cancel()
    elif job.exception() is not None:
        future.set_exception(job.exception())
    else:
        future.set_result(job.result())


@dataclass(slots=True)
class RequestStream:
    """One request in flight, as AsyncLLM tracks it: the collector its outputs are put in (which
    merges them if the consumer falls behind, so there is never a backlog) and how many core-side
    requests it stands for."""

    request_id: str
    num_seqs: int  # n
    collector: RequestOutputCollector

    async def get(self) -> RequestOutput:
        return await self.collector.get()  # raises the exception that ended the request, if any


class AsyncLLM(EngineFrontend):
    def __init__(self, config: EngineConfig, *, model_name: str | None = None, log_stats: bool = True,
                 metrics_prefix: str = "tokenloom", log_requests: bool = False) -> None:
        """`metrics_prefix`: "vllm" names the metrics vLLM also has `vllm:...` (see
        metrics/prometheus.py). `log_requests`: an INFO line as each request is added and
        aborted (vLLM's enable_log_requests)."""
        self.log_requests = log_requests
        self.engine_core: AsyncMPClient | DPAsyncClient
        self._start(config, asyncio_mode=True)
        # As given (config.model_name): a hub id, not the folder it is downloaded to.
        self.model_name: str = model_name or config.model_name  # type: ignore[assignment]
        self.data_parallel_size = config.data_parallel_size
        self.metrics: PrometheusMetrics | None = (
            PrometheusMetrics(self.model_name, metrics_prefix=metrics_prefix, max_model_len=self.max_model_len,
                              data_parallel_size=config.data_parallel_size) if log_stats else None)
        # The ledger's caller side: returned stamps, and the trace file (`--trace`).
        self.ledger: FrontendLedger | None = None
        if config.enable_ledger:
            self.ledger = FrontendLedger(config, self.model_name, self.engine_core.info, metrics=self.metrics,
                                         live=True)
        self._streams: dict[str, RequestStream] = {}
        self._num_unfinished_seqs = 0
        self._num_pending_seqs = 0  # being tokenized (see add_request)
        # Sequences a caller has processed and holds back to add later (the server adds a big
        # request's prompts a window at a time): unfinished work, counted for admission.
        self.num_deferred_seqs = 0
        self._output_handler: asyncio.Task | None = None
        self._dead_error: EngineDeadError | None = None
        self._reaper: asyncio.Task | None = None
        # Daemon threads: a job that never ends must not keep a stopped server alive.
        self.tokenizer_pool = TokenizerPool(NUM_TOKENIZER_THREADS, thread_name_prefix="tokenloom-tokenize")
        self._off_loop: set[asyncio.Future] = set()  # run_off_loop calls awaited now
        # What /health reports as unhealthy (see health_problem); serve sets them from its flags.
        self.heartbeat_timeout_s = DEFAULT_HEARTBEAT_TIMEOUT_S
        self.tokenizer_pool_limit_s = DEFAULT_TOKENIZER_POOL_LIMIT_S
        self._metrics_refreshed_at = time.monotonic()

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "AsyncLLM":
        return cls(EngineConfig(**kwargs))

    @classmethod
    def from_engine_args(cls, engine_args: Any, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: list[Any] | None = None) -> "AsyncLLM":
        """vLLM's constructor: `engine_args` is anything whose `create_engine_config()` returns an
        EngineConfig (tokenloom's `AsyncEngineArgs`; taken by that method so that engine/ needs
        nothing from entrypoints/). `start_engine_loop` is taken and changes nothing: the output
        handler starts with the first request either way (as vLLM's does when no event loop is
        running yet). `usage_context` is vLLM's usage-telemetry label (unused); `stat_loggers`
        must be empty, since tokenloom's metrics are its own Prometheus ones."""
        config = cls._config_from_engine_args(engine_args, stat_loggers, "AsyncEngineArgs",
                                              "tokenloom's metrics are exported by its own Prometheus collectors "
                                              "(see AsyncLLM.metrics).")
        return cls(config, log_requests=bool(getattr(engine_args, "enable_log_requests", False)))

    # ---- requests ---------------------------------------------------------------------------

    async def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams | None = None,
        priority: int = 0,
        max_tokens_within_context: bool = False,
        lora_request: LoRARequest | None = None,
        pooling_task: str | None = None,
        trace_headers: Mapping[str, str] | None = None,
    ) -> RequestStream:
        """Validates and queues one request; its outputs arrive on the returned stream. Raises
        ValueError for a bad prompt or parameters (with `max_tokens_within_context`, also for a
        max_tokens the context cannot hold: see InputProcessor.process), EngineDeadError if the
        core is gone. `trace_headers`: its W3C trace context (traceparent, tracestate), the parent
        of its OpenTelemetry span."""
        request, prompt_text = await self.process_request(request_id, prompt, params, priority,
                                                          max_tokens_within_context, lora_request, pooling_task)
        return await self.add_processed_request(request, prompt_text, trace_headers=trace_headers)

    async def process_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams | None = None,
        priority: int = 0,
        max_tokens_within_context: bool = False,
        lora_request: LoRARequest | None = None,
        pooling_task: str | None = None,
    ) -> tuple[EngineCoreRequest, str | None]:
        """The first half of add_request(): the request validated and tokenized (off the loop),
        not yet queued; `add_processed_request()` queues it. Raises as add_request() does."""
        self._check_alive()
        self._ensure_output_handler()
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight.")
        if params is None:
            params = PoolingParams() if self.config.is_pooling else SamplingParams()
        arrival_time = now()
        # Counted as unfinished while it is tokenized, so that a burst of requests checked against
        # --max-waiting-requests meanwhile sees it (see get_num_unfinished_seqs).
        pending = params.n if isinstance(params, SamplingParams) else 1
        self._num_pending_seqs += pending
        try:
            return await self.run_off_loop(
                self.input_processor.process, request_id, prompt, params, arrival_time, priority,
                max_tokens_within_context, lora_request, pooling_task
            )
        finally:
            self._num_pending_seqs -= pending

    async def add_processed_request(self, request: EngineCoreRequest, prompt_text: str | None,
                                    arrives_now: bool = False,
                                    trace_headers: Mapping[str, str] | None = None) -> RequestStream:
        """Queues a request from process_request(); its outputs arrive on the returned stream.
        `arrives_now`: its arrival time is now, not when it was processed, so that the priority
        policy orders it after requests that arrived meanwhile (a caller that held it back)."""
        # Checked again: the loop ran other requests while this one was being tokenized.
        self._check_alive()
        request_id = request.request_id
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in flight.")
        if arrives_now:
            request.arrival_time = now()
        n = request.sampling_params.n
        stream = RequestStream(request_id, n, RequestOutputCollector(request.sampling_params.output_kind))
        children = self.output_processor.add_user_request(
            request, prompt_text, trace_headers=dict(trace_headers) if trace_headers else None)
        self._streams[request_id] = stream
        self._num_unfinished_seqs += n
        try:
            await self.engine_core.add_requests_async(children)
        except BaseException:
            self.abort_nowait(request_id)
            raise
        if self.log_requests:
            logger.info("Added request %s.", request_id)
        return stream

    async def run_off_loop(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the tokenizer pool (tokenizing, chat templates), awaited. Raises
        EngineShutDownError if the engine is shut down first (the job itself cannot be stopped)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        job = self.tokenizer_pool.submit(fn, *args)
        job.add_done_callback(functools.partial(_settle_soon, loop, future))
        self._off_loop.add(future)
        try:
            return await future
        except asyncio.CancelledError:
            job.cancel()  # if no thread has taken it yet
            raise
        finally:
            self._off_loop.discard(future)

    @property
    def num_off_loop_jobs(self) -> int:
        """run_off_loop calls still awaited (requests being parsed, tokenized or rendered)."""
        return len(self._off_loop)

    async def generate(
        self,
        prompt: Any,
        sampling_params: SamplingParams | None,
        request_id: str,
        priority: int = 0,
        *,
        lora_request: Any = None,
        tokenization_kwargs: Any = None,
        trace_headers: Mapping[str, str] | None = None,  # W3C trace context: its span's parent (metrics/otel.py)
        data_parallel_rank: int | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields the request's outputs (cumulative, delta or final only, as
        `sampling_params.output_kind` says) until the finished one. Closing or cancelling the
        generator before then aborts the request in the core. vLLM's other arguments are taken
        as None (see check_vllm_only_args)."""
        check_vllm_only_args(tokenization_kwargs, data_parallel_rank)
        stream = await self.add_request(request_id, prompt, sampling_params, priority, lora_request=lora_request,
                                        trace_headers=trace_headers)
        outputs = self.stream_outputs(stream)
        try:
            async for out in outputs:
                yield out
        finally:
            await outputs.aclose()  # its abort is synchronous: this never suspends

    async def encode(
        self,
        prompt: Any,
        pooling_params: PoolingParams | None,
        request_id: str,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        *,
        pooling_task: str | None = None,
        tokenization_kwargs: Any = None,
        trace_headers: Mapping[str, str] | None = None,  # W3C trace context: its span's parent
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """vLLM's: a pooling request (runner="pooling"); yields its one, final output, whose
        `outputs.data` is the pooled tensor. `pooling_task` "embed" or "token_embed" (an embedding
        model; "embed" by default), "classify" or "token_classify" (a classifier; "classify").
        Closing the generator first aborts the request."""
        check_vllm_only_args(tokenization_kwargs)
        stream = await self.add_request(request_id, prompt, pooling_params or PoolingParams(), priority,
                                        lora_request=lora_request, pooling_task=pooling_task,
                                        trace_headers=trace_headers)
        outputs = self.stream_outputs(stream)
        try:
            async for out in outputs:
                if out.finished:
                    yield PoolingRequestOutput.from_request_output(out)
        finally:
            await outputs.aclose()

    async def stream_outputs(self, stream: RequestStream) -> AsyncGenerator[RequestOutput, None]:
        """The outputs of a request queued with `add_request()`, up to the finished one. Raises
        EngineDeadError if the core dies first. Ending early aborts the request."""
        finished = False
        try:
            while not finished:
                out = await stream.get()
                finished = out.finished
                yield out
        except EngineDeadError:
            finished = True  # nothing left to abort
            raise
        finally:
            if not finished:
                # Synchronous on purpose: under a cancelled anyio scope (a disconnected HTTP
                # client) any await here would itself be cancelled before it ran.
                self.abort_nowait(stream.request_id)

    async def abort(self, request_id: str | list[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.abort_nowait(*ids)

    def abort_nowait(self, *request_ids: str) -> None:
        """Aborts unfinished requests (unknown or finished ids are ignored). A consumer still
        waiting gets a final output with finish_reason "abort"; the core is told to free their
        blocks from a task, so this can run where awaiting cannot."""
        live = [rid for rid in request_ids if rid in self._streams]
        if not live:
            return
        if self.log_requests:
            logger.info("Aborted request(s) %s.", ",".join(live))
        streams = {rid: self._streams.pop(rid) for rid in live}
        for stream in streams.values():
            self._num_unfinished_seqs -= stream.num_seqs
        final_outputs, core_ids = self.output_processor.abort_requests(live)
        for out in final_outputs:
            self._returned(out)
            stream = streams.get(out.request_id)
            if stream is not None:
                stream.collector.put(out)
        self._record_ready()  # with the ledger on, their accounts come later from the core
        if core_ids and self._dead_error is None:
            # Queued on the socket now, not from a task: a client may reuse a request_id as soon
            # as this returns, and its ADD must not reach the core before this ABORT.
            self.engine_core.abort_requests_nowait(list(core_ids))

    # ---- the output handler -----------------------------------------------------------------

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        handler = self._output_handler
        if handler is not None and handler.get_loop() is loop and not handler.done():
            return
        if handler is not None and handler.get_loop() is not loop:
            old = handler.get_loop()
            if old.is_running():
                raise RuntimeError("this AsyncLLM is in use by another running event loop; use one AsyncLLM per loop.")
            # The loop it ran in has ended (a second asyncio.run, a notebook cell): its handler,
            # asyncio sockets and consumers went with it. The core is still up: rebind and go on;
            # requests left over from that loop have no consumer any more, so they are aborted.
            if not handler.done():  # a loop stopped but not closed must not read on if it runs again
                with contextlib.suppress(RuntimeError):  # a closed loop takes no callbacks
                    handler.cancel()
            self.engine_core.rebind_loop()
            self.abort_nowait(*list(self._streams))
        self._output_handler = loop.create_task(self._run_output_handler(), name="tokenloom-output-handler")

    async def _run_output_handler(self) -> None:
        try:
            while True:
                try:
                    outputs = await self.engine_core.get_output_async()
                except ReplicaDeadError as e:  # one data-parallel replica; the others serve on
                    self._fail_replica(e)
                    continue
                await self._handle_outputs(outputs)
        except asyncio.CancelledError:
            raise
        except EngineDeadError as e:
            self._fail_everything(e)
        except Exception as e:  # noqa: BLE001 - a bug here must not leave callers hanging forever
            logger.exception("tokenloom output handler failed")
            self._fail_everything(EngineDeadError(f"output handler failed: {e!r}"))
            self.engine_core.shutdown()

    async def _handle_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None and self.metrics is not None:
            self.metrics.record_scheduler_stats(outputs.scheduler_stats, outputs.engine_index)
        if self.ledger is not None:
            self.ledger.record_step(outputs)
        core_outputs = outputs.outputs
        received = outputs.received_time or None  # token times: when the message arrived
        for start in range(0, len(core_outputs), OUTPUT_CHUNK_SIZE):
            if start:
                await asyncio.sleep(0)
            processed = self.output_processor.process_outputs(core_outputs[start : start + OUTPUT_CHUNK_SIZE], received)
            self._route(processed.request_outputs)
            self._record_ready()
            if processed.reqs_to_abort:  # e.g. stop strings found by the detokenizer
                await self.engine_core.abort_requests_async(processed.reqs_to_abort)

    def _route(self, request_outputs: list[RequestOutput]) -> None:
        # The processor returns its outputs instead of putting them into the collectors itself so
        # that finishing (the unfinished count, the metrics) is accounted for here, once, even for
        # a request whose consumer has not read its final output yet.
        for out in request_outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # aborted meanwhile
                continue
            if out.finished:
                del self._streams[out.request_id]
                self._num_unfinished_seqs -= stream.num_seqs
                self._returned(out)
                failed = out.error is not None or any(c.finish_reason == "error" for c in out.outputs)
                if failed and self.metrics is not None:
                    self.metrics.request_errors.inc()  # failed alone: the core is still running
            stream.collector.put(out)

    def _returned(self, out: RequestOutput) -> None:
        """A final output handed to its stream: the end of its e2e."""
        if self.ledger is not None:
            self.ledger.returned(out)

    def _record_ready(self) -> None:
        """Metrics of the finished requests whose accounts are complete, each once (see
        engine/accounts.py: an aborted request's account arrives after its final output)."""
        for out in self.output_processor.pop_ready():
            self._record_finished(out)

    def _record_finished(self, out: RequestOutput) -> None:
        if self.ledger is not None:
            self.ledger.record_finished(out)  # the trace
        m = out.metrics
        if self.metrics is None or m is None:
            return
        self.metrics.record_finished_output(out, m.e2e_latency if m.e2e_latency is not None else now() - m.arrival_time)

    def _fail_everything(self, error: EngineDeadError) -> None:
        self._dead_error = error
        # A Ctrl-C reaches the core too: a stop someone asked for, not worth an ERROR line.
        stopped = str(error).startswith(ENGINE_STOPPED_BY_SIGINT)
        logger.log(logging.WARNING if stopped else logging.ERROR, "engine core is dead: %s", error)
        try:
            for out in self.output_processor.fail_all(str(error)):
                if out.request_id in self._streams:
                    self._returned(out)
            self._record_ready()  # counted as finished_reason="error"
        except Exception:  # noqa: BLE001 - the streams below must be failed regardless
            logger.exception("OutputProcessor.fail_all failed")
        for stream in self._streams.values():
            stream.collector.put(error)
        self._streams.clear()
        self._num_unfinished_seqs = 0
        self._start_reaper()

    def _fail_replica(self, error: ReplicaDeadError) -> None:
        """A data-parallel replica died: its requests, and only those, end with the engine-death
        error, exactly as every request does when the only engine core dies."""
        logger.error("%s (%d request(s) failed; %d replica(s) still serving)", error, len(error.request_ids),
                     len(self.engine_core.live_indices()) if isinstance(self.engine_core, DPAsyncClient) else 0)
        for out in self.output_processor.fail_requests(error.request_ids, str(error)):
            stream = self._streams.pop(out.request_id, None)
            if stream is None:
                continue
            self._num_unfinished_seqs -= stream.num_seqs
            self._returned(out)
            stream.collector.put(error)
        self._record_ready()  # counted as finished_reason="error"
        if self.metrics is not None:
            self.metrics.replica_died(error.replica, len(error.request_ids))

    def _start_reaper(self) -> asyncio.Task:
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_core(), name="tokenloom-reap-core")
        return self._reaper

    async def reap_dead_core(self) -> None:
        """Once the core is dead: reap its process and release the sockets (idempotent). The
        output handler does this when it sees the death; a server's watchdog calls it for a core
        that dies while nothing is in flight."""
        if self.is_dead:
            await self._start_reaper()

    async def _reap_core(self) -> None:
        """Waits for the dead core's process (off the loop) so it does not stay a zombie, then
        closes the sockets and removes the IPC directory. Only the process handle and the sockets
        go: `is_dead` and the 503s stay as they are."""
        await asyncio.to_thread(self.engine_core.wait_exited)  # kills one that lingers
        self.engine_core.shutdown()

    # ---- state ------------------------------------------------------------------------------

    def _check_alive(self) -> None:
        if self._dead_error is not None:
            raise self._dead_error
        if self.engine_core.is_dead:
            raise EngineDeadError(self.engine_core._dead_reason or "engine core is dead")

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    @property
    def errored(self) -> bool:
        """vLLM's name: the engine can take no more requests (its core died or it was shut down)."""
        return self.is_dead

    @property
    def is_running(self) -> bool:
        return not self.is_dead

    @property
    def is_stopped(self) -> bool:
        return self.is_dead

    async def check_health(self) -> None:
        """Raises EngineDeadError when the engine can take no more requests (vLLM's health check)."""
        self._check_alive()
        if self.is_dead:  # its process exited, not yet noticed by the client
            raise EngineDeadError("the engine core process exited")

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None or self.engine_core.is_dead or self.engine_core.process_exited()

    def replica_health(self) -> list[bool]:
        """Which data-parallel replicas are alive and heard from within heartbeat_timeout_s (one
        entry without data parallelism)."""
        fresh = [age <= self.heartbeat_timeout_s for age in self.heartbeat_ages()]
        if isinstance(self.engine_core, DPAsyncClient):
            return [r.alive and self.engine_core._usable(i) and fresh[i]
                    for i, r in enumerate(self.engine_core.balancer.replicas)]
        return [not self.is_dead and fresh[0]]

    def heartbeat_ages(self) -> list[float]:
        """Seconds since each engine core (each data-parallel replica) last sent anything, an
        output or its heartbeat. Only meaningful while the output handler runs (it reads them)."""
        clients = self.engine_core.clients if isinstance(self.engine_core, DPAsyncClient) else [self.engine_core]
        t = now()
        return [max(0.0, t - c.last_heard) for c in clients]

    def set_health_limits(self, heartbeat_timeout_s: float, tokenizer_pool_limit_s: float) -> None:
        """What health_problem() reports: a core silent for more than `heartbeat_timeout_s`, a
        tokenizer pool whose every thread has been on one job for more than `tokenizer_pool_limit_s`."""
        if not heartbeat_timeout_s > 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}.")
        if not tokenizer_pool_limit_s > 0:
            raise ValueError(f"tokenizer_pool_limit_s must be > 0, got {tokenizer_pool_limit_s}.")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.tokenizer_pool_limit_s = tokenizer_pool_limit_s
        if isinstance(self.engine_core, DPAsyncClient):
            self.engine_core.heartbeat_timeout_s = heartbeat_timeout_s

    def start(self) -> None:
        """Starts the output handler (which hears the core's heartbeats) in the running loop, if
        it is not running yet; a server calls it at start-up, before the first request."""
        self._check_alive()
        self._ensure_output_handler()

    async def health_problem(self) -> tuple[str, str] | None:
        """(code, message) when the engine cannot serve new requests in time although its core
        lives: every core (every replica) silent past heartbeat_timeout_s, or every tokenizer
        thread stuck on one job past tokenizer_pool_limit_s. None when healthy. A dead engine
        raises EngineDeadError."""
        self.start()
        if not any(self.replica_health()):
            await asyncio.sleep(_HEARTBEAT_GRACE_S)  # let the output handler read what waits
            self._check_alive()
            if not any(self.replica_health()):
                silent = min(self.heartbeat_ages())
                what = "engine core" if self.data_parallel_size == 1 else "every data-parallel replica"
                return "engine_unresponsive", (
                    f"The {what} has not been heard from for {silent:.1f} s (heartbeat timeout "
                    f"{self.heartbeat_timeout_s:g} s): it is stopped, hung or starved of CPU.")
        stuck = self.tokenizer_pool.stuck_for()
        if stuck > self.tokenizer_pool_limit_s:
            return "tokenizer_pool_saturated", (
                f"Every one of the {self.tokenizer_pool.num_threads} tokenizer threads has been busy on one job for "
                f"over {stuck:.1f} s (limit {self.tokenizer_pool_limit_s:g} s), with "
                f"{self.tokenizer_pool.num_queued} job(s) queued behind them: new requests cannot be read.")
        return None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead_error

    def get_num_unfinished_requests(self) -> int:
        """Requests accepted and not finished, counted on the caller side (parents, not n)."""
        return len(self._streams)

    def get_num_unfinished_seqs(self) -> int:
        """Core-side requests accepted and not finished (a request with n=4 counts 4), including
        those still being tokenized."""
        return self._num_unfinished_seqs + self._num_pending_seqs + self.num_deferred_seqs

    async def call_utility(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        self._check_alive()
        self._ensure_output_handler()
        return await self.engine_core.call_utility_async(method, *args, timeout=timeout)

    async def start_profile(self) -> None:
        """vLLM's: the torch profiler runs in the engine core's ranks until stop_profile()."""
        await self.call_utility("profile", True, torch_profiler_dir())

    async def stop_profile(self) -> list[str]:
        """Stops the profiler; returns the trace files written (see LLMEngine.stop_profile)."""
        return await self.call_utility("profile", False, torch_profiler_dir())

    async def get_state(self, timeout: float | None = None) -> dict:
        """The core's `get_state()`: num_running, num_waiting, num_requests, num_free_blocks,
        num_total_blocks."""
        return await self.call_utility("get_state", timeout=timeout)

    async def get_ledger_view(self, num_steps: int = 100, num_requests: int = 20,
                              timeout: float = 2.0) -> dict | None:
        """The ledger's live view (metrics/live.py): the last steps, the requests in flight with
        their state in the core, the last finished requests. None when the ledger is off."""
        if self.ledger is None or self.ledger.recent is None:
            return None
        in_core = await self.call_utility("get_ledger_state", timeout=timeout)
        return live_view(self.ledger.recent, in_core, list(self._streams), now(), num_steps, num_requests)

    def get_ledger_trace(self) -> dict | None:
        """The recent past as a trace (`tokenloom explain --url`); None when the ledger is off."""
        if self.ledger is None or self.ledger.recent is None:
            return None
        return self.ledger.recent.to_json()

    async def refresh_metrics(self, timeout: float = 2.0) -> None:
        """Brings the gauges up to date before a scrape (an idle core sends no steps). When the
        core does not answer in time the gauges keep their last values, and
        tokenloom:metrics_staleness_seconds says how old those are."""
        if self.metrics is None or self.is_dead:
            return
        # Set before the call below, which a stalled core never answers. The live replicas only.
        ages = self.heartbeat_ages()
        live = self.engine_core.live_indices() if isinstance(self.engine_core, DPAsyncClient) else [0]
        self.metrics.engine_heartbeat_age.set(max((ages[i] for i in live), default=0.0))
        try:
            if isinstance(self.engine_core, DPAsyncClient):
                self._check_alive()
                states = await self.engine_core.call_utility_each_async("get_state", timeout=timeout)
                replicas = self.engine_core.balancer.replicas
                self.metrics.record_replica_states(states, [r.num_sent for r in replicas],
                                                   [r.num_finished for r in replicas])
            else:
                self.metrics.record_core_state(await self.get_state(timeout=timeout))
            self._metrics_refreshed_at = time.monotonic()
        except (EngineDeadError, asyncio.TimeoutError, RuntimeError) as e:
            # repr: a TimeoutError's str() is empty, which left the warning without a reason.
            logger.warning("could not refresh metrics from the engine core (serving gauges %.1fs old): %r",
                           time.monotonic() - self._metrics_refreshed_at, e)
        self.metrics.metrics_staleness.set(time.monotonic() - self._metrics_refreshed_at)

    def shutdown(self) -> None:
        self.tokenizer_pool.shutdown(wait=False, cancel_futures=True)
        # Requests still being parsed or tokenized end now, as those in the core do; their jobs
        # run on (they cannot be interrupted) but no one waits for them.
        for future in list(self._off_loop):
            if not future.done():
                with contextlib.suppress(RuntimeError):  # its loop has closed
                    future.set_exception(EngineShutDownError(ENGINE_SHUT_DOWN))
        if self._output_handler is not None and not self._output_handler.done():
            self._output_handler.cancel()
        for stream in self._streams.values():
            stream.collector.put(EngineShutDownError(ENGINE_SHUT_DOWN))
        self._streams.clear()
        try:
            if self.ledger is not None:
                self.ledger.flush()  # the trace file, if tracing
        finally:
            self.engine_core.shutdown()
