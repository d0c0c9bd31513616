"""Parallel sampling (`n > 1`): one user request, n child requests in the engine core.

The core knows nothing about n: each child is an ordinary request (n=1) with its own id, and the
children share the prompt's KV blocks through the prefix cache. The caller fans the request out
with `ParentRequest.child_requests()` and folds the children's completions back into one
`RequestOutput` per step, with `CompletionOutput.index` = the child's index.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from tokenloom.outputs import CompletionOutput, PromptLogprobs, RequestMetrics
from tokenloom.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from tokenloom.engine.accounts import Account


def child_request_id(index: int, parent_request_id: str) -> str:
    return f"{index}_{parent_request_id}"


class ParentRequest:
    """The caller-side state of a request with n > 1.

    Per step the output processor calls `add_child_output` for every child that produced
    something, then `get_outputs` once: the completions to report and whether all children have
    finished. What is reported depends on the output kind:
    - CUMULATIVE: all n completions so far, in index order (a child with nothing yet is empty);
    - DELTA: only the completions that changed this step, each holding only its new part;
    - FINAL_ONLY: nothing until every child has finished, then all n.
    """

    def __init__(self, request_id: str, sampling_params: SamplingParams) -> None:
        self.request_id = request_id
        self.sampling_params = sampling_params
        self.n = sampling_params.n
        self.output_kind = sampling_params.output_kind
        self.child_ids = [child_request_id(i, request_id) for i in range(self.n)]
        self._unfinished = set(range(self.n))
        # Latest (cumulative) completion of each child; only the DELTA kind does without.
        self._latest = [CompletionOutput(i, "", [], None, None) for i in range(self.n)]
        self._step_outputs: dict[int, CompletionOutput] = {}
        # Shared by all children, filled in by the output processor.
        self.prompt: str | None = None
        self.prompt_token_ids: list[int] | None = None
        self.prompt_logprobs: PromptLogprobs | None = None
        self.prompt_logprobs_sent = False
        self.metrics: RequestMetrics | None = None
        self.account: Account | None = None  # set with metrics (engine/accounts.py)
        self.num_cached_tokens = 0
        self.error: str | None = None

    def child_requests(self) -> list[tuple[str, SamplingParams]]:
        """(child id, params) for each child: n=1, and with a seed, seed + index, so that the
        children differ from each other but a rerun repeats them."""
        seed = self.sampling_params.seed
        return [
            (child_id, self.sampling_params.clone(n=1, seed=None if seed is None else (seed + i) % 2**64))
            for i, child_id in enumerate(self.child_ids)
        ]

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def is_child_finished(self, index: int) -> bool:
        return index not in self._unfinished

    def add_child_output(self, completion: CompletionOutput) -> None:
        index = completion.index
        if completion.finished():
            self._unfinished.discard(index)
        if self.output_kind == RequestOutputKind.DELTA:
            previous = self._step_outputs.get(index)
            if previous is None:
                self._step_outputs[index] = completion
            else:  # two outputs of one child in one step: keep both deltas
                previous.append_delta(completion)
        else:
            self._latest[index] = completion
            self._step_outputs[index] = completion

    def get_outputs(self) -> tuple[list[CompletionOutput], bool] | None:
        """The completions to report for this step and whether the request is finished, or None
        when there is nothing to report."""
        if not self._step_outputs:
            return None
        changed, self._step_outputs = self._step_outputs, {}
        if self.output_kind == RequestOutputKind.DELTA:
            return [changed[i] for i in sorted(changed)], self.finished
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not self.finished:
            return None
        return list(self._latest), self.finished
