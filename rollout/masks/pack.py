"""The one mask packer (DESIGN.md Contract 3): device-side supports -> fixed-width rows -> flat
host arrays (`Supports`) that go into the Arrow columns as they are.

After acceptance the engine holds, for every committed position that asked for a mask, the
policy's token ids sorted by probability (desc) and their log-probs, with -inf outside the
support. Because the order is descending, every support is a prefix of its row, so packing
to the batch's largest requested top_k is a slice, one finite test and a count over
`width + 1` columns: a handful of kernels, nothing proportional to the vocabulary, no sort.
The packed tensors go to the host in the step's one copy; `flatten_supports` turns a step's
rows into flat arrays in one numpy pass, and each sample keeps views of them (`Supports`): no
per-token Python lists on the engine thread; lists only when someone asks for them.

Ties: the engine sorts by logits, ties by id; float32 rounding in `z - logsumexp` can still
give two distinct logits the same returned log-prob (with float32 logits, about once per
position at top_k 4096; bf16 logits are too coarse for it). `unpack_supports` puts such
runs in id order on the host, only in the rows that have one, so the values the trainer
sees are "sorted by probability, ties by id" exactly.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor


def pack_supports(sorted_ids: Tensor, sorted_logp: Tensor, width: int) -> tuple[Tensor, Tensor, Tensor]:
    """Pack sorted supports to `width` columns on their device.

    sorted_ids: [N, V] int64, each row's token ids sorted by probability desc;
    V may be the vocabulary or any prefix of it that still covers the supports plus one column.
    sorted_logp: [N, V] float32 log-probs in the same order (non-increasing), -inf outside
    the support.

    Returns ids [N, width] int32 (-1 pad), logp [N, width] float32 (-inf pad) and
    support_len [N] int32. `support_len` is exact up to `width`; a row whose support is longer
    reads `width + 1` (only when V > width) and its sample must fail as a whole: its packed row
    is truncated.
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    v = sorted_ids.shape[1]
    cols = sorted_logp[:, : width + 1].float()  # [N, C], C = min(V, width + 1)
    finite = torch.isfinite(cols)  # [N, C]
    support_len = finite.sum(dim=-1, dtype=torch.int32)  # [N]
    ids = torch.where(finite[:, :width], sorted_ids[:, :width], -1).to(torch.int32)  # [N, min(V, width)]
    logp = cols[:, :width].contiguous()
    if v < width:
        ids = F.pad(ids, (0, width - v), value=-1)
        logp = F.pad(logp, (0, width - v), value=float("-inf"))
    return ids, logp, support_len


class Supports:
    """The supports of consecutive tokens as flat arrays: token j's support ids are
    `ids[offsets[j]:offsets[j + 1]]` (offsets = 0, cumsum(lens)), sorted by probability, ties by
    id; `logprobs` alike, or None (mask mode "selected")."""

    __slots__ = ("ids", "lens", "logprobs")

    def __init__(self, ids: np.ndarray, lens: np.ndarray, logprobs: np.ndarray | None):
        self.ids, self.lens, self.logprobs = ids, lens, logprobs  # [total] int32, [N] int32, [total] float32

    def __len__(self) -> int:
        return len(self.lens)

    def __eq__(self, other) -> bool:
        if not isinstance(other, Supports):
            return NotImplemented
        same_logp = (self.logprobs is None) == (other.logprobs is None) and (
            self.logprobs is None or np.array_equal(self.logprobs, other.logprobs))
        return np.array_equal(self.lens, other.lens) and np.array_equal(self.ids, other.ids) and same_logp

    def __repr__(self) -> str:
        return f"Supports({len(self)} tokens, {len(self.ids)} ids, logprobs={self.logprobs is not None})"

    @classmethod
    def from_lists(cls, ids: list[list[int]], logprobs: list[list[float]] | None = None) -> Supports:
        lens = np.fromiter(map(len, ids), np.int32, count=len(ids))
        flat_logp = None if logprobs is None else np.fromiter(chain.from_iterable(logprobs), np.float32)
        return cls(np.fromiter(chain.from_iterable(ids), np.int32), lens, flat_logp)

    @classmethod
    def concat(cls, parts: list[Supports], with_logprobs: bool) -> Supports:
        if not parts:
            empty = np.zeros(0, np.int32)
            return cls(empty, empty, np.zeros(0, np.float32) if with_logprobs else None)
        logp = np.concatenate([p.logprobs for p in parts]) if with_logprobs else None
        return cls(np.concatenate([p.ids for p in parts]), np.concatenate([p.lens for p in parts]), logp)

    def head(self, n: int) -> Supports:
        """The first n tokens (views)."""
        if n >= len(self.lens):
            return self
        total = int(self.lens[:n].sum())
        return Supports(self.ids[:total], self.lens[:n], None if self.logprobs is None else self.logprobs[:total])

    def id_lists(self) -> list[list[int]]:
        return _split(self.ids.tolist(), np.cumsum(self.lens).tolist())

    def logprob_lists(self) -> list[list[float]] | None:
        return None if self.logprobs is None else _split(self.logprobs.tolist(), np.cumsum(self.lens).tolist())


def flatten_supports(ids: np.ndarray | Tensor, logp: np.ndarray | Tensor, lens: np.ndarray | Tensor,
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Host side: packed rows -> (flat ids, flat log-probs, lengths), each row trimmed to its
    support, equal log-probs in id order; one numpy pass for all rows.

    ids: [N, W] int32, logp: [N, W] float32, lens: [N] int32, as `pack_supports` made them
    (numpy arrays or CPU tensors). A row with `lens > W` overflowed; it comes back empty,
    which is never a valid mask, so it cannot pass for one if the caller forgot to fail it.
    """
    ids, logp, lens = np.asarray(ids), np.asarray(logp), np.asarray(lens)
    width = ids.shape[1]
    lens = np.where(lens > width, 0, lens).astype(np.int32)  # [N]
    keep = np.arange(width)[None, :] < lens[:, None]  # [N, W]
    ids, logp = _ties_by_id(ids, logp, keep)
    return ids[keep].astype(np.int32, copy=False), logp[keep].astype(np.float32, copy=False), lens


def unpack_supports(
    ids: np.ndarray | Tensor, logp: np.ndarray | Tensor, lens: np.ndarray | Tensor, with_logprobs: bool
) -> tuple[list[list[int]], list[list[float]] | None]:
    """`flatten_supports` as one list per row (see there)."""
    flat_ids, flat_logp, lens = flatten_supports(ids, logp, lens)
    sup = Supports(flat_ids, lens, flat_logp if with_logprobs else None)
    return sup.id_lists(), sup.logprob_lists()


def _ties_by_id(ids: np.ndarray, logp: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each run of equal log-probs by id, in the (rare) rows that have one; copies those."""
    tied = (logp[:, 1:] == logp[:, :-1]) & keep[:, 1:]  # [N, W-1]
    tied &= ids[:, 1:] < ids[:, :-1]
    rows = np.flatnonzero(tied.any(axis=1))
    if rows.size == 0:
        return ids, logp
    ids, logp = ids.copy(), logp.copy()
    for r in rows:
        n = int(keep[r].sum())
        order = np.lexsort((ids[r, :n], -logp[r, :n]))  # log-prob desc, then id asc
        ids[r, :n], logp[r, :n] = ids[r, :n][order], logp[r, :n][order]
    return ids, logp


def _split(flat: list, ends: list[int]) -> list[list]:
    """Cut a flat list into consecutive pieces ending at `ends`."""
    return [flat[a:b] for a, b in zip([0, *ends[:-1]], ends)]
