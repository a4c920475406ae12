"""Weight updates without mixing policies inside a sample.

`submit` validates the new state (every name known, shapes equal, floating dtypes) before
anything changes, then pauses admission of new samples. Samples already under way run to
the end on the old weights (draining); when none is left the update is applied between two
steps, `policy_version` increments, cached prompt prefixes (computed with the old weights)
are dropped, and admission resumes. Every sample is stamped with the version current when it
finishes, which is the version it ran under from its first token to its last.
"""

from __future__ import annotations

import torch

from rollout.engine.block_manager import BlockManager
from rollout.engine.loader import load_state_into, param_slots
from rollout.engine.scheduler import Scheduler
from rollout.errors import FailedPrecondition, InvalidArgument


def validate_state(model: torch.nn.Module, state: dict[str, torch.Tensor], field: str) -> None:
    """Every tensor must name a parameter of `model` and match its shape; floating dtypes only."""
    slots, aliases = param_slots(model)
    for name, tensor in state.items():
        key = name.removeprefix("model.")
        if key not in slots and key not in aliases:
            raise InvalidArgument(field, f"unknown tensor {name!r}")
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point():
            raise InvalidArgument(field, f"tensor {name!r} must be a floating tensor, got "
                                         f"{getattr(tensor, 'dtype', type(tensor).__name__)}")
        if key in slots:
            param, rows = slots[key]
            want = tuple((param.data if rows is None else param.data[rows]).shape)
            if tuple(tensor.shape) != want:
                raise InvalidArgument(field, f"tensor {name!r} has shape {tuple(tensor.shape)}, expected {want}")


class WeightUpdater:
    """Updates `model` (and `draft_model`, the drafter's module, None without a loadable drafter)
    between steps: `scheduler` pauses admission and says when started samples have drained;
    `block_manager` forgets the cached prefixes."""

    def __init__(self, model: torch.nn.Module, draft_model: torch.nn.Module | None, scheduler: Scheduler,
                 block_manager: BlockManager):
        self.model, self.draft_model = model, draft_model
        self.scheduler, self.block_manager = scheduler, block_manager
        self.version = 0
        self._pending: tuple[dict, dict | None] | None = None

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def submit(self, state: dict[str, torch.Tensor], draft_state: dict | None = None) -> None:
        if not state and not draft_state:
            raise InvalidArgument("weights", "no tensors given")
        if state:
            validate_state(self.model, state, "weights")
        if draft_state:
            if self.draft_model is None:
                raise InvalidArgument("draft_weights", "this server runs no loadable drafter (--spec none)")
            validate_state(self.draft_model, draft_state, "draft_weights")
        if self._pending is not None:
            raise FailedPrecondition("another weight update is still draining; retry when it has applied")
        self._pending = (state, draft_state)
        self.scheduler.admission_paused = True

    def apply_if_drained(self) -> bool:
        if self._pending is None or self.scheduler.has_started_work():
            return False
        state, draft_state = self._pending
        if state:
            load_state_into(self.model, state, strict=False)
        if draft_state:
            load_state_into(self.draft_model, draft_state, strict=False)
        self.block_manager.reset_prefix_cache()
        self.version += 1
        self._pending = None
        self.scheduler.admission_paused = False
        return True
