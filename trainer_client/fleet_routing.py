"""The fleet's bookkeeping, free of Ray and gRPC: replica state, least-outstanding routing,
per-prompt seeds, the rewrite of a replica's rows into the caller's numbering, and the weight
history a restarted replica is brought up to date with.

`Replica` is the driver's view of one actor: its current server address, its state (`healthy`
replicas take work, `recovering` ones wait for Ray to restart them, `dead` ones are gone for
good), the samples it has outstanding, and `offset`, the fleet policy version minus its server's
(a restarted server counts versions from 0 again). `pick_replica` routes one prompt's n samples to
the healthy replica with the fewest outstanding samples.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rollout.engine.intake import sample_seed
from rollout.schema import INSTANCE_ID_KEY, POLICY_VERSION_KEY

REPLICA_STATES = ("healthy", "recovering", "dead")


@dataclass
class Replica:
    """Driver-side state of one replica (one Ray actor; `incarnation` changes on every restart)."""

    index: int
    actor: Any
    address: str
    incarnation: str
    server_pid: int
    state: str = "healthy"
    offset: int = 0
    outstanding: int = 0
    restarts: int = 0
    samples: int = 0
    samples_since_restart: int = 0
    lost_prompts: int = 0
    dropped_samples: int = 0

    def __post_init__(self):
        if self.state not in REPLICA_STATES:
            raise ValueError(f"state must be one of {REPLICA_STATES}, got {self.state!r}")

    def served(self, num_samples: int) -> None:
        self.samples += num_samples
        self.samples_since_restart += num_samples

    def restarted(self, address: str, incarnation: str, server_pid: int) -> None:
        self.address, self.incarnation, self.server_pid = address, incarnation, server_pid
        self.restarts += 1
        self.samples_since_restart = 0

    def stats(self) -> dict[str, Any]:
        names = ("index", "address", "state", "incarnation", "server_pid", "outstanding", "restarts",
                 "samples", "samples_since_restart", "lost_prompts", "dropped_samples", "offset")  # fmt: skip
        return {name: getattr(self, name) for name in names}


def pick_replica(replicas: Iterable[Replica], n: int, window: int) -> Replica | None:
    """The healthy replica with the fewest outstanding samples (lowest index on ties) that can
    take n more without passing `window`; an idle replica always can. None when none can."""
    best = None
    for replica in replicas:
        fits = replica.outstanding == 0 or replica.outstanding + n <= window
        if replica.state == "healthy" and fits and (best is None or replica.outstanding < best.outstanding):
            best = replica
    return best


def prompt_seed(base: int, prompt_index: int) -> int:
    """The seed of prompt `prompt_index`'s own sub-request when the caller gave seed `base`: a
    function of the caller's numbering only, so routing and resubmission never change a sample."""
    return sample_seed(base, prompt_index, 1 << 20)


def to_caller_rows(table: pa.Table, request_id: str, prompt_index: int, version_offset: int) -> pa.Table:
    """A replica's table for one prompt -> the caller's numbering: its request id, the prompt's
    index in the caller's list, and fleet policy versions (in the metadata too, which loses the
    server's instance id: a fleet's table comes from several servers)."""
    rows = table.num_rows
    meta = dict(table.schema.metadata or {})
    meta.pop(INSTANCE_ID_KEY.encode(), None)
    version = meta.get(POLICY_VERSION_KEY.encode())
    if version is not None:
        meta[POLICY_VERSION_KEY.encode()] = str(int(version) + version_offset).encode()
    table = table.replace_schema_metadata(meta)
    schema = table.schema
    new = {
        "request_id": pa.array([request_id] * rows, pa.string()),
        "prompt_index": pa.array([prompt_index] * rows, pa.int32()),
        "policy_version": pc.add(table.column("policy_version"), pa.scalar(version_offset, pa.int64())),
    }
    for name, column in new.items():
        i = schema.get_field_index(name)
        table = table.set_column(i, schema.field(name), column)
    return table


class WeightHistory:
    """The weight updates a freshly started server must receive, in order. Each entry is a payload
    handle with the tensor names it sets; an entry all of whose names a later entry sets again is
    dropped, so a run of full updates keeps one entry."""

    def __init__(self):
        self._entries: list[tuple[Any, frozenset[Hashable]]] = []

    def add(self, payload: Any, names: Iterable[Hashable]) -> None:
        names = frozenset(names)
        self._entries.append((payload, names))
        kept, covered = [], set()
        for entry in reversed(self._entries):
            if not entry[1] <= covered:
                kept.append(entry)
            covered |= entry[1]
        self._entries = kept[::-1]

    def snapshot(self) -> list[tuple[Any, frozenset[Hashable]]]:
        return list(self._entries)

    def restore(self, snapshot: list[tuple[Any, frozenset[Hashable]]]) -> None:
        """Back to `snapshot`: forgets an update the servers refused."""
        self._entries = list(snapshot)

    def payloads(self) -> list[Any]:
        return [payload for payload, _ in self._entries]

    def __len__(self) -> int:
        return len(self._entries)
