"""Mask capture after acceptance (DESIGN.md Contract 3).

Reads the very policy rows verification used (no recomputation), for the samples that
asked for masks only, packs them on the device to the batch's largest requested width and
hands them to the step's host copy. Each masked sample keeps a (rows, first row, count)
reference per step until it finishes, when its supports are flattened once.
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
    first_row: dict[int, int] | list[int]  # entry -> its first packed row
    width: int

    def to_host(self) -> np.ndarray:
        """The step's copy of the packed rows into a numpy array the samples may keep (pageable
        memory: a pinned buffer held for a sample's lifetime would make the host allocator grow).
        Blocking: it returns once the device has finished the step up to the capture."""
        out = np.empty(tuple(self.packed.shape), np.int32)
        torch.from_numpy(out).copy_(self.packed)
        return out


# a step's packed rows above this size keep only their committed rows (a copy) for the samples.
# Below it the samples share the whole step copy, rejected draft rows included: with 9 rows per
# entry (block 8) and ~3 committed, a sample holds ~3x its masks' bytes until it finishes, in
# exchange for no per-step compaction on the engine thread.
COMPACT_BYTES = 1 << 20


class CommittedMasks(NamedTuple):
    """One step's masks on the host: the packed rows (every row of the step's mask entries, or only
    the committed ones when the step's copy is large, so a long sample does not keep every rejected
    row of a wide support), each entry's first committed row in them, and the entries one of whose
    committed rows overflowed its bound (those samples fail as a whole)."""

    rows: PackedRows
    first: dict[int, int] | list[int]
    failed: set[int]


def mask_width(entries) -> int:
    """The batch's largest requested support bound (top_k, 1 for greedy samples; entries without
    masks count 0)."""
    return max(s.mask_bound for s in entries)


class MaskCapture:
    def __init__(self):
        self.num_captures = 0
        self.last: Captured | None = None

    def capture(self, pol: Policy, step) -> Captured | None:
        if not any(s.mask for s in step.entries):
            self.last = None
            return None
        self.num_captures += 1
        width = mask_width(step.entries)
        sorted_ids, sorted_logp = pol.sorted_ids, pol.sorted_logp
        if all(s.mask for s in step.entries):  # every row is a mask row: no gather
            first_row = step.cu_rows
        else:
            first_row, rows = {}, []
            for e, s in enumerate(step.entries):
                if s.mask:
                    first_row[e] = len(rows)
                    rows.extend(range(step.cu_rows[e], step.cu_rows[e + 1]))
            index = upload(rows, torch.int64, sorted_ids.device)
            cols = min(width + 1, sorted_ids.shape[1])
            sorted_ids, sorted_logp = sorted_ids[index, :cols], sorted_logp[index, :cols]
        self.last = Captured(pack_supports(sorted_ids, sorted_logp, width), first_row, width)
        return self.last


def committed_masks(cap: Captured, packed: np.ndarray, counts: dict[int, int]) -> CommittedMasks:
    """Host side, once per step: `counts[e]` committed tokens of every masked entry e, whose packed
    rows ([M, C + C'] int32, `Captured.to_host`) start at `cap.first_row[e]`. A couple of numpy calls
    whatever the batch; the flatten into flat arrays waits until a sample finishes
    (`assemble_supports`)."""
    first = cap.first_row  # (a list when every entry is masked: the step's cu_rows)
    if packed.nbytes > COMPACT_BYTES:
        first, index = {}, []
        for e, n in counts.items():
            first[e] = len(index)
            row = cap.first_row[e]
            index.extend(range(row, row + n))
        packed = packed[index]
    rows = PackedRows(packed, cap.width)
    over = rows.overflowed()  # a bound is the batch's largest top_k: an overflow is never expected
    failed = set()
    if over.any():
        failed = {e for e, n in counts.items() if over[first[e]:first[e] + n].any()}
    return CommittedMasks(rows, first, failed)
