"""Mask capture after acceptance (docs/masks.md).

Reads the very policy rows verification used (no recomputation: the top-k candidates, sorted
by probability, of the cand layout, rollout.engine.sampler), for the samples that asked for
masks only, packs them on the device to the batch's largest requested width and
hands them to the step's host copy (asynchronous, into a pinned buffer: the step's one
synchronisation completes it). `committed_masks` then takes the committed rows out of that
buffer (a rejected draft's row is never kept), one step late (rollout.engine.commit explains
the hand-over), and each masked sample keeps a (rows, first row, count) reference per step
until it finishes, when its supports are flattened once.
A batch without mask requests runs none of this: `capture` returns before touching a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from rollout.engine.batch import SampleRows
from rollout.engine.sampler import Policy
from rollout.engine.transfer import upload
from rollout.masks.pack import PackedRows, pack_supports


@dataclass
class Captured:
    packed: torch.Tensor  # [M, C + C'] int32 from `pack_supports`, one row per row of the mask entries
    first_row: np.ndarray  # [E] int64 each entry's first packed row (-1: the entry asked for no masks)
    width: int


class CommittedMasks(NamedTuple):
    """One step's masks on the host: the committed rows of its masked entries (an array of their
    own, which the samples keep), each entry's first row in them, and the entries one of whose
    committed rows overflowed its bound (those samples fail as a whole)."""

    rows: PackedRows
    first: list[int]  # the first kept row of each entry of `counts`, in its order
    failed: set[int]


def mask_width(entries) -> int:
    """The batch's largest requested support bound (top_k, 1 for greedy samples; entries without
    masks count 0)."""
    return max(s.mask_bound for s in entries)


class MaskCapture:
    def __init__(self):
        self.num_captures = 0
        # pinned host memory the packed rows are copied into: two, used in turn, since a step's
        # rows are read one step late (rollout.engine.commit)
        self._staging: list[torch.Tensor | None] = [None, None]
        self._turn = 0

    def capture(self, pol: Policy, step: SampleRows) -> Captured | None:
        if not any(s.mask for s in step.entries):
            return None
        self.num_captures += 1
        width = mask_width(step.entries)
        # mask rows are top-k (or greedy) rows, whose policy is their candidates in the packer's
        # order (RowPlan puts every mask row there)
        sorted_ids, sorted_logp = pol.cand_ids, pol.cand_logp  # [R, C]
        if sorted_ids is None:
            raise RuntimeError("mask rows without top-k candidates: the step's RowPlan left them out")
        cu_rows = np.fromiter(step.cu_rows, np.int64, len(step.cu_rows))  # [E+1]
        if all(s.mask for s in step.entries):  # every row is a mask row: no gather
            return Captured(pack_supports(sorted_ids, sorted_logp, width), cu_rows[:-1], width)
        masked = np.fromiter((bool(s.mask) for s in step.entries), bool, len(step.entries))  # [E]
        first_row, rows = _mask_rows(cu_rows, masked)
        index = upload(rows, torch.int64, sorted_ids.device)
        cols = min(width + 1, sorted_ids.shape[1])
        sorted_ids, sorted_logp = sorted_ids[index, :cols], sorted_logp[index, :cols]
        return Captured(pack_supports(sorted_ids, sorted_logp, width), first_row, width)

    def to_host(self, cap: Captured) -> np.ndarray:
        """Starts the step's copy of the packed rows and returns the host array they land in, valid
        once the step has synchronised and until the copy after next (`committed_masks` takes out
        what the samples keep): one of two buffers used in turn, each grown by doubling. On a GPU
        they are pinned and the copy does not wait; on the CPU it is a plain copy (the same buffers,
        so CPU tests run the GPU's path)."""
        packed = cap.packed
        n, self._turn = packed.numel(), 1 - self._turn
        staging = self._staging[self._turn]
        if staging is None or staging.numel() < n:
            size = max(n, 2 * staging.numel()) if staging is not None else n
            staging = torch.empty(size, dtype=torch.int32, pin_memory=packed.is_cuda)
            self._staging[self._turn] = staging
        host = staging[:n].view(packed.shape)
        host.copy_(packed, non_blocking=packed.is_cuda)
        return host.numpy()


def _mask_rows(cu_rows: np.ndarray, masked: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cu_rows [E+1], masked [E] bool -> (each entry's first row among the mask entries' rows, -1
    for the others: [E] int64; those rows' indices in the step's rows: [M] int64)."""
    count = np.diff(cu_rows) * masked  # [E] rows each entry contributes
    first = np.cumsum(count) - count
    rows = np.repeat(cu_rows[:-1] - first, count) + np.arange(first[-1] + count[-1])
    return np.where(masked, first, -1), rows


def committed_masks(cap: Captured, packed: np.ndarray, counts: dict[int, int]) -> CommittedMasks:
    """Host side, once per step, after the synchronisation: `counts[e]` committed tokens of every
    masked entry e, whose packed rows ([M, C + C'] int32, `MaskCapture.to_host`) start at
    `cap.first_row[e]`. The committed rows are taken into an array of their own (one gather, a few
    numpy calls whatever the batch, no Python per entry), so a sample keeps its masks' bytes and
    no rejected draft's; the flatten into flat arrays waits until a sample finishes
    (`assemble_supports`)."""
    entries = np.fromiter(counts, np.int64, len(counts))
    n = np.fromiter(counts.values(), np.int64, len(counts))
    ends = np.cumsum(n)
    starts = ends - n  # each entry's first row among the kept ones
    total = int(ends[-1]) if len(n) else 0
    src = cap.first_row[entries]
    index = src if total == len(n) else np.repeat(src - starts, n) + np.arange(total)  # one row each: src
    rows = PackedRows(packed[index], cap.width)
    over = rows.overflowed()  # a bound is the batch's largest top_k: an overflow is never expected
    failed = set()
    if over.any():
        failed = set(np.repeat(entries, n)[over].tolist())
    return CommittedMasks(rows, starts.tolist(), failed)
