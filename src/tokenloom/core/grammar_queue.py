"""The scheduler's structured-output bookkeeping (core/scheduler.py calls it).

A request with `structured_outputs` gets its grammar from the StructuredOutputManager when it is
added. While the grammar compiles (on the manager's thread) the request waits here, outside the
policy queue, so that nobody queues behind it; once compiled it joins the waiting queue, and a
failed compilation fails it. The live structured requests (`live`) are the ones whose sampled
rows need a bitmask each step: with none, a step pays nothing for structured outputs.
"""
from __future__ import annotations

from tokenloom.core.request import Request, RequestStatus
from tokenloom.sched_output import SchedulerOutput, WaitReason
from tokenloom.structured_output import StructuredOutputManager


class GrammarQueue:
    def __init__(self, manager: StructuredOutputManager | None) -> None:
        self.manager = manager  # None: no grammar backend (such requests are refused)
        self.compiling: dict[str, Request] = {}
        self.live: set[str] = set()

    def add(self, request: Request) -> bool:
        """Gives a structured request its grammar: True when it may queue now (a cached grammar),
        False while it waits here for the grammar (or for its failure, see `take_ready`)."""
        assert self.manager is not None  # the scheduler refuses such requests without one
        so = request.structured_output = self.manager.request_grammar(request.sampling_params.structured_outputs)
        if not so.ready() or so.error is not None:
            self.compiling[request.request_id] = request
            return False
        self.live.add(request.request_id)
        return True

    def take_ready(self, wait_reasons: dict[str, WaitReason]) -> tuple[list[Request], list[Request]]:
        """(the requests whose grammar compiled, to queue; those whose compilation failed, marked
        FINISHED_ERROR). The rest wait another step, noted in `wait_reasons`."""
        ready, failed = [], []
        for req_id, request in list(self.compiling.items()):
            so = request.structured_output
            assert so is not None
            if not so.ready():
                wait_reasons[req_id] = WaitReason.GRAMMAR_COMPILE
                continue
            del self.compiling[req_id]
            self.manager.release(so)  # type: ignore[union-attr]
            if so.error is not None:
                request.status = RequestStatus.FINISHED_ERROR
                request.error = so.error
                failed.append(request)
            else:
                self.live.add(req_id)
                ready.append(request)
        return ready, failed

    def remove(self, request: Request) -> bool:
        """Forgets a finished request; True when it was still waiting for its grammar."""
        self.live.discard(request.request_id)
        if self.compiling.pop(request.request_id, None) is None:
            return False
        assert self.manager is not None and request.structured_output is not None
        self.manager.release(request.structured_output)  # an aborted request's compile may go
        return True

    def bitmask(self, output: SchedulerOutput, requests: dict[str, Request]) -> None:
        """The bitmask rows of the structured requests that sample in this step: those whose
        computed tokens now reach the end of their tokens (a prefill chunk short of it is not
        sampled). One cheap pass over the scheduled ids; xgrammar fills the rows in one call."""
        ids = [req_id for req_id in output.num_scheduled_tokens
               if req_id in self.live and requests[req_id].num_computed_tokens >= requests[req_id].num_tokens
               and requests[req_id].structured_output.constrains_next]  # type: ignore[union-attr]
        if not ids:
            return
        assert self.manager is not None
        output.structured_output_req_ids = ids
        bitmask = self.manager.grammar_bitmask([requests[r].structured_output for r in ids])  # type: ignore[misc]
        output.grammar_bitmask = bitmask
        # A row that allows no token: the grammar cannot go on from here. Whatever the sampler
        # picks would break it, so the request fails with the grammar's name (`dead_end`).
        empty = (bitmask == 0).all(dim=1)
        if bool(empty.any()):
            for row in empty.nonzero().flatten().tolist():
                requests[ids[row]].structured_output.dead_end = True  # type: ignore[union-attr]

    def wait(self, timeout: float) -> None:
        """Blocks until a compiling grammar is done, or `timeout` (the engine core's loop, when
        nothing else can run)."""
        if self.compiling:
            assert self.manager is not None
            self.manager.wait_any([r.structured_output for r in self.compiling.values()], timeout)  # type: ignore[misc]

    @staticmethod
    def fail_dead_end(request: Request) -> bool:
        """Fails a request whose grammar allowed no next token (its sampled token is dropped);
        False when the grammar allowed one."""
        so = request.structured_output
        if so is None or not so.dead_end:
            return False
        request.status = RequestStatus.FINISHED_ERROR
        kind = so.params.kind
        request.error = (f"structured_outputs.{kind} allows no token after the output so far: the "
                         f"{kind if kind != 'json' else 'JSON schema'} can never be completed from here "
                         "(e.g. a rule that refers only to itself)")
        return True

    @staticmethod
    def advance(request: Request, new_token_ids: list[int]) -> None:
        """The matcher accepts the tokens the request kept. A grammar that is complete (it accepted
        its stop token) finishes the request with STOP; a token it refuses (the mask was not
        applied, e.g. min_tokens suppressed the only allowed stop token) fails it, honestly."""
        so = request.structured_output
        assert so is not None
        if not so.accept(new_token_ids):
            if not request.is_finished:
                request.status = RequestStatus.FINISHED_ERROR
                request.error = (f"token {new_token_ids[-1]} does not fit the request's "
                                 f"structured_outputs.{so.params.kind} constraint")
            return
        if not request.is_finished and so.is_terminated:
            request.status = RequestStatus.FINISHED_STOPPED
