"""The weight arena's page-locking (rollout.server.weight_jobs.EngineSide): with kept upload buffers
the mapping is locked by the first update and stays locked for the next ones; with buffers given
back, each stage locks what it reads and unlocks it once done. Page-locking needs CUDA, so the
driver call is replaced by a recorder and the stage is told it stages host memory for a GPU."""

from __future__ import annotations

import pytest
import torch

import rollout.engine.weight_stage as weight_stage
import rollout.server.weight_jobs as weight_jobs
from rollout import build_engine
from rollout.engine.config import EngineConfig
from rollout.server.arena import HostArena
from rollout.server.weight_jobs import EngineSide
from rollout.server.weights import WeightUpload
from rollout.weight_wire import decode_chunk, encode_piece
from trainer_client.weights import weight_pieces


class LockRecorder:
    def __init__(self):
        self.locked: list[tuple[int, int]] = []
        self.unlocked: list[tuple[int, int]] = []

    def __call__(self, region: torch.Tensor):
        span = (region.data_ptr(), region.numel())
        self.locked.append(span)
        return lambda: self.unlocked.append(span)


@pytest.fixture
def recorder(monkeypatch):
    rec = LockRecorder()
    monkeypatch.setattr(weight_jobs, "page_lock", rec)
    monkeypatch.setattr(weight_stage, "page_lock", rec)
    monkeypatch.setattr(weight_stage.WeightStage, "pins_host", property(lambda self: True))
    monkeypatch.setattr(weight_stage.WeightStage, "reads_host_to_device", property(lambda self: True))
    return rec


def _update(engine, side: EngineSide, arena: HostArena, keep: bool) -> None:
    """One UpdateWeights as the server and the engine's side run it: received into the arena,
    staged from it, applied, the stage closed and the arena released."""
    specs = engine.weights.specs()
    arena.reserve(specs.budget())
    upload = WeightUpload(specs, arena, "token")
    down = engine.model.layers[0].mlp.down_proj.weight
    state = {"model.layers.0.mlp.down_proj.weight": down.detach().clone() + 0.5}
    for piece in weight_pieces(state, piece_bytes=4096):
        upload.add(decode_chunk(encode_piece(piece)))
    stage = upload.finish(keep_locked=keep).stage(engine, side)
    engine.weights.submit(stage)
    engine.step()  # (nothing runs: the update applies between steps)
    stage.close()  # (the server's engine loop closes an applied stage)
    arena.release(give_back=not keep)


@pytest.mark.parametrize("keep", [True, False])
def test_kept_buffers_stay_locked_across_updates_given_back_ones_are_unlocked(tiny_random_qwen3, recorder, keep):
    engine = build_engine(EngineConfig(model=str(tiny_random_qwen3), block_size=4, num_kv_blocks=16))
    arena = HostArena()
    side = EngineSide(arena=arena)
    version = engine.policy_version
    before = engine.model.layers[0].mlp.down_proj.weight.detach().clone()
    for _ in range(3):
        _update(engine, side, arena, keep)
    assert engine.policy_version == version + 3
    assert torch.allclose(engine.model.layers[0].mlp.down_proj.weight, before + 1.5, rtol=0, atol=1e-5)  # each applied
    whole = (arena.view(0, arena.size).data_ptr(), arena.size)
    if keep:
        assert recorder.locked == [whole] and recorder.unlocked == []  # once, and still locked
        assert side.locked == whole
    else:
        assert len(recorder.locked) == 3 and recorder.unlocked == recorder.locked  # each stage its own
        assert side.locked == (0, 0)


def test_a_remapped_arena_is_unlocked_and_locked_again(recorder):
    arena = HostArena()
    side = EngineSide(arena=arena)
    arena.reserve(1 << 16)
    side.lock_arena()
    first = side.locked
    side.lock_arena()
    assert recorder.locked == [first]
    arena.reserve(1 << 17)  # (another size: a new mapping)
    side.lock_arena()
    assert recorder.unlocked == [first] and side.locked == (arena.view(0, arena.size).data_ptr(), 1 << 17)
