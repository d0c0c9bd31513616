"""Engine options shared by every CLI command that starts an engine (generate, serve, bench).

vLLM's spellings work too, so that its launch scripts run unchanged where the meaning is the
same: `--dtype half|float`, `--enable-prefix-caching`, sizes such as `--max-model-len 8k`
(`human_int`), and options that mean nothing here (GPU memory, remote code) are
accepted with a warning saying so (`warn_ignored_vllm_args`).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import re
from typing import Any

import msgspec

from tokenloom.config import EngineConfig

logger = logging.getLogger("tokenloom")

_DEFAULTS = EngineConfig()
# vLLM's --dtype names for the same types.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
_HUMAN_INT = re.compile(r"^(\d+(?:\.\d+)?)([kKmMgG]?)$")


def human_int(text: str) -> int:
    """An integer, or one with vLLM's size suffixes: k/m/g are powers of 1000, K/M/G of 1024
    ("8k" = 8000, "8K" = 8192, "1.5k" = 1500)."""
    match = _HUMAN_INT.match(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 8k or 8K, got {text!r}")
    number, suffix = match.groups()
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suffix]
    value = float(number) * scale
    if value != int(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number")
    return int(value)


def json_dict(text: str) -> dict:
    """A JSON object given on the command line (vLLM's --override-generation-config)."""
    try:
        value = json.loads(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON object such as '{{\"temperature\": 0.5}}': {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="GGUF file or Hugging Face directory (default: embedded SmolLM2-135M-Instruct)")
    g.add_argument("--dtype", default=_DEFAULTS.dtype, choices=["auto", "float32", "bfloat16", "float16", "half", "float"],
                   help="weights and activations (auto: by what the CPU multiplies fastest, float32 under a quantized "
                        "path; half = float16, float = float32 as in vLLM)")
    g.add_argument("--kv-cache-dtype", default=_DEFAULTS.kv_cache_dtype, choices=["auto", "float32", "bfloat16", "float16"],
                   help="KV cache element type (auto: the model dtype, but bfloat16 under a quantized path, as llama.cpp "
                        "keeps its cache in float16); bfloat16 under a float32 model halves the cache on the CPU")
    g.add_argument("--device", default=_DEFAULTS.device)
    g.add_argument("--max-model-len", type=human_int, default=None, help="context length (e.g. 4096, 8k, 8K)")
    g.add_argument("--max-num-batched-tokens", type=int, default=_DEFAULTS.max_num_batched_tokens, help="token budget of one step")
    g.add_argument("--max-num-seqs", type=int, default=_DEFAULTS.max_num_seqs)
    g.add_argument("--block-size", type=int, default=_DEFAULTS.block_size)
    g.add_argument("--enable-prefix-caching", dest="enable_prefix_caching", action="store_true", default=True,
                   help="reuse the KV cache of prompts' shared prefixes (the default)")
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
    g.add_argument("--enforce-eager", action="store_true",
                   help="run every step eagerly: on CUDA, no decode steps replayed from CUDA graphs (as vLLM's)")
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
    g.add_argument("--generation-config", default=_DEFAULTS.generation_config, metavar="auto|vllm|DIR",
                   help="default sampling parameters: auto takes the model's generation_config.json (temperature, top_p, "
                        "top_k, min_p, penalties, max_new_tokens) for what a request leaves unset, as vLLM does; vllm "
                        "keeps SamplingParams' defaults; a folder reads its generation_config.json, whose max_new_tokens "
                        "then caps every request")
    g.add_argument("--override-generation-config", type=json_dict, default=None, metavar="JSON",
                   help='sampling defaults merged over --generation-config\'s, e.g. \'{"temperature": 0.5}\'')
    g.add_argument("--speculative-config", type=json_dict, default=None, metavar="JSON",
                   help='speculative decoding, as vLLM: \'{"method": "ngram", "num_speculative_tokens": 4, '
                        '"prompt_lookup_max": 4}\' proposes up to 4 tokens that followed an earlier occurrence of '
                        "the request's last tokens (n-gram prompt lookup; no draft model) and verifies them in one step")
    g.add_argument("--enable-lora", action="store_true", default=_DEFAULTS.enable_lora,
                   help="serve LoRA adapters (PEFT directories) over the model: requests name one with a LoRARequest "
                        "(offline) or as their model (tokenloom serve --lora-modules)")
    g.add_argument("--max-loras", type=int, default=_DEFAULTS.max_loras,
                   help="vLLM's adapter slots; here the default of --max-cpu-loras (on the CPU any number of adapters "
                        "share a step, each a few small matmuls per layer; default 1)")
    g.add_argument("--max-lora-rank", type=int, default=_DEFAULTS.max_lora_rank, help="largest adapter rank taken (default 16)")
    g.add_argument("--max-cpu-loras", type=int, default=None,
                   help="adapters whose weights the engine core keeps loaded once no request uses them, least "
                        "recently used dropped first (default: --max-loras)")
    g.add_argument("--runner", choices=("auto", "generate", "pooling"), default=_DEFAULTS.runner,
                   help="generate text, or pool (embed: /v1/embeddings, LLM.embed; classify with a "
                        "*ForSequenceClassification checkpoint: /classify, LLM.classify); auto pools a checkpoint "
                        "without a language-model head (default auto)")
    g.add_argument("--convert", choices=("auto", "none", "embed", "classify"), default=_DEFAULTS.convert,
                   help="embed: run the model as an embedding model; classify: a *ForCausalLM as its "
                        "*ForSequenceClassification, its score head from the checkpoint or made from LM-head rows "
                        "by classifier_from_token in --hf-overrides (both imply --runner pooling)")
    g.add_argument("--hf-overrides", type=json_dict, default=None, metavar="JSON",
                   help='config.json keys replaced before the model is read, as vLLM\'s; Qwen3-Reranker as a '
                        'cross-encoder: \'{"architectures": ["Qwen3ForSequenceClassification"], '
                        '"classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": true}\'')
    g.add_argument("--pooler-config", "--override-pooler-config", dest="pooler_config", type=json_dict, default=None,
                   metavar="JSON", help='how a pooling model pools, over its own settings: \'{"pooling_type": "MEAN", '
                                        '"normalize": false}\' (LAST, MEAN or CLS; default: the model\'s '
                                        "sentence-transformers files, else LAST, normalized)")
    so = parser.add_argument_group("structured outputs (a request over a limit gets a 400 naming the field and the limit)")
    so.add_argument("--structured-outputs-max-grammar-chars", type=human_int,
                    default=_DEFAULTS.structured_outputs_max_grammar_chars,
                    help="most characters of a grammar or a regex (a compile's time grows faster than linearly with a "
                         "grammar's rules)")
    so.add_argument("--structured-outputs-max-schema-chars", type=human_int,
                    default=_DEFAULTS.structured_outputs_max_schema_chars, help="most characters of a JSON schema's text")
    so.add_argument("--structured-outputs-max-schema-depth", type=int,
                    default=_DEFAULTS.structured_outputs_max_schema_depth,
                    help="deepest nesting of objects and arrays in a JSON schema")
    so.add_argument("--structured-outputs-max-choices", type=human_int, default=_DEFAULTS.structured_outputs_max_choices,
                    help="most strings in a choice list")
    so.add_argument("--structured-outputs-max-choice-chars", type=human_int,
                    default=_DEFAULTS.structured_outputs_max_choice_chars, help="most characters of a choice list's strings together")
    so.add_argument("--structured-outputs-compile-timeout", type=float,
                    default=_DEFAULTS.structured_outputs_compile_timeout,
                    help="seconds a request waits for its grammar to compile before it fails")
    so.add_argument("--structured-outputs-compile-threads", type=int,
                    default=_DEFAULTS.structured_outputs_compile_threads,
                    help="grammars compiled at once, so that one slow compile does not hold the other requests' grammars")
    v = parser.add_argument_group("accepted for vLLM's launch scripts, with no effect here (a warning says so)")
    v.add_argument("--gpu-memory-utilization", type=float, default=None,
                   help="vLLM sizes its GPU KV cache by it; here --kv-cache-memory-bytes or --num-kv-blocks do")
    v.add_argument("--trust-remote-code", action="store_true", default=None,
                   help="no model code is ever downloaded or run here: the architectures are tokenloom's own")
    g.add_argument("--trace", dest="trace_path", metavar="PATH", default=None, help="write a Chrome trace (Perfetto) of the run to PATH at shutdown; see `tokenloom explain`")


# vLLM's engine arguments that mean nothing here (GPU memory, remote code, swap,
# its periodic stats log): its launch lines and `LLM(...)` calls pass them, so they are taken and
# a warning says so.
VLLM_ONLY_ARGS = ("gpu_memory_utilization", "trust_remote_code", "swap_space", "disable_log_stats")


def warn_ignored_vllm_args(args: argparse.Namespace) -> None:
    for name in VLLM_ONLY_ARGS:
        if getattr(args, name, None) not in (None, False):
            logger.warning("--%s is vLLM's and has no effect in tokenloom (see --help).", name.replace("_", "-"))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    warn_ignored_vllm_args(args)
    if getattr(args, "dtype", None) in DTYPE_ALIASES:
        args.dtype = DTYPE_ALIASES[args.dtype]
    fields = EngineConfig.__struct_fields__
    config = EngineConfig(**{f: getattr(args, f) for f in fields if hasattr(args, f)})
    config.validate()
    return config


def _with_engine_config_fields(cls: type) -> type:
    """Puts EngineConfig's fields, with their types and defaults, ahead of `cls`'s own before
    @dataclass reads them: the engine arguments are the config's fields by construction, so a
    field added to EngineConfig is an EngineArgs field (and reaches the engine) without a second
    list to keep in step. `model` stays positional, as in vLLM (`EngineArgs("path")`)."""
    annotations: dict[str, Any] = {}
    for f in msgspec.structs.fields(EngineConfig):
        annotations[f.name] = f.type
        if f.default_factory is not msgspec.NODEFAULT:
            default = dataclasses.field(default_factory=f.default_factory)
        else:
            default = dataclasses.field(default=f.default, kw_only=False if f.name == "model" else dataclasses.MISSING)
        setattr(cls, f.name, default)
    own = cls.__dict__.get("__annotations__", {})
    clash = sorted(set(own) & set(annotations))
    if clash:
        raise TypeError(f"{cls.__name__} redeclares EngineConfig's field(s) {clash}.")
    cls.__annotations__ = {**annotations, **own}
    return cls


@dataclasses.dataclass(kw_only=True)
@_with_engine_config_fields
class EngineArgs:
    """vLLM's `EngineArgs`, so that scripts written for vLLM build tokenloom's engines unchanged:
    `LLMEngine.from_engine_args(EngineArgs(model=path, max_model_len=512))`, or from a command
    line with `EngineArgs.add_cli_args(parser)` and `EngineArgs.from_cli_args(args)`.

    The fields are EngineConfig's (same names as vLLM's where vLLM has them, same defaults as
    `LLM(...)` and the CLI), plus vLLM's that mean nothing here (VLLM_ONLY_ARGS), which are taken
    and warned about when the config is built. vLLM's other arguments (tokenizer, LoRA,
    ...) are a TypeError, as any unknown name is in vLLM: taking them silently would run
    something other than what the script asked for.
    """

    # VLLM_ONLY_ARGS: taken so vLLM's scripts run; a value other than None/False is warned about.
    gpu_memory_utilization: float | None = None
    trust_remote_code: bool | None = None
    swap_space: float | None = None
    disable_log_stats: bool | None = None

    def create_engine_config(self, usage_context: Any = None, headless: bool = False) -> EngineConfig:
        """The validated EngineConfig these arguments describe (vLLM returns its VllmConfig here),
        built the way the CLI builds it: vLLM's dtype names half/float read as float16/float32,
        a warning for each vLLM-only argument set, a ValueError naming a field with a bad value.
        `usage_context` is vLLM's usage-telemetry label, which tokenloom has no use for."""
        if headless:
            raise ValueError("headless=True is not supported: tokenloom's engine cores always run "
                             "under the front end that starts them.")
        args = argparse.Namespace(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        return engine_config_from_args(args)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """The CLI's engine options (`add_engine_args`, vLLM's spellings included) plus vLLM's
        `--swap-space` and `--disable-log-stats`, which `tokenloom serve` handles itself; returns
        the parser, as vLLM's does."""
        add_engine_args(parser)
        v = parser.add_argument_group("more of vLLM's engine arguments, with no effect here (a warning says so)")
        v.add_argument("--swap-space", type=float, default=None,
                       help="vLLM's CPU swap space in GiB; preempted requests are recomputed here")
        v.add_argument("--disable-log-stats", action="store_true", default=None, help="no periodic stats are logged here")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments a parser built by `add_cli_args` parsed (other attributes of `args`,
        such as a subcommand's own options, are left out, as in vLLM)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


@dataclasses.dataclass(kw_only=True)
class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`, for `AsyncLLM.from_engine_args` (tokenloom's `AsyncLLMEngine`):
    EngineArgs' fields and vLLM's async one, `enable_log_requests` (an INFO line as each request
    is added and aborted, as vLLM's AsyncLLM logs them; `disable_log_requests`, its older
    spelling, is taken too)."""

    enable_log_requests: bool = False
    disable_log_requests: bool | None = None

    def __post_init__(self) -> None:
        if self.disable_log_requests is not None:
            self.enable_log_requests = not self.disable_log_requests

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, async_args_only: bool = False) -> argparse.ArgumentParser:
        """EngineArgs' options (unless `async_args_only`) and `--enable-log-requests` /
        `--disable-log-requests`."""
        if not async_args_only:
            EngineArgs.add_cli_args(parser)
        parser.add_argument("--enable-log-requests", action="store_true", dest="enable_log_requests",
                            help="log an INFO line as each request is added and aborted")
        parser.add_argument("--disable-log-requests", action="store_false", dest="enable_log_requests",
                            help="vLLM's older spelling: requests are not logged unless --enable-log-requests")
        return parser
