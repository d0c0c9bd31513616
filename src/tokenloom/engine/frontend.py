"""What LLMEngine and AsyncLLM share: one constructor path from a config to a running engine.

The config is resolved once, here, in the caller (model/resolve.py: the runner and pooler the
model's files decide, its architecture facts); then the tokenizer, the engine-core client (which
starts the core with the resolved config), the input processor and the output processor are built
the same way for both. Only the client differs: synchronous or asyncio, one core or replicas.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tokenloom.config import EngineConfig
from tokenloom.engine.output_processor import OutputProcessor
from tokenloom.engine.processor import InputProcessor
from tokenloom.model.resolve import resolve_engine_config
from tokenloom.model.source import load_tokenizer


class EngineFrontend:
    """The caller's side of an engine, as built by `_start`."""

    config: EngineConfig
    engine_core: Any

    def _start(self, config: EngineConfig, make_client: Callable[[EngineConfig], Any]) -> None:
        self.model_config = resolve_engine_config(config)
        self.config = config
        # Only the tokenizer and the architecture facts live in the caller; the weights are
        # loaded (and dequantized) once, in the engine core.
        self.tokenizer = load_tokenizer(config.tokenizer or config.model, config.tokenizer_mode)
        self.engine_core = make_client(config)
        info = self.engine_core.info
        # The core's answer: the worker that loaded the weights checked the requested length.
        self.max_model_len = info.max_model_len
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
