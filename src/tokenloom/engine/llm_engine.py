"""LLMEngine: the synchronous caller-side engine (vLLM's V1 `LLMEngine`).

`add_request` tokenizes and validates in the caller, then sends an `EngineCoreRequest` to the core;
`step` pulls whatever the core has produced since (it does not drive the core: in the default
multiprocess mode the core runs its own busy loop), detokenizes it and returns `RequestOutput`s.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator, Mapping
from typing import Any


from tokenloom.config import EngineConfig, torch_profiler_dir
from tokenloom.engine.core_client import EngineCoreClient, EngineDeadError
from tokenloom.engine.dp_client import DPClient, ReplicaDeadError
from tokenloom.engine.frontend import EngineFrontend
from tokenloom.engine.processor import check_vllm_only_args
from tokenloom.messages import EngineCoreOutputs, EngineInfo, now
from tokenloom.metrics.ledger import FrontendLedger
from tokenloom.metrics.stats import Metric
from tokenloom.outputs import RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


class LLMEngine(EngineFrontend):
    def __init__(self, config: EngineConfig, multiprocess: bool = True, model_name: str | None = None) -> None:
        """`model_name`: the metrics' and trace's name of the model (default: the model as given,
        a hub id rather than the cache folder it is downloaded to: config.model_name)."""
        self.engine_core: EngineCoreClient | DPClient
        self._start(config, asyncio_mode=False, multiprocess=multiprocess)
        model_name = model_name or config.model_name
        assert model_name is not None  # resolved
        self._dead_error: EngineDeadError | None = None
        self._request_counter = itertools.count()
        self._batch: list[list[Any]] | None = None  # core requests held by batched_adds()
        # The caller's half of the ledger: metrics (get_metrics) and the trace file.
        self.ledger: FrontendLedger | None = None
        if config.enable_ledger:
            self.ledger = FrontendLedger(config, model_name, self.engine_core.info)

    @classmethod
    def from_kwargs(cls, multiprocess: bool = True, **kwargs: Any) -> "LLMEngine":
        return cls(EngineConfig(**kwargs), multiprocess=multiprocess)

    @classmethod
    def from_engine_args(cls, engine_args: Any, usage_context: Any = None, stat_loggers: list[Any] | None = None,
                         enable_multiprocessing: bool = True) -> "LLMEngine":
        """vLLM's constructor (tokenloom's `EngineArgs`): `enable_multiprocessing=False` runs the
        core in this process; `usage_context` is vLLM's usage-telemetry label (unused)."""
        config = cls._config_from_engine_args(engine_args, stat_loggers, "EngineArgs",
                                              "read tokenloom's metrics with LLMEngine.get_metrics().")
        return cls(config, multiprocess=enable_multiprocessing)

    def next_request_id(self) -> str:
        return str(next(self._request_counter))

    def add_request(
        self,
        request_id: str,
        prompt: Any,
        params: SamplingParams | PoolingParams | None = None,
        arrival_time: float | None = None,
        priority: int = 0,
        *,
        lora_request: Any = None,
        pooling_task: str | None = None,
        tokenization_kwargs: Any = None,
        trace_headers: Mapping[str, str] | None = None,  # W3C trace context: its span's parent (metrics/otel.py)
    ) -> None:
        check_vllm_only_args(tokenization_kwargs)
        if self._dead_error is not None:
            raise self._dead_error
        if params is None:
            params = PoolingParams() if self.config.is_pooling else SamplingParams()
        arrival_time = now() if arrival_time is None else arrival_time
        request, prompt_text = self.input_processor.process(request_id, prompt, params, arrival_time, priority,
                                                            lora_request=lora_request, pooling_task=pooling_task)
        core_requests = self.output_processor.add_user_request(
            request, prompt_text, trace_headers=dict(trace_headers) if trace_headers else None)
        if self._batch is not None:
            self._batch.append(core_requests)
        else:
            self.engine_core.add_requests(core_requests)

    @contextlib.contextmanager
    def batched_adds(self) -> Iterator[None]:
        """Requests added inside reach the engine core together, in one message when the block
        ends, so its next step sees all of them: the batches it forms (and so the tokens of a
        run) do not depend on how fast the caller tokenized. Also when the block is left by an
        exception (the caller aborts them as it would any request in flight)."""
        if self._batch is not None:  # nested: the outer block sends
            yield
            return
        self._batch = []
        try:
            yield
        finally:
            batch, self._batch = self._batch, None
            if batch and self._dead_error is None:
                self.engine_core.add_request_batch(batch)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        outputs, core_ids = self.output_processor.abort_requests(request_ids)
        if self._dead_error is None:
            self.engine_core.abort_requests(core_ids)
        if self.ledger is not None:
            t = now()
            for out in outputs:
                self.ledger.returned(out, t)
            for out in self.output_processor.pop_ready():  # their accounts come with a later step
                self.ledger.record_finished(out)
        return outputs

    def step(self, timeout: float | None = None) -> list[RequestOutput]:
        """Outputs produced since the last call. If the engine core has died, every request in
        flight is returned once, finished with finish_reason "error"; later calls raise."""
        if self._dead_error is not None:
            raise self._dead_error
        try:
            core_outputs = self.engine_core.get_output(timeout)
        except ReplicaDeadError as e:  # one data-parallel replica: its requests alone fail
            failed = self.output_processor.fail_requests(e.request_ids, str(e))
            if self.ledger is not None:
                self.ledger.record(EngineCoreOutputs(), failed, self.output_processor.pop_ready())
            return failed
        except EngineDeadError as e:
            self._dead_error = e
            failed = self.output_processor.fail_all(str(e))
            if self.ledger is not None:
                self.ledger.record(EngineCoreOutputs(), failed, self.output_processor.pop_ready())
            return failed
        # Token times are when the message was received (not when it was processed).
        processed = self.output_processor.process_outputs(core_outputs.outputs, core_outputs.received_time or None)
        if self.ledger is not None:
            self.ledger.record(core_outputs, processed.request_outputs, self.output_processor.pop_ready())
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        """Requests in flight, or finished ones (aborted, stopped by a stop string) whose
        account the core still owes: stepping on collects it, so their metrics are complete."""
        if self._dead_error is not None:
            return self.output_processor.has_unfinished_requests()
        return self.output_processor.has_unfinished_requests() or self.output_processor.owes_timing()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()

    @property
    def is_dead(self) -> bool:
        return self._dead_error is not None

    @property
    def info(self) -> EngineInfo:
        """What the engine core chose and holds (dtype, quantization, KV cache, CPU path)."""
        return self.engine_core.info

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached KV block (as vLLM's); False while requests still hold blocks."""
        return self.engine_core.call_utility("reset_prefix_cache")

    def start_profile(self) -> None:
        """vLLM's: the torch profiler runs in the engine core's ranks until stop_profile()."""
        self.engine_core.call_utility("profile", True, torch_profiler_dir())

    def stop_profile(self) -> list[str]:
        """Stops the profiler; returns the trace files written (one per rank and replica) under
        $TOKENLOOM_TORCH_PROFILER_DIR (or vLLM's $VLLM_TORCH_PROFILER_DIR)."""
        return self.engine_core.call_utility("profile", False, torch_profiler_dir())

    def get_metrics(self) -> list[Metric]:
        """Every `tokenloom:` metric, as plain objects (vLLM's `LLM.get_metrics()`)."""
        if self.ledger is None:
            raise RuntimeError("metrics are off: the engine was built with enable_ledger=False.")
        return self.ledger.get_metrics()

    def flush_trace(self) -> str | None:
        """Writes the trace file now (it is also written at shutdown); returns its path."""
        return None if self.ledger is None else self.ledger.flush()

    def shutdown(self) -> None:
        try:
            self.flush_trace()
        finally:
            self.engine_core.shutdown()
