"""What LLMEngine and AsyncLLM share: one constructor path from a config to a running engine.

The config arrives resolved from `EngineArgs.create_engine_config()`, or is resolved here when it
was built by hand (model/resolve.py, once either way: local paths, the context length, the runner
and pooler); then the tokenizer, the engine-core client (which starts the core with the resolved
config), the input processor and the output processor are built the same way for both. Only the
client differs: synchronous or asyncio, one core or replicas.
"""
from __future__ import annotations

from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.engine.async_client import AsyncMPClient
from tokenloom.engine.core_client import EngineCoreClient
from tokenloom.engine.dp_client import DPAsyncClient, DPClient
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.processor import InputProcessor
from tokenloom.model.resolve import model_arch_config, resolve_engine_config
from tokenloom.model.source import load_tokenizer


class EngineFrontend:
    """The caller's side of an engine, as built by `_start`."""

    config: EngineConfig
    engine_core: Any

    def _start(self, config: EngineConfig, *, asyncio_mode: bool, multiprocess: bool = True) -> None:
        if config.model_name is None:  # built by hand, not by EngineArgs.create_engine_config()
            resolve_engine_config(config)
        self.model_config = model_arch_config(config.model, config.hf_overrides, config.convert)  # type: ignore[arg-type]
        self.config = config
        # Only the tokenizer and the architecture facts live in the caller; the weights are
        # loaded (and dequantized) once, in the engine core.
        self.tokenizer = load_tokenizer(config.tokenizer, config.tokenizer_mode)
        self.engine_core = make_client(config, asyncio_mode=asyncio_mode, multiprocess=multiprocess)
        info = self.engine_core.info
        self.max_model_len: int = config.max_model_len  # type: ignore[assignment]  # resolved
        self.input_processor = InputProcessor(
            self.tokenizer, self.model_config, self.max_model_len, num_kv_blocks=info.num_kv_blocks,
            block_size=info.block_size, kv_cache_capacity_tokens=info.kv_cache_capacity_tokens or None,
            scheduling_policy=config.scheduling_policy, enable_lora=config.enable_lora,
            max_lora_rank=config.max_lora_rank,
            pooler_config=config.pooler_config,  # None unless the engine pools (resolve_pooling)
            structured_output_limits=config.structured_output_limits(), max_logprobs=config.max_logprobs,
        )
        self.output_processor = OutputProcessor(self.tokenizer, expect_timing=config.enable_ledger)

    @staticmethod
    def _config_from_engine_args(engine_args: Any, stat_loggers: list[Any] | None, args_name: str,
                                 metrics_hint: str) -> EngineConfig:
        """vLLM's `from_engine_args` checks: `engine_args` is anything whose
        `create_engine_config()` returns an EngineConfig (taken by that method so that engine/
        needs nothing from entrypoints/); `stat_loggers` must be empty (tokenloom's metrics are
        its own: `metrics_hint` says where)."""
        if stat_loggers:
            raise ValueError(f"stat_loggers is not supported: {metrics_hint}")
        config = engine_args.create_engine_config()
        if not isinstance(config, EngineConfig):
            raise TypeError(f"engine_args.create_engine_config() returned {type(config).__name__}, not tokenloom's "
                            f"EngineConfig: pass tokenloom.{args_name}.")
        return config


def make_client(config: EngineConfig, *, asyncio_mode: bool, multiprocess: bool = True) -> Any:
    """The engine-core client of a resolved config (vLLM's EngineCoreClient.make_client): replicas
    behind a load balancer only for data parallelism (at data_parallel_size=1 the backend, "mp" or
    "ray", says only who runs the tensor-parallel ranks, as in vLLM); asyncio for AsyncLLM."""
    if config.data_parallel_size > 1:
        if not multiprocess:
            raise ValueError("data_parallel_size > 1 needs multiprocess=True (each replica is its own process).")
        return DPAsyncClient(config) if asyncio_mode else DPClient(config)
    if asyncio_mode:
        return AsyncMPClient(config)
    return EngineCoreClient.make_client(config, multiprocess=multiprocess)
