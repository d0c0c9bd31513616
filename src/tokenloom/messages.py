"""The wire vocabulary between the caller (engine/) and the engine core (core/).

Everything that crosses the process boundary is one of these msgspec Structs, encoded as msgpack.
Nothing is pickled. New fields are appended last so old and new encoders stay compatible
(`array_like=True` encodes by position).
"""
from __future__ import annotations

import enum
import time

import msgspec

from tokenloom.lora_request import LoRARequest
from tokenloom.pooling_params import PoolingParams
from tokenloom.sampling_params import SamplingParams


class FinishReason(enum.IntEnum):
    """Why a request finished. `str()` gives the OpenAI/vLLM spelling."""

    STOP = 0  # EOS, a stop token id or a stop string
    LENGTH = 1  # max_tokens or max_model_len reached
    ABORT = 2  # aborted by the caller (disconnect, explicit abort)
    ERROR = 3  # the engine failed while the request was in flight

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequestType(enum.Enum):
    """First frame of every message on the input socket."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x02"
    SHUTDOWN = b"\x03"
    # Several ADDs in one message (a list of EngineCoreRequest): the core queues them all before
    # its next step, so that step's batch does not depend on when each would have arrived.
    ADD_BATCH = b"\x04"


def now() -> float:
    """The one clock of the ledger: CLOCK_MONOTONIC is system-wide on Linux, so timestamps taken
    in the caller and in the engine-core process are directly comparable."""
    return time.monotonic()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    arrival_time: float
    priority: int = 0
    lora_request: LoRARequest | None = None  # the LoRA adapter it runs with (enable_lora)
    # Set just before the request is encoded; the core's receive time minus this is "IPC in".
    sent_time: float = 0.0
    # Core-local, never sent: stamped by the engine core's input thread when it decoded this.
    received_time: float = 0.0
    # A pooling request (runner="pooling"), resolved by the caller (PoolingParams.resolve): its
    # prompt is run once and pooled; `sampling_params` then only carries max_tokens=1.
    pooling_params: PoolingParams | None = None


class LogprobsLists(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Logprobs of several positions, vLLM's layout: for each position, `token_ids[i]` and
    `logprobs[i]` hold the chosen token first, then the top-k; `ranks[i]` is the chosen token's
    rank in the full distribution (1 = most likely)."""

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class PooledData(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """A pooling request's result: float32 values, little-endian, row-major in `shape` ([d] for
    an embedding, [tokens, d] for token_embed). Bytes, not a list of floats: msgpack carries them
    as one binary blob, and the caller needs neither torch nor a float per Python object."""

    shape: list[int]
    data: bytes


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    request_id: str
    new_token_ids: list[int]
    new_logprobs: LogprobsLists | None = None
    new_prompt_logprobs: LogprobsLists | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Error text when finish_reason is ERROR (e.g. the prompt can never fit the KV cache).
    error: str | None = None
    # The ledger: set on a request's final output only (None when the ledger is off).
    timing: RequestTiming | None = None
    # A pooling request's result, on its final output.
    pooling_output: PooledData | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """One engine step, as the ledger sees it."""

    step: int = 0
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    token_budget: int = 0
    num_free_blocks: int = 0
    num_used_blocks: int = 0
    num_cached_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # The step profile, in seconds (appended fields; 0 when not measured). schedule -> execute
    # (prepare inputs, forward incl. logits, sample) -> update (the runner's bookkeeping after
    # sampling plus the scheduler's update_from_output). `loop_time` is the busy loop's time
    # between the end of the previous step and the start of this one (inputs drained, outputs
    # queued); `serialize_time` is what the output thread spent encoding and sending since the
    # previous step (it overlaps the step on the other core, but shares the CPU and the GIL).
    schedule_time: float = 0.0
    prepare_time: float = 0.0
    forward_time: float = 0.0
    sample_time: float = 0.0
    update_time: float = 0.0
    step_time: float = 0.0
    loop_time: float = 0.0
    serialize_time: float = 0.0
    # Models with several KV cache groups (sliding-window layers; kv_cache_spec.py): per group,
    # the blocks in use (the totals above are their sum) and, in a step whose queue head was left
    # waiting for KV blocks, the blocks it asked of each group (what queue_no_kv_blocks waits for).
    # Empty with one group.
    kv_cache_group_used_blocks: list[int] = []
    kv_cache_group_wanted_blocks: list[int] = []
    # Speculative decoding (cumulative since start; 0 and [] without it): drafts verified (one
    # per request and step that had draft tokens), draft tokens verified, draft tokens accepted,
    # and accepted tokens by position in the draft (vLLM's spec_decode_* metrics).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # Machine contention (ops/schedstat.py; 0 where /proc has no schedstat): over the step, the
    # CPU seconds of the engine core's compute threads, and the seconds the most delayed of them
    # was runnable but not running (its run_delay); the cores other processes used (/proc/stat,
    # refreshed every half second) and the cores this engine may use.
    cpu_time: float = 0.0
    run_delay: float = 0.0
    other_cores: float = 0.0
    num_cores: int = 0
    # In a container with a CPU quota (ops/cgroup_cpu.py): the part of run_delay the quota
    # throttled the engine (run_delay is the larger of the two), and the quota as its file says it
    # ("cpu.max 20000/100000"); 0 and "" without a quota. Under tensor parallelism cpu_time and
    # run_delay cover the ranks' worker processes too (the sum and the largest).
    throttled: float = 0.0
    cpu_quota: str = ""


# The engine core's output thread sends an empty EngineCoreOutputs after this many seconds in which
# it sent nothing else (only once the ready handshake is out): the caller's proof that the core
# process is alive, since that thread answers while a step runs (see engine_core_proc).
HEARTBEAT_INTERVAL_S = 0.5
# The call id of the engine core's ready handshake: its first message answers it with EngineInfo.
READY_CALL_ID = -1
# The engine_error of a core stopped by SIGINT (a terminal's Ctrl-C reaches the whole process
# group): a stop someone asked for, which callers log as such rather than as a crash.
ENGINE_STOPPED_BY_SIGINT = "engine core stopped by SIGINT"


class UtilityOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    call_id: int
    result: bytes = b""  # msgpack of the result
    failure: str | None = None


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: SchedulerStats | None = None
    timestamp: float = 0.0
    utility_output: UtilityOutput | None = None
    # Set once, on the last message of a dying engine core.
    engine_error: str | None = None
    # Caller-local, never sent: stamped by the client when it decoded this message.
    received_time: float = 0.0
    # Stamped by the engine core's output thread just before it encodes and sends this message.
    sent_time: float = 0.0
    # Caller-local, never sent: the data-parallel replica this came from (vLLM's engine_index).
    engine_index: int = 0


class UtilityRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """A method call on the engine core that is not a request (stats, introspection, cache reset).
    `args` and the result must be plain msgpack values."""

    call_id: int
    method: str
    args: list = []


class EngineInfo(msgspec.Struct, array_like=True, gc=False):  # type: ignore[call-arg]
    """Sent once by the engine core when it is ready: the facts the caller needs to validate."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    dtype: str
    attention_backend: str
    pid: int
    kv_cache_dtype: str = ""  # "" from an engine that predates the field
    # What the matmuls compute with: "none" (float) or e.g. "gguf Q4_1x210+Q8_0x1 avx512_vnni".
    quantization: str = ""
    # Bytes of matrix weights one decode step reads (linear layers and the LM head, as stored).
    weight_bytes_per_token: int = 0
    # What the engine chose for the CPU it runs on ("" on other devices or older engines): the
    # CPU (model name, usable cores, ISA flags), the C kernels' ISA level, the matmul path and
    # the thread policy, one line (ops/cpu_features.engine_cpu_line).
    cpu: str = ""
    cpu_kernels_isa: str = ""  # "avx512" | "avx2" | "scalar" | "off"
    # Models with sliding-window layers (several KV cache groups): the longest request the KV
    # cache holds on its own, in tokens, which is less than num_kv_blocks x block_size (every
    # group takes blocks). 0: num_kv_blocks x block_size.
    kv_cache_capacity_tokens: int = 0
    # How the model is split: its tensor-parallel ranks and who runs them ("uni", "mp", "ray").
    tensor_parallel_size: int = 1
    executor_backend: str = "uni"
    # On CUDA, the decode batches replayed from CUDA graphs (worker/cuda_graph.py); "": none.
    cuda_graphs: str = ""
    # The CPU's kernel plan (ops/kernel_plan.py): its summary line and its [op, dtype, rows,
    # kernel, note] rows; empty on other devices or from older engines.
    kernel_plan_summary: str = ""
    kernel_plan: list[list[str]] = msgspec.field(default_factory=list)
    # Seconds the warm-up took before ready (core/warmup.py); 0.0: none ran.
    warmup_seconds: float = 0.0

    def __repr__(self) -> str:
        # The plan's rows are logged once as a table at start-up; a repr counts them.
        shown = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__struct_fields__
                          if name != "kernel_plan")
        return f"EngineInfo({shown}, kernel_plan=<{len(self.kernel_plan)} rows>)"


class LedgerBucket(enum.IntEnum):
    """Where the engine core spent a request's time; indexes `RequestTiming.seconds`.

    Each step's whole duration (from its start to the next step's start) goes to one bucket per
    live request: the kind of tokens it computed in the step, or why it was left waiting
    (`SchedulerOutput.wait_reasons`). Head-of-line waits are kept apart by what blocked the head.
    """

    STEP_BOUNDARY = 0  # received, not yet considered: the step in flight must end first
    BEHIND_PREFILL = 1  # the same, when the step in flight was a long prefill chunk
    TOKEN_BUDGET = 2
    MAX_NUM_SEQS = 3
    NO_KV_BLOCKS = 4
    HOL_TOKEN_BUDGET = 5  # behind a waiting request blocked by the token budget
    HOL_MAX_NUM_SEQS = 6
    HOL_NO_KV_BLOCKS = 7
    PREFILL = 8
    DECODE = 9
    # Its tokens computed in a step that was mostly someone else's long prefill chunk.
    PREFILL_BEHIND_PREFILL = 10
    DECODE_BEHIND_PREFILL = 11
    PREEMPTED = 12  # from a preemption until it decodes again: waiting to resume, then recompute
    GRAMMAR_COMPILE = 13  # waiting for its structured-output grammar to compile
    # In the engine's first step after ready, beyond what the start-up warm-up's step took: the
    # one-time work the warm-up did not reach (core/warmup.py), never booked as prefill.
    FIRST_STEP = 14
    # Never a request's bucket: the seconds of its PREFILL / DECODE steps in which the engine's
    # threads were runnable but not running (other processes held the cores), taken out of them.
    MACHINE_CONTENTION = 15


class RequestTiming(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    """The engine core's ledger of one request, sent once, with its final output. All times are
    on the `now()` clock; `seconds` (one float per LedgerBucket) adds up to
    finished_time - received_time."""

    sent_time: float  # EngineCoreRequest.sent_time, echoed
    received_time: float
    queued_time: float  # added to the scheduler
    first_scheduled_time: float  # start of the first step that computed tokens for it (0: never)
    first_token_time: float  # end of the step that produced its first token (0: none)
    finished_time: float  # end of the step that finished it
    seconds: list[float]
    num_preemptions: int = 0
    # Only when tracing: its phases in order, (bucket, start, end), end to end consecutive.
    segments: list[tuple[int, float, float]] = []
    num_segments_dropped: int = 0
    # The bucket it was in at the end: where an aborted request's account is cut back to its
    # caller's end (metrics.timeline.clip_core).
    last_bucket: int = -1
