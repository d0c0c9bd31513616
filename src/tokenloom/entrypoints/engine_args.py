"""Engine options shared by every CLI command that starts an engine (generate, serve, bench)."""
from __future__ import annotations

import argparse

from tokenloom.config import EngineConfig

_DEFAULTS = EngineConfig()


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=_DEFAULTS.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--kv-cache-dtype", default=_DEFAULTS.kv_cache_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache element type (auto: the model dtype); bfloat16 under a float32 model halves the cache on the CPU")
    g.add_argument("--device", default=_DEFAULTS.device)
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    g.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    g.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    g.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--seed", type=int, default=_DEFAULTS.seed)
    g.add_argument("--scheduling-policy", default=_DEFAULTS.scheduling_policy, choices=["fcfs", "priority"])
    g.add_argument("--attention-backend", default=_DEFAULTS.attention_backend, choices=["auto", "torch", "triton"])
    g.add_argument("--data-parallel-size", "-dp", type=int, default=_DEFAULTS.data_parallel_size,
                   help="engine-core replicas behind one front end, each with its share of the cores; requests go to the least loaded")
    g.add_argument("--inprocess", dest="multiprocess", action="store_false", help="run the engine core in this process")
    g.add_argument("--no-ledger", dest="enable_ledger", action="store_false", help="turn the ledger (per-request timing, metrics) off")
    g.add_argument("--compile", action="store_true", help="torch.compile the model forward (slower on CPU today: see benchmarks/README.md)")
    g.add_argument("--quantization", default=_DEFAULTS.quantization, choices=["auto", "gguf", "int8", "none"],
                   help="auto: a GGUF computes with its quantized weights (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K kernels), an HF model in float; "
                        "int8: int8 weights and activations for any model; none: dequantized float path")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=_DEFAULTS.tensor_parallel_size,
                   help="split the model across this many ranks (one process each; torch.distributed, gloo on CPU, NCCL on CUDA)")
    g.add_argument("--distributed-executor-backend", default=None, choices=["uni", "mp", "ray"],
                   help="who runs the ranks: uni (this engine core, one rank), mp (worker processes), ray (Ray actors, "
                        "also across machines: `ray start --head` first); default uni for one rank, mp for more. "
                        "With --data-parallel-size > 1, ray also runs each replica's engine core as a Ray actor "
                        "placed with a placement group")
    g.add_argument("--trace", dest="trace_path", metavar="PATH", default=None, help="write a Chrome trace (Perfetto) of the run to PATH at shutdown; see `tokenloom explain`")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    fields = EngineConfig.__struct_fields__
    config = EngineConfig(**{f: getattr(args, f) for f in fields if hasattr(args, f)})
    config.validate()
    return config
