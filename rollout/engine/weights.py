"""Weight updates without mixing policies inside a sample.

An update is staged and checked first (rollout.engine.weight_stage; off the engine thread for
the server's paths) while the engine keeps admitting and generating on the old weights. `submit`
then pauses admission of new samples: those already under way run to the end on the old weights
(draining); when none is left the staged tensors are copied into the parameters between two
steps (the pause: no step runs meanwhile), `policy_version` increments, cached prompt prefixes
(computed with the old weights) are dropped, and admission resumes. Every sample is stamped with
the version current when it finishes, which is the version it ran under from its first token
to its last.

An update submitted with a token can be withdrawn by it until it applies (its caller went
away), and one withdrawn before it was even submitted is refused when it comes. An update with
an `update_id` that was already applied is not applied again: `submit` returns its version.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque

import torch

from rollout.engine.block_manager import BlockManager
from rollout.engine.loader import param_slots
from rollout.engine.scheduler import Scheduler
from rollout.engine.weight_specs import WeightSpecs, dtype_name, model_specs
from rollout.engine.weight_stage import WeightStage
from rollout.errors import FailedPrecondition, InvalidArgument

REMEMBERED_IDS = 256  # applied update ids (and withdrawn tokens) kept
STAGING_HEADROOM = 2 << 30  # device memory left free when "auto" stages an update on the device


class WeightUpdater:
    """Updates `model` (and `draft_model`, the drafter's module, None without a loadable drafter)
    between steps: `scheduler` pauses admission and says when started samples have drained;
    `block_manager` forgets the cached prefixes; updates wait for their swap on `device` or in host
    memory as `staging` says (EngineConfig.weight_staging)."""

    def __init__(self, model: torch.nn.Module, draft_model: torch.nn.Module | None, scheduler: Scheduler,
                 block_manager: BlockManager, device: torch.device, staging: str = "auto"):
        self.model, self.draft_model = model, draft_model
        self.scheduler, self.block_manager = scheduler, block_manager
        self.device, self.staging = device, staging
        self.host_staging = False  # set while the engine's device memory is released (rollout.engine.release)
        self.version = 0
        self.pause_seconds = 0.0  # of the last swap
        self._pending: WeightStage | None = None
        self._token = ""
        self._update_id = ""
        self._applied: OrderedDict[str, int] = OrderedDict()
        self._withdrawn: deque[str] = deque(maxlen=REMEMBERED_IDS)

    @property
    def pending(self) -> bool:
        return self._pending is not None

    def specs(self) -> WeightSpecs:
        draft = self.draft_model
        return WeightSpecs(model_specs(self.model), None if draft is None else model_specs(draft))

    def new_stage(self, nbytes: int) -> WeightStage:
        """An empty stage for an update of `nbytes`: on the device when `staging` says so, or, with
        "auto", when it fits with STAGING_HEADROOM to spare; in host memory otherwise, and always
        while the device memory is released."""
        device, mode = self.device, self.staging
        on_device = device.type == "cuda" and mode != "host" and not self.host_staging
        if on_device and mode == "auto":
            on_device = torch.cuda.mem_get_info(device)[0] >= nbytes + STAGING_HEADROOM
        return WeightStage(device, on_device or device.type == "cpu", self._current)

    def _current(self, draft: bool, key: str) -> torch.Tensor:
        param, index = param_slots(self.draft_model if draft else self.model)[0][key]
        return param.data if index is None else param.data[index]

    def stage_state(self, state: dict, draft_state: dict | None = None) -> WeightStage:
        """State dicts (checkpoint names -> tensors) staged and checked, or InvalidArgument."""
        specs = self.specs()
        items = [(False, n, t) for n, t in state.items()] + [(True, n, t) for n, t in (draft_state or {}).items()]
        stage = self.new_stage(sum(t.numel() * t.element_size() for _, _, t in items if torch.is_tensor(t)))
        for draft, name, tensor in items:
            if not torch.is_tensor(tensor):
                raise InvalidArgument("draft_weights" if draft else "weights",
                                      f"{name!r} is a {type(tensor).__name__}, not a tensor")
            key, spec = specs.check(name, dtype_name(tensor.dtype), tensor.shape, draft)
            stage.adopt(draft, key, name, spec, tensor.detach())
        stage.check()
        return stage

    def submit(self, stage: WeightStage, token: str = "", update_id: str = "") -> int | None:
        """Pauses admission until `stage` applies (None), or returns the version an earlier update
        with this `update_id` produced (nothing changes)."""
        if update_id in self._applied:
            return self._applied[update_id]
        if not stage.tensors:
            raise InvalidArgument("weights", "no tensors given")
        if token and token in self._withdrawn:
            raise FailedPrecondition("weights: the update was withdrawn (its caller went away)")
        if self._pending is not None:
            raise FailedPrecondition("another weight update is still draining; retry when it has applied")
        self._pending, self._token, self._update_id = stage, token, update_id
        self.scheduler.admission_paused = True
        return None

    def withdraw(self, token: str) -> bool:
        """Drops the pending update submitted with `token` (True), or refuses it if it comes later."""
        if self._pending is not None and self._token == token:
            self._pending = None
            self.scheduler.admission_paused = False
            return True
        self._withdrawn.append(token)
        return False

    def applied_version(self, update_id: str) -> int | None:
        return self._applied.get(update_id)

    def apply_if_drained(self) -> bool:
        if self._pending is None or self.scheduler.has_started_work():
            return False
        start = time.perf_counter()
        models = {False: self.model, True: self.draft_model}
        _apply(self._pending, {draft: param_slots(m)[0] for draft, m in models.items() if m is not None},
               sync=self.device.type == "cuda")
        self.block_manager.reset_prefix_cache()
        self.version += 1
        if self._update_id:
            self._applied[self._update_id] = self.version
            while len(self._applied) > REMEMBERED_IDS:
                self._applied.popitem(last=False)
        self._pending = None
        self.scheduler.admission_paused = False
        self.pause_seconds = time.perf_counter() - start
        return True


def _apply(stage: WeightStage, slots: dict, sync: bool) -> None:
    """Copies every staged tensor but tied aliases (checked, never loaded) into its parameter;
    one synchronisation at the end."""
    with torch.no_grad():
        for (draft, key), tensor in stage.tensors.items():
            if stage.specs[(draft, key)].alias_of is not None:
                continue
            param, index = slots[draft][key]
            (param.data if index is None else param.data[index]).copy_(tensor, non_blocking=True)
    if sync:
        torch.cuda.synchronize()
