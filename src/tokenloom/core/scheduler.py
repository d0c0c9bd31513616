"""Who runs in each step, and what happens when a step's tokens come back.

One step: `schedule()` spends the token budget, first on RUNNING requests (one decode token, or
the next prefill chunk), then on WAITING ones in policy order; `update_from_output()` appends the
sampled tokens, applies the stop conditions and frees the blocks of finished requests, so the next
`schedule()` can admit into them (admission is downstream of completion).

Conventions:
  * `num_computed_tokens` is advanced in `schedule()` by the tokens it schedules, as in vLLM:
    between the two calls it counts the tokens of the step in flight. The diffs sent to the runner
    carry the value from *before* the step (the position of the step's first token).
  * `self.running` is kept in policy order (admission order for FCFS; (priority, arrival) for
    priority), so the request to preempt is always the last one, and it is never a request that
    was already scheduled in this step.
  * A request never holds more tokens than the whole KV cache: `max_request_len` is the smaller of
    max_model_len and the cache's capacity for one request (with sliding-window groups, what the
    full-attention groups can hold next to the windows), and reaching it finishes the request
    with LENGTH (otherwise a request that outgrew the cache would preempt itself forever).
  * KV cache groups (kv_cache_spec.py) are the KV cache manager's business: the scheduler passes
    their block ids through (one list per group) and, after each step, lets the manager give back
    what fell out of the sliding windows.
  * Speculative decoding (n-gram drafts, spec_decode/): a running request at its decode point
    schedules its draft tokens after its decode token, within the budget and only into free KV
    blocks (a draft never preempts anyone); `update_from_output` takes back the positions of the
    drafts the runner rejected (`num_computed_tokens -= rejected`; their K/V slots are simply
    overwritten later) and stores the next drafts, capped so that accepting all of them never
    passes max_tokens or the request's length limit.
  * Rejected at `add_request` (finished with ERROR, reported by the next `update_from_output`): an
    empty prompt, a prompt longer than max_model_len, a prompt needing more blocks than the cache
    has, and, with chunked prefill off, a prompt longer than max_num_batched_tokens.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterable
from dataclasses import dataclass, field

from tokenloom.config import EngineConfig
from tokenloom.core.grammar_queue import GrammarQueue
from tokenloom.core.kv_cache_manager import KVCacheManager
from tokenloom.core.request import Request, RequestStatus
from tokenloom.core.request_queue import create_request_queue
from tokenloom.kv_cache_spec import KVCacheGroupSpec
from tokenloom.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, LogprobsLists, SchedulerStats, now
from tokenloom.pooling_params import TOKEN_TASKS
from tokenloom.runner_output import ModelRunnerOutput
from tokenloom.sched_output import CachedRequestData, NewRequestData, SchedulerOutput, WaitReason
from tokenloom.structured_output import StructuredOutputManager


@dataclass(slots=True)
class _StepPlan:
    """What one `schedule()` call has decided so far."""

    token_budget: int
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    wait_reasons: dict[str, WaitReason] = field(default_factory=dict)
    decode_req_ids: set[str] = field(default_factory=set)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_preempted: int = 0

    def take(self, request: Request, num_new_tokens: int) -> None:
        self.num_scheduled_tokens[request.request_id] = num_new_tokens
        self.token_budget -= num_new_tokens
        # A decode computes the one token after everything else: the latest sampled token. This
        # is the one place that decides it; the ledger and the stats read `decode_req_ids`.
        if request.num_output_tokens > 0 and request.num_computed_tokens == request.num_tokens - 1:
            self.decode_req_ids.add(request.request_id)
            if num_new_tokens > 1:  # the rest are its draft tokens (what the budget left of them)
                self.spec_tokens[request.request_id] = request.spec_token_ids[: num_new_tokens - 1]


class Scheduler:
    def __init__(self, config: EngineConfig, num_kv_blocks: int, max_model_len: int,
                 structured_output_manager: StructuredOutputManager | None = None,
                 kv_cache_groups: list[KVCacheGroupSpec] | None = None) -> None:
        self.block_size = config.block_size
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_num_seqs = config.max_num_seqs
        self.enable_chunked_prefill = config.enable_chunked_prefill
        self.policy = config.scheduling_policy
        self.num_kv_blocks = num_kv_blocks
        self.max_model_len = max_model_len
        kv = self.kv_cache_manager = KVCacheManager(
            num_kv_blocks, config.block_size, config.enable_prefix_caching, max_model_len, kv_cache_groups
        )
        self.max_request_len = kv.max_tokens_per_request(self.max_num_batched_tokens)
        kv.max_model_len = self.max_request_len
        # Sliding-window groups give blocks back as requests advance; without them the update
        # pays nothing for it.
        self._frees_windows = bool(kv._sliding_managers)
        # Per group, the blocks the head of the queue asked for in this step's refused admission
        # (empty: it was not refused for blocks); the step stats' "wanted" breakdown.
        self._head_wanted_blocks: tuple[int, ...] = ()
        self.requests: dict[str, Request] = {}  # every live (waiting or running) request
        self.waiting = create_request_queue(self.policy)
        self.running: list[Request] = []
        # Finished, aborted or preempted since the last schedule(): the runner drops them.
        self.finished_req_ids: set[str] = set()
        # Finished with ERROR at add_request; their final output goes out with the next update.
        self.rejected: list[Request] = []
        self.num_preemptions = 0  # cumulative
        self.step = 0
        # Speculative decoding's counters (cumulative; vLLM's spec_decode metrics): drafts
        # verified (requests x steps), draft tokens verified, accepted, and accepted per position.
        spec = config.speculative_config
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.spec_disable_by_batch_size = spec.disable_by_batch_size if spec is not None else None
        self.spec_num_drafts = 0
        self.spec_num_draft_tokens = 0
        self.spec_num_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * self.num_spec_tokens
        # Structured outputs (core/grammar_queue.py): requests whose grammar compiles wait there.
        self.structured_output_manager = structured_output_manager
        self.grammars = GrammarQueue(structured_output_manager)
        self.pooling_type = config.pooler_config.pooling_type if config.pooler_config is not None else None

    # ---- requests in and out ----------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in the scheduler")
        error = self._admission_error(request)
        if error is not None:
            self.reject_request(request, error)
            return
        if self.kv_cache_manager.enable_caching:
            request.enable_block_hashing(self.block_size)
        pooling = request.pooling_params
        if pooling is not None and (self.pooling_type != "LAST" or pooling.task in TOKEN_TASKS):
            # Pooled from every prompt token's state (or the first's): none may come from the
            # cache, whose blocks hold K/V, not hidden states. LAST needs only the last token,
            # which is always computed.
            request.skip_reading_prefix_cache = True
        self.requests[request.request_id] = request
        if request.sampling_params.structured_outputs is not None and not self.grammars.add(request):
            return  # waits for its grammar
        self.waiting.add(request)

    def reject_request(self, request: Request, error: str) -> None:
        """Finishes a request that was never admitted with ERROR; its final output goes out with
        the next update_from_output()."""
        request.status = RequestStatus.FINISHED_ERROR
        request.error = error
        self.rejected.append(request)

    def _admission_error(self, request: Request) -> str | None:
        n = request.num_prompt_tokens
        if request.sampling_params.structured_outputs is not None and self.structured_output_manager is None:
            return "structured outputs are not available in this engine (no grammar backend)"
        if n == 0:
            return "the prompt is empty"
        if n > self.max_model_len:
            return f"the prompt ({n} tokens) is longer than max_model_len ({self.max_model_len})"
        kv = self.kv_cache_manager
        need = kv.max_blocks_held(n, self.max_num_batched_tokens)
        if need > kv.num_usable_blocks:
            return (
                f"the prompt ({n} tokens) needs {need} KV cache blocks of "
                f"{self.block_size} tokens but the cache has only {kv.num_usable_blocks}"
            )
        if not self.enable_chunked_prefill and n > self.max_num_batched_tokens:
            return (
                f"the prompt ({n} tokens) is longer than max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) and chunked prefill is off"
            )
        return None

    def finish_requests(self, request_ids: str | Iterable[str], finished_status: RequestStatus) -> None:
        """Finish requests from outside (abort). Unknown or already finished ids are ignored; no
        output is emitted for them (the caller already knows)."""
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(f"{finished_status!r} is not a finished status")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif not self.grammars.remove(request):
                self.waiting.remove(request)
            request.status = finished_status
            self._free_request(request)

    def _free_request(self, request: Request) -> None:
        if request.structured_output is not None:
            self.grammars.remove(request)
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]

    def has_unfinished_requests(self) -> bool:
        # A rejected request still needs one step to deliver its final output.
        return bool(self.requests) or bool(self.rejected)

    # ---- schedule ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        self.step += 1
        plan = _StepPlan(token_budget=self.max_num_batched_tokens)
        self._head_wanted_blocks = ()
        if self.grammars.compiling:
            ready, failed = self.grammars.take_ready(plan.wait_reasons)
            for request in ready:  # in policy order
                self.waiting.add(request)
            for request in failed:
                self._free_request(request)
                self.rejected.append(request)
        self._schedule_running(plan)
        # After a preemption the cache is short of blocks: admitting anyone now would only
        # take blocks the running requests need next.
        blocked = self._schedule_waiting(plan) if plan.num_preempted == 0 else WaitReason.NO_KV_BLOCKS
        if blocked is not None and self.waiting:
            self._record_waiting_reasons(plan, blocked)

        output = SchedulerOutput(
            scheduled_new_reqs=plan.new_reqs,
            scheduled_cached_reqs=plan.cached_reqs,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            total_num_scheduled_tokens=sum(plan.num_scheduled_tokens.values()),
            finished_req_ids=self.finished_req_ids,
            wait_reasons=plan.wait_reasons,
            decode_req_ids=plan.decode_req_ids,
            scheduled_spec_decode_tokens=plan.spec_tokens,
            step=self.step,
            blocked_reason=blocked if self.waiting else None,
        )
        self.finished_req_ids = set()
        for req_id, num_new_tokens in plan.num_scheduled_tokens.items():
            self.requests[req_id].num_computed_tokens += num_new_tokens
        if self.grammars.live:
            self.grammars.bitmask(output, self.requests)
        return output

    def wait_for_grammars(self, timeout: float) -> None:
        """When nothing can run until a grammar compiles, the busy loop waits here (up to
        `timeout`) instead of spinning empty steps."""
        if not self.running and not self.waiting and not self.rejected:
            self.grammars.wait(timeout)

    def _schedule_running(self, plan: _StepPlan) -> None:
        if self.spec_disable_by_batch_size is not None and len(self.running) >= self.spec_disable_by_batch_size:
            for request in self.running:  # a batch this large decodes without drafts
                request.spec_token_ids = []
        i = 0
        while i < len(self.running):
            request = self.running[i]
            i += 1
            num_new_tokens = self._num_new_tokens(request, request.num_computed_tokens, plan.token_budget)
            if num_new_tokens == 0:
                plan.wait_reasons[request.request_id] = WaitReason.TOKEN_BUDGET
                continue
            new_block_ids = None
            if num_new_tokens > 1 and _has_drafts_due(request):
                new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
                if new_block_ids is None:  # drafts are a bet: nobody is preempted for their slots
                    request.spec_token_ids = []
                    num_new_tokens = 1
            if new_block_ids is None:
                new_block_ids = self._allocate_or_preempt(request, num_new_tokens, plan)
            if new_block_ids is None:
                break  # it preempted itself, after every request behind it
            plan.cached_reqs.req_ids.append(request.request_id)
            plan.cached_reqs.new_block_ids.append(new_block_ids)
            plan.cached_reqs.num_computed_tokens.append(request.num_computed_tokens)
            plan.take(request, num_new_tokens)

    def _allocate_or_preempt(self, request: Request, num_new_tokens: int, plan: _StepPlan
                             ) -> tuple[list[int], ...] | None:
        """Blocks for a running request; while there are none, preempt the last running request
        (latest admitted, or lowest priority), possibly this one. None if it was."""
        while True:
            new_block_ids = self.kv_cache_manager.allocate_slots(request, num_new_tokens)
            if new_block_ids is not None:
                return new_block_ids
            victim = self.running.pop()
            self._preempt(victim, plan)
            if victim is request:
                return None

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Recompute preemption: drop the request's blocks (its full blocks stay in the prefix
        cache, so resuming is often cheap) and send it to the front of the waiting queue. It
        keeps its output tokens and later comes back to the runner as a new request with them."""
        self.kv_cache_manager.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)
        self.finished_req_ids.add(request.request_id)
        plan.wait_reasons[request.request_id] = WaitReason.PREEMPTED
        plan.num_preempted += 1

    def _schedule_waiting(self, plan: _StepPlan) -> WaitReason | None:
        """Admit waiting requests in policy order until one cannot be; returns why it could not
        (None: the queue is empty). Nothing behind it is tried: no overtaking."""
        kv = self.kv_cache_manager
        while self.waiting:
            if len(self.running) >= self.max_num_seqs:
                return WaitReason.MAX_NUM_SEQS
            if plan.token_budget == 0:
                return WaitReason.TOKEN_BUDGET
            request = self.waiting.peek()
            computed_blocks, num_hit_tokens = kv.get_computed_blocks(request)
            num_new_tokens = self._num_new_tokens(request, num_hit_tokens, plan.token_budget)
            if num_new_tokens == 0:
                return WaitReason.TOKEN_BUDGET
            if kv.allocate_slots(request, num_new_tokens, computed_blocks) is None:
                self._head_wanted_blocks = kv.last_refused_need
                return WaitReason.NO_KV_BLOCKS
            # Publish the prompt blocks this step will fill now, not after the step: a request
            # admitted right behind it with the same prefix (the n children of one prompt, a
            # shared system prompt) then shares them in this very step. Safe because every
            # backend writes the whole batch's new K/V of a layer before any query reads them.
            kv.cache_blocks(request, num_hit_tokens + num_new_tokens)
            self.waiting.pop()
            self._admit(request, num_hit_tokens)
            plan.new_reqs.append(
                NewRequestData(
                    req_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    sampling_params=request.sampling_params,
                    block_ids=kv.get_block_ids(request.request_id),
                    num_computed_tokens=num_hit_tokens,
                    output_token_ids=list(request.output_token_ids),
                    lora_request=request.lora_request,
                    pooling_params=request.pooling_params,
                )
            )
            plan.take(request, num_new_tokens)
        return None

    def _admit(self, request: Request, num_hit_tokens: int) -> None:
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_hit_tokens
        if self.policy == "priority":
            bisect.insort(self.running, request, key=lambda r: (r.priority, r.arrival_time))
        else:
            self.running.append(request)

    def _num_new_tokens(self, request: Request, num_computed: int, token_budget: int) -> int:
        """Tokens to compute for the request this step: all it has left (one for a decode, with
        its draft tokens), or a prefill chunk of what is left of the budget; 0 when it must wait
        for budget."""
        remaining = min(request.num_tokens + len(request.spec_token_ids), self.max_request_len) - num_computed
        if remaining <= token_budget:
            return remaining
        if _has_drafts_due(request):
            return token_budget  # a decode, and as many of its drafts as the budget leaves room for
        # With chunked prefill off, a prefill runs whole. The one exception is a preempted request
        # whose prompt + outputs outgrew the whole budget: it could never resume otherwise.
        if self.enable_chunked_prefill or remaining > self.max_num_batched_tokens:
            return token_budget
        return 0

    def _record_waiting_reasons(self, plan: _StepPlan, reason: WaitReason) -> None:
        """The head of the queue could not be admitted for `reason`; everyone behind it waits
        for it. Requests preempted in this step keep PREEMPTED."""
        plan.wait_reasons.setdefault(self.waiting.peek().request_id, reason)
        for request in self.waiting:
            plan.wait_reasons.setdefault(request.request_id, WaitReason.HEAD_OF_LINE)

    # ---- update -----------------------------------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, model_runner_output: ModelRunnerOutput
    ) -> EngineCoreOutputs:
        """Append the sampled tokens, stop finished requests, free their blocks and build the
        step's outputs. This is the only function that loops over the runner's results."""
        outputs: list[EngineCoreOutput] = []
        index = model_runner_output.req_id_to_index
        failed = model_runner_output.failed_req_ids
        any_finished = False
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is None:
                continue  # aborted while the step ran
            i = index.get(req_id)
            sampled = model_runner_output.sampled_token_ids[i] if i is not None else []
            drafts = scheduler_output.scheduled_spec_decode_tokens.get(req_id)
            if drafts:
                # Positions of the rejected drafts were computed but hold nothing: take them back
                # before the full blocks are cached (their hashes cover only kept tokens).
                num_accepted = max(len(sampled) - 1, 0)
                request.num_computed_tokens -= len(drafts) - num_accepted
                if sampled:
                    self._count_spec(len(drafts), num_accepted)
            # num_computed_tokens includes this step, whose K/V are now written.
            self.kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
            if self._frees_windows:  # after caching: the blocks leave the windows still cached
                self.kv_cache_manager.remove_skipped_blocks(request)
            pooled = None
            if req_id in failed:  # the runner failed this request alone (see ModelRunner._fail_request)
                request.status = RequestStatus.FINISHED_ERROR
                request.error = failed[req_id]
                new_token_ids = []
            elif request.structured_output is not None and self.grammars.fail_dead_end(request):
                new_token_ids = []  # the grammar allowed no token: none is kept
            elif request.pooling_params is not None:
                # A pooling request ends with its prompt: the runner pooled it in this step.
                new_token_ids = []
                pooled = model_runner_output.pooler_output.get(req_id)
                if pooled is not None:
                    request.status = RequestStatus.FINISHED_STOPPED
            else:
                new_token_ids = self._append_and_check_stop(request, sampled)
                if new_token_ids and request.structured_output is not None:
                    self.grammars.advance(request, new_token_ids)
            if self.num_spec_tokens:
                self._set_drafts(request, model_runner_output.spec_token_ids.get(req_id))
            prompt_logprobs = model_runner_output.prompt_logprobs.get(req_id)
            if new_token_ids or request.is_finished or prompt_logprobs is not None:
                outputs.append(
                    EngineCoreOutput(
                        request_id=req_id,
                        new_token_ids=new_token_ids,
                        new_logprobs=_logprobs_of(model_runner_output, req_id, len(new_token_ids)),
                        new_prompt_logprobs=prompt_logprobs,
                        finish_reason=request.get_finish_reason(),
                        stop_reason=request.stop_reason,
                        num_cached_tokens=request.num_cached_tokens,
                        error=request.error,
                        pooling_output=pooled,
                    )
                )
            if request.is_finished:
                self._free_request(request)
                any_finished = True
        if any_finished:
            self.running = [r for r in self.running if not r.is_finished]
        for request in self.rejected:
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    finish_reason=FinishReason.ERROR,
                    error=request.error,
                )
            )
        self.rejected = []
        return EngineCoreOutputs(
            outputs=outputs, scheduler_stats=self.make_stats(scheduler_output), timestamp=now()
        )

    def _set_drafts(self, request: Request, drafts: list[int] | None) -> None:
        """The drafts for the request's next step: none for a finished or structured request,
        and never more than accepting them all (plus the sampled token) may add."""
        if not drafts or request.is_finished or request.structured_output is not None:
            request.spec_token_ids = []
            return
        room = self.max_request_len - request.num_tokens
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens)
        request.spec_token_ids = drafts[: max(room - 1, 0)]

    def _count_spec(self, num_drafts: int, num_accepted: int) -> None:
        self.spec_num_drafts += 1
        self.spec_num_draft_tokens += num_drafts
        self.spec_num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            self.spec_accepted_per_pos[pos] += 1

    def _append_and_check_stop(self, request: Request, sampled: list[int]) -> list[int]:
        """Append tokens one at a time; the ones after a stop are dropped."""
        for n, token_id in enumerate(sampled, 1):
            request.append_output_token_ids(token_id)
            if self._check_stop(request):
                return sampled[:n]
        return sampled

    def _check_stop(self, request: Request) -> bool:
        """Sets the finished status. Order: EOS, stop token ids, max_tokens, max_model_len. EOS
        and stop tokens do not count before min_tokens (the sampler also masks them until then)."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if last == request.eos_token_id and not params.ignore_eos:
                request.status = RequestStatus.FINISHED_STOPPED
                return True
            if params.stop_token_ids and last in params.stop_token_ids:
                request.status = RequestStatus.FINISHED_STOPPED
                request.stop_reason = last
                return True
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if request.num_tokens >= self.max_request_len:
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    # ---- stats ------------------------------------------------------------------------------

    def make_stats(self, scheduler_output: SchedulerOutput | None = None) -> SchedulerStats:
        """Gauges are the state after this step's update; prefix-cache and preemption counts are
        cumulative since start."""
        kv = self.kv_cache_manager
        so = scheduler_output
        return SchedulerStats(
            step=so.step if so is not None else self.step,
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting) + len(self.grammars.compiling),
            num_prefill_tokens=so.num_prefill_tokens if so is not None else 0,
            num_decode_tokens=so.num_decode_tokens if so is not None else 0,
            token_budget=self.max_num_batched_tokens,
            num_free_blocks=kv.num_free_blocks,
            num_used_blocks=kv.num_used_blocks,
            num_cached_free_blocks=kv.num_cached_free_blocks,
            num_total_blocks=kv.num_usable_blocks,  # the null block (if any) is no one's
            kv_cache_usage=kv.usage,
            prefix_cache_queries=kv.prefix_cache_queries,
            prefix_cache_hits=kv.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            **self._group_stats(),
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict:
        if not self.num_spec_tokens:
            return {}
        return {"spec_num_drafts": self.spec_num_drafts, "spec_num_draft_tokens": self.spec_num_draft_tokens,
                "spec_num_accepted_tokens": self.spec_num_accepted_tokens,
                "spec_accepted_per_pos": list(self.spec_accepted_per_pos)}

    def _group_stats(self) -> dict:
        """The per-group breakdown of the KV gauges (models with several KV cache groups only):
        blocks in use per group and, when the head of the queue was left waiting for KV blocks,
        how many it asked of each group."""
        kv = self.kv_cache_manager
        if kv.num_groups == 1:
            return {}
        return {"kv_cache_group_used_blocks": kv.num_used_blocks_per_group,
                "kv_cache_group_wanted_blocks": list(self._head_wanted_blocks)}


def _has_drafts_due(request: Request) -> bool:
    """The request is at its decode point (only its latest sampled token is not computed) with
    draft tokens to verify after it."""
    return bool(request.spec_token_ids) and request.num_computed_tokens == request.num_tokens - 1


def _logprobs_of(output: ModelRunnerOutput, req_id: str, num_kept: int) -> LogprobsLists | None:
    """The logprobs of the tokens a request kept (a stop among accepted draft tokens drops the
    positions after it)."""
    logprobs = output.logprobs.get(req_id) if num_kept else None
    if logprobs is None or len(logprobs.token_ids) <= num_kept:
        return logprobs
    return LogprobsLists(token_ids=logprobs.token_ids[:num_kept], logprobs=logprobs.logprobs[:num_kept],
                         ranks=logprobs.ranks[:num_kept])
