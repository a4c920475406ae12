"""Weight updates as the engine's side receives them: small picklable jobs, each of which stages
its tensors (`stage(engine, side) -> WeightStage`, on a worker thread of the process that owns
the engine, while the engine keeps stepping) before the engine loop submits the stage.

`UploadJob` is an UpdateWeights stream already written into the weight arena; the jobs of the
same-host and broadcast paths live in rollout.server.shared_weights and
rollout.server.broadcast_weights.
`EngineSide` is what such work needs besides the engine: the arena mapping and the
torch.distributed groups joined.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

from rollout.engine.weight_specs import FLOAT_DTYPES
from rollout.engine.weight_stage import WeightStage
from rollout.server.arena import HostArena


@dataclass
class EngineSide:
    """State of the engine's process that weight jobs use: the arena (this process's mapping of
    the server's weight arena) and the weight groups joined, by name."""

    arena: HostArena = field(default_factory=HostArena)
    groups: dict[str, Any] = field(default_factory=dict)


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

    def stage(self, engine, side: EngineSide) -> WeightStage:
        side.arena.map(self.arena_size)
        specs = engine.weights.specs()
        tables = {False: specs.target, True: specs.draft}
        end = max(t.offset + tables[t.draft][t.key].nbytes for t in self.tensors)
        stage = engine.weights.new_stage(sum(tables[t.draft][t.key].nbytes for t in self.tensors))
        with closed_on_error(stage):
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
