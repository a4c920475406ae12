"""Mask capture after acceptance (DESIGN.md Contract 3).

Reads the very policy rows verification used (no recomputation), for the samples that
asked for masks only, packs them on the device to the batch's largest requested width and
hands them to the step's one host copy. The host side keeps exactly the committed rows, and
each masked sample a (rows, first row, count) reference per step until it finishes.
A batch without mask requests runs none of this: `capture` returns before touching a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from rollout.engine.sampler import Policy
from rollout.engine.transfer import upload
from rollout.masks.pack import PackedRows, pack_supports


@dataclass
class Captured:
    packed: torch.Tensor  # [M, C + C'] int32 from `pack_supports`, one row per row of the mask entries
    first_row: dict[int, int]  # entry -> its first packed row
    width: int

    def tensors(self) -> tuple[torch.Tensor]:
        return (self.packed,)


class CommittedMasks(NamedTuple):
    """One step's masks on the host: the committed rows of every masked entry, compacted (so the
    step's rejected rows are not kept), each entry's first row among them, and the entries one of
    whose committed rows overflowed its bound (those samples fail as a whole)."""

    rows: PackedRows
    first: dict[int, int]
    failed: set[int]


def mask_width(entries) -> int:
    """The batch's largest requested support bound: top_k, or 1 for greedy samples."""
    return max(1 if s.params.greedy else s.params.top_k for s in entries)


class MaskCapture:
    def __init__(self):
        self.num_captures = 0
        self.last: Captured | None = None

    def capture(self, pol: Policy, step) -> Captured | None:
        entries = [e for e, s in enumerate(step.entries) if s.mask]
        if not entries:
            self.last = None
            return None
        self.num_captures += 1
        width = mask_width([step.entries[e] for e in entries])
        sorted_ids, sorted_logp = pol.sorted_ids, pol.sorted_logp
        if len(entries) == len(step.entries):  # every row is a mask row: no gather
            first_row = {e: step.cu_rows[e] for e in entries}
        else:
            first_row, rows = {}, []
            for e in entries:
                first_row[e] = len(rows)
                rows.extend(range(step.cu_rows[e], step.cu_rows[e + 1]))
            index = upload(rows, torch.int64, sorted_ids.device)
            cols = min(width + 1, sorted_ids.shape[1])
            sorted_ids, sorted_logp = sorted_ids[index, :cols], sorted_logp[index, :cols]
        self.last = Captured(pack_supports(sorted_ids, sorted_logp, width), first_row, width)
        return self.last


def committed_masks(cap: Captured, packed: np.ndarray, counts: dict[int, int]) -> CommittedMasks:
    # packed: [M, C + C'] int32 host copy of cap.packed
    """Host side, once per step: `counts[e]` committed tokens of every masked entry e, whose
    packed rows start at `cap.first_row[e]`. A few numpy calls whatever the batch; the flatten
    into flat arrays waits until a sample finishes (`assemble_supports`)."""
    first, index = {}, []
    for e, n in counts.items():
        first[e] = len(index)
        row = cap.first_row[e]
        index.extend(range(row, row + n))
    rows = PackedRows(packed[index], cap.width)
    over = rows.overflowed()
    failed = {e for e, a in first.items() if over[a:a + counts[e]].any()} if over.any() else set()
    return CommittedMasks(rows, first, failed)
