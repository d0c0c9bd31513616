"""Each finished request's metrics are recorded once, and only with the engine core's account.

A request usually gets its core timing (`RequestTiming`) with its final output. Two kinds end in
the caller first: an abort (a client gone, `abort()`), and a stop string the detokenizer found
while the core was still generating. Their final output goes to the consumer at once, but their
account is owed: the core sends it when it handles the abort (core_ledger.CoreLedger.abort). An
`Account` holds such a request's final output until every core request it stands for (its n
children) has paid; only then is it "ready", and the engine records its metrics (histograms,
the ledger's parts, the trace) from `pop_ready()`, exactly once.

With the ledger off the core sends no timing: every final output is ready at once.
"""
from __future__ import annotations

from tokenloom.messages import EngineCoreOutput
from tokenloom.metrics.timeline import settle
from tokenloom.outputs import RequestMetrics, RequestOutput


class Account:
    """The metrics of one user request (n=1, or the parent of n children)."""

    __slots__ = ("metrics", "owed", "output", "last_core_id")

    def __init__(self, metrics: RequestMetrics) -> None:
        self.metrics = metrics
        self.owed: set[str] = set()  # core requests finished here whose timing has not come yet
        self.output: RequestOutput | None = None  # the final output, once emitted
        # The core request that finished last in the caller: the request's critical path, whose
        # timing is the request's own (the other children ran alongside it).
        self.last_core_id: str | None = None


class Accounts:
    def __init__(self, expect_timing: bool) -> None:
        self.expect_timing = expect_timing
        self._owed: dict[str, tuple[Account, RequestMetrics]] = {}  # core request id -> ...
        self._ready: list[RequestOutput] = []

    def __len__(self) -> int:
        """Core requests whose timing is still owed."""
        return len(self._owed)

    def owes(self, core_id: str) -> bool:
        return core_id in self._owed

    def finished(self, account: Account, core_id: str, metrics: RequestMetrics) -> None:
        """A core request finished in the caller; `metrics` are its own (a child's, or the
        request's). Its timing came with it, or is now owed."""
        account.last_core_id = core_id
        if metrics is not account.metrics:
            account.metrics.core = metrics.core
        if metrics.core is None and self.expect_timing:
            account.owed.add(core_id)
            self._owed[core_id] = (account, metrics)

    def emitted(self, account: Account, output: RequestOutput) -> None:
        """The request's final output went to its consumer."""
        account.output = output
        if not account.owed:
            self._ready.append(output)

    def pay(self, out: EngineCoreOutput) -> None:
        """The late timing of an owed core request (an output that carries nothing else)."""
        account, metrics = self._owed.pop(out.request_id)
        metrics.core = out.timing
        if metrics is not account.metrics:
            settle(metrics)
            if account.last_core_id == out.request_id:
                account.metrics.core = out.timing
        account.owed.discard(out.request_id)
        if not account.owed and account.output is not None:
            settle(account.metrics)
            self._ready.append(account.output)

    def pop_ready(self) -> list[RequestOutput]:
        """Final outputs whose metrics are complete, each once: record them now."""
        ready, self._ready = self._ready, []
        return ready

    def forgive_all(self) -> None:
        """The core died: nothing more will come. What is owed is recorded as it is (its core
        time unattributed)."""
        self.forgive(list(self._owed))

    def forgive(self, core_ids: list[str]) -> None:
        """These core requests' engine core died (one data-parallel replica, or the only core):
        their timing will not come."""
        ready = {id(o) for o in self._ready}
        for core_id in core_ids:
            entry = self._owed.pop(core_id, None)
            if entry is None:
                continue
            account = entry[0]
            account.owed.discard(core_id)
            if not account.owed and account.output is not None and id(account.output) not in ready:
                ready.add(id(account.output))
                self._ready.append(account.output)
