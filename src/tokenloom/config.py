"""Plain configuration shared by the caller and the engine core."""
from __future__ import annotations

import os
import re
from typing import Any, Literal

import msgspec

from tokenloom import envs
from tokenloom.pooling_params import PoolerConfig
from tokenloom.sampling_params import MAX_LOGPROBS

# `quantization=` values (model/loader.QUANTIZATION_METHODS; the last four are the methods a
# pre-quantized checkpoint declares, model/quant_config.CHECKPOINT_METHODS).
QUANTIZATION_CHOICES = ("auto", "gguf", "int8", "none", "compressed-tensors", "awq", "gptq", "fp8")


# vLLM's tokenizer modes and load formats that tokenloom has (the others need its GPU loaders).
TOKENIZER_MODES = ("auto", "slow", "mistral")
LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")

# The speculative methods this engine has (vLLM's `speculative_config["method"]`).
SPECULATIVE_METHODS = ("ngram",)
MAX_SPECULATIVE_TOKENS = 16


class SpeculativeConfig(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):  # type: ignore[call-arg]
    """vLLM's `speculative_config` for n-gram speculation (prompt lookup): after each step the
    model runner looks for the request's last n tokens (n from `prompt_lookup_max` down to
    `prompt_lookup_min`) earlier in its prompt and output, proposes the up to
    `num_speculative_tokens` tokens that followed them, and the next step verifies them in one
    forward pass with the usual sampler (spec_decode/). No draft model: nothing to load."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    # vLLM's older spelling of the method, `"model": "[ngram]"`; any other model (a draft
    # model) is refused.
    model: str | None = None
    # vLLM's knob: no drafts in a step while this many requests or more are running (a large
    # batch already amortises the weight reads that verifying drafts would share; on a CPU
    # whose matmuls are compute-bound there, drafts cost more than they save). None: always.
    disable_by_batch_size: int | None = None

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """The config from vLLM's dict (or None), checked; the ValueError names the field."""
        if isinstance(value, cls):  # checked again: a struct's constructor checks no types
            value = msgspec.structs.asdict(value)
        if value is None:
            spec = None
        elif isinstance(value, dict):
            try:
                spec = msgspec.convert(value, cls)
            except msgspec.ValidationError as e:
                raise ValueError(f"speculative_config: {e}") from None
        else:
            raise ValueError(f"speculative_config must be a dict such as {{'method': 'ngram', "
                             f"'num_speculative_tokens': 4}} or None, got {value!r}.")
        if spec is not None:
            spec._check()
        return spec

    def _check(self) -> None:
        if self.model is not None:
            if self.model != "[ngram]":
                raise ValueError(f"speculative_config.model={self.model!r}: draft models are not supported; "
                                 "use {'method': 'ngram', 'num_speculative_tokens': k}.")
            self.method, self.model = "ngram", None
        if self.method == "[ngram]":
            self.method = "ngram"
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPECULATIVE_METHODS)} "
                             f"(no draft model, EAGLE or MTP heads here), got {self.method!r}.")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}.")
        # vLLM's defaults: both unset is 5 and 5; one unset takes the other's value.
        if self.prompt_lookup_min is None and self.prompt_lookup_max is None:
            self.prompt_lookup_min = self.prompt_lookup_max = 5
        elif self.prompt_lookup_min is None:
            self.prompt_lookup_min = self.prompt_lookup_max
        elif self.prompt_lookup_max is None:
            self.prompt_lookup_max = self.prompt_lookup_min
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError("speculative_config.disable_by_batch_size must be a positive integer or None, got "
                             f"{self.disable_by_batch_size!r}.")
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if not 1 <= getattr(self, name) <= 64:
                raise ValueError(f"speculative_config.{name} must be in [1, 64], got {getattr(self, name)!r}.")
        if self.prompt_lookup_min > self.prompt_lookup_max:  # type: ignore[operator]
            raise ValueError(f"speculative_config.prompt_lookup_min ({self.prompt_lookup_min}) must not "
                             f"exceed prompt_lookup_max ({self.prompt_lookup_max}).")


class StructuredOutputLimits(msgspec.Struct, frozen=True, kw_only=True):  # type: ignore[call-arg]
    """How large a structured output's spec may be (EngineConfig's structured_outputs_max_*);
    checked in the caller before the spec is parsed (structured_output/backend.check_limits)."""

    structured_outputs_max_grammar_chars: int = 8192
    structured_outputs_max_schema_chars: int = 65536
    structured_outputs_max_schema_depth: int = 64
    structured_outputs_max_choices: int = 4096
    structured_outputs_max_choice_chars: int = 65536


STRUCTURED_OUTPUT_LIMITS = tuple(StructuredOutputLimits.__struct_fields__)
# EngineConfig's fields that the resolution sets (model/resolve.py) rather than an argument.
RESOLVED_FIELDS = ("model_name",)
_LIMITS = StructuredOutputLimits()  # the defaults, once


class EngineConfig(msgspec.Struct, kw_only=True):  # type: ignore[call-arg]
    """Everything the engine core needs to build itself; sent to the child process at start-up."""

    model: str | None = None  # None: the embedded SmolLM2-135M-Instruct GGUF; resolved: a local path
    # Where the model and its tokenizer come from (vLLM's names). `model` and `tokenizer` may be
    # hub ids ("org/name", "org/name-GGUF:Q4_K_M"): the resolution (model/resolve.py) downloads
    # them once, in the caller, and rewrites both to local paths before the core starts, so the
    # core never sees a hub id, nor `hf_token`, which the caller then clears.
    tokenizer: str | None = None  # None: the model's own
    tokenizer_mode: str = "auto"  # "auto" | "slow" | "mistral" (model/source.TOKENIZER_MODES)
    tokenizer_revision: str | None = None
    revision: str | None = None
    hf_token: str | bool | None = None
    download_dir: str | None = None
    # "auto" (by the files), "safetensors", "gguf", or "dummy": random weights of the config's shape.
    load_format: str = "auto"
    # The most logprobs (sampled or prompt) one request may ask for; at most
    # sampling_params.MAX_LOGPROBS, the engine's own ceiling.
    max_logprobs: int = 20
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    # The KV cache's element type: "auto" is the model dtype, except on the quantized CPU path
    # (bfloat16, see worker/model_runner.resolve_kv_cache_dtype). "bfloat16" under a float32
    # model (CPU only) halves the cache's memory and the bytes decode attention reads, at the
    # cost of rounding K and V to 8 significant bits (vLLM's kv_cache_dtype).
    kv_cache_dtype: str = "auto"
    device: str = "cpu"
    max_model_len: int | None = None  # None: the model's context length; resolved: the length served
    max_num_batched_tokens: int = 2048  # the token budget of one step
    max_num_seqs: int = 128
    block_size: int = 16
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    kv_cache_memory_bytes: int | None = None
    num_kv_blocks: int | None = None
    seed: int | None = 0  # None: unseeded (a fresh generator each start), as older vLLM
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    # The ledger (tokenloom.metrics): per-request timelines and per-step stats. On by default;
    # off sends no timing with the outputs and keeps no caller-side bookkeeping.
    enable_ledger: bool = True
    # Chrome trace JSON written by the caller at shutdown; the core then also keeps each
    # request's phases (not only their totals).
    trace_path: str | None = None
    # OTLP endpoint the caller sends one OpenTelemetry span per request to (metrics/otel.py).
    otlp_traces_endpoint: str | None = None
    # torch.compile (inductor) of the model forward, dynamic shapes. Off by default: on the CPU
    # it compiled for minutes and then ran decode steps slower than eager (benchmarks/CHANGELOG.md,
    # "CPU: what was tried").
    compile: bool = False
    # vLLM's switch: True runs every step eagerly. Otherwise, on CUDA, decode steps replay CUDA
    # graphs captured at start-up (worker/cuda_graph.py); on the CPU there are none to turn off.
    enforce_eager: bool = False
    # What the matmuls compute with (model/loader.QUANTIZATION_METHODS): "auto" computes a GGUF's
    # quantized tensors as shipped, a pre-quantized HF checkpoint (compressed-tensors, awq, gptq,
    # fp8: its config.json's quantization_config) as shipped, and any other HF checkpoint in
    # `dtype`; "int8" quantizes a float checkpoint's matrices at load; None / "none" is the float
    # path (a GGUF dequantized).
    quantization: str | None = "auto"
    # Data parallelism (vLLM's data_parallel_size): this many whole engine cores (each with its
    # own scheduler, KV cache and model runner) behind one front end, which sends each request to
    # the least loaded one (engine/dp_client.py). Each replica gets its share of the cores.
    data_parallel_size: int = 1
    # The engine core's compute threads per rank (llama.cpp's -t). None: one per usable core,
    # fewer while other processes use them (ops/cpu_threads.ThreadGovernor); a number fixes the
    # count and turns that adaptation off (as TOKENLOOM_NUM_THREADS, which it overrides).
    num_threads: int | None = None
    # Tensor parallelism: the model's attention heads, MLP and vocabulary split across this many
    # ranks (one process each), joined by torch.distributed (executor/, ops/distributed.py).
    tensor_parallel_size: int = 1
    # Who runs the ranks and the replicas: "uni" (in the engine core's process; one rank only),
    # "mp" (local processes) or "ray" (Ray actors, also across the machines of a Ray cluster).
    # None: "uni" for one rank, "mp" for more; data-parallel replicas are local processes.
    distributed_executor_backend: Literal["uni", "mp", "ray"] | None = None
    # Default sampling parameters (vLLM's --generation-config): "auto" takes the model's
    # generation_config.json (temperature, top_p, top_k, min_p, penalties, max_new_tokens) as the
    # defaults a request that leaves them unset gets; "vllm" keeps SamplingParams' own; a folder
    # reads its generation_config.json (and then its max_new_tokens caps every request's
    # max_tokens). `override_generation_config` is merged on top (model/generation_defaults.py).
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] | None = None
    # Speculative decoding (vLLM's speculative_config; n-gram prompt lookup only): a dict is
    # taken and checked by validate().
    speculative_config: SpeculativeConfig | None = None
    # LoRA adapters (vLLM's names): requests may name a PEFT adapter (`LoRARequest`) of rank at
    # most `max_lora_rank`. Any number of adapters share a step (on the CPU an adapter is a few
    # small matmuls per layer, not one of vLLM's GPU slots); the engine core keeps the weights of
    # `max_cpu_loras` (default: max_loras) adapters loaded once no running request uses them.
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    # Pooling (embeddings; vLLM's names): runner "pooling" returns a vector per prompt made from
    # the final hidden states (pooling_params.py) instead of generating; "auto" picks it for a
    # checkpoint without a language-model head. `convert="embed"` asks for it on any model.
    # `pooler_config` (a PoolerConfig or a dict) overrides the model's own pooling settings.
    # model/pooling_config.resolve_pooling decides from the model's files, when the config is
    # resolved (model/resolve.py): an engine that pools gets runner "pooling" and its whole
    # pooler_config; a generating one gets runner "generate".
    runner: str = "auto"
    convert: str = "auto"
    pooler_config: PoolerConfig | None = None
    # vLLM's `hf_overrides`: config.json keys replaced before the model is read (an HF directory
    # only), e.g. Qwen3-Reranker run as a classifier: {"architectures":
    # ["Qwen3ForSequenceClassification"], "classifier_from_token": ["no", "yes"],
    # "is_original_qwen3_reranker": true} (model/hf_config.read_config_json). A dict, not
    # vLLM's alternative of a function: the engine core reads the checkpoint in its own process.
    hf_overrides: dict[str, Any] | None = None
    # Structured outputs: what one request's grammar may ask of the compiler. The limits keep
    # every admitted compile short (xgrammar's compile time grows faster than linearly with a
    # grammar's rules and a schema's nesting), so a compile needs no killing; several compile
    # threads keep one slow compile from holding the others; a compile past the time limit fails
    # its request. Each refusal names the field, the limit and its flag.
    # Characters of a grammar or regex; of a JSON schema's text, and its nesting; strings of a
    # choice list, and their characters together.
    structured_outputs_max_grammar_chars: int = _LIMITS.structured_outputs_max_grammar_chars
    structured_outputs_max_schema_chars: int = _LIMITS.structured_outputs_max_schema_chars
    structured_outputs_max_schema_depth: int = _LIMITS.structured_outputs_max_schema_depth
    structured_outputs_max_choices: int = _LIMITS.structured_outputs_max_choices
    structured_outputs_max_choice_chars: int = _LIMITS.structured_outputs_max_choice_chars
    structured_outputs_compile_timeout: float = 30.0  # seconds a request waits for its grammar
    structured_outputs_compile_threads: int = 2
    # Set by the resolution (model/resolve.py), not an argument: the model as its user gave it (a
    # hub id, not the folder it was downloaded to), which names it in /v1/models and the metrics;
    # None until the config is resolved, after which the core and the runner decide nothing again.
    model_name: str | None = None
    # A pre-quantized checkpoint's LM head that its quantizer left in float: quantized to Q8_0 at
    # load (model/quant_linear.quantize_lm_head_q8_). Off: the head computes as shipped.
    quantize_lm_head: bool = False

    @property
    def executor_backend(self) -> str:
        """distributed_executor_backend with None resolved (the executor inside one engine core;
        "ray" also places data-parallel replicas as Ray actors)."""
        if self.distributed_executor_backend is not None:
            return self.distributed_executor_backend
        return "uni" if self.tensor_parallel_size == 1 else "mp"

    def validate(self) -> None:
        """Refuses what the engine core could not use, naming the field, in the caller: a value
        of the wrong type would otherwise end the core at start-up (it decodes this struct with
        its types) with only "exited with code 1" to show for it."""
        self._check_types()
        self._check_values()
        self._check_parallelism_and_features()

    def _check_types(self) -> None:
        """Paths and option dicts made what the core decodes, then every field's type checked."""
        for name in ("model", "tokenizer", "download_dir", "trace_path"):  # a pathlib.Path is a path too (it cannot cross to the core)
            if isinstance(getattr(self, name), os.PathLike):
                setattr(self, name, os.fspath(getattr(self, name)))
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)  # type: ignore[arg-type]
        self.pooler_config = PoolerConfig.from_any(self.pooler_config)
        if callable(self.hf_overrides):
            raise ValueError("hf_overrides must be a dict of config.json keys (a function cannot reach the engine "
                             "core, which reads the checkpoint in its own process).")
        if self.hf_overrides is not None:
            try:
                msgspec.json.encode(self.hf_overrides)
            except (TypeError, msgspec.EncodeError) as e:
                raise ValueError(f"hf_overrides must hold JSON values (as config.json does): {e}") from None
        try:
            msgspec.convert(msgspec.structs.asdict(self), type(self))
        except msgspec.ValidationError as e:
            match = re.match(r"Expected `(.+?)`, got `(.+?)` - at `\$\.(\w+)`", str(e))
            if match is not None:
                expected, _, name = match.groups()
                expected = expected.replace(" | null", " or None").replace("object", "dict").replace("array", "list")
                raise ValueError(f"{name} must be of type {expected}, got {getattr(self, name)!r}.") from None
            if not str(e).startswith("Invalid enum value"):  # those are named with their choices below
                raise ValueError(f"invalid engine configuration: {e}") from None

    def _check_values(self) -> None:
        """The device, sizes, seed and the fields that name one of a few choices."""
        if not re.fullmatch(r"cpu|cuda(:\d+)?", self.device):
            raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {self.device!r}.")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes < 1:
            raise ValueError("kv_cache_memory_bytes must be a positive number of bytes (or None: sized from "
                             f"max_num_seqs and max_model_len), got {self.kv_cache_memory_bytes!r}.")
        for name in ("max_num_batched_tokens", "max_num_seqs", "block_size", "data_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}.")
        if self.num_threads is not None and (isinstance(self.num_threads, bool) or not isinstance(self.num_threads, int)
                                             or self.num_threads < 1):
            raise ValueError(f"num_threads (--threads) must be a positive integer or None (one per usable core, "
                             f"adaptive), got {self.num_threads!r}.")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be a positive integer, got {self.num_kv_blocks!r}.")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 1 << 64):
            # What numpy's and torch's generators take.
            raise ValueError(f"seed must be an integer in [0, 2**64) or None, got {self.seed!r}.")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}.")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16, got {self.dtype!r}.")
        if self.kv_cache_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError("kv_cache_dtype must be one of auto, float32, bfloat16, float16, got "
                             f"{self.kv_cache_dtype!r}.")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, got {self.attention_backend!r}.")
        if self.tokenizer_mode not in TOKENIZER_MODES:
            raise ValueError(f"tokenizer_mode must be one of {', '.join(TOKENIZER_MODES)}, got {self.tokenizer_mode!r}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}.")
        if isinstance(self.max_logprobs, bool) or not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be an integer in [0, {MAX_LOGPROBS}] (the engine's ceiling), "
                             f"got {self.max_logprobs!r}.")
        if self.quantization not in (None, *QUANTIZATION_CHOICES):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} (or None), got "
                             f"{self.quantization!r}.")

    def _check_parallelism_and_features(self) -> None:
        """Tensor parallelism and what it rules out, LoRA, structured-output limits, the trace."""
        tp = self.tensor_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {tp!r}.")
        if self.distributed_executor_backend not in (None, "uni", "mp", "ray"):
            raise ValueError("distributed_executor_backend must be one of uni, mp, ray (or None), got "
                             f"{self.distributed_executor_backend!r}.")
        if self.distributed_executor_backend == "uni" and tp > 1:
            raise ValueError(f"distributed_executor_backend='uni' runs one rank in the engine core's "
                             f"process, but tensor_parallel_size={tp}; use 'mp' or 'ray'.")
        if tp > 1 and self.compile:
            raise ValueError(f"compile=True is not supported with tensor_parallel_size={tp} "
                             "(the collectives break the graph); leave compile off.")
        if not self.generation_config:
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder, got {self.generation_config!r}.")
        for name in ("max_loras", "max_lora_rank"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras must be at least max_loras ({self.max_loras}), got {self.max_cpu_loras!r}.")
        if self.enable_lora and tp > 1:
            raise ValueError(f"enable_lora is not supported with tensor_parallel_size={tp}: LoRA adapters run "
                             "with one rank.")
        for name in STRUCTURED_OUTPUT_LIMITS:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        timeout = self.structured_outputs_compile_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < float("inf"):
            raise ValueError(f"structured_outputs_compile_timeout must be a positive number of seconds, got {timeout!r}.")
        threads = self.structured_outputs_compile_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"structured_outputs_compile_threads must be a positive integer, got {threads!r}.")
        if self.trace_path is not None and not self.enable_ledger:
            raise ValueError("trace_path needs the ledger: do not combine it with enable_ledger=False.")
        if self.otlp_traces_endpoint is not None and not self.enable_ledger:
            raise ValueError("otlp_traces_endpoint needs the ledger: do not combine it with enable_ledger=False.")


    def structured_output_limits(self) -> StructuredOutputLimits:
        """The size limits the callers' input processors check a structured output against."""
        return StructuredOutputLimits(**{name: getattr(self, name) for name in STRUCTURED_OUTPUT_LIMITS})

    @property
    def is_pooling(self) -> bool:
        """After resolve_pooling(): the engine pools (embeds) rather than generates."""
        return self.runner == "pooling"


# The most the default KV cache takes (kv_cache_memory_bytes=None): at most 768 MiB and at most
# 24,576 tokens (room for 96 sequences of 256 tokens, or three of SmolLM2's 8,192). The token cap
# binds in bfloat16 (SmolLM2-135M: 540 MiB), the byte cap in float32 (~17k tokens: 64 sequences
# of 256). Below both the default is what max_num_seqs sequences of max_model_len tokens need
# (default_kv_cache_bytes), as vLLM's CPU backend sizes its cache by VLLM_CPU_KVCACHE_SPACE
# rather than by the whole memory. The pool hands blocks out in LRU order (for the prefix
# cache), so a busy server ends up touching all of it: this is resident memory, not a reservation.
DEFAULT_KV_CACHE_MEMORY_BYTES = 768 * 1024**2
DEFAULT_KV_CACHE_MAX_TOKENS = 24 * 1024


def default_kv_cache_bytes(bytes_per_token: int, max_num_seqs: int, max_model_len: int,
                           cap: int = DEFAULT_KV_CACHE_MEMORY_BYTES,
                           max_tokens: int = DEFAULT_KV_CACHE_MAX_TOKENS) -> int:
    """The default KV cache budget: room for `max_num_seqs` full-length sequences, at most `cap`
    bytes and `max_tokens` tokens, and at least one full-length sequence (so every admitted
    request can finish)."""
    need = bytes_per_token * max_num_seqs * max_model_len
    return max(min(need, cap, bytes_per_token * max_tokens), bytes_per_token * max_model_len)


def configured_torch_profiler_dir() -> str | None:
    """$TOKENLOOM_TORCH_PROFILER_DIR, or vLLM's $VLLM_TORCH_PROFILER_DIR; None when neither is set."""
    return envs.torch_profiler_dir()


def torch_profiler_dir() -> str:
    """Where `start_profile()` / `stop_profile()` write torch profiler traces (LLM, AsyncLLM, the
    server's /start_profile): configured_torch_profiler_dir(), read by the caller at each call,
    so that setting it after the engine started counts."""
    directory = configured_torch_profiler_dir()
    if not directory:
        raise RuntimeError("profiling needs a folder for its traces: set TOKENLOOM_TORCH_PROFILER_DIR "
                           "(or vLLM's VLLM_TORCH_PROFILER_DIR).")
    return os.path.abspath(os.path.expanduser(directory))
