"""The one mask packer (docs/masks.md): device-side supports -> fixed-width rows -> flat
host arrays (`Supports`) that go into the Arrow columns as they are.

After acceptance the engine holds, for every committed position that asked for a mask, the
policy's top-k candidates: token ids sorted by probability (desc) and their log-probs, with -inf
outside the support. Because the order is descending, every support is a prefix of its row, so packing
to the batch's largest requested top_k is a slice of `width + 1` columns: two kernels (one
conversion, one concatenation into a single int32 tensor), nothing proportional to the
vocabulary, no sort. It goes to the host in the step's copy; the step's committed rows are taken
into a numpy array the samples keep. On the engine thread a step then costs a gather, an overflow
test and one tuple per masked sample; the flatten into flat arrays (`Supports`) runs once per
sample when it finishes (`assemble_supports`). No per-token Python lists anywhere; lists only
when someone asks for them.

Ties: the engine sorts by logits, ties by id; float32 rounding in `z - logsumexp` can still
give two distinct logits the same returned log-prob (with float32 logits, about once per
position at top_k 4096; bf16 logits are too coarse for it). `flatten_supports` puts such
runs in id order on the host, only in the rows that have one, so the values the trainer
sees are "sorted by probability, ties by id" exactly.
"""

from __future__ import annotations

from itertools import chain

import numpy as np
import torch
from torch import Tensor


def pack_supports(sorted_ids: Tensor, sorted_logp: Tensor, width: int) -> Tensor:
    """Pack sorted supports to `width` columns on their device, as one int32 tensor (one
    device-to-host copy): two kernels, whatever the batch.

    sorted_ids: [N, V'] int64, each row's token ids sorted by probability desc: the policy's
    top-k candidate columns (rollout.engine.sampler), or any prefix of a sorted row that covers
    the supports (plus one column, to tell an overflow, when there is one).
    sorted_logp: [N, V'] float32 log-probs in the same order (non-increasing), -inf outside
    the support.

    Returns [N, C + C'] int32: columns [:C] hold the float32 bits of the first C = min(V, width + 1)
    log-probs, columns [C:] the first C' = min(V, width) ids. `PackedRows` reads it on the host;
    the extra log-prob column tells a support longer than `width` (whose sample must fail as a
    whole: its packed row is truncated).
    """
    if width < 1:
        raise ValueError(f"width must be >= 1, got {width}")
    if sorted_logp.dtype != torch.float32:
        raise TypeError(f"sorted_logp must be float32, got {sorted_logp.dtype}")
    logp_bits = sorted_logp[:, : width + 1].view(torch.int32)  # [N, C], bit-exact
    return torch.cat([logp_bits, sorted_ids[:, :width].to(torch.int32)], dim=1)


class PackedRows:
    """Host side of `pack_supports`: rows of packed supports (views of one int32 array).

    ids [N, C'] int32 (past a row's support: the policy's order of excluded tokens), logp [N, C]
    float32 (-inf past the support). Support lengths are counted when a sample's rows are
    assembled; per step only the overflow column is read.
    """

    __slots__ = ("packed", "ids", "logp", "width")

    def __init__(self, packed: np.ndarray, width: int):
        c = (packed.shape[1] + 1) // 2  # C = C' + 1 when V > width, else C = C' = V
        self.packed = packed
        self.logp = packed[:, :c].view(np.float32)
        self.ids = packed[:, c:]
        self.width = width

    def lens(self) -> np.ndarray:
        """[N] int32 support lengths: exact up to `width`, `width + 1` when longer (overflow)."""
        return _support_lens(self.logp)

    def overflowed(self) -> np.ndarray:
        """[N] bool: rows whose support exceeds `width` (their column `width` is finite)."""
        if self.logp.shape[1] <= self.width:  # the whole vocabulary fits: nothing can overflow
            return np.zeros(len(self.logp), bool)
        return np.isfinite(self.logp[:, self.width])


def assemble_supports(parts: list[tuple[PackedRows, int, int]], with_logprobs: bool) -> Supports:
    """A sample's supports from the (rows, first row, count) parts its steps committed: one
    concatenation and one flatten per run of parts of equal packed width (one run unless the
    batch's bound changed)."""
    pieces = []
    for rows in _joined(parts):
        flat_ids, flat_logp, lens = flatten_supports(rows.ids, rows.logp[:, :rows.ids.shape[1]], rows.lens())
        pieces.append(Supports(flat_ids, lens, flat_logp if with_logprobs else None))
    if len(pieces) == 1:
        return pieces[0]
    return Supports.concat(pieces, with_logprobs)


def _joined(parts: list[tuple[PackedRows, int, int]]) -> list[PackedRows]:
    """The parts' rows joined into one PackedRows per run of equal packed width: a single
    concatenation, unless numpy refuses it because the width changed (rare), then one per run."""
    if not parts:
        return []
    slices = [rows.packed[a:a + n] for rows, a, n in parts]
    try:
        return [PackedRows(np.concatenate(slices), parts[0][0].width)]
    except ValueError:  # the batch's bound changed between steps
        widths = [rows.packed.shape[1] for rows, _, _ in parts]
        cuts = [0, *(i for i in range(1, len(widths)) if widths[i] != widths[i - 1]), len(parts)]
        return [PackedRows(np.concatenate(slices[a:b]), parts[a][0].width) for a, b in zip(cuts, cuts[1:])]


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


def _support_lens(logp: np.ndarray) -> np.ndarray:
    """[N, C] packed log-probs (-inf past the support) -> [N] int32 support lengths."""
    return np.isfinite(logp).sum(axis=1, dtype=np.int32)


def _ties_by_id(ids: np.ndarray, logp: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Sort each run of equal log-probs by id, in the (rare) rows that have one; copies those."""
    tied = logp[:, 1:] == logp[:, :-1]  # [N, W-1]
    tied &= keep[:, 1:]
    if not tied.any():  # the common case: no equal log-probs inside any support
        return ids, logp
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
