"""The trainer's end of a weight group: rank 0 of a torch.distributed group (gloo on CPU, NCCL on
GPUs) with one or more rollout servers, for updates whose bytes go by broadcast instead of
through gRPC (rollout.weight_group; the servers' side is rollout.server.broadcast_weights).

    group = BroadcastGroup(["10.0.0.2:50051", "10.0.0.3:50051"], backend="nccl", host="10.0.0.1")
    versions = group.update_weights(model.state_dict())   # every server, at once
    group.close()

gRPC carries the metadata (names, dtypes, shapes) and each server's answer; the bytes go in
buckets of `bucket_bytes`, so a server needs one bucket besides its staging. Every server checks
the tensors and the group votes before any bucket: one refusal refuses the update on every server
(the refusing server's INVALID_ARGUMENT is raised). A collective that fails (a server died, a
timeout) breaks the group: close it and make a new one.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Mapping, Sequence

import grpc
import torch

from rollout.engine.weight_specs import dtype_name
from rollout.proto.rollout.v1 import rollout_pb2 as pb
from rollout.proto.rollout.v1 import rollout_pb2_grpc
from rollout.weight_group import WeightGroup, bucket_plan, flat_bytes, send_buckets

BUCKET_BYTES = 256 << 20
POLL_S = 0.002
FAILURE_WAIT_S = 5.0  # after a broken collective: how long a server call may take to report why


class BroadcastGroup:
    """Rank 0 of a new weight group with the servers at `addresses` (ranks 1..n, in that order);
    returns once all have joined. `host` is this machine's address as the servers reach it."""

    def __init__(self, addresses: Sequence[str], backend: str = "gloo", host: str = "127.0.0.1", port: int = 0,
                 name: str | None = None, timeout: float = 300.0, device: torch.device | None = None):  # fmt: skip
        self.name = name or f"weights-{uuid.uuid4().hex[:12]}"
        self.timeout, self.broken = timeout, False
        self._channels = [grpc.insecure_channel(a) for a in addresses]
        self._stubs = [rollout_pb2_grpc.RolloutStub(c) for c in self._channels]
        device = device or (torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else None)
        self.group = WeightGroup(self.name, host, port, len(addresses) + 1, 0, backend, timeout, device)
        init = f"tcp://{host}:{self.group.port}"
        calls = [stub.JoinWeightGroup.future(pb.JoinWeightGroupRequest(
            group=self.name, init_method=init, world_size=len(addresses) + 1, rank=rank, backend=backend,
            timeout_s=timeout), timeout=timeout + 30) for rank, stub in enumerate(self._stubs, 1)]  # fmt: skip
        try:
            self._until(_Thread(self.group.connect), calls)
            for call in calls:
                call.result()
        except BaseException:
            self.close()
            raise

    def update_weights(self, weights: Mapping[str, torch.Tensor] | None, draft: bool = False, *,
                       draft_weights: Mapping[str, torch.Tensor] | None = None, bucket_bytes: int = BUCKET_BYTES,
                       update_id: str | None = None, timeout: float | None = None) -> list[int]:  # fmt: skip
        """Every server's new policy_version, once all applied the update (see the module docstring)."""
        if self.broken:
            raise RuntimeError(f"weight group {self.name!r} is broken by an earlier failure: make a new one")
        items = [(draft, n, t.detach()) for n, t in (weights or {}).items()]
        items += [(True, n, t.detach()) for n, t in (draft_weights or {}).items()]
        bucket_plan([], bucket_bytes)  # (InvalidArgument here rather than on every server)
        metas = [pb.TensorMeta(name=n, dtype=dtype_name(t.dtype), shape=t.shape, draft=d) for d, n, t in items]
        request = pb.BroadcastWeights(group=self.name, tensors=metas, bucket_bytes=bucket_bytes,
                                      update_id=update_id or "")  # fmt: skip
        calls = [stub.UpdateWeightsBroadcast.future(request, timeout=timeout) for stub in self._stubs]
        try:
            self._until(self.group.vote(False), calls)
            if self.group.refusals():
                raise _refusal(calls)
            for work in send_buckets(self.group, [flat_bytes(t.contiguous()) for _, _, t in items], bucket_bytes):
                self._until(work, calls)
            return [call.result().policy_version for call in calls]
        except grpc.RpcError:
            raise
        except BaseException:
            self.broken = True
            raise

    def _until(self, work, calls: list[grpc.Future]) -> None:
        """Waits for a collective (or the join); a server call that fails meanwhile (it will never
        take part) breaks the group and raises its error instead of waiting for the timeout. A
        collective that a member broke (it left: its connections closed) can end before that member's
        call reports why; its error is then the call's, if one fails within FAILURE_WAIT_S."""
        while not work.is_completed():
            failed = _first_failure(calls, 0.0)
            if failed is not None:
                self.broken = True
                raise failed
            time.sleep(POLL_S)
        try:
            work.wait()
        except RuntimeError as err:
            self.broken = True
            failed = _first_failure(calls, FAILURE_WAIT_S)
            if failed is not None:
                raise failed from err
            raise

    def close(self) -> None:
        """Leaves the group on every server (best effort) and here."""
        for stub in self._stubs:
            try:
                stub.LeaveWeightGroup(pb.LeaveWeightGroupRequest(group=self.name), timeout=30)
            except grpc.RpcError:
                pass
        self.group.close()
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> BroadcastGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _refusal(calls: list[grpc.Future]) -> grpc.RpcError:
    """The refusing server's error (INVALID_ARGUMENT) among the answers of an update the group refused."""
    errors = [c.exception() for c in calls if c.exception() is not None]
    invalid = [e for e in errors if e.code() == grpc.StatusCode.INVALID_ARGUMENT]
    return (invalid or errors)[0]


def _first_failure(calls: list[grpc.Future], wait_s: float) -> BaseException | None:
    """The error of a call that failed, waiting up to wait_s seconds for one while any is running
    (None: none failed)."""
    deadline = time.monotonic() + wait_s
    while True:
        failed = next((c.exception() for c in calls if c.done() and c.exception() is not None), None)
        if failed is not None or time.monotonic() >= deadline or all(c.done() for c in calls):
            return failed
        time.sleep(POLL_S)


class _Thread:
    """`fn()` on a daemon thread, with a collective's `is_completed` / `wait`."""

    def __init__(self, fn):
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as exc:
            self._error = exc

    def is_completed(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error
