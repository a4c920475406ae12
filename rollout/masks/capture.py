"""Mask capture after acceptance (DESIGN.md Contract 3).

Reads the very policy rows verification used (no recomputation), for the samples that
asked for masks only, packs them on the device to the batch's largest requested width and
hands them to the step's one host copy. The host side keeps exactly the committed rows.
A batch without mask requests runs none of this: `capture` returns before touching a tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rollout.engine.sampler import Policy
from rollout.engine.transfer import upload
from rollout.masks.pack import Supports, flatten_supports, pack_supports


@dataclass
class Captured:
    ids: torch.Tensor  # [M, W] int32 packed supports of the mask rows (-1 pad)
    logp: torch.Tensor  # [M, W] float32
    lens: torch.Tensor  # [M] int32 support lengths (> W means overflow)
    first_row: dict[int, int]  # entry -> its first packed row
    width: int

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self.ids, self.logp, self.lens


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
        cols = min(width + 1, pol.sorted_ids.shape[1])
        sorted_ids, sorted_logp = pol.sorted_ids[:, :cols], pol.sorted_logp[:, :cols]
        if len(entries) == len(step.entries):  # every row is a mask row: no gather
            first_row = {e: step.cu_rows[e] for e in entries}
        else:
            first_row, rows = {}, []
            for e in entries:
                first_row[e] = len(rows)
                rows.extend(range(step.cu_rows[e], step.cu_rows[e + 1]))
            index = upload(rows, torch.int64, pol.sorted_ids.device)
            sorted_ids, sorted_logp = sorted_ids[index], sorted_logp[index]
        ids, logp, lens = pack_supports(sorted_ids, sorted_logp, width)
        self.last = Captured(ids, logp, lens, first_row, width)
        return self.last


def committed_masks(cap: Captured, host: list, counts: dict[int, int]) -> dict[int, Supports | None]:
    """Host side, once per step: for every masked entry e, the supports of its first counts[e]
    committed tokens (views of the step's flat arrays), or None when one of them overflowed its
    bound (the sample then fails as a whole). One flatten for the whole step."""
    ids, logp, lens = (np.asarray(h) for h in host)
    count = np.fromiter(counts.values(), np.int64, len(counts))  # [M] rows committed per entry
    span = np.cumsum(count) - count  # [M] each entry's first row among the committed ones
    first = np.fromiter((cap.first_row[e] for e in counts), np.int64, len(counts))
    rows = np.repeat(first - span, count) + np.arange(int(count.sum()))  # packed row of each committed token
    spans = dict(zip(counts, span.tolist()))
    lens = lens[rows]
    over = lens > cap.width
    flat_ids, flat_logp, lens = flatten_supports(ids[rows], logp[rows], lens)
    offsets = np.concatenate([[0], np.cumsum(lens)])
    out = {}
    for e, start in spans.items():
        end = start + counts[e]
        a, b = offsets[start], offsets[end]
        out[e] = None if over[start:end].any() else Supports(flat_ids[a:b], lens[start:end], flat_logp[a:b])
    return out
