"""The truncation (docs/sampling.md, step 3), on the paths `rollout.engine.sampler.policy`
picks per row.

* `top_candidates`: the k most probable tokens of each row without sorting the vocabulary: a
  `topk`, whose choice among the tokens tied at the k-th value (`torch.topk` picks as it likes)
  is replaced by the lowest-id ties, exactly as a stable sort would keep them.
* `truncate_sorted`: the one statement of top-k / top-p / min-p on rows sorted by probability
  (desc, ties by id): candidate columns, or whole sorted rows.
* `truncate_top_p`: the same on the first columns of whole rows sorted the same way (top-p rows
  without top-k, rollout.engine.top_p), whose mass is of the whole row; it also says whether those
  columns reach top_p.
* `top_p_by_sort`: the top-p rows whose candidates do not reach top_p sort their rows.
* `min_p_in_vocab_order`: min-p without top-p needs no order at all.

Rows are worked in chunks whose temporaries take about `CHUNK_BYTES`, so they stay bounded whatever
the batch (a speculative step at 256 sequences x 9 rows is 2304 rows).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from rollout.engine.transfer import upload

CHUNK_BYTES = 1 << 30  # temporaries per row chunk, at the bytes per logit below
TOPK_BYTES = 6  # top-k: the tie mask and its running count
SORT_BYTES = 40  # top-p by sorting: the sorted copy, its int64 order, softmax, sums, masks
ELEMENTWISE_BYTES = 8  # logsumexp, min-p
NEG_INF = float("-inf")


def min_p_keeps(z: Tensor, min_p: Tensor) -> Tensor:
    """Min-p on tempered logits z [N, W]: p >= min_p * p_max <=> z - z_max >= log(min_p), in the
    logit domain (no softmax rounding; at the p = min_p * p_max boundary the tests pin it agrees
    with the double-precision reference). min_p: [N] (0 keeps everything). -> [N, W] bool."""
    return (z - z.amax(dim=1, keepdim=True)) >= min_p.log()[:, None]


def truncate_sorted(vals: Tensor, top_k: Tensor | None, top_p: Tensor, min_p: Tensor) -> Tensor:
    """Top-k, then top-p (the shortest prefix whose mass reaches top_p; 1 = off), then min-p, then
    renormalise, on tempered logits sorted by value desc, ties by id (so by probability).

    vals: [N, W] float32 (-inf: excluded); top_k: [N] int64 or None (every column); top_p,
    min_p: [N] float32. Returns log p [N, W] float32, -inf outside the support (a prefix).
    """
    return _truncate(vals, top_k, top_p, min_p, None)[0]


def truncate_top_p(vals: Tensor, top_p: Tensor, min_p: Tensor, row_max: Tensor,
                   row_sum: Tensor) -> tuple[Tensor, Tensor]:
    """`truncate_sorted` without top-k on the first W columns of whole rows sorted by value desc,
    ties by id (a row's most probable tokens): the mass of a column is exp(z - row_max) / row_sum,
    of the whole row (row_max [N] its largest logit, row_sum [N] the sum of exp(z - row_max) over
    it). -> (log p [N, W], -inf outside the support; reached [N] bool: the columns' running mass
    reaches top_p, or they hold every token the row allows, so the support lies inside them)."""
    return _truncate(vals, None, top_p, min_p, (row_max, row_sum))


def _truncate(vals: Tensor, top_k: Tensor | None, top_p: Tensor, min_p: Tensor,
              whole_row: tuple[Tensor, Tensor] | None) -> tuple[Tensor, Tensor]:
    """The one statement of the truncation on sorted columns (`truncate_sorted`, `truncate_top_p`):
    whole_row None: the mass is the softmax over the kept columns; else (row_max, row_sum) [N] each."""
    keep = vals > NEG_INF  # [N, W]
    if top_k is not None:
        keep &= torch.arange(vals.shape[1], device=vals.device) < top_k[:, None]
    masked = vals.masked_fill(~keep, NEG_INF)
    if whole_row is None:
        mass = torch.softmax(masked, dim=1)
    else:  # a row without any token: max -inf and sum 0 give mass 0, not NaN
        row_max, row_sum = whole_row
        mass = (masked - row_max.clamp(min=torch.finfo(vals.dtype).min)[:, None]).exp_()
        mass.div_(row_sum.clamp(min=torch.finfo(vals.dtype).tiny)[:, None])
    mass = mass.cumsum_(dim=1)  # [N, W] float32 running sums
    # a token stays while the running sum before it is short of top_p: the prefix ends at the
    # first token whose running sum reaches top_p (the sum compared is exactly the one the
    # prefix reaches). top_p == 1 is off: a float32 sum reaches 1 before the tail, which stays.
    keep[:, 1:] &= (mass[:, :-1] < top_p[:, None]) | (top_p[:, None] >= 1.0)
    reached = (mass[:, -1] >= top_p) | (vals[:, -1] == NEG_INF)  # [N]
    del mass
    keep &= min_p_keeps(vals, min_p)
    masked.masked_fill_(~keep, NEG_INF)
    lse = torch.logsumexp(masked, dim=1, keepdim=True)  # [N, 1]; -inf: no token left, log p stays -inf
    return masked.sub_(lse.masked_fill_(lse == NEG_INF, 0.0)), reached


def top_candidates(z: Tensor, width: int) -> Tensor:
    """The `width` largest logits of each row, by value desc, ties by lowest id: the first `width`
    entries of a stable descending sort (so also, for every k <= width, the first k).
    z: [N, V] float32 -> ids [N, width] int64."""
    parts = [_top_candidates(part, width) for part in _row_chunks(z, TOPK_BYTES)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _top_candidates(z: Tensor, width: int) -> Tensor:
    """`top_candidates` of one row chunk [n, V]. torch.topk finds the width-th value and every
    token above it, but picks among the tokens tied at it as it likes: those are replaced by the
    lowest-id ties, found in one pass (their running count in id order), then the candidates are
    put in (value desc, id asc) order."""
    vals, ids = z.topk(width, dim=1)  # [n, C] by value desc; ties in any order
    kth = vals[:, -1:]  # [n, 1]
    above = (vals > kth).sum(dim=1, keepdim=True)  # [n, 1] tokens above the cutoff: topk's first columns
    tie_count = (z == kth).cumsum(dim=1, dtype=torch.int32)  # [n, V] ties up to each id
    col = torch.arange(width, device=z.device)
    nth_tie = (col + 1 - above).clamp_(min=1).int()  # [n, C] column j >= above takes the (j - above + 1)-th tie
    ids = torch.where(col < above, ids, torch.searchsorted(tie_count, nth_tie))
    del tie_count
    ids = ids.sort(dim=1).values  # by id, then by value (stable): equal values stay in id order
    vals = z.gather(1, ids)
    order = vals.masked_fill_(vals == 0, 0.0).sort(dim=1, descending=True, stable=True).indices  # -0.0 == 0.0
    return ids.gather(1, order)


def top_p_by_sort(z: Tensor, rows: np.ndarray, top_p: Tensor, min_p: Tensor, row_max: Tensor,
                  row_sum: Tensor) -> None:
    """Top-p (and min-p) rows without top-k whose candidates did not reach top_p
    (rollout.engine.top_p): -inf in place on z [R, V] outside each support, for the host-known
    `rows` [P], by sorting them (stably, in row chunks). row_max, row_sum [P]: as for
    `truncate_top_p`, so that the running sums over the first columns are those the candidates had."""
    every = len(rows) == z.shape[0]
    index = None if every else upload(rows, torch.int64, z.device)  # [P]
    step = chunk_rows(z.shape[1], SORT_BYTES)
    for a in range(0, len(rows), step):
        pick = slice(a, a + step) if every else index[a:a + step]
        part = z[pick]  # a view when every row sorts, else a copy written back below
        sorted_z, order = torch.where(part == 0, 0.0, part).sort(dim=1, descending=True, stable=True)  # -0.0 == 0.0
        own = slice(a, a + step)
        kept = truncate_top_p(sorted_z, top_p[pick], min_p[pick], row_max[own], row_sum[own])[0] > NEG_INF
        del sorted_z
        part.masked_fill_(~torch.empty_like(kept).scatter_(1, order, kept), NEG_INF)
        if not every:
            z[pick] = part


def min_p_in_vocab_order(z: Tensor, min_p: Tensor) -> None:
    """Min-p in place on z [R, V] (rows with min_p 0 keep everything), in vocabulary order."""
    step = chunk_rows(z.shape[1], ELEMENTWISE_BYTES)
    for a, part in zip(range(0, z.shape[0], step), _row_chunks(z, ELEMENTWISE_BYTES)):
        part.masked_fill_(~min_p_keeps(part, min_p[a:a + part.shape[0]]), NEG_INF)


def logsumexp_rows(z: Tensor) -> Tensor:
    """logsumexp of every row of z [N, V] -> [N, 1], in row chunks (its temporary is a chunk)."""
    parts = [torch.logsumexp(part, dim=1, keepdim=True) for part in _row_chunks(z, ELEMENTWISE_BYTES)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def chunk_rows(vocab: int, bytes_per_logit: int = ELEMENTWISE_BYTES) -> int:
    """Rows per chunk whose temporaries, at `bytes_per_logit`, take about CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (vocab * bytes_per_logit))


def _row_chunks(z: Tensor, bytes_per_logit: int) -> list[Tensor]:
    """z [N, V] as views of consecutive row chunks."""
    return list(z.split(chunk_rows(z.shape[1], bytes_per_logit)))
