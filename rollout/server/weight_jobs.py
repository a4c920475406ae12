"""Weight updates as the engine's side receives them: small picklable jobs, each of which stages
its tensors (`stage(engine, side) -> WeightStage`, on a worker thread of the process that owns
the engine, while the engine keeps stepping) before the engine loop submits the stage.

`UploadJob` is an UpdateWeights stream already written into the weight arena; the jobs of the
same-host and broadcast paths live in rollout.server.shared_weights and
rollout.server.broadcast_weights.
`EngineSide` is what such work needs besides the engine: the arena mapping (page-locked once and
kept so between updates when the server keeps its upload buffers) and the torch.distributed
groups joined.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout.engine.weight_specs import FLOAT_DTYPES
from rollout.engine.weight_stage import WeightStage, page_lock
from rollout.server.arena import HostArena


@dataclass
class EngineSide:
    """State of the engine's process that weight jobs use: the arena (this process's mapping of
    the server's weight arena) and the weight groups joined, by name.

    Page-locking a 16 GB mapping takes the driver seconds, and copying it to the device unlocked
    takes as long (~6 GB/s, where locked memory copies at ~50). When the server keeps its upload
    buffers (`--keep-weight-buffers`), the mapping is locked by the first update and stays locked
    for the next ones (`lock_arena`), whether the stage copies it to the device now or at the swap.
    When it gives them back, a stage on the host locks what it reads and unlocks it after the
    swap (pages still locked cannot be given back), and a stage on the device copies unlocked."""

    arena: HostArena = field(default_factory=HostArena)
    groups: dict[str, Any] = field(default_factory=dict)
    locked: tuple[int, int] = (0, 0)  # (address, bytes) of the arena mapping kept page-locked
    _unlock: Callable[[], Any] | None = None

    def lock_arena(self) -> None:
        """Keeps the whole arena mapping page-locked from now on (again only if it was remapped)."""
        view = self.arena.view(0, self.arena.size)
        region = (view.data_ptr(), view.numel())
        if region == self.locked:
            return
        if self._unlock is not None:
            self._unlock()
        self._unlock = page_lock(view)
        self.locked = region if self._unlock is not None else (0, 0)


@dataclass(frozen=True)
class WeightsApplied:
    """What an update reports once applied (or found already applied: `repeated`)."""

    policy_version: int
    num_tensors: int = 0
    num_draft_tensors: int = 0
    stage_seconds: float = 0.0
    pause_seconds: float = 0.0
    repeated: bool = False


@dataclass(frozen=True)
class ArenaTensor:
    """A received tensor: its bytes at `offset` of the arena, in the parameter's dtype."""

    draft: bool
    key: str
    name: str
    offset: int
    dtype: str


@dataclass
class UploadJob:
    """An UpdateWeights stream, received: every tensor in the arena (rollout.server.weights)."""

    token: str
    update_id: str
    tensors: list[ArenaTensor]
    arena_size: int
    keep_locked: bool = False  # the server keeps its upload buffers: the arena stays page-locked

    def stage(self, engine, side: EngineSide) -> WeightStage:
        side.arena.map(self.arena_size)
        specs = engine.weights.specs()
        tables = {False: specs.target, True: specs.draft}
        end = max(t.offset + tables[t.draft][t.key].nbytes for t in self.tensors)
        stage = engine.weights.new_stage(sum(tables[t.draft][t.key].nbytes for t in self.tensors))
        with closed_on_error(stage):
            if stage.reads_host_to_device and self.keep_locked:
                side.lock_arena()
            else:
                stage.pin_region(side.arena.view(0, end))
            for t in self.tensors:
                spec = tables[t.draft][t.key]
                view = side.arena.view(t.offset, spec.nbytes).view(FLOAT_DTYPES[t.dtype]).view(spec.shape)
                stage.adopt(t.draft, t.key, t.name, spec, view)
            stage.check()
        return stage


@contextlib.contextmanager
def closed_on_error(stage: WeightStage):
    """Closes `stage` if the block raises (a job that fails to stage leaves nothing locked)."""
    try:
        yield stage
    except BaseException:
        stage.close()
        raise
