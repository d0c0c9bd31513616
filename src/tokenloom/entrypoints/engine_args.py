"""Every engine argument, declared once: the `EngineArgs` dataclass (vLLM's), whose fields carry
their defaults, their help text and their command-line spelling.

Generated from it: the options of every CLI command that starts an engine (`add_engine_args`),
the keywords `LLM(...)` takes, the `EngineConfig` the engine core is built from
(`create_engine_config`) and the configuration reference, docs/configuration.md
(`config_reference_markdown`; `python -m tokenloom.entrypoints.engine_args` writes it).

vLLM's spellings work too, so that its launch scripts run unchanged where the meaning is the
same: `--dtype half|float`, `--enable-prefix-caching`, sizes such as `--max-model-len 8k`
(`human_int`), and options that mean nothing here (GPU memory, remote code) are accepted with a
warning saying so (`warn_ignored_vllm_args`).
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any, Literal

from tokenloom.config import LOAD_FORMATS, QUANTIZATION_CHOICES, RESOLVED_FIELDS, TOKENIZER_MODES, EngineConfig
from tokenloom.entrypoints.arg_fields import (
    FROM_CONFIG,
    add_dataclass_args,
    arg,
    human_int,
    json_dict,
    reference_markdown,
)
from tokenloom.model.resolve import resolve_engine_config
from tokenloom.pooling_params import PoolerConfig
from tokenloom.sampling_params import MAX_LOGPROBS

__all__ = ["EngineArgs", "AsyncEngineArgs", "add_engine_args", "engine_config_from_args", "human_int", "json_dict",
           "DTYPE_ALIASES", "VLLM_ONLY_ARGS", "config_reference_markdown"]

logger = logging.getLogger("tokenloom")

# vLLM's --dtype names for the same types.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}
# vLLM's engine arguments that mean nothing here (GPU memory, remote code, swap, its periodic
# stats log): its launch lines and `LLM(...)` calls pass them, so they are taken and a warning
# says so.
VLLM_ONLY_ARGS = ("gpu_memory_utilization", "trust_remote_code", "swap_space", "disable_log_stats")

LOADING = "model loading (vLLM's names: a hub id is downloaded once, by the caller, with huggingface_hub)"
STRUCTURED = "structured outputs (a request over a limit gets a 400 naming the field and the limit)"
VLLM = "accepted for vLLM's launch scripts, with no effect here (a warning says so)"
# Options that only EngineArgs.add_cli_args adds: `tokenloom serve` spells its own.
VLLM_MORE = "more of vLLM's engine arguments, with no effect here (a warning says so)"
REFERENCE_PATH = Path(__file__).resolve().parents[3] / "docs" / "configuration.md"


def _defaults_from_config(cls: type) -> type:
    """Fills the defaults left as FROM_CONFIG with EngineConfig's, before @dataclass reads them,
    and refuses a class that leaves out one of EngineConfig's fields: each field the engine core
    reads is an argument, with its help, by construction."""
    defaults = EngineConfig()
    for name in cls.__dict__.get("__annotations__", {}):
        field = cls.__dict__.get(name)
        if isinstance(field, dataclasses.Field) and field.default is FROM_CONFIG:
            field.default = getattr(defaults, name)
    missing = sorted(set(EngineConfig.__struct_fields__) - set(RESOLVED_FIELDS)
                     - set(cls.__dict__.get("__annotations__", {})))
    if missing:
        raise TypeError(f"{cls.__name__} does not declare EngineConfig's field(s) {missing}.")
    return cls


@dataclasses.dataclass(kw_only=True)
@_defaults_from_config
class EngineArgs:
    """vLLM's `EngineArgs`: every argument of an engine, with its default and help. Scripts
    written for vLLM build tokenloom's engines unchanged: `LLMEngine.from_engine_args(
    EngineArgs(model=path, max_model_len=512))`, or from a command line with
    `EngineArgs.add_cli_args(parser)` and `EngineArgs.from_cli_args(args)`. `LLM(...)` takes
    exactly these fields as keywords. vLLM's arguments that mean nothing here (VLLM_ONLY_ARGS)
    are taken and warned about; any other unknown name is a TypeError, as in vLLM: taking it
    silently would run something other than what the script asked for."""

    model: str | None = arg("GGUF file, Hugging Face directory, or hub id: org/name, org/name-GGUF:Q4_K_M (the GGUF "
                            "of that quantization), org/name-GGUF/file.gguf (default: embedded SmolLM2-135M-Instruct)",
                            positional=True)
    tokenizer: str | None = arg("the tokenizer's GGUF file, directory or hub id (default: the model's); e.g. a GGUF "
                                "repo's base model, for its Hugging Face tokenizer and chat template", group=LOADING)
    tokenizer_mode: str = arg("auto: the fast tokenizer (transformers); slow: the same here (transformers 5 builds "
                              "one tokenizer per model); mistral: mistral_common's (pip install 'tokenloom[mistral]')",
                              choices=TOKENIZER_MODES, group=LOADING)
    tokenizer_revision: str | None = arg("branch, tag or commit of the tokenizer's hub repo (default: the model's "
                                         "revision when the tokenizer is the model's, else the repo's main)",
                                         group=LOADING)
    revision: str | None = arg("branch, tag or commit of the model's hub repo (default: main)", group=LOADING)
    hf_token: str | bool | None = arg("the hub token for gated and private repos (default: $HF_TOKEN or the one "
                                      "`hf auth login` saved); stays in the caller's process", group=LOADING,
                                      parse=str, metavar="TOKEN")
    download_dir: str | None = arg("where hub downloads go (default: $HF_HUB_CACHE, else $HF_HOME/hub)",
                                   group=LOADING)
    load_format: str = arg("auto: by the model's files; safetensors or gguf: only that; dummy: random weights of the "
                           "config's shape (a directory or hub repo with config.json and a tokenizer; no weights "
                           "read or downloaded), for benchmarks", choices=LOAD_FORMATS, group=LOADING)
    max_logprobs: int = arg("the most logprobs (sampled or prompt) a request may ask for; more is a 400 naming the "
                            f"limit (at most {MAX_LOGPROBS})", group=LOADING)
    dtype: str = arg("weights and activations (auto: by what the CPU multiplies fastest, float32 under a quantized "
                     "path; half = float16, float = float32 as in vLLM)",
                     choices=("auto", "float32", "bfloat16", "float16", "half", "float"))
    kv_cache_dtype: str = arg("KV cache element type (auto: the model dtype, but bfloat16 under a quantized path, as "
                              "llama.cpp keeps its cache in float16); bfloat16 under a float32 model halves the cache "
                              "on the CPU", choices=("auto", "float32", "bfloat16", "float16"))
    device: str = arg("where the model runs: cpu, cuda or cuda:N")
    max_model_len: int | None = arg("context length (e.g. 4096, 8k, 8K; default: the model's)", parse=human_int)
    max_num_batched_tokens: int = arg("token budget of one step")
    max_num_seqs: int = arg("most requests running in one step")
    block_size: int = arg("tokens per KV cache block")
    enable_prefix_caching: bool = arg("reuse the KV cache of prompts' shared prefixes (the default)")
    enable_chunked_prefill: bool = arg("split a long prompt's prefill over steps, within the token budget")
    kv_cache_memory_bytes: int | None = arg("bytes of KV cache (default: room for max_num_seqs sequences of "
                                            "max_model_len tokens, capped)")
    num_kv_blocks: int | None = arg("KV cache blocks, instead of sizing the cache by bytes")
    seed: int | None = arg("the engine's random seed (None: unseeded)")
    scheduling_policy: Literal["fcfs", "priority"] = arg("which waiting request is admitted first",
                                                         choices=("fcfs", "priority"))
    attention_backend: Literal["auto", "torch", "triton"] = arg("the attention kernels",
                                                                choices=("auto", "torch", "triton"))
    data_parallel_size: int = arg("engine-core replicas behind one front end, each with its share of the cores; "
                                  "requests go to the least loaded", flags=("--data-parallel-size", "-dp"))
    num_threads: int | None = arg("compute threads of the engine core (per rank), as llama.cpp's -t: a number fixes "
                                  "the count; default one per usable core, one fewer per core other processes keep "
                                  "busy", flags=("--threads", "-t"), metavar="N")
    multiprocess: bool = arg("run the engine core in this process", default=True, flags=(),
                             negative=("--inprocess",))
    enable_ledger: bool = arg("turn the ledger (per-request timing, metrics) off", flags=(), negative=("--no-ledger",))
    compile: bool = arg("torch.compile the model forward (slower on CPU today: see benchmarks/CHANGELOG.md)")
    enforce_eager: bool = arg("run every step eagerly: on CUDA, no decode steps replayed from CUDA graphs (as vLLM's)")
    quantization: str | None = arg(
        "auto: a GGUF computes with its quantized weights (Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K kernels), a "
        "pre-quantized HF checkpoint (compressed-tensors, awq, gptq, fp8) as its config.json's quantization_config "
        "says, another HF model in float; int8: int8 weights and activations for a float model; none: dequantized "
        "float path (a GGUF)",
        choices=QUANTIZATION_CHOICES)
    quantize_lm_head: bool = arg(
        "a pre-quantized HF checkpoint (W4A16, W8A8, FP8) whose LM head the quantizer left in float: quantize that "
        "head to Q8_0 at load (int8 with a scale per 32 weights): fewer bytes read a step, its logits rounded "
        "differently from the checkpoint's")
    tensor_parallel_size: int = arg("split the model across this many ranks (one process each; torch.distributed, "
                                    "gloo on CPU, NCCL on CUDA)", flags=("--tensor-parallel-size", "-tp"))
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = arg(
        "who runs the ranks: uni (this engine core, one rank), mp (worker processes), ray (Ray actors, also across "
        "machines: `ray start --head` first); default uni for one rank, mp for more. With --data-parallel-size > 1, "
        "ray also runs each replica's engine core as a Ray actor placed with a placement group",
        choices=("uni", "mp", "ray"))
    generation_config: str = arg(
        "default sampling parameters: auto takes the model's generation_config.json (temperature, top_p, top_k, "
        "min_p, penalties, max_new_tokens) for what a request leaves unset, as vLLM does; vllm keeps "
        "SamplingParams' defaults; a folder reads its generation_config.json, whose max_new_tokens then caps every "
        "request", metavar="auto|vllm|DIR")
    override_generation_config: dict[str, Any] | None = arg(
        "sampling defaults merged over --generation-config's, e.g. '{\"temperature\": 0.5}'", metavar="JSON")
    speculative_config: dict[str, Any] | None = arg(
        "speculative decoding, as vLLM: '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4}' proposes up to 4 tokens that followed an earlier occurrence of the request's "
        "last tokens (n-gram prompt lookup; no draft model) and verifies them in one step", metavar="JSON")
    enable_lora: bool = arg("serve LoRA adapters (PEFT directories) over the model: requests name one with a "
                            "LoRARequest (offline) or as their model (tokenloom serve --lora-modules)")
    max_loras: int = arg("vLLM's adapter slots; here the default of --max-cpu-loras (on the CPU any number of "
                         "adapters share a step, each a few small matmuls per layer; default 1)")
    max_lora_rank: int = arg("largest adapter rank taken (default 16)")
    max_cpu_loras: int | None = arg("adapters whose weights the engine core keeps loaded once no request uses them, "
                                    "least recently used dropped first (default: --max-loras)")
    runner: str = arg("generate text, or pool (embed: /v1/embeddings, LLM.embed; classify with a "
                      "*ForSequenceClassification checkpoint: /classify, LLM.classify); auto pools a checkpoint "
                      "without a language-model head (default auto)", choices=("auto", "generate", "pooling"))
    convert: str = arg("embed: run the model as an embedding model; classify: a *ForCausalLM as its "
                       "*ForSequenceClassification, its score head from the checkpoint or made from LM-head rows by "
                       "classifier_from_token in --hf-overrides (both imply --runner pooling)",
                       choices=("auto", "none", "embed", "classify"))
    hf_overrides: dict[str, Any] | None = arg(
        "config.json keys replaced before the model is read, as vLLM's; Qwen3-Reranker as a cross-encoder: "
        "'{\"architectures\": [\"Qwen3ForSequenceClassification\"], \"classifier_from_token\": [\"no\", \"yes\"], "
        "\"is_original_qwen3_reranker\": true}'", metavar="JSON")
    pooler_config: PoolerConfig | dict[str, Any] | None = arg(
        "how a pooling model pools, over its own settings: '{\"pooling_type\": \"MEAN\", \"normalize\": false}' "
        "(LAST, MEAN or CLS; default: the model's sentence-transformers files, else LAST, normalized)",
        flags=("--pooler-config", "--override-pooler-config"), parse=json_dict, metavar="JSON")
    override_pooler_config: PoolerConfig | dict[str, Any] | None = arg(
        "vLLM's older name of pooler_config (give one of them)", default=None, cli=False)
    trace_path: str | None = arg("write a Chrome trace (Perfetto) of the run to PATH at shutdown; see "
                                 "`tokenloom explain`", flags=("--trace",), metavar="PATH")
    otlp_traces_endpoint: str | None = arg(
        "send one OpenTelemetry span per request to this OTLP endpoint, as vLLM's (gen_ai.* attributes), with a "
        "child span per ledger part and an event per wait; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc (default) "
        "or http/protobuf; needs pip install 'tokenloom[otel]'", metavar="URL")
    structured_outputs_max_grammar_chars: int = arg(
        "most characters of a grammar or a regex (a compile's time grows faster than linearly with a grammar's rules)",
        parse=human_int, group=STRUCTURED)
    structured_outputs_max_schema_chars: int = arg("most characters of a JSON schema's text", parse=human_int,
                                                   group=STRUCTURED)
    structured_outputs_max_schema_depth: int = arg("deepest nesting of objects and arrays in a JSON schema",
                                                   group=STRUCTURED)
    structured_outputs_max_choices: int = arg("most strings in a choice list", parse=human_int, group=STRUCTURED)
    structured_outputs_max_choice_chars: int = arg("most characters of a choice list's strings together",
                                                   parse=human_int, group=STRUCTURED)
    structured_outputs_compile_timeout: float = arg("seconds a request waits for its grammar to compile before it "
                                                    "fails", group=STRUCTURED)
    structured_outputs_compile_threads: int = arg("grammars compiled at once, so that one slow compile does not hold "
                                                  "the other requests' grammars", group=STRUCTURED)
    # VLLM_ONLY_ARGS: taken so vLLM's scripts run; a value other than None/False is warned about.
    gpu_memory_utilization: float | None = arg("vLLM sizes its GPU KV cache by it; here --kv-cache-memory-bytes or "
                                               "--num-kv-blocks do", default=None, group=VLLM)
    trust_remote_code: bool | None = arg("no model code is ever downloaded or run here: the architectures are "
                                         "tokenloom's own", default=None, group=VLLM)
    swap_space: float | None = arg("vLLM's CPU swap space in GiB; preempted requests are recomputed here",
                                   default=None, group=VLLM_MORE)
    disable_log_stats: bool | None = arg("no periodic stats are logged here", default=None, group=VLLM_MORE)

    def create_engine_config(self, usage_context: Any = None, headless: bool = False, *,
                             spelling: Literal["flag", "keyword"] = "flag") -> EngineConfig:
        """The validated and resolved EngineConfig these arguments describe (vLLM returns its
        VllmConfig here): vLLM's dtype names half/float read as float16/float32, a warning for
        each vLLM-only argument set (spelled as a flag or as an `LLM(...)` keyword), a ValueError
        naming a field with a bad value; then, once, what the model's files decide
        (model/resolve.py): the model and tokenizer as local paths (a hub id downloaded), the
        context length served (`max_model_len` above the model's is a ValueError naming both),
        the runner and pooler. The engines, the core and the runner take the result as it is.
        `usage_context` is vLLM's usage-telemetry label, which tokenloom has no use for."""
        if headless:
            raise ValueError("headless=True is not supported: tokenloom's engine cores always run "
                             "under the front end that starts them.")
        warn_ignored_vllm_args(self, spelling)
        if self.otlp_traces_endpoint is not None:
            from tokenloom.metrics.otel import require_otel

            require_otel()  # the optional extra, named, before any process starts
        if self.pooler_config is not None and self.override_pooler_config is not None:
            raise ValueError("give pooler_config or override_pooler_config (its older name), not both.")
        values = {name: getattr(self, name) for name in EngineConfig.__struct_fields__ if name not in RESOLVED_FIELDS}
        values["dtype"] = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if self.override_pooler_config is not None:
            values["pooler_config"] = self.override_pooler_config
        config = EngineConfig(**values)
        resolve_engine_config(config)
        return config

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Every option of these arguments: the CLI's engine options (`add_engine_args`, vLLM's
        spellings included) and vLLM's `--swap-space` and `--disable-log-stats`, which `tokenloom
        serve` spells itself; returns the parser, as vLLM's does."""
        add_dataclass_args(parser, cls)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments a parser built by `add_cli_args` parsed (other attributes of `args`,
        such as a subcommand's own options, are left out, as in vLLM)."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})


@dataclasses.dataclass(kw_only=True)
class AsyncEngineArgs(EngineArgs):
    """vLLM's `AsyncEngineArgs`, for `AsyncLLM.from_engine_args` (tokenloom's `AsyncLLMEngine`):
    EngineArgs' fields and vLLM's async one, `enable_log_requests` (`disable_log_requests`, its
    older spelling, is taken too)."""

    enable_log_requests: bool = arg("log an INFO line as each request is added and aborted", default=False,
                                    negative=("--disable-log-requests",), group=None,
                                    negative_help="vLLM's older spelling: requests are not logged unless "
                                                  "--enable-log-requests")
    disable_log_requests: bool | None = arg("vLLM's older spelling of enable_log_requests=False", default=None,
                                            cli=False)

    def __post_init__(self) -> None:
        if self.disable_log_requests is not None:
            self.enable_log_requests = not self.disable_log_requests

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, async_args_only: bool = False) -> argparse.ArgumentParser:
        """EngineArgs' options (unless `async_args_only`) and `--enable-log-requests` /
        `--disable-log-requests`."""
        engine_fields = {f.name for f in dataclasses.fields(EngineArgs)}
        add_dataclass_args(parser, cls, include=lambda f: not async_args_only or f.name not in engine_fields)
        return parser


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The options of every CLI command that starts an engine: EngineArgs' fields, but for the
    vLLM options `tokenloom serve` spells itself (VLLM_MORE)."""
    add_dataclass_args(parser, EngineArgs, include=lambda f: f.metadata["group"] != VLLM_MORE)


def warn_ignored_vllm_args(args: Any, spelling: Literal["flag", "keyword"] = "flag") -> None:
    for name in VLLM_ONLY_ARGS:
        if getattr(args, name, None) not in (None, False):
            if spelling == "keyword":
                logger.warning("LLM(%s=...) is vLLM's and has no effect in tokenloom.", name)
            else:
                logger.warning("--%s is vLLM's and has no effect in tokenloom (see --help).", name.replace("_", "-"))


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    """The EngineConfig of a command line parsed with `add_engine_args`."""
    return EngineArgs.from_cli_args(args).create_engine_config()


def config_reference_markdown() -> str:
    """docs/configuration.md: every engine argument, from EngineArgs."""
    intro = ("Generated from `tokenloom.entrypoints.engine_args.EngineArgs` by `python -m "
             "tokenloom.entrypoints.engine_args`; do not edit by hand. Every row is a keyword of `LLM(...)`, "
             "`EngineArgs(...)` and `AsyncEngineArgs(...)`, and (where it has flags) an option of `tokenloom "
             "generate`, `serve`, `run-batch` and `bench`. Option names also take vLLM's underscores "
             "(`--max_model_len`).")
    return reference_markdown(AsyncEngineArgs, "Configuration reference", intro)


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else REFERENCE_PATH
    target.write_text(config_reference_markdown())
    print(f"wrote {target}")
