"""One caller request spread over a fleet: the coroutine that routes, resubmits and reassembles.

Every prompt becomes its own Generate sub-request (all n samples together, so they share the
prompt's KV blocks on one server), sent to the healthy replica with the fewest outstanding
samples. A prompt's rows are delivered only when its whole sub-request has finished, so when a
replica dies mid-stream the samples it already sent for unfinished prompts are simply dropped
and those prompts are sent again to a live replica: every (prompt, sample) arrives exactly once.
A failure counts as the replica's when its gRPC health check fails afterwards; otherwise the
error is the request's and is raised to the caller. A seeded request seeds each prompt from the
caller's seed and prompt index (`fleet_routing.prompt_seed`), so its samples do not depend on
routing or on resubmission.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import grpc
import pyarrow as pa

from trainer_client.client import Prompt, to_table
from trainer_client.fleet_routing import Replica, pick_replica, prompt_seed, to_caller_rows

# Codes that describe the request, never the replica that answered it.
REQUEST_ERRORS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNIMPLEMENTED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED,
})  # fmt: skip


class ReplicaLost(Exception):
    """A replica failed under a sub-request; its prompt goes to another replica."""

    def __init__(self, replica: Replica, cause: BaseException, dropped: int):
        super().__init__(f"replica {replica.index} at {replica.address} failed: {cause}")
        self.replica = replica
        self.dropped = dropped  # samples of the prompt it had already sent


class FleetCore(Protocol):
    """What a request needs from the fleet, all called on the fleet's event loop."""

    replicas: list[Replica]
    window: int
    max_attempts: int

    def client(self, replica: Replica) -> Any: ...  # AsyncRolloutClient of the replica's address
    async def alive(self, replica: Replica) -> bool: ...
    def replica_failed(self, replica: Replica) -> None: ...
    def routing_changed(self) -> asyncio.Future: ...  # resolves at the next notify()
    def notify(self) -> None: ...


class FleetRequest:
    """Runs one request; `emit(record_batch)` receives each prompt's rows once they are complete."""

    def __init__(self, core: FleetCore, prompts: Sequence[Prompt], n: int, sampling: Mapping[str, Any] | None,
                 mask: str | None, grammar: Any, request_id: str, timeout: float | None,
                 emit: Callable[[pa.RecordBatch], None], return_text: bool = False):  # fmt: skip
        self.core, self.prompts, self.n = core, prompts, n
        self.sampling = dict(sampling or {})
        self.mask, self.grammar, self.request_id, self.timeout = mask, grammar, request_id, timeout
        self.return_text = return_text
        self.emit = emit
        self.delivered = 0

    async def run(self) -> None:
        pending = deque((p, 0) for p in range(len(self.prompts)))  # (prompt index, failed attempts)
        running: dict[asyncio.Task, tuple[int, int, Replica]] = {}
        try:
            while pending or running:
                self._dispatch(pending, running)
                if not running and all(replica.state == "dead" for replica in self.core.replicas):
                    raise RuntimeError("every replica of the fleet is dead; see the actors' logs")
                change = self.core.routing_changed()
                done, _ = await asyncio.wait([*running, change], return_when=asyncio.FIRST_COMPLETED)
                for task in done & running.keys():
                    self._finished(task, running.pop(task), pending)
                for task, (_, _, replica) in running.items():
                    if replica.state != "healthy":  # found dead by the health monitor
                        task.cancel()
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)

    def _dispatch(self, pending: deque, running: dict) -> None:
        while pending:
            replica = pick_replica(self.core.replicas, self.n, self.core.window)
            if replica is None:
                return
            prompt, failures = pending.popleft()
            replica.outstanding += self.n
            task = asyncio.ensure_future(self._attempt(replica, prompt, failures))
            task.add_done_callback(lambda _, replica=replica: self._release(replica))
            running[task] = (prompt, failures, replica)

    def _release(self, replica: Replica) -> None:
        replica.outstanding -= self.n
        self.core.notify()

    def _finished(self, task: asyncio.Task, job: tuple[int, int, Replica], pending: deque) -> None:
        prompt, failures, replica = job
        try:
            table = task.result()
        except (ReplicaLost, asyncio.CancelledError) as exc:
            replica.lost_prompts += 1
            replica.dropped_samples += exc.dropped if isinstance(exc, ReplicaLost) else 0
            self.core.replica_failed(replica)
            if failures + 1 >= self.core.max_attempts:
                raise RuntimeError(f"prompt {prompt} of {self.request_id} lost {failures + 1} times") from exc
            pending.append((prompt, failures + 1))
            return
        for batch in table.to_batches():
            self.emit(batch)
        self.delivered += table.num_rows

    async def _attempt(self, replica: Replica, prompt: int, failures: int) -> pa.Table:
        """The prompt's n samples from one replica, in the caller's numbering."""
        offset = replica.offset
        sampling = dict(self.sampling)
        if sampling.get("seed") is not None:
            sampling["seed"] = prompt_seed(sampling["seed"], prompt)
        sub_id = f"{self.request_id}/{prompt}/{failures}"
        batches: list[pa.RecordBatch] = []
        try:
            client = self.core.client(replica)
            stream = client.stream([self.prompts[prompt]], self.n, sampling, self.mask, self.grammar, sub_id,
                                   self.timeout, self.return_text)  # fmt: skip
            with stream:
                async for batch in stream:
                    batches.append(batch)
        except grpc.RpcError as exc:
            if exc.code() in REQUEST_ERRORS or await self.core.alive(replica):
                raise
            raise ReplicaLost(replica, exc, sum(b.num_rows for b in batches)) from exc
        table = to_table(batches)
        replica.served(table.num_rows)
        return to_caller_rows(table.combine_chunks(), self.request_id, prompt, offset)
