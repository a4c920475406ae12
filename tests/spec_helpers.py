"""Test doubles for the drafter extension point (tests only)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import numpy as np
import torch

from rollout.engine.drafter import Drafter, Drafts
from rollout.engine.params import SamplingParams
from rollout.engine.sequence import Sequence
from rollout.engine.step_cost import Curve, StepCost, TargetCost
from rollout.engine.verify import Proposal, verify


class RepeatDrafter(Drafter):
    """Drafts the anchor token repeated: random tiny models repeat tokens a lot, so these
    drafts are often accepted and exercise accepted, rejected and bonus paths alike."""

    def __init__(self, block_size: int):
        self.num_spec = block_size - 1
        self.target_layer_ids = ()
        self.block = block_size

    def bytes_per_block(self, block_size: int) -> int:
        return 0

    def allocate(self, num_blocks: int, block_size: int) -> None:
        pass

    def propose(self, items, block_table) -> Drafts:
        counts = [it.num_draft for it in items]
        flat = [it.seq.last_token for it in items for _ in range(it.num_draft)]
        return Drafts(torch.tensor(flat, dtype=torch.int64), counts)

    def update_context(self, target_aux, meta) -> None:
        pass

    def copy_blocks(self, pairs) -> None:
        pass


class DeviceRepeatDrafter(RepeatDrafter):
    """RepeatDrafter that proposes from anchors on the device (`Drafter.device_anchors`): a sample
    whose last token is pending (drawn by the step in flight) repeats that token, read from
    `pending` with no host read, so its steps overlap drafted ones."""

    def overlaps(self) -> bool:
        return True

    def device_anchors(self) -> bool:
        return True

    def propose(self, items, block_table, pending=None) -> Drafts:
        counts = [it.num_draft for it in items]
        anchors = torch.tensor([it.seq.last_token for it in items], dtype=torch.int64)
        if pending is not None:
            anchors = torch.where(pending.has, pending.anchor, anchors)
        flat = anchors.repeat_interleave(torch.tensor(counts, dtype=torch.int64), output_size=sum(counts))
        return Drafts(flat, counts)


def factory_of(drafter: Drafter | None):
    """An engine's drafter factory that hands out `drafter` (None: no factory, so the engine runs
    what its config names)."""
    return None if drafter is None else (lambda config, target: drafter)


def linear_target(decode_ms: float, token_ms: float, q: int) -> TargetCost:
    """A synthetic target: decode_ms a step plus token_ms a token past the first (verify blocks of q)."""
    rows = np.array([1.0, 256.0])
    decode = (decode_ms + token_ms * (rows - 1)) / 1e3
    return TargetCost(rows, decode, decode + token_ms * rows * (q - 1) / 1e3, q)


def cost_table(decode_ms: float = 1.0, token_ms: float = 0.0, drafter_ms: float = 0.0, graph: bool = False,
               q: int = 8) -> StepCost:
    """A frozen synthetic step cost (no startup profile): `linear_target`, drafter_ms when drafting,
    the same table for CUDA-graph steps when `graph`."""
    line = linear_target(decode_ms, token_ms, q)
    return StepCost(line, line if graph else None, Curve((1.0,), (drafter_ms / 1e3,)), learn=False)


def verify_rows(pol, drafts, draft_q, num_draft: list[int], cu_rows: list[int], judge_row, draft_of_row,
                row_seed, row_position):
    """`rollout.engine.verify.verify` on a row layout given as plain lists and tensors (what a
    StepBatch carries, built here without a step)."""
    first_draft = list(itertools.accumulate(num_draft[:-1], initial=0)) if num_draft else []
    as_t = lambda x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    layout = SimpleNamespace(num_draft=num_draft, judge_row=judge_row, draft_of_row=draft_of_row,
                             row_seed=row_seed, row_position=row_position, entry_first_row=as_t(cu_rows[:-1]),
                             entry_num_draft=as_t(num_draft), entry_first_draft=as_t(first_draft))
    return verify(pol, drafts, draft_q, layout)


def proposal(q: torch.Tensor, drafts: torch.Tensor, one_hot: torch.Tensor | None = None) -> Proposal:
    """A Proposal for drafts [D] drawn from probabilities q [D, V] (rows of `one_hot` [D] bool:
    greedy drafts, q one-hot at the draft)."""
    z = q.log()
    one_hot = torch.zeros(len(drafts), dtype=torch.bool) if one_hot is None else one_hot
    return Proposal(z, torch.logsumexp(z, dim=1), one_hot, drafts)


def budget_seq(i: int) -> Sequence:
    """A sample of a two-token prompt and up to 64 output tokens, as the draft budget's tests use."""
    return Sequence(i, f"r{i}", 0, 0, [1, 2], SamplingParams(max_tokens=64), seed=i)
