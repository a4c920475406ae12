"""The drafter extension point: what the engine asks of a drafter, and what a drafter hands back.

A `Drafter` proposes, in one batched call, a draft block for every sample in a decode step
(anchor = its last committed token, context = what the target already processed) together
with the distributions `q` the drafts were drawn from (None = deterministic, one-hot q), and
keeps its own context state up to date from the target's hidden states after each step. It may
also learn from verify results (`verified`) and finished samples (`sample_finished`), and hear of
weight updates (`policy_updated`). A drafter combining proposers says per item which one drafted
(`Drafts.proposers`), so drafts are counted per proposer.

The engine owns this interface and never imports a drafter: it receives a factory
(`LLMEngine(config, drafter_factory=...)`; `rollout.build_engine` passes the DFlash / DSpark one
of `rollout.spec`). Verification (rollout.engine.verify) is exact for whatever a drafter
proposes, provided `Drafts.q` is the distribution the drafts were really drawn from
(docs/verification.md).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rollout.engine.attention import AttentionMetadata
from rollout.engine.scheduler import ScheduledSeq
from rollout.engine.sequence import Sequence
from rollout.engine.verify import Proposal


@dataclass
class Drafts:
    tokens: torch.Tensor  # [D] int64 drafts of all decode items, flattened in item order
    num_per_item: list[int]  # drafts carried by each scheduled item (0 for prefill chunks)
    q: Proposal | None = None  # [D] proposal distributions, None = all one-hot
    proposers: list[str] | None = None  # per item, the proposer of its drafts (None: all the drafter's own)


class Drafter(ABC):
    """The drafter extension point (see module docstring)."""

    num_spec: int  # the most drafts per block
    target_layer_ids: tuple[int, ...]  # target layers whose hidden states `update_context` receives
    name: str = ""  # what the server reports as its drafter ("" = the class name)

    @abstractmethod
    def bytes_per_block(self, block_size: int) -> int:
        """KV bytes the drafter keeps per block of the target's cache (they share the block ids)."""

    def max_model_len(self) -> int | None:
        """The longest sequence this drafter can draft for (None = no limit of its own)."""
        return None

    @abstractmethod
    def allocate(self, num_blocks: int, block_size: int) -> None: ...

    def parts(self) -> list[Drafter]:
        """The drafters whose state this one holds: itself, or a combined drafter's proposers (the
        startup profile saves and restores each one's caches, graphs and counts)."""
        return [self]

    def free(self) -> None:
        """Drops the KV caches and CUDA graphs (the engine's device memory is released for a trainer,
        rollout.engine.release); `allocate` and `use_graphs` build them again. Optional: a drafter
        that holds no device memory of its own may ignore it."""
        return None

    @abstractmethod
    def propose(self, items: list[ScheduledSeq], block_table: np.ndarray) -> Drafts:
        """Drafts for the items with num_draft > 0; block_table: [len(items), W] host array of
        their padded block tables (batch.padded_block_table)."""

    @abstractmethod
    def update_context(self, target_aux: torch.Tensor, meta: AttentionMetadata) -> None: ...

    @abstractmethod
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...

    def begin_step(self, items: list[ScheduledSeq]) -> None:
        """A step begins with these items: `propose` calls it first; a drafter combining others calls
        it for a member that does not propose this step. Optional."""
        return None

    def sample_finished(self, seq: Sequence) -> None:
        """A sample has finished (`seq.finish_reason` says how: stop, length, abort, error); called
        once per sample, before the engine forgets it. Optional."""
        return None

    def verified(self, items: list[ScheduledSeq], drafts: Drafts, accepted: list[int]) -> None:
        """After a step's verification: `accepted[i]` of item i's `drafts.num_per_item[i]` drafts were
        accepted (the step's host copy). Optional."""
        return None

    def after_step(self, seconds: float) -> None:
        """A step has ended and been recorded (its wall time `seconds`, what the draft budget's cost
        model saw): background work the drafter does between steps, within its own bound, goes here,
        outside the step's measured time. Optional."""
        return None

    def overlaps(self) -> bool:
        """Whether a step without drafts may be scheduled and launched before the previous step's sync
        (rollout.engine.overlap): then `begin_step` / `propose` (proposing nothing) and the forward's
        `update_context` of step n+1 come before `verified` of step n. A drafter that keeps per-step
        host state across those calls says False (every step then runs synchronously). Optional:
        False unless a drafter says otherwise."""
        return False

    def device_anchors(self) -> bool:
        """Whether `propose(items, block_table, pending=...)` drafts for samples whose anchor is on the
        device only (rollout.engine.overlap.Pending: the token and positions of a step still in flight),
        with no host read, and no host state of the drafter follows the committed tokens step by step:
        then a step may be drafted before the step ahead of it syncs, and one may follow a drafted step
        before its sync. Optional: False unless a drafter says otherwise (such steps then wait for the
        sync)."""
        return False

    def idle(self) -> bool:
        """The engine loop has nothing to run: background work (a drafter refresh's training, rollout.
        spec.refresh) within the drafter's own time bound. Returns whether it wants more (the loop
        then polls for commands instead of waiting). Optional."""
        return False

    def checkpoint(self) -> tuple[str, bytes] | None:
        """The drafter model's checkpoint (config.json's text, model.safetensors' bytes) in its
        published layout, taken between steps (GetDrafterWeights); None: no model to save. Optional."""
        return None

    def stats(self) -> dict[str, float]:
        """Numbers the server reports of the drafter (GetServerInfo's drafter_stats). Optional."""
        return {}

    def policy_updated(self, version: int) -> None:
        """A weight update has applied between two steps: policy `version` samples from now on.
        Optional."""
        return None

    def use_graphs(self, max_batch: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                   capture: bool) -> None:
        """Replay the drafter's forward as CUDA graphs (`capture=False`: the same static-buffer
        path eagerly, for tests). Optional: a drafter may ignore it."""
        return None

    def profile_forward(self, rows: int, scratch_block: int, block_size: int) -> Callable[[], object] | None:
        """A thunk that drafts for `rows` samples whose context is the scratch block, as one proposal
        does, for the draft budget's startup profile (rollout.engine.step_cost); None: drafting
        costs nothing worth measuring. Optional."""
        return None

class DraftCounts:
    """Draft tokens proposed and accepted, by proposer and policy version: what the server's
    metrics and stats log show of a drafter (rollout.server.engine_stats), and the draft budget's
    summary (rollout.engine.spec_budget): the engine's one count of drafts."""

    def __init__(self):
        self.by_key: dict[tuple[str, int], tuple[int, int]] = {}  # (proposer, version) -> (proposed, accepted)

    def record(self, proposer: str, version: int, proposed: int, accepted: int) -> None:
        if proposed:
            before = self.by_key.get((proposer, version), (0, 0))
            self.by_key[(proposer, version)] = (before[0] + proposed, before[1] + accepted)

    def record_step(self, drafts: Drafts, accepted: list[int], drafter_name: str, version: int) -> None:
        """A verified step's drafts and `accepted` (per item), by proposer (`drafts.proposers`, or
        all the drafter's own)."""
        if drafts.proposers is None:
            self.record(drafter_name, version, sum(drafts.num_per_item), sum(accepted))
            return
        for name in dict.fromkeys(drafts.proposers):
            mine = [i for i, p in enumerate(drafts.proposers) if p == name]
            self.record(name, version, sum(drafts.num_per_item[i] for i in mine), sum(accepted[i] for i in mine))

    def total(self) -> tuple[int, int]:
        """(proposed, accepted) over every proposer and policy version."""
        proposed, accepted = (sum(c) for c in zip((0, 0), *self.by_key.values()))
        return proposed, accepted
