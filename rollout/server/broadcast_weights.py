"""Weight groups on the engine's side: joining and leaving one (`JoinGroup`, `LeaveGroup`, run on a
worker thread of the engine's process through `EngineLoop.aside`), and UpdateWeightsBroadcast
(`BroadcastJob`), whose tensor bytes come by broadcast from the trainer (rollout.weight_group).

A broadcast update checks its tensors against the model, then votes with the rest of the group
(a refusal anywhere refuses everywhere, before any bucket is sent), receives the buckets into
staging tensors and checks their values like any update. A group whose collective fails (a
member died, a timeout) is left: later updates through it fail at once until it is joined again.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollout.engine.weight_specs import FLOAT_DTYPES, TensorSpec
from rollout.engine.weight_stage import WeightStage, field_of
from rollout.errors import FailedPrecondition, InvalidArgument
from rollout.server.weight_jobs import EngineSide, closed_on_error
from rollout.weight_group import WeightGroup, bucket_plan, flat_bytes, parse_init_method, receive


@dataclass(frozen=True)
class JoinGroup:
    """Joins weight group `name` as `rank` (> 0; the trainer is 0); returns once every member has."""

    name: str
    init_method: str
    world_size: int
    rank: int
    backend: str
    timeout_s: float

    def __call__(self, engine, side: EngineSide) -> None:
        if self.name in side.groups:
            raise FailedPrecondition(f"group: {self.name!r} is already joined (LeaveWeightGroup first)")
        if self.rank == 0:
            raise InvalidArgument("rank", "0 is the trainer's rank; a server joins with rank >= 1")
        host, port = parse_init_method(self.init_method)
        group = WeightGroup(self.name, host, port, self.world_size, self.rank, self.backend, self.timeout_s,
                            engine.device)  # fmt: skip
        try:
            side.groups[self.name] = group.connect()
        except RuntimeError as exc:  # (torch.distributed's errors: store or rendezvous timeouts)
            raise FailedPrecondition(f"group {self.name!r}: joining failed: {exc}") from exc


@dataclass(frozen=True)
class LeaveGroup:
    name: str

    def __call__(self, engine, side: EngineSide) -> bool:
        group = side.groups.pop(self.name, None)
        if group is not None:
            group.close()
        return group is not None


@dataclass(frozen=True)
class BroadcastMeta:
    draft: bool
    name: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class BroadcastJob:
    token: str
    update_id: str
    group: str
    tensors: list[BroadcastMeta]
    bucket_bytes: int

    def stage(self, engine, side: EngineSide) -> WeightStage:
        group = side.groups.get(self.group)
        if group is None:
            raise FailedPrecondition(f"weights: this server is not in weight group {self.group!r} (JoinWeightGroup)")
        refusal, checked = None, []
        try:
            checked = self._checked(engine.weights.specs())
        except InvalidArgument as exc:
            refusal = exc
        try:
            return self._receive(engine, side, group, refusal, checked)
        except RuntimeError as exc:  # the group's collective failed: the group is gone
            LeaveGroup(self.group)(engine, side)
            raise FailedPrecondition(f"weight group {self.group!r} failed and was left: {exc}") from exc

    def _checked(self, specs) -> list[tuple[BroadcastMeta, str, TensorSpec]]:
        bucket_plan([], self.bucket_bytes)  # (InvalidArgument for a bucket size out of range)
        checked, seen = [], set()
        for meta in self.tensors:
            key, spec = specs.check(meta.name, meta.dtype, meta.shape, meta.draft)
            if (meta.draft, key) in seen:
                raise InvalidArgument(field_of(meta.draft), f"tensor {meta.name!r} is sent twice")
            seen.add((meta.draft, key))
            checked.append((meta, key, spec))
        if not checked:
            raise InvalidArgument("weights", "the update carries no tensors")
        return checked

    def _receive(self, engine, side, group: WeightGroup, refusal, checked) -> WeightStage:
        group.vote(refusal is not None).wait()
        if refusal is not None:
            raise refusal
        if group.refusals():
            raise FailedPrecondition(f"weights: {group.refusals()} member(s) of weight group {self.group!r} "
                                     f"refused the update")
        nbytes = sum(spec.numel * FLOAT_DTYPES[meta.dtype].itemsize for meta, _, spec in checked)
        stage = engine.weights.new_stage(nbytes)
        with closed_on_error(stage):
            dests = [flat_bytes(stage.slot(meta.draft, key, meta.name, spec, meta.dtype))
                     for meta, key, spec in checked]  # fmt: skip
            with stage.on_stream():
                receive(group, dests, self.bucket_bytes)
            stage.check()
        return stage
