"""Weight groups: a torch.distributed process group (gloo on CPU, NCCL on GPUs) of a trainer
(rank 0) and rollout servers, for updates whose tensor bytes go by broadcast
(UpdateWeightsBroadcast; the trainer's side is trainer_client.broadcast).

A group is standalone: its own TCPStore (rank 0 hosts it) and its own ProcessGroup object, never
torch.distributed's default group, so a trainer with a training world of its own, or a process
running several servers, is not disturbed. An update's tensors, in the request's order, form one
byte stream in which each tensor starts at a multiple of STREAM_ALIGN; the stream is cut into
buckets of `bucket_bytes`, and each bucket is one broadcast from rank 0: no member needs more
than one bucket besides where the tensors go (`bucket_plan`, the same on both sides). Before any
bucket, every member votes (one all-reduce): a refusal anywhere refuses the update everywhere.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from urllib.parse import urlparse

import torch
import torch.distributed as dist

from rollout.errors import InvalidArgument

BACKENDS = ("gloo", "nccl")
STREAM_ALIGN = 64
MIN_BUCKET_BYTES, MAX_BUCKET_BYTES = 1 << 16, 1 << 32


@dataclass(frozen=True)
class Segment:
    """Bytes [start, start + size) of tensor `tensor`, at byte `at` of a bucket."""

    tensor: int
    start: int
    at: int
    size: int


def bucket_plan(sizes: list[int], bucket_bytes: int) -> list[tuple[int, list[Segment]]]:
    """(bucket length, its segments) of every bucket of tensors of `sizes` bytes (module docstring)."""
    if not MIN_BUCKET_BYTES <= bucket_bytes <= MAX_BUCKET_BYTES:
        raise InvalidArgument("bucket_bytes", f"must be in [{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}], "
                                              f"got {bucket_bytes}")
    starts, end = [], 0
    for size in sizes:
        starts.append(end)
        end = -(-(end + size) // STREAM_ALIGN) * STREAM_ALIGN
    total = starts[-1] + sizes[-1] if sizes else 0
    plan = []
    for b0 in range(0, total, bucket_bytes):
        b1 = min(b0 + bucket_bytes, total)
        segments = [Segment(i, max(b0, s) - s, max(b0, s) - b0, min(b1, s + n) - max(b0, s))
                    for i, (s, n) in enumerate(zip(starts, sizes)) if s < b1 and s + n > b0]  # fmt: skip
        plan.append((b1 - b0, segments))
    return plan


def parse_init_method(init_method: str) -> tuple[str, int]:
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise InvalidArgument("init_method", f"must be tcp://HOST:PORT, got {init_method!r}")
    return url.hostname, url.port


class WeightGroup:
    """One member of a weight group. Rank 0 (`host`) creates the store first (its port may be 0: a
    free one, then `port` says which), then every member `connect`s; connecting returns once all
    `world_size` members have."""

    def __init__(self, name: str, host: str, port: int, world_size: int, rank: int, backend: str,
                 timeout_s: float, device: torch.device):  # fmt: skip
        checks = {  # field: (value, valid, what is allowed)
            "group": (name, bool(name), "a name"),
            "world_size": (world_size, world_size >= 2, ">= 2"),
            "rank": (rank, 0 <= rank < world_size, f"in [0, {world_size})"),
            "backend": (backend, backend in BACKENDS, f"one of {BACKENDS}"),
            "timeout_s": (timeout_s, timeout_s > 0, "> 0"),
        }
        for field, (value, ok, allowed) in checks.items():
            if not ok:
                raise InvalidArgument(field, f"must be {allowed}, got {value!r}")
        self.name, self.rank, self.world_size, self.backend = name, rank, world_size, backend
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=self.timeout,
                                    wait_for_workers=False)  # fmt: skip
        self.port = self._store.port
        self.pg = None

    def connect(self) -> WeightGroup:
        store = dist.PrefixStore(f"rollout-weights/{self.name}", self._store)
        if self.backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, self.rank, self.world_size, self.timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = self.timeout
            self.pg = dist.ProcessGroupNCCL(store, self.rank, self.world_size, options)
        return self

    def vote(self, refuse: bool) -> dist.Work:
        """Starts the all-reduce of the refusals (`refusals()` once it completed)."""
        self._votes = torch.tensor([int(refuse)], dtype=torch.int64, device=self.device)
        options = dist.AllreduceOptions()
        options.reduceOp = dist.ReduceOp.SUM
        return self.pg.allreduce([self._votes], options)

    def refusals(self) -> int:
        return int(self._votes.item())

    def broadcast(self, bucket: torch.Tensor) -> dist.Work:
        options = dist.BroadcastOptions()
        options.rootRank, options.rootTensor = 0, 0
        return self.pg.broadcast([bucket], options)

    def close(self) -> None:
        if self.pg is not None:
            self.pg.shutdown()
            self.pg = None


def flat_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """[nbytes] uint8 view of a contiguous tensor."""
    return tensor.reshape(-1).view(torch.uint8)


def receive(group: WeightGroup, dests: list[torch.Tensor], bucket_bytes: int) -> None:
    """Every bucket from rank 0, copied into `dests` (flat uint8 views, in the request's order)."""
    plan = bucket_plan([d.numel() for d in dests], bucket_bytes)
    bucket = torch.empty(max((n for n, _ in plan), default=0), dtype=torch.uint8, device=group.device)
    for size, segments in plan:
        group.broadcast(bucket[:size]).wait()
        for s in segments:
            dests[s.tensor][s.start : s.start + s.size].copy_(bucket[s.at : s.at + s.size])


def send_buckets(group: WeightGroup, sources: list[torch.Tensor], bucket_bytes: int):
    """Rank 0: yields the Work of each bucket's broadcast (its bytes copied from `sources`, flat
    uint8 views) for the caller to wait on before the next bucket is filled."""
    plan = bucket_plan([s.numel() for s in sources], bucket_bytes)
    bucket = torch.empty(max((n for n, _ in plan), default=0), dtype=torch.uint8, device=group.device)
    for size, segments in plan:
        for s in segments:
            bucket[s.at : s.at + s.size].copy_(sources[s.tensor][s.start : s.start + s.size])
        yield group.broadcast(bucket[:size])
