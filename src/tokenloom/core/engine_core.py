"""EngineCore: one step = schedule -> execute -> update.

The same object runs inside the child process (`engine_core_proc`) or, for debugging and tests,
in the caller's own process (the in-process client). It never imports from engine/ or
entrypoints/; it speaks only the message types of `tokenloom.messages`.
"""
from __future__ import annotations

import gc
import logging
import os
import time

from tokenloom.config import EngineConfig
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.scheduler import Scheduler
from tokenloom.core.warmup import warm_up
from tokenloom.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo, now
from tokenloom.executor import executor_class
from tokenloom.kv_cache_spec import kv_cache_groups
from tokenloom.metrics.core_ledger import CoreLedger
from tokenloom.ops.kernel_plan import format_plan_rows
from tokenloom.ops.schedstat import StepCpuMeter
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured_output import StructuredOutputManager

__all__ = ["EngineCore"]

logger = logging.getLogger(__name__)

# While every live request waits for its grammar, the loop sleeps this long on the compilations
# between (empty) steps instead of spinning; it never waits while anything else can run.
GRAMMAR_POLL_SECONDS = 0.005


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        # Resolved by the caller (model/resolve.py) before it started this core: the model's path,
        # the context length, the runner and pooler are decided; validate() only guards what
        # crossed the process boundary.
        if config.max_model_len is None:
            raise ValueError("the engine core takes a resolved EngineConfig (max_model_len is unset): build it with "
                             "EngineArgs.create_engine_config(), or pass it to LLMEngine / AsyncLLM, which resolve it.")
        config.validate()
        self.config = config
        t0 = time.perf_counter()
        # The model's rank(s): in this process, in worker processes or in Ray actors.
        self.executor = executor_class(config)(config)
        info = self.executor.info
        self.max_model_len = info.max_model_len
        num_kv_blocks = self.executor.determine_num_kv_blocks()
        model_config = self.executor.model_config()
        # The tokenizer (and its EOS, a grammar's stop token beside the model's) is built with
        # the first structured output, on the grammar thread: few engines ever need it here.
        stop_ids = [t for t in model_config.eos_token_ids if t is not None]
        self.structured_output_manager = StructuredOutputManager(
            None, model_config.vocab_size, stop_ids, config.max_num_seqs,
            num_compile_threads=config.structured_outputs_compile_threads,
            compile_timeout=config.structured_outputs_compile_timeout, tokenizer_loader=self.executor.tokenizer)
        self.scheduler = Scheduler(config, num_kv_blocks, self.max_model_len,
                                   self.structured_output_manager, kv_cache_groups(model_config))
        self.info = EngineInfo(
            max_model_len=self.max_model_len,
            vocab_size=model_config.vocab_size,
            num_kv_blocks=num_kv_blocks,
            block_size=config.block_size,
            dtype=info.dtype,
            attention_backend=info.attention_backend,
            pid=os.getpid(),
            kv_cache_dtype=info.kv_cache_dtype,
            quantization=info.quantization,
            weight_bytes_per_token=info.weight_bytes_per_token,
            kv_cache_capacity_tokens=(self.scheduler.max_request_len
                                      if self.scheduler.kv_cache_manager.num_groups > 1 else 0),
            tensor_parallel_size=config.tensor_parallel_size,
            executor_backend=config.executor_backend,
            cuda_graphs=info.cuda_graphs,
        )
        if info.cpu:
            self.info.cpu, self.info.cpu_kernels_isa = info.cpu, info.cpu_kernels_isa
            logger.info("CPU: %s", self.info.cpu)
            self.info.kernel_plan_summary, self.info.kernel_plan = info.kernel_plan_summary, info.kernel_plan
            logger.info("kernel plan: %s\n%s", info.kernel_plan_summary, format_plan_rows(info.kernel_plan))
        # The accounts of aborted requests, owed to the caller: sent with the next step.
        self._aborted_outputs: list[EngineCoreOutput] = []
        # The one-time work of the first steps, done before ready (core/warmup.py), unledgered.
        self.ledger: CoreLedger | None = None
        self.cpu_meter: StepCpuMeter | None = None
        warm = warm_up(self)
        # Where each request's time goes, step by step (see metrics/core_ledger.py).
        self.ledger = CoreLedger(record_segments=config.trace_path is not None) if config.enable_ledger else None
        # Each step's CPU time and machine contention (ops/schedstat.py), with the ledger on.
        self.cpu_meter = StepCpuMeter() if self.ledger is not None else None
        if self.cpu_meter is not None and not self.cpu_meter.available:
            self.cpu_meter = None
        if warm is not None:
            self.info.warmup_seconds = warm.seconds
            if self.ledger is not None:
                self.ledger.expect_first_step(warm.num_tokens, warm.step_seconds)
        # What start-up built (the model, its tables, the tokenizer) lives as long as the engine:
        # moved out of the collector's generations, each collection walks only what the steps
        # allocate, as vLLM's engine core does (perf showed the collections: benchmarks/CHANGELOG.md).
        gc.collect()
        gc.freeze()
        logger.info("engine core ready in %.1fs: %s", time.perf_counter() - t0, self.info)

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queues a request. A request that cannot be admitted fails alone (finish_reason
        "error" with the reason, sent with the next step); the core keeps running."""
        received = request.received_time or now()  # the in-process client has no input thread
        if request.request_id in self.scheduler.requests:
            # The caller keeps ids unique among requests in flight; an error output under this id
            # would finish the live request, so the duplicate is dropped with a log line.
            logger.error("dropped a request whose id %r is already in flight", request.request_id)
            return
        try:
            self.scheduler.add_request(Request.from_engine_core_request(request))
        except Exception as e:  # noqa: BLE001 - one malformed request must not stop the core
            logger.exception("request %s could not be admitted; the engine keeps running", request.request_id)
            if self.ledger is not None:  # its error output carries an account like any other
                self.ledger.add(request.request_id, request.sent_time, received, now())
            self.reject_request(request.request_id, f"request {request.request_id} could not be admitted: {e!r}")
            return
        if self.ledger is not None:
            self.ledger.add(request.request_id, request.sent_time, received, now())

    def reject_request(self, request_id: str, error: str) -> None:
        """Fails a request that never reached the scheduler (e.g. its message could not be
        decoded): its caller gets a final output with finish_reason "error" and `error`."""
        if request_id in self.scheduler.requests:
            return  # see add_request: never finish a live request under a clashing id
        stub = Request(
            request_id=request_id, prompt_token_ids=[], sampling_params=SamplingParams(), eos_token_id=None, arrival_time=now()
        )
        if self.ledger is not None and request_id not in self.ledger.entries:
            t = now()
            self.ledger.add(request_id, 0.0, t, t)
        self.scheduler.reject_request(stub, error)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        if self.ledger is not None:
            self._aborted_outputs += self.ledger.abort(request_ids, now())
        self._release_if_idle()

    def pop_aborted_outputs(self) -> list[EngineCoreOutput]:
        """The accounts of requests aborted since the last step, for a caller that sends them at
        once (the busy loop: ahead of any later reply, such as a get_state for /metrics)."""
        aborted, self._aborted_outputs = self._aborted_outputs, []
        return aborted

    def _release_if_idle(self) -> None:
        """The runner learns of finished requests with the next schedule(); when no next step is
        coming (the core goes idle), hand them over now so no request state outlives its request."""
        if self.scheduler.finished_req_ids and not self.scheduler.has_unfinished_requests():
            self.executor.remove_requests(self.scheduler.finished_req_ids)
            self.scheduler.finished_req_ids = set()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._aborted_outputs)

    def step(self) -> EngineCoreOutputs:
        # Aborted requests' accounts go first: the caller may reuse an aborted id at once, and
        # the old request's account must reach it before anything of the new one.
        aborted, self._aborted_outputs = self._aborted_outputs, []
        if not self.scheduler.has_unfinished_requests():
            return EngineCoreOutputs(outputs=aborted, timestamp=now())
        step_start = now()
        meter = self.cpu_meter
        if meter is not None:
            meter.begin(step_start)
        t0 = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if self.ledger is not None:
            self.ledger.on_schedule(scheduler_output, step_start)
        t1 = time.perf_counter()
        runner_output = self.executor.execute_model(scheduler_output)
        t2 = time.perf_counter()
        outputs = self.scheduler.update_from_output(scheduler_output, runner_output)
        if not scheduler_output.total_num_scheduled_tokens and self.scheduler.grammars.compiling:
            # Part of this (empty) step, so the ledger counts it as queue_grammar_compile.
            self.scheduler.wait_for_grammars(GRAMMAR_POLL_SECONDS)
        outputs.timestamp = now()
        cpu_time = run_delay = 0.0
        if meter is not None:
            cpu_time, run_delay = meter.measure(outputs.timestamp)
            # Tensor-parallel ranks measure their own threads (executor/multiproc_executor.py):
            # the step waited for its slowest rank, so the largest wait counts, and every CPU second.
            meter.add_cpu(runner_output.cpu_time)
            cpu_time += runner_output.cpu_time
            run_delay = min(max(run_delay, runner_output.run_delay), outputs.timestamp - step_start)
        if self.ledger is not None:
            self.ledger.on_update(outputs.outputs, outputs.timestamp, run_delay)
        if aborted:
            outputs.outputs[:0] = aborted
        self._release_if_idle()
        t3 = time.perf_counter()
        stats = outputs.scheduler_stats
        if stats is not None:
            # The step profile (a few perf_counter calls: cheap enough to leave on). What
            # execute_model spent after sampling (appending tokens, building its output) is
            # bookkeeping of the results, so it counts as update, with the ledger's share.
            ro = runner_output
            stats.schedule_time = t1 - t0
            stats.prepare_time = ro.prepare_time
            stats.forward_time = ro.forward_time
            stats.sample_time = ro.sample_time
            stats.update_time = (t2 - t1 - ro.prepare_time - ro.forward_time - ro.sample_time) + (t3 - t2)
            stats.step_time = t3 - t0
            if meter is not None:
                stats.cpu_time, stats.run_delay = cpu_time, run_delay
                stats.other_cores, stats.num_cores = meter.other_cores, len(meter.cores)
                if meter.throttle is not None:
                    stats.throttled, stats.cpu_quota = min(meter.throttled, run_delay), meter.throttle.describe
        return outputs

    def shutdown(self) -> None:
        """Stops the executor's workers (worker processes or Ray actors)."""
        if self.cpu_meter is not None:
            self.cpu_meter.close()
        self.executor.shutdown()

    # ---- utility calls (msgpack-able results) -----------------------------------------------

    def get_info(self) -> EngineInfo:
        return self.info

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv_cache_manager.reset_prefix_cache()

    def profile(self, is_start: bool, directory: str) -> list[str]:
        """Starts or stops the torch profiler on every rank (Worker.profile); stopping returns
        the traces written."""
        return [path for paths in self.executor.collective_rpc("profile", is_start, directory) for path in paths]

    def get_ledger_state(self) -> list[dict]:
        """The ledger's live view of the requests in the core (CoreLedger.snapshot); [] when the
        ledger is off."""
        return [] if self.ledger is None else self.ledger.snapshot(now())

    def get_state(self) -> dict:
        """Introspection for tests and /metrics: what the core holds right now."""
        s = self.scheduler
        pool = s.kv_cache_manager.block_pool
        return {
            "num_running": len(s.running),
            "num_waiting": len(s.waiting) + len(s.grammars.compiling),
            "num_requests": len(s.requests),
            "num_free_blocks": pool.num_free_blocks,
            "num_cached_free_blocks": s.kv_cache_manager.num_cached_free_blocks,
            "num_total_blocks": pool.num_usable_blocks,  # the null block (if any) is no one's
            "num_runner_requests": self.executor.num_runner_requests(),
            "prefix_cache_queries": s.kv_cache_manager.prefix_cache_queries,
            "prefix_cache_hits": s.kv_cache_manager.prefix_cache_hits,
            "num_preemptions": s.num_preemptions,
            **({"kv_cache_group_used_blocks": s.kv_cache_manager.num_used_blocks_per_group}
               if s.kv_cache_manager.num_groups > 1 else {}),
        }
