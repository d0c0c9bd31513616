"""The caller's half of the ledger, one object per engine (LLMEngine or AsyncLLM).

It sees every message from the engine core (its `SchedulerStats`) and every finished
`RequestOutput` as it is handed to the caller (stamping `returned_time`), and feeds the
Prometheus metrics (`PrometheusMetrics`: vLLM's basic set plus the ledger's `LedgerMetrics`)
and, when a trace path is set, the `TraceRecorder`; when an OTLP endpoint is set, the
OpenTelemetry exporter (`OtlpExporter`, metrics/otel.py, imported only then). The per-request accounting itself happens in
the core (core_ledger.py) and in `RequestMetrics` (timeline.py).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from tokenloom.messages import EngineCoreOutputs, EngineInfo, now
from tokenloom.metrics.live import LIVE_MAX_REQUESTS, LIVE_MAX_STEPS
from tokenloom.metrics.prometheus import PrometheusMetrics
from tokenloom.metrics.stats import Metric, read_metrics
from tokenloom.metrics.timeline import settle
from tokenloom.metrics.trace import TraceRecorder

if TYPE_CHECKING:
    from tokenloom.config import EngineConfig
    from tokenloom.metrics.otel import OtlpExporter
    from tokenloom.outputs import RequestOutput

logger = logging.getLogger(__name__)


class FrontendLedger:
    def __init__(
        self,
        config: EngineConfig,
        model_name: str,
        info: EngineInfo | None = None,
        metrics: PrometheusMetrics | None = None,
        live: bool = False,
    ) -> None:
        """`metrics`: an engine's existing `PrometheusMetrics`, which its owner already feeds
        (AsyncLLM); by default the ledger builds its own and feeds it (LLMEngine). `live`: keep
        the recent past for the live view (a server's `GET /ledger`, metrics/live.py)."""
        self._feeds_metrics = metrics is None
        self.metrics = metrics if metrics is not None else PrometheusMetrics(
            model_name, max_model_len=info.max_model_len if info is not None else None)
        self._message_sent_time = 0.0  # of the message being processed (AsyncLLM: in chunks)
        self.trace: TraceRecorder | None = None
        if config.trace_path is not None:
            self.trace = TraceRecorder(config.trace_path, _run_config(config, model_name, info))
        self.otel: OtlpExporter | None = None
        if config.otlp_traces_endpoint is not None:
            from tokenloom.metrics.otel import OtlpExporter  # the optional extra: only when asked for

            self.otel = OtlpExporter(config.otlp_traces_endpoint, model_name)
        # The live view reads the trace when there is one, else a small recorder of its own.
        self.recent: TraceRecorder | None = self.trace
        if live and self.trace is None:
            self.recent = TraceRecorder(None, _run_config(config, model_name, info), LIVE_MAX_STEPS, LIVE_MAX_REQUESTS)

    def record_step(self, outputs: EngineCoreOutputs) -> None:
        """A message from the core, before its outputs are processed."""
        self._message_sent_time = outputs.sent_time
        stats = outputs.scheduler_stats
        if stats is None:
            return
        if self._feeds_metrics:
            self.metrics.record_scheduler_stats(stats)
        if self.recent is not None:
            self.recent.record_step(outputs)

    def returned(self, output: RequestOutput, t: float | None = None) -> None:
        """A finished output, as it is handed to the caller: the end of its e2e."""
        m = output.metrics
        if m is not None and m.returned_time is None:
            m.returned_time = now() if t is None else t
            # Finished by the message being processed: its final output was sent with it.
            if m.core is not None and m.core.finished_time <= self._message_sent_time:
                m.output_sent_time = self._message_sent_time
            settle(m)

    def record_finished(self, output: RequestOutput) -> None:
        """A finished output whose account is complete (OutputProcessor.pop_ready): once each."""
        m = output.metrics
        if self._feeds_metrics and m is not None:
            self.metrics.record_finished_output(output, m.e2e_latency if m.e2e_latency is not None else 0.0)
        if self.recent is not None:
            self.recent.record_request(output)
        if self.otel is not None:
            self.otel.export(output)

    def record(self, outputs: EngineCoreOutputs, request_outputs: Iterable[RequestOutput],
               ready: Iterable[RequestOutput]) -> None:
        """One message from the core, what the caller got from it, and the outputs whose
        accounts it completed (LLMEngine.step)."""
        self.record_step(outputs)
        t = None
        for out in request_outputs:
            if out.finished:
                t = now() if t is None else t
                self.returned(out, t)
        for out in ready:
            self.record_finished(out)

    def get_metrics(self) -> list[Metric]:
        return read_metrics(self.metrics.registry)

    def flush(self) -> str | None:
        """Writes the trace file (if tracing) and sends the pending OpenTelemetry spans; returns
        the trace file's path."""
        if self.otel is not None:
            self.otel.flush()
        if self.trace is None:
            return None
        path = self.trace.write()
        logger.info("tokenloom trace written to %s", path)
        return path


def _run_config(config: EngineConfig, model_name: str, info: EngineInfo | None) -> dict[str, Any]:
    run: dict[str, Any] = {
        "model": model_name,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_num_seqs": config.max_num_seqs,
        "block_size": config.block_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "enable_chunked_prefill": config.enable_chunked_prefill,
        "scheduling_policy": config.scheduling_policy,
    }
    if info is not None:
        run.update(
            num_kv_blocks=info.num_kv_blocks, max_model_len=info.max_model_len, device=config.device, dtype=info.dtype
        )
    return run
