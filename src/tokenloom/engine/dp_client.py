"""Data parallelism: M engine cores behind one front end (`--data-parallel-size M`).

Each replica is a whole engine core in its own process (its own scheduler, KV cache and model
runner) with its own pair of ZMQ sockets, started by the ordinary client (`MPClient`, or
`AsyncMPClient` for `AsyncLLM`) locally or, with `distributed_executor_backend="ray"`, as a Ray
actor (engine/ray_launcher.py). The clients here hold the M clients and look like one to
`LLMEngine` and `AsyncLLM`:

- a request (with all its n children) goes to the replica with the fewest running plus waiting
  requests, as vLLM's DP coordinator balances them: the counts each core reports with every step
  (`SchedulerStats`), plus what was sent to it minus what finished since that report, so a burst
  that arrives between two reports is spread instead of piling onto the replica that looked
  idlest (`LoadBalancer`);
- an abort goes to the replica that owns the request;
- a utility call (get_state, reset_prefix_cache, the ledger's view) goes to every live replica,
  and their answers are merged (`merge_results`);
- a replica that dies fails only the requests it owned: `ReplicaDeadError` (an `EngineDeadError`,
  so the caller's contract is today's) names them, and the front end fails them alone; new
  requests go to the replicas still alive. Only when the last one dies is the engine dead;
- (the asyncio form) a replica not heard from for `heartbeat_timeout_s` (no output nor heartbeat:
  stopped, hung) gets no new requests while another replica is heard from (`fresh`).
"""
from __future__ import annotations

import asyncio
import zmq
from dataclasses import dataclass, field
from typing import Any, Callable

from tokenloom.config import EngineConfig
from tokenloom.engine.async_client import AsyncMPClient
from tokenloom.engine.core_client import (
    _POLL_MS,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    CoreLauncher,
    EngineCoreClient,
    EngineDeadError,
    MPClient,
)
from tokenloom.messages import EngineCoreOutputs, EngineCoreRequest, now


class ReplicaDeadError(EngineDeadError):
    """One data-parallel replica died; the others serve on. `request_ids` are the core requests it
    owned (each gets the engine-death error)."""

    def __init__(self, reason: str, replica: int, request_ids: list[str]) -> None:
        super().__init__(reason)
        self.replica = replica
        self.request_ids = request_ids


@dataclass(slots=True)
class ReplicaLoad:
    """What the front end knows of one replica's load."""

    reported: int = 0  # running + waiting in its last SchedulerStats
    sent_since: int = 0  # core requests sent to it since that report
    finished_since: int = 0  # ... and finished (or aborted) since
    owned: set[str] = field(default_factory=set)  # core request ids in flight there
    alive: bool = True
    num_sent: int = 0  # totals, for /metrics
    num_finished: int = 0

    @property
    def load(self) -> int:
        return max(0, self.reported + self.sent_since - self.finished_since)


class LoadBalancer:
    """Chooses the least loaded live replica and remembers which one owns each core request."""

    def __init__(self, size: int) -> None:
        self.replicas = [ReplicaLoad() for _ in range(size)]
        self.owner: dict[str, int] = {}
        self._last = -1  # ties go round-robin, starting after the last choice

    def choose(self, usable: Callable[[int], bool]) -> int:
        n = len(self.replicas)
        best, best_load = -1, 0
        for k in range(1, n + 1):
            i = (self._last + k) % n
            r = self.replicas[i]
            if r.alive and usable(i) and (best < 0 or r.load < best_load):
                best, best_load = i, r.load
        if best < 0:
            raise EngineDeadError("every data-parallel replica is dead")
        self._last = best
        return best

    def sent(self, replica: int, request_ids: list[str]) -> None:
        r = self.replicas[replica]
        r.sent_since += len(request_ids)
        r.num_sent += len(request_ids)
        r.owned.update(request_ids)
        for rid in request_ids:
            self.owner[rid] = replica

    def received(self, replica: int, outputs: EngineCoreOutputs) -> None:
        """Counts the requests this message finished, then takes its stats as the new report (a
        step's stats already leave out the requests it finished)."""
        r = self.replicas[replica]
        for out in outputs.outputs:
            if out.finish_reason is not None and self.owner.get(out.request_id) == replica:
                self._finished(r, out.request_id)
        stats = outputs.scheduler_stats
        if stats is not None:
            r.reported = stats.num_running_reqs + stats.num_waiting_reqs
            r.sent_since = r.finished_since = 0

    def _finished(self, r: ReplicaLoad, request_id: str) -> None:
        del self.owner[request_id]
        r.owned.discard(request_id)
        r.finished_since += 1
        r.num_finished += 1

    def forget(self, request_ids: list[str]) -> dict[int, list[str]]:
        """Aborted core requests, grouped by the replica that owns them."""
        by_replica: dict[int, list[str]] = {}
        for rid in request_ids:
            i = self.owner.get(rid)
            if i is not None:
                self._finished(self.replicas[i], rid)
                by_replica.setdefault(i, []).append(rid)
        return by_replica

    def mark_dead(self, replica: int) -> list[str]:
        """The replica died: returns the core requests it owned (no longer anyone's)."""
        r = self.replicas[replica]
        r.alive = False
        ids = sorted(r.owned)
        for rid in ids:
            del self.owner[rid]
        r.owned.clear()
        r.reported = r.sent_since = r.finished_since = 0
        return ids

    @property
    def num_alive(self) -> int:
        return sum(r.alive for r in self.replicas)


def merge_results(results: list[Any]) -> Any:
    """One answer from every live replica's answer to the same utility call: numbers in dicts are
    summed (get_state: the engine's totals), lists are concatenated (the ledger's requests in
    flight), booleans must all hold (reset_prefix_cache), anything else is the list."""
    if not results:
        return None
    first = results[0]
    if isinstance(first, bool):
        return all(results)
    if isinstance(first, dict):
        merged: dict[str, Any] = {}
        for r in results:
            for k, v in r.items():
                merged[k] = merged.get(k, 0) + v if isinstance(v, (int, float)) and not isinstance(v, bool) else v
        return merged
    if isinstance(first, list):
        return [x for r in results for x in r]
    if isinstance(first, (int, float)):
        return sum(results)
    return results


def _launcher(config: EngineConfig) -> CoreLauncher | None:
    if config.distributed_executor_backend == "ray":
        from tokenloom.engine.ray_launcher import RayCoreLauncher

        return RayCoreLauncher(config.data_parallel_size)
    return None


def _start_replicas(config: EngineConfig, client_cls: type[MPClient], launcher: CoreLauncher | None) -> list[Any]:
    """Starts the M engine cores, then waits for them all (they load their models at once); all
    or none. Started from this thread: a child's parent-death signal (engine_core_proc) fires
    when the thread that started it exits, so never from a short-lived pool thread."""
    size = config.data_parallel_size
    clients: list[Any] = []
    try:
        for i in range(size):
            clients.append(client_cls(config, dp_rank=i, dp_size=size, launcher=launcher, wait_ready=False))
        for c in clients:
            c.wait_ready()
    except BaseException:
        for c in clients:
            c.shutdown()
        raise
    return clients


class _DPClientBase:
    clients: list[MPClient]

    def _init_replicas(self, config: EngineConfig, client_cls: type[MPClient]) -> None:
        config.validate()
        self.launcher = _launcher(config)
        try:
            self.clients = _start_replicas(config, client_cls, self.launcher)
        except BaseException:
            self._close_launcher()
            raise
        self.info = self.clients[0].info  # every replica has the same config and model
        self.balancer = LoadBalancer(len(self.clients))

    def _usable(self, i: int) -> bool:
        c = self.clients[i]
        return not c.is_dead and c.proc.poll() is None

    def _choose(self, requests: list[EngineCoreRequest]) -> MPClient:
        i = self.balancer.choose(self._usable)
        self.balancer.sent(i, [r.request_id for r in requests])
        return self.clients[i]

    def _replica_died(self, i: int, reason: str) -> EngineDeadError:
        """The error that reports replica i's death: a ReplicaDeadError naming its requests while
        another replica lives, else the engine's death."""
        ids = self.balancer.mark_dead(i)
        reason = f"data-parallel replica {i}: {reason}"
        if self.balancer.num_alive:
            return ReplicaDeadError(reason, i, ids)
        return EngineDeadError(reason)

    def live_indices(self) -> list[int]:
        return [i for i, r in enumerate(self.balancer.replicas) if r.alive]

    @property
    def is_dead(self) -> bool:
        return self.balancer.num_alive == 0

    def process_exited(self) -> bool:
        return all(c.process_exited() for c in self.clients)

    @property
    def _dead_reason(self) -> str | None:
        reasons = [c._dead_reason for c in self.clients if c._dead_reason]
        return "; ".join(reasons) if self.is_dead and reasons else None

    def wait_exited(self, timeout: float = 10.0) -> None:
        for c in self.clients:
            if c.is_dead or c.process_exited():
                c.wait_exited(timeout)

    def shutdown(self) -> None:
        for c in self.clients:
            c.shutdown()
        self._close_launcher()

    def _close_launcher(self) -> None:
        close = getattr(self.launcher, "close", None)
        if close is not None:
            close()


class DPClient(_DPClientBase, EngineCoreClient):
    """The blocking form, for `LLMEngine` (`LLM(data_parallel_size=M)`)."""

    def __init__(self, config: EngineConfig) -> None:
        self._init_replicas(config, MPClient)
        self._poller = zmq.Poller()
        for c in self.clients:
            self._poller.register(c.output_socket, zmq.POLLIN)
        self._by_socket = {c.output_socket: i for i, c in enumerate(self.clients)}

    def add_request(self, request: EngineCoreRequest) -> None:
        self.add_requests([request])

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        client = self._choose(requests)
        for request in requests:
            client.add_request(request)

    def add_request_batch(self, groups: list[list[EngineCoreRequest]]) -> None:
        # Balanced group by group, then one message per replica.
        per_client: dict[int, tuple[MPClient, list[list[EngineCoreRequest]]]] = {}
        for group in groups:
            client = self._choose(group)
            per_client.setdefault(id(client), (client, []))[1].append(group)
        for client, client_groups in per_client.values():
            client.add_request_batch(client_groups)

    def abort_requests(self, request_ids: list[str]) -> None:
        for i, ids in self.balancer.forget(request_ids).items():
            self.clients[i].abort_requests(ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        return merge_results([self.clients[i].call_utility(method, *args) for i in self.live_indices()])

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        deadline = None if timeout is None else now() + timeout
        while True:
            for i in self.live_indices():  # parked by a blocking utility call
                if self.clients[i]._pending:
                    return self._received(i, self.clients[i]._pending.popleft())
            wait_ms = _POLL_MS if deadline is None else max(0, min(_POLL_MS, int((deadline - now()) * 1000)))
            events = dict(self._poller.poll(wait_ms))
            for sock, i in self._by_socket.items():
                if not self.balancer.replicas[i].alive:
                    continue
                client = self.clients[i]
                try:
                    if sock in events:
                        outputs = client._decode(sock.recv(copy=False).buffer)
                        if client._has_outputs(outputs):
                            return self._received(i, outputs)
                    else:
                        client._check_process()
                except EngineDeadError as e:
                    self._poller.unregister(sock)
                    raise self._replica_died(i, str(e)) from None
            if deadline is not None and now() >= deadline:
                return EngineCoreOutputs(timestamp=now())

    def _received(self, i: int, outputs: EngineCoreOutputs) -> EngineCoreOutputs:
        self.balancer.received(i, outputs)
        return outputs


class DPAsyncClient(_DPClientBase):
    """The asyncio form, for `AsyncLLM` (`tokenloom serve -dp M`): one reader task per replica
    feeds one queue, which the output handler (the only caller of `get_output_async`) drains."""

    def __init__(self, config: EngineConfig) -> None:
        self._init_replicas(config, AsyncMPClient)
        self._queue: asyncio.Queue | None = None
        self._readers: list[asyncio.Task] = []
        self.heartbeat_timeout_s = DEFAULT_HEARTBEAT_TIMEOUT_S

    def fresh(self, i: int) -> bool:
        """Replica i was heard from (an output or a heartbeat) within heartbeat_timeout_s."""
        return now() - self.clients[i].last_heard <= self.heartbeat_timeout_s

    def _choose(self, requests: list[EngineCoreRequest]) -> MPClient:
        # A stalled replica would hold the request until it wakes, if ever: prefer one that
        # answers. When none does, a live one still takes it (as before heartbeats).
        try:
            i = self.balancer.choose(lambda i: self._usable(i) and self.fresh(i))
        except EngineDeadError:
            i = self.balancer.choose(self._usable)
        self.balancer.sent(i, [r.request_id for r in requests])
        return self.clients[i]

    async def add_requests_async(self, requests: list[EngineCoreRequest]) -> None:
        client = self._choose(requests)
        for request in requests:
            await client.add_request_async(request)

    async def add_request_async(self, request: EngineCoreRequest) -> None:
        await self.add_requests_async([request])

    async def abort_requests_async(self, request_ids: list[str]) -> None:
        self.abort_requests_nowait(request_ids)

    def abort_requests_nowait(self, request_ids: list[str]) -> None:
        for i, ids in self.balancer.forget(request_ids).items():
            self.clients[i].abort_requests_nowait(ids)

    async def call_utility_async(self, method: str, *args: Any, timeout: float | None = None) -> Any:
        return merge_results(list((await self.call_utility_each_async(method, *args, timeout=timeout)).values()))

    async def call_utility_each_async(self, method: str, *args: Any, timeout: float | None = None) -> dict[int, Any]:
        """Every live replica's own answer, by replica index."""
        live = self.live_indices()
        results = await asyncio.gather(
            *(self.clients[i].call_utility_async(method, *args, timeout=timeout) for i in live))
        return dict(zip(live, results))

    async def get_output_async(self) -> EngineCoreOutputs:
        """The next message of any replica. Raises ReplicaDeadError when one dies (the others
        go on), EngineDeadError when the last one does."""
        if self._queue is None:
            self._queue = asyncio.Queue()
            loop = asyncio.get_running_loop()
            self._readers = [loop.create_task(self._read(i), name=f"tokenloom-dp-reader-{i}")
                             for i in self.live_indices()]
        item = await self._queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    async def _read(self, i: int) -> None:
        client = self.clients[i]
        assert self._queue is not None
        try:
            while True:
                outputs = await client.get_output_async()
                self.balancer.received(i, outputs)
                self._queue.put_nowait(outputs)
        except EngineDeadError as e:
            self._queue.put_nowait(self._replica_died(i, str(e)))
        except Exception as e:  # noqa: BLE001 - a bug here must fail this replica's requests, not hang them
            self._queue.put_nowait(self._replica_died(i, f"output reader failed: {e!r}"))
        # Reap it now (no zombie), off the loop; its sockets go with it.
        try:
            await asyncio.to_thread(client.wait_exited)
        finally:
            client.shutdown()

    def rebind_loop(self) -> None:
        """A new event loop took over (see AsyncMPClient.rebind_loop): the readers and their queue
        went with the old one; new ones start on the next get_output_async()."""
        for client in self.clients:
            client.rebind_loop()
        self._queue = None
        self._readers = []

    def shutdown(self) -> None:
        for task in self._readers:
            task.cancel()
        super().shutdown()
